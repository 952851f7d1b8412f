"""`kernels benchmark <repo>` workloads for rmsnorm-tpu.

Device: kernels 0.17 runs every workload on the device of the backend it
detects, and it never detects `tpu` (torch_tpu 0.2 does not set
`torch.backends.tpu`), so on a TPU host it would time the CPU path. The
benchmark takes the runner's device and replaces it with `tpu` when torch has
a TPU accelerator. The runner has no TPU synchronisation either, so each
workload waits for the TPU (`torch.accelerator.synchronize()`) before it returns.

Verification: the runner compares the kernel's output with `verify_*`'s result
(atol 1e-2). The reference is the same float32 math as the kernel, rounded
once to bfloat16; see `_round_like_kernel` for the one place where two
roundings are both correct.
"""

import sys

import torch
from kernels.benchmark import Benchmark

EPS = 1e-6


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


def _round_like_kernel(ref32: torch.Tensor, out: torch.Tensor, rel_err: float) -> torch.Tensor:
    """The float32 reference rounded to out's dtype, as the kernel rounds its float32 result.

    The kernel sums the squares in another order than torch (and, on a TPU,
    computes rsqrt in another way), so its float32 result differs from
    `ref32` by up to `rel_err` (relative). Where `ref32` lies that close to the
    midpoint between two bfloat16 values, both roundings are correct and the
    kernel's is taken; everywhere else the result must be the correctly rounded
    reference. Without this, one element in ~10^5 rounds the other way, one
    bfloat16 step (0.0156 at 2-4) above the runner's atol.
    """
    ref32 = ref32.float()
    lo = (ref32 * (1 - rel_err)).to(out.dtype)
    hi = (ref32 * (1 + rel_err)).to(out.dtype)
    either = (lo != hi) & ((out == lo) | (out == hi))
    return torch.where(either, out, ref32.to(out.dtype))


def _reference(s: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """RMSNorm of s (float32 math, as the kernel) rounded like the kernel; computed on the host."""
    s, w, out = s.cpu().float(), w.cpu().float(), out.cpu()
    ref32 = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w
    # A reduction over H terms in float32 is accurate to ~sqrt(H) ulps (2^-18 relative at H = 4096).
    rel_err = s.shape[-1] ** 0.5 * 2.0**-24
    return _round_like_kernel(ref32, out, rel_err)


class RMSNormBenchmark(_OnTpuWhenAttached, Benchmark):
    seed = 0

    # Llama-3-8B hidden size, 256 tokens.
    def setup_llama_hidden_4096(self):
        self.x = torch.randn(256, 4096, device=self.device, dtype=torch.bfloat16)
        self.w = torch.randn(4096, device=self.device, dtype=torch.bfloat16)

    def benchmark_llama_hidden_4096(self):
        self.out = self.kernel.rms_norm(self.x, self.w, EPS)
        sync(self.device)

    def verify_llama_hidden_4096(self):
        return _reference(self.x, self.w, self.out).to(self.device)

    # GPT-OSS hidden size (not a multiple of 128), residual add fused.
    def setup_fused_residual_2880(self):
        self.x = torch.randn(256, 2880, device=self.device, dtype=torch.bfloat16)
        self.r = torch.randn(256, 2880, device=self.device, dtype=torch.bfloat16)
        self.w = torch.randn(2880, device=self.device, dtype=torch.bfloat16)

    def benchmark_fused_residual_2880(self):
        self.out, self.residual = self.kernel.fused_add_rms_norm(self.x, self.r, self.w, EPS)
        sync(self.device)

    def verify_fused_residual_2880(self):
        # The kernel normalises the sum as stored (rounded to bfloat16), like the reference.
        s = (self.x.cpu().float() + self.r.cpu().float()).to(self.x.dtype)
        if not torch.equal(self.residual.cpu(), s):
            raise RuntimeError(
                "Verification failed for fused_residual_2880: the residual output is not x + r"
            )
        return _reference(s, self.w, self.out).to(self.device)
