"""Symmetric quantization of f32 weights for the quantized-weight tests:
per output channel, or per 128 x 128 block (FP8 checkpoints' format)."""

from __future__ import annotations

import jax.numpy as jnp

QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def quantize(w, dtype, out_axis):
    """Symmetric per-output-channel quantization of f32 weights [G, a, b]:
    (quantized weights, [G, out] f32 scales) with w ~= q * scale on out_axis."""
    w = jnp.asarray(w, jnp.float32)
    in_axis = 3 - out_axis
    amax = jnp.max(jnp.abs(w), axis=in_axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / QMAX[jnp.dtype(dtype)], 1.0)
    q = w / scale
    if jnp.dtype(dtype) == jnp.int8:
        q = jnp.clip(jnp.round(q), -127, 127)
    return q.astype(dtype), jnp.squeeze(scale, in_axis)


def quantize_blocks(w, dtype):
    """Symmetric quantization per 128 x 128 block of [G, A, B] (A, B multiples
    of 128): (quantized, [G, A/128, B/128] f32 scales), FP8 checkpoints' format."""
    w = jnp.asarray(w, jnp.float32)
    g, a, b = w.shape
    blocks = w.reshape(g, a // 128, 128, b // 128, 128)
    amax = jnp.max(jnp.abs(blocks), axis=(2, 4), keepdims=True)
    scale = jnp.where(amax > 0, amax / QMAX[jnp.dtype(dtype)], 1.0)
    q = blocks / scale
    if jnp.dtype(dtype) == jnp.int8:
        q = jnp.clip(jnp.round(q), -127, 127)
    return q.reshape(g, a, b).astype(dtype), scale.reshape(g, a // 128, b // 128)
