"""Helpers of the quantized-weight tests (int8 / fp8, MXFP4, w8a8): symmetric
quantization of f32 weights per output channel or per 128 x 128 block (FP8
checkpoints' format), the drawn group sizes, the small-block config, and the
MoE layer's comparison with its reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from ragged_dot_tpu import tiling

QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


# jitted: one program per shape; eager, each of its ops compiled per shape.
@functools.partial(jax.jit, static_argnames=("dtype", "out_axis"))
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


@functools.partial(jax.jit, static_argnames="dtype")
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


def group_sizes(draw, m, g):
    """g drawn group sizes summing to m, m - 5 or m // 2 (rows past the sum)."""
    total = draw(st.sampled_from([m, max(m - 5, 0), m // 2]))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=g - 1, max_size=g - 1)))
    edges = [0, *cuts, total]
    return [b - a for a, b in zip(edges[:-1], edges[1:])]


def small_config(small, k, n):
    """v6e's blocks, or (small) explicit ones that walk several row tiles and
    N slabs and wrap a 2-slot weight ring."""
    if not small:
        return "v6e"
    slab = lambda d: 128 if d % 128 == 0 and d > 128 else d  # noqa: E731
    return tiling.RaggedDotConfig(
        tiling.GmmConfig(16, slab(n), 16, weight_buffers=2),
        tiling.GmmConfig(16, slab(k), 16, weight_buffers=3),
        tiling.TgmmConfig(16, k, n, 16),
    )


def assert_moe_layer_close(out, want, grads, want_grads):
    """The MoE layer against its reference with the same rounding points
    (projections to bf16, the activation once): they differ by summation order
    and the d_lhs rounding, a bf16 ulp of the output's scale per rounding point."""
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2**-6 * scale, rtol=2**-6
    )
    for name, got, w in zip(("d_hidden", "d_weights"), grads, want_grads):
        w = np.asarray(w, np.float32)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), w, atol=2**-5 * np.abs(w).max(), rtol=2**-5, err_msg=name
        )
