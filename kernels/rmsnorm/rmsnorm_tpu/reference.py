"""Plain-JAX RMSNorm: the definition the Pallas kernels are checked against.

Tolerances (max abs error of kernel vs this reference, inputs ~N(0,1)):
  float32:  atol 1e-5, rtol 1e-5   (same f32 math, different reduction order)
  bfloat16: atol 2e-2, rtol 2e-2   (one bf16 rounding of the output, |y| ~ 4)
  float16:  atol 4e-3, rtol 4e-3
Gradients use the same tolerances scaled by the row length's growth of the
weight-gradient sum (see tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

TOLERANCES = {
    jnp.dtype(jnp.float32): dict(atol=1e-5, rtol=1e-5),
    jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
    jnp.dtype(jnp.float16): dict(atol=4e-3, rtol=4e-3),
}


# jitted: one program per shape, not one per op (eager mode compiles every op
# anew for each shape, and checks call these with many shapes).
@functools.partial(jax.jit, static_argnames=("eps", "gemma"))
def rms_norm_ref(x, weight, eps: float = 1e-6, gemma: bool = False):
    xf = x.astype(jnp.float32)
    w = weight.astype(jnp.float32)
    if gemma:
        w = 1.0 + w
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * w
    return y.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "gemma"))
def fused_add_rms_norm_ref(x, residual, weight, eps: float = 1e-6, gemma: bool = False):
    s = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
    return rms_norm_ref(s, weight, eps, gemma), s


@functools.partial(jax.jit, static_argnames=("eps", "gemma"))
def rms_norm_bwd_ref(dy, ds, s, weight, eps: float = 1e-6, gemma: bool = False):
    """(dx, dweight) by autodiff of the f32 reference."""
    f = lambda s_, w_: rms_norm_ref(s_.astype(jnp.float32), w_.astype(jnp.float32), eps, gemma)
    _, vjp = jax.vjp(f, s, weight)
    dx, dw = vjp(dy.astype(jnp.float32))
    if ds is not None:
        dx = dx + ds.astype(jnp.float32)
    return dx.astype(s.dtype), dw.astype(weight.dtype)
