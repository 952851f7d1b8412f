"""w8a8: activations quantized per row inside gmm, to the weights' dtype.

int8 x int8 runs at twice the bf16 rate on v5e's and v6e's MXUs, fp8 x fp8
on tpu7x's. The row's scale is chosen in the kernel, from the row it
quantizes, so no calibration travels with the model; the rule lives here once,
for the kernel and the reference alike.
"""

from __future__ import annotations

import jax.numpy as jnp

# The row's largest magnitude maps to the dtype's largest value.
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def quantize_rows(x, dtype):
    """(x [R, K] quantized to int8 / float8_e4m3fn per row, the [R, 1] f32
    scales that multiply it back). int8 rounds to nearest (ties to even);
    e4m3 rounds on the cast. A zero row gets scale 0."""
    dtype = jnp.dtype(dtype)
    qmax = QMAX[dtype]
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=1, keepdims=True)
    q = xf * jnp.where(amax > 0, qmax / amax, 0.0)
    if dtype == jnp.dtype(jnp.int8):
        q = jnp.round(q)
    return q.astype(dtype), amax * (1.0 / qmax)
