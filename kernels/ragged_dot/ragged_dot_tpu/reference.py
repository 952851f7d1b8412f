"""Pure-JAX reference for ragged_dot, built on ``jax.lax.ragged_dot``.

Tolerances (kernel vs this reference; both accumulate in f32):

* float32 inputs: the reference runs at Precision.HIGHEST; the only
  difference is summation order over K, so ``atol = rtol = 1e-4 * sqrt(K)/8``
  relative to the output scale is ample (observed ~1e-6 relative).
* bfloat16 inputs: products of bf16 are exact in f32, so the f32 results
  agree to summation order; a bf16 output adds one rounding (2^-8 relative),
  and a summation-order difference can flip it to the neighbouring bf16
  value: ``rtol = 2e-2`` and ``atol = 2e-2 * scale``.
* Gradients (custom_vjp) cast the cotangent to the operand dtype before the
  MXU, so bf16 gradients get the bf16 tolerance against an f32 reference.

``tolerance(dtype, k, scale)`` returns these as kwargs for numpy.testing.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from . import checks, moe, mxfp4, tiling, w8a8


def tolerance(dtype, k: int = 128, scale: float = 1.0) -> dict:
    if jnp.dtype(dtype) == jnp.float32:
        tol = 1e-4 * max(1.0, (k / 64) ** 0.5)
        return {"atol": tol * scale, "rtol": tol}
    return {"atol": 2e-2 * scale, "rtol": 2e-2}


def shard_rows(group_sizes, group_offset, num_local):
    """[lo, hi): rows covered by groups [group_offset, group_offset + num_local)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    g0 = jnp.asarray(group_offset, jnp.int32)
    return starts[g0], ends[g0 + num_local - 1]


def dequantize(rhs, rhs_scale):
    """rhs [G, A, B] in f32, times its scales if any: [G, B] per output channel,
    or [G, A/128, B/128] per 128 x 128 block; MXFP4 (uint8 [G, K/2, N]) by its
    code table (mxfp4.dequantize), not the kernels' bit arithmetic."""
    if mxfp4.is_mxfp4(rhs.dtype):
        return mxfp4.dequantize(rhs, rhs_scale)
    w = rhs.astype(jnp.float32)
    if rhs_scale is None:
        return w
    s = rhs_scale.astype(jnp.float32)
    if s.ndim == 3:
        return w * jnp.repeat(jnp.repeat(s, 128, axis=1), 128, axis=2)
    return w * s[:, None, :]


def as_kn(rhs, rhs_scale=None):
    """Weights given as [G, N, K] (torch Linear layout) and their scales, as
    [G, K, N] and scales for that (block scales are swapped with the weights;
    per-channel [G, N] ones stay)."""
    rhs = jnp.swapaxes(rhs, 1, 2)
    if rhs_scale is not None and rhs_scale.ndim == 3:
        rhs_scale = jnp.swapaxes(rhs_scale, 1, 2)
    return rhs, rhs_scale


# jitted: one program per shape, not one per op (eager mode compiles every op
# anew for each shape, and checks call these with many shapes).
@functools.partial(jax.jit, static_argnames=("preferred_element_type", "quantize_lhs"))
def ragged_dot_reference(
    lhs,
    rhs,
    group_sizes,
    group_offset=0,
    preferred_element_type=None,
    rhs_scale=None,
    bias=None,
    quantize_lhs=False,
):
    """ragged_dot with rows past the sum, and other shards' rows, exactly zero.

    rhs holds groups [group_offset, group_offset + rhs.shape[0]) of the
    len(group_sizes) groups; computed in f32 at HIGHEST precision. Quantized
    rhs (int8, float8_e4m3fn) is dequantized with rhs_scale in f32 first
    ([G, N] per channel or [G, K/128, N/128] per block, see `dequantize`).
    bias [G_local, N]: bias[g] added to group g's rows, in f32.
    """
    out_dtype = preferred_element_type or tiling.default_out_dtype(lhs.dtype, rhs.dtype)
    if quantize_lhs:  # w8a8: lhs as the kernel quantizes it, then dequantized
        q, row_scale = w8a8.quantize_rows(lhs, rhs.dtype)
        lhs = q.astype(jnp.float32) * row_scale
    rhs = dequantize(rhs, rhs_scale)
    g_total, g_local = group_sizes.shape[0], rhs.shape[0]
    m = lhs.shape[0]
    full = jnp.zeros((g_total,) + rhs.shape[1:], jnp.float32)
    full = lax.dynamic_update_slice(
        full, rhs.astype(jnp.float32), (jnp.asarray(group_offset, jnp.int32), 0, 0)
    )
    if bias is not None:
        # A ragged_dot against a ones column per group puts bias[g] on its rows.
        full_bias = jnp.zeros((g_total, 1, rhs.shape[2]), jnp.float32)
        full_bias = lax.dynamic_update_slice(
            full_bias,
            bias.astype(jnp.float32)[:, None, :],
            (jnp.asarray(group_offset, jnp.int32), 0, 0),
        )
        full = jnp.concatenate([full, full_bias], axis=1)
        lhs = jnp.concatenate([lhs.astype(jnp.float32), jnp.ones((m, 1), jnp.float32)], axis=1)
    out = lax.ragged_dot(
        lhs.astype(jnp.float32),
        full,
        group_sizes.astype(jnp.int32),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    lo, hi = shard_rows(group_sizes, group_offset, g_local)
    r = jnp.arange(m)[:, None]
    out = jnp.where((r >= lo) & (r < hi), out, 0.0)
    return out.astype(out_dtype)


def tgmm_reference(
    lhs, grad, group_sizes, group_offset=0, num_groups=None, preferred_element_type=None
):
    """Per-group lhs_g^T @ grad_g in f32 (numpy loop; for tests)."""
    gs = np.asarray(group_sizes, np.int64)
    num_groups = len(gs) if num_groups is None else num_groups
    ends = np.cumsum(gs)
    starts = ends - gs
    lhs32 = np.asarray(jnp.asarray(lhs, jnp.float32))
    grad32 = np.asarray(jnp.asarray(grad, jnp.float32))
    out = np.zeros((num_groups, lhs32.shape[1], grad32.shape[1]), np.float32)
    for j in range(num_groups):
        g = group_offset + j
        a, b = starts[g], ends[g]
        out[j] = lhs32[a:b].T.astype(np.float64) @ grad32[a:b].astype(np.float64)
    return jnp.asarray(out).astype(preferred_element_type or lhs.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "num_experts",
        "has_gate",
        "is_transposed",
        "is_concatenated",
        "activation",
        "group_offset",
        "alpha",
        "limit",
        "quantize_activations",
    ),
)
def moe_experts_reference(
    hidden,
    top_k_index,
    top_k_weights,
    gate_up,
    down,
    gate_up_bias,
    down_bias,
    num_experts,
    has_gate,
    is_transposed,
    is_concatenated,
    activation,
    group_offset,
    alpha,
    limit,
    gate_up_scale=None,
    down_scale=None,
    quantize_activations=False,
):
    """moe_experts on jax.lax.ragged_dot (f32, HIGHEST), positional arguments.

    Same routing, rounding points and sentinel handling as moe_experts; the
    expert matmuls are ragged_dot_reference. Tolerances: reference.py.
    """
    checks.check_moe_args(
        hidden,
        top_k_index,
        top_k_weights,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        num_experts,
        has_gate,
        is_transposed,
        activation,
        gate_up_scale,
        down_scale,
    )
    scales = {"up": gate_up_scale, "down": down_scale}

    def matmul(x, w, group_sizes, which):
        s = scales[which]
        if not is_transposed:
            w, s = as_kn(w, s)
        return ragged_dot_reference(
            x,
            w,
            group_sizes,
            preferred_element_type=x.dtype,
            rhs_scale=s,
            quantize_lhs=quantize_activations,
        )

    return moe.experts_program(
        hidden,
        top_k_index,
        top_k_weights,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        matmul=matmul,
        num_experts=num_experts,
        has_gate=has_gate,
        is_concatenated=is_concatenated,
        activation=activation,
        group_offset=group_offset,
        alpha=alpha,
        limit=limit,
        routing="gather",
    )
