"""`kernels benchmark <repo>` workloads for rmsnorm-tpu.

The runner has no TPU synchronisation, so each workload synchronises itself
(`torch.tpu.synchronize()` where a TPU is the device) before returning.
"""

import torch
from kernels.benchmark import Benchmark


def _sync(device: str) -> None:
    sync = getattr(getattr(torch, "tpu", None), "synchronize", None)
    if device not in ("cpu", "meta") and sync is not None:
        sync()


class RMSNormBenchmark(Benchmark):
    seed = 0

    def setup_llama_hidden_4096(self):
        self.x = torch.randn(256, 4096, device=self.device, dtype=torch.bfloat16)
        self.w = torch.randn(4096, device=self.device, dtype=torch.bfloat16)

    def benchmark_llama_hidden_4096(self):
        self.out = self.kernel.rms_norm(self.x, self.w, 1e-6)
        _sync(self.device)

    def verify_llama_hidden_4096(self):
        xf = self.x.float()
        ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w.float()
        return ref.to(self.x.dtype)

    def setup_fused_residual_2880(self):
        self.x = torch.randn(256, 2880, device=self.device, dtype=torch.bfloat16)
        self.r = torch.randn(256, 2880, device=self.device, dtype=torch.bfloat16)
        self.w = torch.randn(2880, device=self.device, dtype=torch.bfloat16)

    def benchmark_fused_residual_2880(self):
        self.out, _ = self.kernel.fused_add_rms_norm(self.x, self.r, self.w, 1e-6)
        _sync(self.device)

    def verify_fused_residual_2880(self):
        s = (self.x.float() + self.r.float()).to(self.x.dtype).float()
        ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w.float()
        return ref.to(self.x.dtype)
