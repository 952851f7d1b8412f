"""rmsnorm-tpu: RMSNorm (plain, Gemma-style, fused residual add) as Pallas TPU kernels for PyTorch."""

from . import layers
from .ops import LIB as LIB, fused_add_rms_norm, rms_norm

__all__ = ["fused_add_rms_norm", "layers", "rms_norm"]
