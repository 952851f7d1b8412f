"""RMSNorm as torch ops: plain and fused residual add, differentiable through
torch_bindings' one autograd path (api.py's forward and backward rules)."""

from __future__ import annotations

from pathlib import Path

import torch

from . import api, checks, reference
from ._torch_bindings import OpLibrary, validate

LIB = OpLibrary("rmsnorm_tpu", Path(__file__).parent)


def _statics(args):
    eps, gemma = args[-2:]
    return dict(eps=eps, gemma=gemma, config=None)


_rms_norm = LIB.define_differentiable(
    "rms_norm",
    "(Tensor x, Tensor weight, float eps, bool gemma) -> Tensor",
    forward=lambda x, w, eps, gemma, *, interpret: api.rms_norm_fwd(
        x, w, eps=eps, gemma=gemma, config=None, interpret=interpret
    ),
    backward=lambda args, y, res, dy, *, interpret: api.rms_norm_bwd(
        args[:2], y, res, dy, **_statics(args), interpret=interpret
    ),
    reference=reference.rms_norm_ref,
    differentiable=("x", "weight"),
    check=lambda x, w, eps, gemma: checks.check_rms_norm_args(x, w, eps=eps),
)
_fused_add_rms_norm = LIB.define_differentiable(
    "fused_add_rms_norm",
    "(Tensor x, Tensor residual, Tensor weight, float eps, bool gemma) -> (Tensor, Tensor)",
    forward=lambda x, r, w, eps, gemma, *, interpret: api.fused_add_rms_norm_fwd(
        x, r, w, eps=eps, gemma=gemma, config=None, interpret=interpret
    ),
    backward=lambda args, outs, res, cts, *, interpret: api.fused_add_rms_norm_bwd(
        args[:3], outs, res, cts, **_statics(args), interpret=interpret
    ),
    reference=reference.fused_add_rms_norm_ref,
    differentiable=("x", "residual", "weight"),
    check=lambda x, r, w, eps, gemma: checks.check_rms_norm_args(x, w, r, eps=eps),
)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, gemma: bool = False
) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight over the last dim; `gemma=True` scales by (1 + weight).

    Any leading dims, any hidden size; float32/bfloat16/float16 with f32 math.
    Returns x's dtype.
    """
    validate.check_tensors(x=x, weight=weight)
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
    validate.check_tensors(x=x, residual=residual, weight=weight)
    return _fused_add_rms_norm(x, residual, weight, float(eps), bool(gemma))
