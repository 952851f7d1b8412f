"""`kernels benchmark <repo>` workloads for flash-attention-tpu (Llama-3-8B-like heads, scaled down on CPU).

Device: kernels 0.17 runs every workload on the device of the backend it
detects, and it never detects `tpu` (torch_tpu 0.2 does not set
`torch.backends.tpu`), so on a TPU host it would time the CPU path. The
benchmark takes the runner's device and replaces it with `tpu` when torch has
a TPU accelerator. The runner has no TPU synchronisation either, so each
workload waits for the TPU (`torch.accelerator.synchronize()`) before it returns.

Each verify_* recomputes the attention in float32 with torch on the host.
"""

import math
import sys

import torch
from kernels.benchmark import Benchmark

HQ, HKV, D = 8, 2, 128  # GQA 4:1, head_dim 128


def tpu_or(device: str) -> str:
    """`tpu` when torch has a TPU accelerator, else the runner's device."""
    try:
        acc = torch.accelerator.current_accelerator(check_available=True)
    except Exception:  # noqa: BLE001 - no usable accelerator runtime
        acc = None
    return "tpu" if acc is not None and acc.type == "tpu" else device


def sync(device: str) -> None:
    """Wait for the device (torch_tpu only allows the public `torch.accelerator` API)."""
    if device != "cpu":
        torch.accelerator.synchronize()


class _OnTpuWhenAttached:
    """Mixin (not a Benchmark, so the runner does not collect it): the runner's device, or `tpu`."""

    _device = "cpu"

    @property
    def device(self) -> str:
        return self._device

    @device.setter
    def device(self, runner_device: str) -> None:
        self._device = tpu_or(runner_device)
        if self._device != runner_device:
            print(
                f"  (on {self._device}: kernels detected backend {runner_device!r})",
                file=sys.stderr,
            )


def _reference(q, k, v, causal=True, left=-1):
    """q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D] -> [B, Sq, Hq, D] in q's dtype (bottom-right aligned)."""
    q, k, v = (x.cpu().float().transpose(1, 2) for x in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    sq, skv = s.shape[-2:]
    qi = torch.arange(sq)[:, None] + (skv - sq)
    kj = torch.arange(skv)[None, :]
    mask = torch.ones(sq, skv, dtype=torch.bool)
    if causal:
        mask &= kj <= qi
    if left >= 0:
        mask &= kj >= qi - left
    out = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v
    return out.transpose(1, 2)


class FlashAttentionBenchmark(_OnTpuWhenAttached, Benchmark):
    seed = 0

    def _qkv(self, b, sq, skv):
        def rnd(*shape):
            return torch.randn(*shape, dtype=torch.bfloat16, device=self.device)

        # v at half scale keeps outputs below 2, where one bf16 ulp stays under the runner's atol.
        return rnd(b, sq, HQ, D), rnd(b, skv, HKV, D), rnd(b, skv, HKV, D) * 0.5

    # Prefill: causal self-attention over one 256-token prompt.
    def setup_prefill_causal_256(self):
        self.q, self.k, self.v = self._qkv(1, 256, 256)

    def benchmark_prefill_causal_256(self):
        self.out = self.kernel.flash_attn_func(self.q, self.k, self.v, causal=True)
        sync(self.device)

    def verify_prefill_causal_256(self):
        return _reference(self.q, self.k, self.v).to(self.q.dtype).to(self.device)

    # Decode: 4 sequences, one new token each against 512 cached keys.
    def setup_decode_4x512(self):
        self.q, self.k, self.v = self._qkv(4, 1, 512)

    def benchmark_decode_4x512(self):
        self.out = self.kernel.flash_attn_func(self.q, self.k, self.v, causal=True)
        sync(self.device)

    def verify_decode_4x512(self):
        return _reference(self.q, self.k, self.v).to(self.q.dtype).to(self.device)

    # Packed prompts of different lengths, sliding window of 64 keys (Mistral/Gemma-style).
    def setup_varlen_sliding_window(self):
        lens = [100, 37, 119]
        self.lens = lens
        q, k, v = self._qkv(1, sum(lens), sum(lens))
        self.q, self.k, self.v = q[0], k[0], v[0]
        self.cu = torch.tensor([0, 100, 137, 256], dtype=torch.int32, device=self.device)

    def benchmark_varlen_sliding_window(self):
        self.out = self.kernel.flash_attn_varlen_func(
            self.q, self.k, self.v, self.cu, self.cu, 119, 119, causal=True, window_size=(63, 0)
        )
        sync(self.device)

    def verify_varlen_sliding_window(self):
        outs, start = [], 0
        for n in self.lens:
            sl = slice(start, start + n)
            outs.append(
                _reference(self.q[None, sl], self.k[None, sl], self.v[None, sl], left=63)[0]
            )
            start += n
        return torch.cat(outs).to(self.q.dtype).to(self.device)
