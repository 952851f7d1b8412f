"""RMSNorm's JAX API: `rms_norm` and `fused_add_rms_norm`, differentiable
through one autograd path (torch_bindings/vjp.py) that the torch ops share.

Forward rules return (outputs, residuals); backward rules start from the
inputs, outputs and residuals. RMSNorm keeps no residual of its own: the
backward kernel re-derives each row's 1/rms from the row it reads anyway
(x, or the stored sum x + residual, an output of the fused forward), which
costs no memory traffic in a memory-bound kernel, where saving rstd would
cost a write and a read.

Every entry takes `config`: None (the attached TPU's generation), a generation
name ("v5e", "v6e", "tpu7x") or a tiling.RMSNormConfig (used for both
directions).
"""

from __future__ import annotations

from . import checks, kernel
from ._torch_bindings.vjp import differentiable


def rms_norm_fwd(x, weight, *, eps, gemma, config, interpret):
    y = kernel.rms_norm_fwd(x, weight, eps=eps, gemma=gemma, interpret=interpret, config=config)
    return y, ()


def rms_norm_bwd(args, y, residuals, dy, *, eps, gemma, config, interpret):
    x, weight = args
    return kernel.rms_norm_bwd(
        dy, None, x, weight, eps=eps, gemma=gemma, interpret=interpret, config=config
    )


def fused_add_rms_norm_fwd(x, residual, weight, *, eps, gemma, config, interpret):
    y, s = kernel.rms_norm_fwd(
        x, weight, residual, eps=eps, gemma=gemma, interpret=interpret, config=config
    )
    return (y, s), ()


def fused_add_rms_norm_bwd(args, outputs, residuals, cotangents, *, eps, gemma, config, interpret):
    _, _, weight = args
    _, s = outputs
    dy, ds = cotangents
    dx, dw = kernel.rms_norm_bwd(
        dy, ds, s, weight, eps=eps, gemma=gemma, interpret=interpret, config=config
    )
    # s = x + residual: both inputs get the gradient that reaches s.
    return dx, dx, dw


_rms_norm = differentiable(rms_norm_fwd, rms_norm_bwd)
_fused_add_rms_norm = differentiable(fused_add_rms_norm_fwd, fused_add_rms_norm_bwd)


def rms_norm(
    x, weight, *, eps: float = 1e-6, gemma: bool = False, config=None, interpret: bool = False
):
    """x / sqrt(mean(x^2, -1) + eps) * weight (`gemma`: * (1 + weight)), in x's dtype.

    x [..., H] float32/bfloat16/float16 with f32 math; weight [H].
    """
    checks.check_rms_norm_args(x, weight, eps=eps)
    return _rms_norm(
        x, weight, eps=float(eps), gemma=bool(gemma), config=config, interpret=interpret
    )


def fused_add_rms_norm(
    x,
    residual,
    weight,
    *,
    eps: float = 1e-6,
    gemma: bool = False,
    config=None,
    interpret: bool = False,
):
    """(rms_norm(x + residual), x + residual), the sum stored in x's dtype and
    that stored value normalised."""
    checks.check_rms_norm_args(x, weight, residual, eps=eps)
    return _fused_add_rms_norm(
        x, residual, weight, eps=float(eps), gemma=bool(gemma), config=config, interpret=interpret
    )
