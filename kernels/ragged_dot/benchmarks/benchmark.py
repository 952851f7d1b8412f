"""`kernels benchmark <repo>` workloads for ragged-dot-tpu (Qwen3-30B-A3B-like decode layer, scaled down on CPU).

The runner has no TPU synchronisation, so each workload synchronises itself.
"""

import torch
from kernels.benchmark import Benchmark


def _sync(device: str) -> None:
    sync = getattr(getattr(torch, "tpu", None), "synchronize", None)
    if device not in ("cpu", "meta") and sync is not None:
        sync()


def _reference(lhs, rhs, sizes):
    out, start = torch.zeros(lhs.shape[0], rhs.shape[2]), 0
    for g, n in enumerate(sizes.tolist()):
        out[start:start + n] = lhs[start:start + n].float() @ rhs[g].float()
        start += n
    return out.to(lhs.dtype)


class RaggedDotBenchmark(Benchmark):
    seed = 0

    def setup_decode_64_tokens_top8(self):
        experts, hidden, inter = 16, 256, 128
        self.sizes = torch.bincount(torch.randint(0, experts, (64 * 8,)), minlength=experts).to(torch.int32)
        self.lhs = torch.randn(64 * 8, hidden, dtype=torch.bfloat16, device=self.device)
        self.rhs = torch.randn(experts, hidden, inter, dtype=torch.bfloat16, device=self.device) * 0.05
        self.gs = self.sizes.to(self.device)

    def benchmark_decode_64_tokens_top8(self):
        self.out = self.kernel.ragged_dot(self.lhs, self.rhs, self.gs)
        _sync(self.device)

    def verify_decode_64_tokens_top8(self):
        return _reference(self.lhs.cpu(), self.rhs.cpu(), self.sizes).to(self.device)
