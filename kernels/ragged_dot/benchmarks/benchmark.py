"""`kernels benchmark <repo>` workloads for ragged-dot-tpu (Qwen3-30B-A3B-like decode layer, scaled down).

Device: kernels 0.17 runs every workload on the device of the backend it
detects, and it never detects `tpu` (torch_tpu 0.2 does not set
`torch.backends.tpu`), so on a TPU host it would time the CPU path. The
benchmark takes the runner's device and replaces it with `tpu` when torch has
a TPU accelerator. The runner has no TPU synchronisation either, so each
workload waits for the TPU (`torch.accelerator.synchronize()`) before it returns.

Verification: the reference is the same float32-accumulated product, rounded
once to bfloat16 (see `_round_like_kernel`).
"""

import sys

import torch
from kernels.benchmark import Benchmark


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


def _round_like_kernel(ref32: torch.Tensor, out: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """The float32 reference rounded to out's dtype, as the kernel rounds its float32 accumulator.

    The kernel accumulates in another order than torch, so its float32 result
    differs from `ref32` by up to `err`. Where `ref32` lies that close to the
    midpoint between two bfloat16 values, both roundings are correct and the
    kernel's is taken; everywhere else the result must be the correctly rounded
    reference (one bfloat16 step is 0.0156 at 2-4, above the runner's atol).
    """
    lo = (ref32 - err).to(out.dtype)
    hi = (ref32 + err).to(out.dtype)
    either = (lo != hi) & ((out == lo) | (out == hi))
    return torch.where(either, out, ref32.to(out.dtype))


def _reference(lhs, rhs, sizes, out):
    """Grouped matmul in float32 on the host, rounded like the kernel's output `out`."""
    lhs, rhs, out = lhs.cpu().float(), rhs.cpu().float(), out.cpu()
    ref32, bound, start = (
        torch.zeros(lhs.shape[0], rhs.shape[2]),
        torch.zeros(lhs.shape[0], rhs.shape[2]),
        0,
    )
    for g, n in enumerate(sizes.tolist()):
        ref32[start : start + n] = lhs[start : start + n] @ rhs[g]
        bound[start : start + n] = lhs[start : start + n].abs() @ rhs[g].abs()
        start += n
    # A float32 sum of K products is accurate to ~sqrt(K) ulps of the sum of their magnitudes.
    return _round_like_kernel(ref32, out, bound * lhs.shape[1] ** 0.5 * 2.0**-24)


class RaggedDotBenchmark(_OnTpuWhenAttached, Benchmark):
    seed = 0

    def setup_decode_64_tokens_top8(self):
        experts, hidden, inter = 16, 256, 128
        self.sizes = torch.bincount(torch.randint(0, experts, (64 * 8,)), minlength=experts).to(
            torch.int32
        )
        self.lhs = torch.randn(64 * 8, hidden, dtype=torch.bfloat16, device=self.device)
        self.rhs = (
            torch.randn(experts, hidden, inter, dtype=torch.bfloat16, device=self.device) * 0.05
        )
        self.gs = self.sizes.to(self.device)

    def benchmark_decode_64_tokens_top8(self):
        self.out = self.kernel.ragged_dot(self.lhs, self.rhs, self.gs)
        sync(self.device)

    def verify_decode_64_tokens_top8(self):
        return _reference(self.lhs, self.rhs, self.sizes, self.out).to(self.device)
