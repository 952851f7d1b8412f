"""Argument validation for ragged_dot, in one place.

Shape and dtype checks run at trace time on static metadata, so they work on
tracers. Value checks (negative sizes, sum > M) need concrete numbers and are
for the eager torch layer: ``check_group_sizes_values``.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import tiling

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


def check_ragged_dot_args(
    lhs, rhs, group_sizes, group_offset=0, preferred_element_type=None, *, transpose_rhs=False
) -> None:
    """Raises ValueError naming the argument when shapes or dtypes are wrong.

    lhs [M, K] and rhs [G_local, K, N] share a dtype (bfloat16 or float32);
    group_sizes is int32 [G] with G >= G_local; group_offset is an integer
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
    check_dtype("rhs.dtype", rhs.dtype)
    if jnp.dtype(lhs.dtype) != jnp.dtype(rhs.dtype):
        raise ValueError(
            f"rhs.dtype: expected the dtype of lhs ({_dtype_name(lhs)}), got {_dtype_name(rhs)}"
        )
    k_axis = 2 if transpose_rhs else 1
    if lhs.shape[1] != rhs.shape[k_axis]:
        want = rhs_layout.replace("K", f"K={lhs.shape[1]}")
        raise ValueError(f"rhs: expected shape {want} to match lhs [M, K], got {tuple(rhs.shape)}")
    if np.ndim(group_sizes) != 1:
        raise ValueError(
            f"group_sizes: expected a 1-D array [G], got shape {tuple(np.shape(group_sizes))}"
        )
    if jnp.dtype(group_sizes.dtype) != jnp.dtype(jnp.int32):
        raise ValueError(f"group_sizes: expected dtype int32, got {_dtype_name(group_sizes)}")
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


def check_group_sizes_values(group_sizes, m: int) -> None:
    """Eager check of concrete group sizes: non-negative and sum(sizes) <= m."""
    gs = np.asarray(group_sizes)
    if gs.ndim != 1:
        raise ValueError(f"group_sizes: expected a 1-D array, got shape {gs.shape}")
    if not np.issubdtype(gs.dtype, np.integer):
        raise ValueError(f"group_sizes: expected integers, got {gs.dtype}")
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
