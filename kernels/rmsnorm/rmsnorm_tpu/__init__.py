"""rmsnorm-tpu: RMSNorm (plain, Gemma-style, fused residual add) as Pallas TPU kernels for PyTorch.

Layout (the package contract, README "Layout"): kernel.py the Pallas forward
and backward kernels; api.py the JAX API (`rms_norm`, `fused_add_rms_norm`)
with its forward/backward rules; tiling.py `RMSNormConfig` and its choice;
checks.py the argument rules; reference.py the pure-JAX reference; ops.py the
torch ops; layers.py the `kernelize` layers.
"""

from . import layers
from .ops import LIB as LIB, fused_add_rms_norm, rms_norm

__all__ = ["fused_add_rms_norm", "layers", "rms_norm"]
