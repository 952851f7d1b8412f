"""ragged-dot-tpu: grouped matmul (ragged dot) Pallas TPU kernels and a fused MoE experts layer for PyTorch."""

from .layers import experts_forward
from .ops import LIB as LIB, grouped_mm, ragged_dot

__all__ = ["experts_forward", "grouped_mm", "ragged_dot"]
