"""Argument validation for RMSNorm, in one place.

Every rule reads only shapes and dtypes, so it runs on JAX arrays, tracers and
the torch ops' tensor specs alike (the ops call these functions before they
dispatch). Errors name the argument and say what was expected.
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SUPPORTED = "float32, bfloat16 or float16"


def _float_array(name: str, a) -> None:
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name}: expected an array, got {type(a).__name__}")
    if jnp.dtype(a.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: expected dtype {_SUPPORTED}, got {jnp.dtype(a.dtype).name}")


def check_rms_norm_args(x, weight, residual=None, eps=1e-6) -> None:
    """x [..., H] (H > 0), weight [H], residual like x (same shape and dtype); eps >= 0."""
    _float_array("x", x)
    if len(x.shape) < 1 or x.shape[-1] == 0:
        raise ValueError(
            f"x: expected a non-empty last (hidden) dimension, got shape {tuple(x.shape)}"
        )
    hidden = x.shape[-1]
    _float_array("weight", weight)
    if tuple(weight.shape) != (hidden,):
        raise ValueError(
            f"weight: expected shape ({hidden},) (x's hidden size), got {tuple(weight.shape)}"
        )
    if residual is not None:
        _float_array("residual", residual)
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(
                f"residual: expected x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
        if jnp.dtype(residual.dtype) != jnp.dtype(x.dtype):
            raise ValueError(
                f"residual: expected x's dtype {jnp.dtype(x.dtype).name}, "
                f"got {jnp.dtype(residual.dtype).name}"
            )
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {eps!r}")
