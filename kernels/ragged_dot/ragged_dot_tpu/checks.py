"""Argument validation for ragged_dot, in one place.

Shape and dtype checks read only `.shape` and `.dtype`, so they run on JAX
arrays, tracers and the torch ops' tensor specs alike (the ops call them before
they dispatch). Value checks (negative sizes, sum > M) need concrete numbers
and are for the eager torch layer: ``check_group_sizes_values``.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import mxfp4, tiling, w8a8
from .moe import ACTIVATIONS

_SUPPORTED = "bfloat16 or float32"


def _dtype_name(x) -> str:
    return jnp.dtype(x.dtype).name


def check_dtype(name: str, dtype) -> jnp.dtype:
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"{name}: expected {_SUPPORTED}, got {dtype!r}") from e
    if dt not in tiling.SUPPORTED_DTYPES:
        raise ValueError(f"{name}: expected {_SUPPORTED}, got {dt.name}")
    return dt


def check_mxfp4(name: str, w, scale, scale_name: str, *, transposed: bool) -> None:
    """uint8 (MXFP4) weights: mxfp4's kernel layout [G, K/2, N], e8m0 scales
    [G, S, N] with S = K/32 or mxfp4.scale_rows(K)."""
    if transposed:
        raise ValueError(
            f"{name}: MXFP4 (uint8) weights are taken in mxfp4's kernel layout"
            f" [G, K/2, N] ({'transpose_rhs=False' if name == 'rhs' else 'is_transposed=True'});"
            " convert checkpoint [G, N, K/2] weights once with mxfp4.to_kernel_layout"
        )
    g, kh, n = w.shape
    k = 2 * kh
    if scale is None:
        raise ValueError(
            f"{scale_name}: expected e8m0 scales [{g}, {mxfp4.scale_rows(k)}, {n}] for"
            f" MXFP4 {name}, got None"
        )
    if jnp.dtype(scale.dtype) not in mxfp4.SCALE_DTYPES:
        raise ValueError(
            f"{scale_name}: expected uint8 or float8_e8m0fnu (e8m0) scales for MXFP4"
            f" {name}, got {_dtype_name(scale)}"
        )
    rows = (k // mxfp4.BLOCK, mxfp4.scale_rows(k))
    shape = tuple(np.shape(scale))
    if k % mxfp4.BLOCK or len(shape) != 3 or shape[::2] != (g, n) or shape[1] not in rows:
        raise ValueError(
            f"{scale_name}: expected shape ({g}, {rows[1]}, {n}) (or {rows[0]} rows: one"
            f" scale per 32 k of each of the {n} columns, K = 2 * {name}.shape[1] = {k},"
            f" a multiple of 32), got {shape}"
        )


def check_weight_scale(name: str, w, scale, n: int, scale_name: str, transposed=False) -> None:
    """A weight's dtype and its scales: bfloat16/float32 weights take none;
    int8/float8_e4m3fn weights [G, A, B] need float32/bfloat16 scales, per
    output channel [G, n] or per 128 x 128 block [G, A/128, B/128] (A and B
    multiples of 128); uint8 ones are MXFP4 (check_mxfp4)."""
    wdt = jnp.dtype(w.dtype)
    if mxfp4.is_mxfp4(wdt):
        return check_mxfp4(name, w, scale, scale_name, transposed=transposed)
    if not tiling.is_quantized(wdt):
        if wdt not in tiling.SUPPORTED_DTYPES:
            raise ValueError(
                f"{name}.dtype: expected {_SUPPORTED}, or int8 / float8_e4m3fn / uint8"
                " (MXFP4) with scales,"
                f" got {wdt.name}"
            )
        if scale is not None:
            raise ValueError(
                f"{scale_name}: expected None for {wdt.name} {name} (scales go with int8 or"
                f" float8_e4m3fn weights), got shape {tuple(np.shape(scale))}"
            )
        return
    if scale is None:
        raise ValueError(
            f"{scale_name}: expected [{w.shape[0]}, {n}] per-output-channel scales for"
            f" {wdt.name} {name}, got None"
        )
    want = (w.shape[0], n)
    a, b = w.shape[1:]
    blocks = (w.shape[0], a // 128, b // 128)
    if np.ndim(scale) == 3:
        if a % 128 or b % 128 or tuple(np.shape(scale)) != blocks:
            raise ValueError(
                f"{scale_name}: expected 128 x 128 block scales of shape"
                f" ({w.shape[0]}, {name}.shape[1] / 128, {name}.shape[2] / 128) with both"
                f" dims multiples of 128, got {tuple(np.shape(scale))} for {name}"
                f" {tuple(w.shape)}"
            )
    elif tuple(np.shape(scale)) != want:
        raise ValueError(
            f"{scale_name}: expected shape {want} (one scale per expert and output"
            f" channel) or 128 x 128 block scales {blocks}, got {tuple(np.shape(scale))}"
        )
    if jnp.dtype(scale.dtype) not in tiling.SUPPORTED_DTYPES:
        raise ValueError(f"{scale_name}: expected float32 or bfloat16, got {_dtype_name(scale)}")


def check_ragged_dot_args(
    lhs,
    rhs,
    group_sizes,
    group_offset=0,
    preferred_element_type=None,
    *,
    transpose_rhs=False,
    rhs_scale=None,
    bias=None,
    quantize_lhs=False,
) -> None:
    """Raises ValueError naming the argument when shapes or dtypes are wrong.

    lhs [M, K] and rhs [G_local, K, N] are bfloat16 or float32 (not
    necessarily the same), or rhs is int8/float8_e4m3fn with rhs_scale
    [G_local, N] or 128 x 128 block scales (float32/bfloat16); bias, if any,
    is [G_local, N] bfloat16/float32;
    group_sizes is integer (read as int32) [G] with G >= G_local; group_offset is an integer
    scalar, and when static, 0 <= group_offset <= G - G_local. With
    transpose_rhs, rhs is [G_local, N, K].
    """
    if np.ndim(lhs) != 2:
        raise ValueError(f"lhs: expected a 2-D array [M, K], got shape {tuple(np.shape(lhs))}")
    rhs_layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
    if np.ndim(rhs) != 3:
        raise ValueError(
            f"rhs: expected a 3-D array {rhs_layout}, got shape {tuple(np.shape(rhs))}"
        )
    check_dtype("lhs.dtype", lhs.dtype)
    n = rhs.shape[1 if transpose_rhs else 2]
    check_weight_scale("rhs", rhs, rhs_scale, n, "rhs_scale", transposed=transpose_rhs)
    if quantize_lhs:
        check_w8a8("quantize_lhs", rhs, rhs_scale)
    if bias is not None:
        if tuple(np.shape(bias)) != (rhs.shape[0], n):
            raise ValueError(
                f"bias: expected shape ({rhs.shape[0]}, {n}) (one row per group held in rhs),"
                f" got {tuple(np.shape(bias))}"
            )
        check_dtype("bias.dtype", bias.dtype)
    k_axis = 2 if transpose_rhs else 1
    packed = 2 if mxfp4.is_mxfp4(rhs.dtype) else 1
    if lhs.shape[1] != rhs.shape[k_axis] * packed:
        if packed == 2:
            rhs_layout = "[G, K/2, N]"
        want = rhs_layout.replace("K", f"K={lhs.shape[1]}")
        raise ValueError(f"rhs: expected shape {want} to match lhs [M, K], got {tuple(rhs.shape)}")
    if np.ndim(group_sizes) != 1:
        raise ValueError(
            f"group_sizes: expected a 1-D array [G], got shape {tuple(np.shape(group_sizes))}"
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        # Any integer type is taken (tokamax passes uint32) and read as int32.
        raise ValueError(
            f"group_sizes: expected an integer dtype (int32; others are cast), got"
            f" {_dtype_name(group_sizes)}"
        )
    g_total, g_local = group_sizes.shape[0], rhs.shape[0]
    if g_total < g_local:
        raise ValueError(
            f"group_sizes: expected length >= rhs.shape[0] = {g_local} (one size per"
            f" group), got length {g_total}"
        )
    if isinstance(group_offset, numbers.Integral) and not isinstance(group_offset, bool):
        if not 0 <= group_offset <= g_total - g_local:
            raise ValueError(
                f"group_offset: expected 0 <= group_offset <= len(group_sizes) -"
                f" rhs.shape[0] = {g_total - g_local}, got {group_offset}"
            )
    elif isinstance(group_offset, (jax.Array, np.ndarray, np.generic)):
        if np.ndim(group_offset) != 0 or not jnp.issubdtype(group_offset.dtype, jnp.integer):
            raise ValueError(
                f"group_offset: expected an integer scalar, got {group_offset.dtype}"
                f" array of shape {tuple(np.shape(group_offset))}"
            )
    else:
        raise ValueError(
            f"group_offset: expected an integer scalar, got {type(group_offset).__name__}"
        )
    if preferred_element_type is not None:
        check_dtype("preferred_element_type", preferred_element_type)


def check_w8a8(name: str, w, scale) -> None:
    """Activations quantized in the kernel (w8a8) need int8 / float8_e4m3fn
    weights with per-output-channel scales (the row scale and the column scale
    then multiply the integer or fp8 product)."""
    wdt = jnp.dtype(w.dtype)
    if wdt not in w8a8.QMAX or scale is None or np.ndim(scale) != 2:
        raise ValueError(
            f"{name}: w8a8 needs int8 or float8_e4m3fn weights with per-output-channel"
            f" scales [G, N]; got {wdt.name} weights with scales of shape"
            f" {None if scale is None else tuple(np.shape(scale))}"
        )


def check_group_sizes_values(group_sizes, m: int) -> None:
    """Eager check of concrete group sizes: non-negative and sum(sizes) <= m."""
    gs = np.asarray(group_sizes)
    if gs.ndim != 1 or not np.issubdtype(gs.dtype, np.integer):
        return  # check_ragged_dot_args reports the shape or dtype
    neg = np.flatnonzero(gs < 0)
    if neg.size:
        raise ValueError(
            f"group_sizes: expected non-negative sizes, got {int(gs[neg[0]])} at"
            f" index {int(neg[0])}"
        )
    total = int(gs.astype(np.int64).sum())
    if total > m:
        raise ValueError(
            f"group_sizes: expected sum(group_sizes) <= lhs.shape[0] = {m}, got {total}"
        )


def check_moe_args(
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
    gate_up_scale=None,
    down_scale=None,
    quantize_activations=False,
) -> None:
    """The fused MoE layer's arguments (see api.moe_experts); ValueError naming the argument."""
    if np.ndim(hidden) != 2:
        raise ValueError(f"hidden: expected [T, H], got shape {tuple(hidden.shape)}")
    check_dtype("hidden.dtype", hidden.dtype)
    t, h = hidden.shape
    if np.ndim(top_k_index) != 2 or top_k_index.shape[0] != t:
        raise ValueError(f"top_k_index: expected [T={t}, k], got shape {tuple(top_k_index.shape)}")
    if not jnp.issubdtype(top_k_index.dtype, jnp.integer):
        raise ValueError(f"top_k_index: expected integers, got {top_k_index.dtype}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_weights: expected shape {tuple(top_k_index.shape)}, got"
            f" {tuple(top_k_weights.shape)}"
        )
    if np.ndim(gate_up) != 3 or np.ndim(down) != 3:
        raise ValueError(
            f"gate_up/down: expected 3-D expert weights, got {tuple(gate_up.shape)}"
            f" and {tuple(down.shape)}"
        )
    if gate_up.shape[0] != num_experts or down.shape[0] != num_experts:
        raise ValueError(
            f"gate_up/down: expected {num_experts} experts (num_experts), got"
            f" {gate_up.shape[0]} and {down.shape[0]}"
        )
    for name, w in (("gate_up", gate_up), ("down", down)):
        if mxfp4.is_mxfp4(w.dtype) and not is_transposed:
            check_mxfp4(name, w, None, name + "_scale", transposed=True)
    up_in, up_out = gate_up.shape[1:] if is_transposed else gate_up.shape[:0:-1]
    dn_in, dn_out = down.shape[1:] if is_transposed else down.shape[:0:-1]
    if is_transposed:  # MXFP4 weights pack their input dim
        up_in *= 2 if mxfp4.is_mxfp4(gate_up.dtype) else 1
        dn_in *= 2 if mxfp4.is_mxfp4(down.dtype) else 1
    if up_in != h:
        raise ValueError(
            f"gate_up: expected input dim H={h} (is_transposed={is_transposed}),"
            f" got shape {tuple(gate_up.shape)}"
        )
    inter = up_out // 2 if has_gate else up_out
    if has_gate and up_out % 2:
        raise ValueError(f"gate_up: expected an even gate+up dim, got {up_out}")
    if dn_in != inter or dn_out != h:
        raise ValueError(
            f"down: expected [E, {inter}, {h}] (is_transposed) or [E, {h}, {inter}],"
            f" got shape {tuple(down.shape)}"
        )
    t = not is_transposed
    check_weight_scale("gate_up", gate_up, gate_up_scale, up_out, "gate_up_scale", transposed=t)
    check_weight_scale("down", down, down_scale, dn_out, "down_scale", transposed=t)
    if quantize_activations:
        check_w8a8("quantize_activations", gate_up, gate_up_scale)
        check_w8a8("quantize_activations", down, down_scale)
    if activation == "gpt_oss" and not has_gate:
        raise ValueError("activation: 'gpt_oss' is a gated activation; has_gate=False")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(ACTIVATIONS)}, got {activation!r}")
    for name, b, dim in (("gate_up_bias", gate_up_bias, up_out), ("down_bias", down_bias, h)):
        if b is not None and tuple(b.shape) != (num_experts, dim):
            raise ValueError(f"{name}: expected shape ({num_experts}, {dim}), got {tuple(b.shape)}")


def check_grouped_mm_offs(offs, weight) -> None:
    """torch.nn.functional.grouped_mm's offs: integer [G], one row end per group of weight."""
    if np.ndim(offs) != 1 or not jnp.issubdtype(offs.dtype, jnp.integer):
        raise ValueError(
            f"offs: expected a 1-D integer array [G], got {jnp.dtype(offs.dtype).name} "
            f"of shape {tuple(np.shape(offs))}"
        )
    if np.ndim(weight) == 3 and offs.shape[0] != weight.shape[0]:
        raise ValueError(
            f"offs: expected length {weight.shape[0]} (weight.shape[0]), got {offs.shape[0]}"
        )
