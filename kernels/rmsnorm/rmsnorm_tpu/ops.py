"""RMSNorm as torch ops: forward, fused residual add, and a backward op for autograd."""

from __future__ import annotations

from pathlib import Path

import torch

from . import kernel, reference
from ._torch_bindings import OpLibrary, validate

LIB = OpLibrary("rmsnorm_tpu", Path(__file__).parent)

_rms_norm = LIB.define(
    "rms_norm",
    "(Tensor x, Tensor weight, float eps, bool gemma) -> Tensor",
    kernel=lambda x, w, eps, gemma, *, interpret: kernel.rms_norm_fwd(
        x, w, eps=eps, gemma=gemma, interpret=interpret
    ),
    reference=reference.rms_norm_ref,
)
_fused_add_rms_norm = LIB.define(
    "fused_add_rms_norm",
    "(Tensor x, Tensor residual, Tensor weight, float eps, bool gemma) -> (Tensor, Tensor)",
    kernel=lambda x, r, w, eps, gemma, *, interpret: kernel.rms_norm_fwd(
        x, w, r, eps=eps, gemma=gemma, interpret=interpret
    ),
    reference=reference.fused_add_rms_norm_ref,
)
_rms_norm_backward = LIB.define(
    "rms_norm_backward",
    "(Tensor dy, Tensor? ds, Tensor s, Tensor weight, float eps, bool gemma) -> (Tensor, Tensor)",
    kernel=lambda dy, ds, s, w, eps, gemma, *, interpret: kernel.rms_norm_bwd(
        dy, ds, s, w, eps=eps, gemma=gemma, interpret=interpret
    ),
    reference=reference.rms_norm_bwd_ref,
)


def _setup_rms_norm(ctx, inputs, output):
    x, weight, eps, gemma = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.gemma = eps, gemma


def _backward_rms_norm(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = _rms_norm_backward(dy, None, x, weight, ctx.eps, ctx.gemma)
    return dx, dw, None, None


def _setup_fused(ctx, inputs, output):
    _, _, weight, eps, gemma = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps, ctx.gemma = eps, gemma


def _backward_fused(ctx, dy, ds):
    s, weight = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(s)
    dx, dw = _rms_norm_backward(dy, ds, s, weight, ctx.eps, ctx.gemma)
    return dx, dx, dw, None, None


_rms_norm.register_autograd(_backward_rms_norm, _setup_rms_norm)
_fused_add_rms_norm.register_autograd(_backward_fused, _setup_fused)


def _check(x, weight, residual=None):
    validate.check_tensor("x", x, min_ndim=1, dtypes=validate.FLOAT_DTYPES)
    validate.check_supported_device("x", x)
    hidden = x.shape[-1]
    if hidden == 0:
        raise ValueError(
            f"x: expected a non-empty last (hidden) dimension, got shape {tuple(x.shape)}"
        )
    validate.check_tensor("weight", weight, shape=(hidden,), dtypes=validate.FLOAT_DTYPES)
    if residual is not None:
        validate.check_tensor("residual", residual, shape=tuple(x.shape))
        validate.check_same_dtype(x=x, residual=residual)
    validate.check_same_device(x=x, weight=weight, residual=residual)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, gemma: bool = False
) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight over the last dim; `gemma=True` scales by (1 + weight).

    Any leading dims, any hidden size; float32/bfloat16/float16 with f32 math.
    Returns x's dtype.
    """
    _check(x, weight)
    return _rms_norm(x, weight, float(eps), bool(gemma))


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over memory.

    The sum is stored in x's dtype and that stored value is what is normalised,
    as a decoder that does `residual = residual + h; h = norm(residual)` would.
    """
    _check(x, weight, residual)
    return _fused_add_rms_norm(x, residual, weight, float(eps), bool(gemma))
