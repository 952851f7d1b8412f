"""ragged_dot-tpu kernels (gmm, tgmm, custom_vjp) in interpret mode vs references.

References: jax.lax.ragged_dot (reference.py) in f32 on the same inputs, and
a torch loop (reference_torch.py). Every comparison is per element
(tests/tolerances.py): the kernels compute in f32 (bf16 x bf16 products are
exact) and round once to the output dtype, so the bound is one output rounding
plus f32 reordering relative to the magnitude sum_k |lhs||rhs|, which is the
same bilinear computation on absolute values.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from ragged_dot_tpu import checks, moe, tiling
from ragged_dot_tpu.kernel_gmm import gmm, gmm_dma_schedule, pass_sizes, row_passes
from ragged_dot_tpu.api import ragged_dot
from ragged_dot_tpu.reference import ragged_dot_reference, tgmm_reference
from ragged_dot_tpu.reference_torch import ragged_dot_torch
from ragged_dot_tpu.kernel_tgmm import tgmm
from tolerances import assert_close

DTYPES = [jnp.float32, jnp.bfloat16]


# Test-side conversions in numpy: in JAX each would be an eager op, compiled
# anew for every drawn shape (a third of this module's programs, 2026-12-07).
def _f32(x):
    return np.asarray(x).astype(np.float32)


def _abs32(x):
    return np.abs(_f32(x))


def _check_rd(out, lhs, rhs, gs, group_offset=0, what="out"):
    """out = ragged_dot(lhs, rhs) (rhs as [G, K, N]) against the f32 reference."""
    ref = ragged_dot_reference(_f32(lhs), _f32(rhs), gs, group_offset)
    mag = ragged_dot_reference(_abs32(lhs), _abs32(rhs), gs, group_offset)
    return assert_close(out, ref, magnitude=mag, what=what)


def _check_tgmm(out, lhs, grad, sizes, what="tgmm"):
    ref = tgmm_reference(_f32(lhs), _f32(grad), sizes)
    mag = tgmm_reference(_abs32(lhs), _abs32(grad), sizes)
    return assert_close(out, ref, magnitude=mag, what=what)


def _rand(rng, shape, dtype):
    # f64 -> f32 -> dtype, the rounding jnp.asarray(f64 values, dtype) does
    return jax.device_put(rng.standard_normal(shape).astype(np.float32).astype(dtype))


def _sizes(draw, m, g):
    """Group sizes with sum <= m, often with empty groups and a short sum."""
    total = draw(st.sampled_from([m, m, max(m - 3, 0), m // 2, m // 3, 0]))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=g - 1, max_size=g - 1)))
    edges = [0, *cuts, total]
    return [b - a for a, b in zip(edges[:-1], edges[1:])]


def _blocks(draw, m, dtype):
    sub = tiling.sublane(dtype)
    bm = draw(st.sampled_from([sub, 2 * sub, 4 * sub, tiling.round_up(max(m, 1), sub)]))
    # Chunks of up to 8 sublane tiles: a group's tail is one pass of a power
    # of two tiles ending at its last row, after a 4-tile pass past half a
    # chunk (gmm.row_passes): windows that reach back over rows done, rows
    # of the group before, and the tile's start.
    chunk = draw(st.sampled_from([sub, 2 * sub, 4 * sub, 8 * sub]))
    return bm, min(chunk, bm)


def _slab(draw, n):
    return draw(st.sampled_from([n] + [128] * (n % 128 == 0 and n > 128)))


def _merged(draw, bm, chunk, dtype):
    """GmmConfig.merged_tails the blocks allow: none, tiling's choice, or one
    tile (a tail merged into the last whole pass, kernel_gmm.row_passes)."""
    sub = tiling.sublane(dtype)
    options = [(), tiling.merged_tail_tiles(chunk, sub), (1,) if chunk > sub else ()]
    return draw(st.sampled_from([t for t in options if not t or bm >= chunk + t[-1] * sub]))


def _maybe_config(draw, m, n, dtype):
    """None (tiling's choice) or small explicit blocks for n output columns:
    several row tiles and slabs, 2 to 4 weight slots, merged tails or not."""
    if not draw(st.booleans()):
        return None
    bm, chunk = _blocks(draw, m, dtype)
    return tiling.GmmConfig(
        bm,
        _slab(draw, n),
        chunk,
        weight_buffers=draw(st.integers(2, 4)),
        merged_tails=_merged(draw, bm, chunk, dtype),
    )


def _configs(draw, m, k, n, dtype):
    """Small explicit blocks, so that several row tiles and N slabs are walked."""
    bm, chunk = _blocks(draw, m, dtype)
    # 2 to 4 weight slots: the stream's ring wraps within a few experts.
    bufs = lambda: draw(st.integers(2, 4))  # noqa: E731
    merged = _merged(draw, bm, chunk, dtype)
    fwd = tiling.GmmConfig(bm, _slab(draw, n), chunk, weight_buffers=bufs(), merged_tails=merged)
    bwd_lhs = tiling.GmmConfig(
        bm, _slab(draw, k), chunk, weight_buffers=bufs(), merged_tails=merged
    )
    bwd_rhs = tiling.TgmmConfig(bm, _slab(draw, k), _slab(draw, n), chunk)
    return tiling.RaggedDotConfig(fwd, bwd_lhs, bwd_rhs)


def _small_config(dtype, k, n, rows_per_tile_in_subs=1):
    """Explicit one- or two-sublane row tiles and 128-column slabs where N, K allow."""
    sub = tiling.sublane(dtype)
    bm = rows_per_tile_in_subs * sub
    slab = lambda d: 128 if d % 128 == 0 and d > 128 else d  # noqa: E731
    return tiling.RaggedDotConfig(
        tiling.GmmConfig(bm, slab(n), sub),
        tiling.GmmConfig(bm, slab(k), sub),
        tiling.TgmmConfig(bm, slab(k), slab(n), sub),
    )


_MERGED = tiling.RaggedDotConfig(
    tiling.GmmConfig(128, 128, 64, merged_tails=(1, 2)),
    tiling.GmmConfig(128, 40, 64, merged_tails=(1, 2)),
    tiling.TgmmConfig(128, 40, 128, 64),
)


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from(DTYPES))
    m = draw(st.sampled_from([1, 5, 8, 24, 37, 64, 100]))
    k = draw(st.sampled_from([1, 7, 40, 128, 136]))
    n = draw(st.sampled_from([3, 50, 128, 256]))
    g = draw(st.integers(1, 5))
    sizes = _sizes(draw, m, g)
    cfg = _configs(draw, m, k, n, dtype) if draw(st.booleans()) else None
    seed = draw(st.integers(0, 2**16))
    return dtype, m, k, n, sizes, cfg, seed


@functools.partial(jax.jit, static_argnums=0)
def _fwd_bwd(f, lhs, rhs, ct):
    out, vjp = jax.vjp(f, lhs, rhs)
    return (out, *vjp(ct))


def _check_fwd_bwd(out, d_lhs, d_rhs, lhs, rhs, ct, gs, group_offset=0):
    """Output and both gradients against the f32 reference on the same inputs;
    the magnitudes are the same forward and vjp on absolute values."""
    ref = lambda a, b: ragged_dot_reference(a, b, gs, group_offset)  # noqa: E731
    want = _fwd_bwd(ref, _f32(lhs), _f32(rhs), _f32(ct))
    mags = _fwd_bwd(ref, _abs32(lhs), _abs32(rhs), _abs32(ct))
    for name, got, w, mag in zip(("out", "d_lhs", "d_rhs"), (out, d_lhs, d_rhs), want, mags):
        assert_close(got, w, magnitude=mag, what=name)


# Hypothesis draws these too, but not reliably within 6 examples: a sum of
# group sizes well short of M with several row tiles (the tail tiles must be
# zero and never fetched), and an N split into slabs.
@example((jnp.bfloat16, 100, 40, 256, [30, 0, 7, 12], _small_config(jnp.bfloat16, 40, 256), 1))
@example((jnp.float32, 64, 136, 256, [0, 20, 3], _small_config(jnp.float32, 136, 256, 2), 2))
# Tails merged into a group's last whole pass (64-row chunks, 128-row tiles):
# a three-tile tail as one more whole pass ([0, 112)), a one-tile tail merged
# ([128, 208)), groups without a whole pass, and rows past the groups' sum.
@example((jnp.bfloat16, 240, 40, 256, [112, 0, 16, 80, 11], _MERGED, 3))
@settings(max_examples=4, deadline=None, derandomize=True)
@given(problems())
def test_ragged_dot_fwd_and_grads_match_references(problem):
    dtype, m, k, n, sizes, cfg, seed = problem
    rng = np.random.default_rng(seed)
    gs = jnp.asarray(sizes, jnp.int32)
    lhs, rhs = _rand(rng, (m, k), dtype), _rand(rng, (len(sizes), k, n), dtype)
    ct = _rand(rng, (m, n), dtype)
    out, d_lhs, d_rhs = _fwd_bwd(
        lambda a, b: ragged_dot(a, b, gs, config=cfg, interpret=True), lhs, rhs, ct
    )
    assert out.dtype == dtype and out.shape == (m, n)
    assert d_lhs.dtype == dtype and d_rhs.dtype == dtype
    _check_fwd_bwd(out, d_lhs, d_rhs, lhs, rhs, ct, gs)
    # Rows past sum(group_sizes) are exactly zero, not merely close.
    assert not np.asarray(out[sum(sizes) :], np.float32).any()
    assert not np.asarray(d_lhs[sum(sizes) :], np.float32).any()
    # Independent torch loop.
    t_out = ragged_dot_torch(
        torch.from_numpy(np.array(lhs, np.float32)),
        torch.from_numpy(np.array(rhs, np.float32)),
        torch.tensor(sizes),
    )
    mag = ragged_dot_reference(_abs32(lhs), _abs32(rhs), gs)
    assert_close(out, t_out.numpy(), magnitude=mag, what="out vs torch loop")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,k,n,sizes",
    [
        (1, 16, 8, [0, 1, 0]),  # one row, one active group among empties
        (3, 130, 200, [3]),  # G = 1, M < 8, K and N not multiples of 128
        (40, 72, 100, [0, 0, 40, 0]),  # every row in one group
        (50, 64, 256, [7, 0, 0, 20]),  # sum < M: tail rows must be zero
        (64, 256, 256, [0, 0, 0, 0]),  # nothing to do: all zeros, no DMA
        # N unaligned and wider than a piece: 256-column pieces, then a 44-wide tail
        (24, 136, 300, [9, 0, 11]),
    ],
)
def test_gmm_edge_cases(dtype, m, k, n, sizes):
    rng = np.random.default_rng(m + k + n)
    gs = jnp.asarray(sizes, jnp.int32)
    lhs, rhs = _rand(rng, (m, k), dtype), _rand(rng, (len(sizes), k, n), dtype)
    out = gmm(lhs, rhs, gs, interpret=True)
    _check_rd(out, lhs, rhs, gs)
    assert not np.asarray(out[sum(sizes) :], np.float32).any()
    # d_lhs path: rhs given as [G, N, K], contracted on its last axis.
    rhs_t = jnp.swapaxes(rhs, 1, 2)
    out_t = gmm(lhs, rhs_t, gs, transpose_rhs=True, interpret=True)
    _check_rd(out_t, lhs, rhs, gs, what="out (transpose_rhs)")


def test_bf16_inputs_with_f32_output_and_grads():
    rng = np.random.default_rng(6)
    gs = jnp.asarray([4, 0, 9], jnp.int32)
    lhs, rhs = _rand(rng, (16, 40), jnp.bfloat16), _rand(rng, (3, 40, 24), jnp.bfloat16)
    ct = _rand(rng, (16, 24), jnp.float32)
    f = lambda a, b: ragged_dot(a, b, gs, preferred_element_type=jnp.float32, interpret=True)
    out, d_lhs, d_rhs = _fwd_bwd(f, lhs, rhs, ct)
    assert out.dtype == jnp.float32 and d_lhs.dtype == d_rhs.dtype == jnp.bfloat16
    # bf16 x bf16 products are exact in f32: the f32 output is held to f32's
    # bound; the gradients are rounded once to bf16 (the cotangent is cast to
    # bf16 first, so the reference sees that rounded cotangent).
    _check_fwd_bwd(out, d_lhs, d_rhs, lhs, rhs, ct.astype(jnp.bfloat16), gs)


@st.composite
def mixed_problems(draw):
    lhs_dtype, rhs_dtype = draw(st.sampled_from([(DTYPES[0], DTYPES[1]), (DTYPES[1], DTYPES[0])]))
    m = draw(st.sampled_from([5, 24, 40]))
    k, n = draw(st.sampled_from([40, 128])), draw(st.sampled_from([50, 128]))
    g_total = draw(st.integers(2, 4))
    g_local = draw(st.integers(1, g_total))
    offset = draw(st.integers(0, g_total - g_local))
    sizes = _sizes(draw, m, g_total)
    bias = draw(st.sampled_from([None, jnp.float32, jnp.bfloat16]))
    return lhs_dtype, rhs_dtype, m, k, n, sizes, g_local, offset, bias, draw(st.booleans())


# Megablox takes lhs and rhs of different dtypes and its callers add a per-group
# bias; both against the f32 reference, which adds the bias as one more
# contraction term (a ones column), not by gathering rows as ragged_dot does.
@example((jnp.bfloat16, jnp.float32, 24, 128, 50, [5, 0, 12, 4], 2, 1, jnp.float32, True))
@settings(max_examples=2, deadline=None, derandomize=True)
@given(mixed_problems())
def test_mixed_dtypes_and_group_bias_match_reference(problem):
    lhs_dtype, rhs_dtype, m, k, n, sizes, g_local, offset, bias_dtype, transpose = problem
    rng = np.random.default_rng(m * k + n)
    gs = jnp.asarray(sizes, jnp.int32)
    lhs, rhs = _rand(rng, (m, k), lhs_dtype), _rand(rng, (g_local, k, n), rhs_dtype)
    bias = None if bias_dtype is None else _rand(rng, (g_local, n), bias_dtype)
    out_dtype = jnp.promote_types(lhs_dtype, rhs_dtype)
    ct = _rand(rng, (m, n), out_dtype)
    w = jnp.swapaxes(rhs, 1, 2) if transpose else rhs

    def ours(a, b, c):
        return ragged_dot(
            a, b, gs, group_offset=offset, bias=c, transpose_rhs=transpose, interpret=True
        )

    def ref(a, b, c):
        return ragged_dot_reference(a, b, gs, offset, bias=c)

    out, vjp = jax.vjp(ours, lhs, w, bias)
    d_lhs, d_w, d_bias = vjp(ct)
    assert out.dtype == out_dtype and d_lhs.dtype == lhs_dtype and d_w.dtype == rhs_dtype
    d_rhs = jnp.swapaxes(d_w, 1, 2) if transpose else d_w
    f32 = lambda *xs: [None if x is None else _f32(x) for x in xs]  # noqa: E731
    absf = lambda *xs: [None if x is None else _abs32(x) for x in xs]  # noqa: E731
    want_out, want_vjp = jax.vjp(ref, *f32(lhs, rhs, bias))
    mag_out, mag_vjp = jax.vjp(ref, *absf(lhs, rhs, bias))
    # One bf16 rounding of an MXU operand (lhs to rhs's bf16 in the forward, the
    # cotangent to lhs's dtype in the backward) on top of each output rounding.
    tol = dict(dtype=jnp.bfloat16, roundings=1)
    assert_close(out, want_out, magnitude=mag_out, what="out", **tol)
    names = ("d_lhs", "d_rhs", "d_bias")
    for name, got, w_, mag in zip(
        names, (d_lhs, d_rhs, d_bias), want_vjp(_f32(ct)), mag_vjp(_abs32(ct))
    ):
        if got is None:
            assert bias is None and name == "d_bias"
            continue
        assert_close(got, w_, magnitude=mag, what=name, **tol)
    # Rows outside this shard's groups, with or without a bias: exactly zero.
    ends = np.cumsum(sizes)
    lo, hi = (ends[offset - 1] if offset else 0), ends[offset + g_local - 1]
    assert not np.asarray(out[:lo], np.float32).any() and not np.asarray(out[hi:], np.float32).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_tgmm_matches_reference_with_empty_groups(dtype):
    rng = np.random.default_rng(1)
    m, k, n, sizes = 45, 136, 256, [9, 0, 30, 0, 4]
    gs = jnp.asarray(sizes, jnp.int32)
    lhs, grad = _rand(rng, (m, k), dtype), _rand(rng, (m, n), dtype)
    # Poison the rows past the sum: they must not leak into any group.
    lhs = lhs.at[43:].set(jnp.nan)
    sub = tiling.sublane(dtype)
    cfg = tiling.TgmmConfig(block_m=2 * sub, block_k=k, block_n=128, chunk_m=sub)
    out = tgmm(lhs, grad, gs, config=cfg, interpret=True)
    _check_tgmm(out, lhs[:43], grad[:43], sizes)
    assert not np.asarray(out[1], np.float32).any() and not np.asarray(out[3], np.float32).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_tgmm_sums_each_row_once_where_tail_passes_reach_back(dtype):
    """tgmm sums rows over its passes, so a tail window reaching back over
    rows an earlier pass took (row_passes) must not add them again. 8-tile
    chunks, 16-tile row tiles; in sublane tiles, group 1 takes a chunk then a
    4-tile window over 3 new tiles, group 3 a lead pass of 4 and a window,
    group 4 (across the tile boundary) a lead pass and a 2-tile window."""
    rng = np.random.default_rng(3)
    sub = tiling.sublane(dtype)
    scale = sub // 8
    sizes = [9 * scale, 85 * scale, 0, 60 * scale, 40 * scale]
    m, k, n = 200 * scale, 136, 256
    gs = jnp.asarray(sizes, jnp.int32)
    lhs, grad = _rand(rng, (m, k), dtype), _rand(rng, (m, n), dtype)
    lhs = lhs.at[sum(sizes) :].set(jnp.nan)
    cfg = tiling.TgmmConfig(block_m=16 * sub, block_k=k, block_n=128, chunk_m=8 * sub)
    out = tgmm(lhs, grad, gs, config=cfg, interpret=True)
    _check_tgmm(out, lhs[: sum(sizes)], grad[: sum(sizes)], sizes)


# bf16 only: f32 (and mixed) shards are drawn by test_mixed_dtypes_and_group_bias_match_reference.
@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_group_offset_shards_sum_to_full_result(dtype):
    rng = np.random.default_rng(2)
    m, k, n, sizes = 40, 48, 136, [6, 0, 11, 9, 0, 10]
    gs = jnp.asarray(sizes, jnp.int32)
    lhs, rhs = _rand(rng, (m, k), dtype), _rand(rng, (6, k, n), dtype)
    ct = _rand(rng, (m, n), dtype)
    full = _fwd_bwd(lambda a, b: ragged_dot(a, b, gs, interpret=True), lhs, rhs, ct)
    parts = []
    for off in (0, 3):
        # A traced offset, as under shard_map.
        f = jax.jit(lambda a, b, o: ragged_dot(a, b, gs, group_offset=o, interpret=True))
        parts.append(
            _fwd_bwd(lambda a, b, o=off: f(a, b, jnp.int32(o)), lhs, rhs[off : off + 3], ct)
        )
        _check_fwd_bwd(*parts[-1], lhs, rhs[off : off + 3], ct, gs, off)
    _check_fwd_bwd(*full, lhs, rhs, ct, gs)
    # Each row belongs to one shard: the other's output and d_lhs rows are
    # exactly zero there, so the shards' sum is the full result bit for bit.
    np.testing.assert_array_equal(_f32(parts[0][0]) + _f32(parts[1][0]), _f32(full[0]))
    np.testing.assert_array_equal(_f32(parts[0][1]) + _f32(parts[1][1]), _f32(full[1]))
    np.testing.assert_array_equal(_f32(jnp.concatenate([parts[0][2], parts[1][2]])), _f32(full[2]))


# --- structural performance properties -----------------------------------


@pytest.mark.parametrize("buffers", [2, 3, 5])
def test_kernel_fetches_each_active_expert_once_and_never_an_empty_one(buffers):
    """The kernel's own DMA log (not a model of it) over 2 N slabs x 3 row
    tiles, groups spanning row tiles, and a weight ring of 2-5 slots."""
    rng = np.random.default_rng(3)
    m, k, n = 90, 64, 256
    sizes = [0, 13, 0, 0, 40, 1, 0, 20, 0, 0, 0, 6]  # 5 active of 12
    gs = jnp.asarray(sizes, jnp.int32)
    lhs, rhs = _rand(rng, (m, k), jnp.float32), _rand(rng, (12, k, n), jnp.float32)
    cfg = tiling.GmmConfig(block_m=32, block_n=128, chunk_m=16, weight_buffers=buffers)
    out, log = gmm(lhs, rhs, gs, config=cfg, interpret=True, _trace=True)
    _check_rd(out, lhs, rhs, gs)
    log = np.asarray(log)
    issued = [divmod(int(x), 12) for x in log[1 : 1 + log[0]]]
    active = [j for j, s in enumerate(sizes) if s]
    assert issued == [(nb, j) for nb in range(2) for j in active]
    sched = gmm_dma_schedule(sizes, m, k, n, 12, cfg, lhs_bytes=4, rhs_bytes=4, out_bytes=4)
    assert sched["weight_dmas"] == issued
    assert sched["grid_steps"] == 2 * 3  # N slabs x row tiles, not x groups


def test_shard_fetches_only_its_own_active_experts():
    rng = np.random.default_rng(4)
    sizes = [5, 0, 7, 3, 0, 9]
    gs = jnp.asarray(sizes, jnp.int32)
    lhs, rhs = _rand(rng, (30, 32), jnp.float32), _rand(rng, (3, 32, 16), jnp.float32)
    cfg = tiling.GmmConfig(block_m=8, block_n=16, chunk_m=8)
    out, log = gmm(lhs, rhs, gs, group_offset=3, config=cfg, interpret=True, _trace=True)
    _check_rd(out, lhs, rhs, gs, 3)
    log = np.asarray(log)
    assert [int(x) for x in log[1 : 1 + log[0]]] == [0, 2]  # global groups 3 and 5
    # This shard's rows are [12, 24): lhs tiles 1 and 2 only; tile 0 and the
    # tail tile past sum(group_sizes) = 24 are never fetched.
    sched = gmm_dma_schedule(
        sizes, 30, 32, 16, 3, cfg, group_offset=3, lhs_bytes=4, rhs_bytes=4, out_bytes=4
    )
    assert sched["lhs_bytes"] == 16 * 32 * 4
    assert sched["weight_dmas"] == [(0, 0), (0, 2)]


@pytest.mark.parametrize("buffers", [2, 4])
def test_dma_discipline_under_tpu_interpreter(buffers):
    """DMAs complete only when waited on; a missing wait would read stale
    weights, and a slot refilled while still read would be a race."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interp
    from jax.experimental.pallas import tpu as pltpu

    rng = np.random.default_rng(5)
    sizes = [9, 0, 20, 3]
    gs = jnp.asarray(sizes, jnp.int32)
    lhs, rhs = _rand(rng, (40, 24), jnp.float32), _rand(rng, (4, 24, 256), jnp.float32)
    params = pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True)
    cfg = tiling.GmmConfig(block_m=16, block_n=128, chunk_m=8, weight_buffers=buffers)
    out = gmm(lhs, rhs, gs, config=cfg, interpret=params)
    _check_rd(out, lhs, rhs, gs)
    assert not tpu_interp.races.races_found
    d = tgmm(lhs, out, gs, config=tiling.TgmmConfig(16, 24, 128, 8), interpret=params)
    _check_tgmm(d, lhs, out, sizes)
    assert not tpu_interp.races.races_found


QWEN3 = {"gate_up": (2048, 1536), "down": (768, 2048)}


@pytest.mark.parametrize("generation", ["v6e", "tpu7x"])
@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
def test_qwen3_decode_meets_bandwidth_targets(generation, tokens):
    """The kernel's own traffic at Qwen3-30B-A3B shapes: only active experts'
    weights are DMA'd, each once; bytes <= 1.05x min, time <= 1.15x roofline.

    bench.grid_walk replays the real gmm launch (its jaxpr, the in-kernel active
    list, every dma_start and BlockSpec fetch) on the concrete group sizes, so
    this checks what the kernel issues, and that the numpy schedule the
    performance model uses agrees with it.
    """
    from bench import grid_walk

    gen = tiling.GENERATIONS[generation]
    rng = np.random.default_rng(tokens)
    ids = np.stack([rng.choice(128, 8, replace=False) for _ in range(tokens)])
    sizes = np.bincount(ids.ravel(), minlength=128)
    m = tokens * 8
    active = int((sizes > 0).sum())
    for k, n in QWEN3.values():
        cfg = tiling.gmm_config(m, k, n, 128, jnp.bfloat16, generation=generation)
        [launch] = grid_walk.analyze(
            functools.partial(gmm, config=cfg),
            jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((128, k, n), jnp.bfloat16),
            jnp.asarray(sizes, jnp.int32),
        )
        slabs = -(-n // cfg.block_n)
        # One row tile: lhs is copied by hand too (one more DMA, m x k bytes).
        by_hand = -(-m // cfg.block_m) == 1 and m % 8 == 0
        # One DMA per active expert and slab; each active expert's weights once.
        assert launch.dma_issues == active * slabs + by_hand
        assert launch.dma_bytes == active * k * n * 2 + by_hand * m * k * 2
        s = gmm_dma_schedule(sizes, m, k, n, 128, cfg)
        assert s["rhs_bytes"] == launch.dma_bytes - by_hand * m * k * 2
        assert s["grid_steps"] == launch.steps
        assert s["mxu_flops"] == launch.flops
        min_bytes = active * k * n * 2 + m * k * 2 + m * n * 2
        moved = launch.hbm_bytes
        assert moved <= 1.05 * min_bytes
        roofline = max(min_bytes / gen.hbm_bytes_per_s, 2 * m * k * n / gen.peak_flops)
        t = (
            max(moved / gen.hbm_bytes_per_s, launch.flops / gen.peak_flops)
            + launch.steps * tiling.STEP_OVERHEAD_S
        )
        assert t <= 1.15 * roofline, (t, roofline, launch.steps)
        # MXU rows: each group's rows rounded to the bf16 sublane tile (16),
        # plus at most one extra tile where a group starts mid-tile, and its
        # tail pass rounded up to a power of two tiles (row_passes): under
        # twice that.
        rows_bound = sum(2 * (-(-int(c) // 16) * 16 + 16) for c in sizes if c)
        assert launch.flops <= 2 * rows_bound * k * n


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
def test_tpu7x_prefill_merges_tails_into_whole_passes_as_modelled(transpose_rhs):
    """Where the MXUs bind (tpu7x, Qwen3's down gmm at 8,192 tokens: 2,048-row
    tiles, 512 rows an expert on average), the kernel takes each group's tail
    into its last whole pass, or a whole pass more where the tail is wider
    than the largest merged size (GmmConfig.merged_tails), and with [N, K]
    weights a group part of over half a chunk that has no whole pass takes
    one: the walked launch's MXU flops are the ones pass_sizes gives, and it
    issues fewer passes than without."""
    from bench import grid_walk

    k, n = QWEN3["down"]
    rng = np.random.default_rng(8192)
    ids = np.stack([rng.choice(128, 8, replace=False) for _ in range(8192)])
    sizes = np.bincount(ids.ravel(), minlength=128)
    m = 8192 * 8
    cfg = tiling.gmm_config(m, k, n, 128, jnp.bfloat16, generation="tpu7x")
    assert cfg.merged_tails == (2, 8), cfg
    [launch] = grid_walk.analyze(
        functools.partial(gmm, config=cfg, transpose_rhs=transpose_rhs),
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((128, n, k) if transpose_rhs else (128, k, n), jnp.bfloat16),
        jnp.asarray(sizes, jnp.int32),
    )
    s = gmm_dma_schedule(sizes, m, k, n, 128, cfg, transpose_rhs=transpose_rhs)
    assert s["mxu_flops"] == launch.flops
    other = gmm_dma_schedule(sizes, m, k, n, 128, cfg, transpose_rhs=not transpose_rhs)
    # More MXU rows with [N, K] weights: whole passes where two narrow ones were.
    assert (s["mxu_flops"] > other["mxu_flops"]) == transpose_rhs
    ends = np.cumsum(sizes)
    bm, chunk = cfg.block_m, cfg.chunk_m
    passes = {(): 0, cfg.merged_tails: 0}
    wide = 0  # group parts whose tail takes a whole pass more
    for lo, hi in zip(ends - sizes, ends):
        for t in range(lo // bm, -(-hi // bm)):
            a, b = max(lo, t * bm) - t * bm, min(hi, t * bm + bm) - t * bm
            for merged in passes:
                sizes_ab = pass_sizes(
                    a, b, sub=16, chunk=chunk, merged=merged, alone_whole=transpose_rhs
                )
                passes[merged] += len(sizes_ab)
            n_sub = -(-b // 16) - a // 16
            wide += n_sub >= 16 and n_sub % 16 > cfg.merged_tails[-1]
    assert wide >= 10, wide
    assert passes[cfg.merged_tails] < 0.8 * passes[()], passes


@pytest.mark.parametrize(
    "chunk_tiles, merged, bm, alone_whole",
    [
        (1, (), 64, False),
        (3, (), 64, False),
        (8, (), 64, False),
        (16, (), 64, False),
        (3, (1,), 64, False),
        (4, (1, 3), 128, False),
        (8, (1, 4), 128, False),
        (8, (1, 4), 128, True),
    ],
    ids=["1", "3", "8", "16", "3-merged", "4-merged", "8-merged", "8-merged-alone-whole"],
)
def test_row_passes_keep_every_row_of_the_group_once(chunk_tiles, merged, bm, alone_whole):
    """row_passes' contract, which tgmm's accumulation relies on: over the
    passes it emits, each row of [r_lo, r_hi) is kept exactly once and no
    other row ever (its tail window reaches back over rows already done and
    rows before the group); the passes stay inside the tile, and their sizes
    are pass_sizes' (the performance model's MXU rows). Every [r_lo, r_hi)
    of the tile, 8-row sublane tiles, in one interpret-mode launch; with
    merged tails, in a tile that holds a chunk and the largest of them (and
    with a group of over half a chunk as one whole pass, alone_whole)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    sub = 8
    chunk = min(chunk_tiles * sub, bm)
    cases = [(lo, hi) for lo in range(bm) for hi in range(lo, bm + 1)]
    los = jnp.asarray([c[0] for c in cases], jnp.int32)
    his = jnp.asarray([c[1] for c in cases], jnp.int32)

    def kernel(lo_ref, hi_ref, kept_ref, rows_ref, out_ref):
        kept_ref[...] = jnp.zeros_like(kept_ref)

        def case(i, carry):
            r_lo, r_hi = lo_ref[i], hi_ref[i]
            rows_ref[i] = 0
            out_ref[i] = 0

            def emit(r0, size, fresh):
                ridx = r0 + lax.broadcasted_iota(jnp.int32, (size, 1), 0)
                keep = jnp.logical_and(ridx >= jnp.maximum(r_lo, fresh), ridx < r_hi)
                kept_ref[i, pl.ds(r0, size), :] += keep.astype(jnp.int32)
                rows_ref[i] += size
                # Rows a pass would reach outside the tile (interpret mode clamps).
                out_ref[i] += jnp.maximum(-r0, 0) + jnp.maximum(r0 + size - bm, 0)

            row_passes(
                r_lo, r_hi, sub=sub, chunk=chunk, emit=emit, merged=merged, alone_whole=alone_whole
            )
            return carry

        lax.fori_loop(0, len(cases), case, 0)

    kept, rows, outside = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((len(cases), bm, 128), jnp.int32),
            jax.ShapeDtypeStruct((len(cases),), jnp.int32),
            jax.ShapeDtypeStruct((len(cases),), jnp.int32),
        ),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] * 2,
        out_specs=(
            pl.BlockSpec(memory_space=pltpu.VMEM),
            pl.BlockSpec(memory_space=pltpu.SMEM),
            pl.BlockSpec(memory_space=pltpu.SMEM),
        ),
        interpret=True,
    )(los, his)
    kept, rows, outside = np.asarray(kept)[:, :, 0], np.asarray(rows), np.asarray(outside)
    for i, (lo, hi) in enumerate(cases):
        want = np.zeros(bm, np.int32)
        want[lo:hi] = 1
        np.testing.assert_array_equal(kept[i], want, err_msg=f"rows [{lo}, {hi})")
        want_rows = pass_sizes(lo, hi, sub=sub, chunk=chunk, merged=merged, alone_whole=alone_whole)
        assert rows[i] == sum(want_rows), (lo, hi)
        assert outside[i] == 0, (lo, hi)
    if merged:
        # The merged sizes are taken: a group of a chunk and one tile is one pass.
        assert pass_sizes(0, chunk + sub, sub=sub, chunk=chunk, merged=merged) == [
            chunk + merged[0] * sub
        ]
        # alone_whole: a group under a chunk but over half of one is one whole
        # pass, not a half-chunk pass and another.
        if chunk_tiles > 3:
            alone = pass_sizes(
                sub, chunk, sub=sub, chunk=chunk, merged=merged, alone_whole=alone_whole
            )
            if alone_whole:
                assert alone == [chunk], alone
            else:
                assert len(alone) == 2, alone


# --- bad input -----------------------------------------------------------


def _args(**kw):
    a = dict(
        lhs=jnp.zeros((8, 16), jnp.bfloat16),
        rhs=jnp.zeros((4, 16, 32), jnp.bfloat16),
        group_sizes=jnp.zeros((4,), jnp.int32),
    )
    a.update(kw)
    return a


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(lhs=jnp.zeros((8, 16, 1), jnp.bfloat16)), "lhs: expected a 2-D"),
        (dict(rhs=jnp.zeros((16, 32), jnp.bfloat16)), "rhs: expected a 3-D"),
        (dict(rhs=jnp.zeros((4, 17, 32), jnp.bfloat16)), "rhs: expected shape .*K=16"),
        (dict(rhs=jnp.zeros((4, 16, 32), jnp.float16)), "rhs.dtype: expected bfloat16 or"),
        (dict(bias=jnp.zeros((4, 16), jnp.float32)), r"bias: expected shape \(4, 32\)"),
        (dict(bias=jnp.zeros((4, 32), jnp.int32)), "bias.dtype: expected bfloat16 or float32"),
        (
            dict(lhs=jnp.zeros((8, 16), jnp.float16), rhs=jnp.zeros((4, 16, 32), jnp.float16)),
            "lhs.dtype: expected bfloat16 or float32",
        ),
        (dict(group_sizes=jnp.zeros((3,), jnp.int32)), "group_sizes: expected length >= "),
        (dict(group_sizes=jnp.zeros((4, 1), jnp.int32)), "group_sizes: expected a 1-D"),
        (dict(group_sizes=jnp.zeros((4,), jnp.float32)), "group_sizes: expected an integer"),
        (
            dict(group_sizes=jnp.zeros((6,), jnp.int32), group_offset=3),
            "group_offset: expected 0 <=",
        ),
        (dict(group_offset=1.5), "group_offset: expected an integer"),
        (dict(preferred_element_type=jnp.int8), "preferred_element_type: expected"),
    ],
)
def test_bad_arguments_raise_value_error(kw, match):
    a = _args(**kw)
    with pytest.raises(ValueError, match=match):
        ragged_dot(a.pop("lhs"), a.pop("rhs"), a.pop("group_sizes"), **a)


def test_bad_config_raises_value_error():
    a = _args()
    with pytest.raises(ValueError, match="config.block_n"):
        gmm(a["lhs"], a["rhs"], a["group_sizes"], config=tiling.GmmConfig(16, 24, 16))
    with pytest.raises(ValueError, match="config: expected"):
        ragged_dot(a["lhs"], a["rhs"], a["group_sizes"], config=42)
    # Merged tails: under a chunk, ascending, and a tile that holds the largest.
    for merged in ((4,), (2, 1), (1, 1), (3,)):
        bad = tiling.GmmConfig(64, 32, 64, merged_tails=merged)
        with pytest.raises(ValueError, match="config.merged_tails"):
            gmm(a["lhs"], a["rhs"], a["group_sizes"], config=bad)
    with pytest.raises(ValueError, match="merged_tails: expected a tuple"):
        tiling.GmmConfig(64, 32, 64, merged_tails=[1])


def test_group_sizes_value_checks():
    checks.check_group_sizes_values(np.array([1, 0, 3]), 4)
    with pytest.raises(ValueError, match="non-negative.*-1 at index 1"):
        checks.check_group_sizes_values(np.array([2, -1, 3]), 8)
    with pytest.raises(ValueError, match=r"sum\(group_sizes\) <= lhs.shape\[0\] = 4, got 5"):
        checks.check_group_sizes_values(np.array([2, 3]), 4)


def test_shape_that_cannot_fit_vmem_names_need_and_budget():
    budget_mib = tiling.GENERATIONS["tpu7x"].vmem_budget / tiling.MiB  # tpu_info's policy
    with pytest.raises(ValueError, match=rf"need [\d.]+ MiB, budget is {budget_mib:.1f} MiB"):
        tiling.gmm_config(4096, 1 << 20, 1024, 8, jnp.bfloat16, generation="tpu7x")
    with pytest.raises(ValueError, match="generation: expected one of"):
        tiling.gmm_config(8, 128, 128, 8, jnp.bfloat16, generation="v9")


def test_tpu7x_takes_wider_row_tiles_only_where_the_mxus_bind():
    """Qwen3's gate/up (GLU epilogue) and down gmm: 2048-row tiles on tpu7x
    once the 128 experts average a full 256-row MXU pass (4,096 tokens x
    top-8), which halves the tile boundaries that split a group into extra
    tail passes; 1024 below, where the weight stream binds, and on v6e."""
    for k, n, glu in ((2048, 768, True), (768, 2048, False)):
        for tokens, gen, want in (
            (2048, "tpu7x", 1024),
            (4096, "tpu7x", 2048),
            (8192, "tpu7x", 2048),
            (8192, "v6e", 1024),
        ):
            cfg = tiling.gmm_config(tokens * 8, k, n, 128, jnp.bfloat16, generation=gen, glu=glu)
            assert cfg.block_m == want, (k, n, tokens, gen, cfg)
            # The same rule merges tails into whole passes (32 and 128 rows).
            assert cfg.merged_tails == ((2, 8) if want == 2048 else ()), (tokens, gen, cfg)


def test_gathering_gmm_keeps_the_hidden_states_in_vmem_only_beside_full_blocks():
    """The gate/up gmm that gathers its rows keeps the hidden states' packed
    rows in VMEM (resident_rows) where they fit beside row tiles as large as
    it takes without them, and then takes 2048-row tiles with merged tails
    where the groups average a full pass (tiling.RESIDENT_BLOCK_M); never
    smaller tiles to make room (tpu7x at 8,192 Qwen3 tokens: 33.5 MB of rows
    beside 2048-row tiles would not fit its 48 MiB). It packs them itself
    (stage_rows) where its staging copies fit beside all that too."""
    for tokens, gen, resident, bm, stage in (
        (2048, "v6e", True, 1024, 256),
        (8192, "v6e", True, 2048, 256),
        (2048, "tpu7x", True, 1024, 256),
        (8192, "tpu7x", False, 2048, 0),
    ):
        m = tokens * 8
        kw = dict(generation=gen, glu=True, gather=True)
        cfg = tiling.gmm_config(m, 2048, 768, 128, jnp.bfloat16, gather_tokens=tokens, **kw)
        plain = tiling.gmm_config(m, 2048, 768, 128, jnp.bfloat16, **kw)
        assert (cfg.resident_rows, cfg.block_m, cfg.stage_rows) == (resident, bm, stage), (
            tokens,
            gen,
            cfg,
        )
        assert not plain.resident_rows and cfg.block_m >= plain.block_m, (tokens, gen, plain)
        assert plain.weight_buffers <= cfg.weight_buffers, (tokens, gen, cfg)
        assert cfg.merged_tails == ((2, 8) if bm == 2048 else ()), (tokens, gen, cfg)
    # Gemma 4 at 512 tokens on tpu7x: 1.8 MiB beside its blocks, under four
    # 128-row copies (2.75 MiB): resident, packed by pack_rows.
    cfg = tiling.gmm_config(
        4096,
        2816,
        704,
        128,
        jnp.bfloat16,
        generation="tpu7x",
        glu=True,
        gather=True,
        gather_tokens=512,
    )
    assert (cfg.resident_rows, cfg.stage_rows) == (True, 0), cfg
    with pytest.raises(ValueError, match="resident_rows: expected a bool"):
        tiling.GmmConfig(64, 32, 64, resident_rows=1)
    for bad in (dict(stage_rows=24, resident_rows=True), dict(stage_rows=16)):
        with pytest.raises(ValueError, match="stage_rows: expected a non-negative multiple"):
            tiling.GmmConfig(64, 32, 64, **bad)


def test_tgmm_pads_unaligned_dims_when_full_blocks_do_not_fit(monkeypatch):
    """GPT-OSS prefill: K = N = 2880 full-extent blocks exceed VMEM, so tgmm pads
    K and N to the 128-lane tile and slices the result; the numbers must not change."""
    import numpy as np
    from ragged_dot_tpu import reference, kernel_tgmm as tgmm_mod, tiling

    real = tiling.tgmm_config
    calls = []

    def only_aligned(m, k, n, *a, **kw):
        calls.append((k, n))
        if k % 128 or n % 128:
            raise ValueError("no tgmm block fits VMEM (simulated)")
        return real(m, k, n, *a, **kw)

    monkeypatch.setattr(tiling, "tgmm_config", only_aligned)
    key = jax.random.key(7)
    lhs = jax.random.normal(key, (40, 72), jnp.float32)
    grad = jax.random.normal(jax.random.fold_in(key, 1), (40, 100), jnp.float32)
    sizes = jnp.array([10, 0, 25, 5], jnp.int32)
    got = tgmm_mod.tgmm(lhs, grad, sizes, interpret=True)
    want = reference.tgmm_reference(lhs, grad, sizes)
    assert calls == [(72, 100), (128, 128)]
    assert got.shape == (4, 72, 100)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.uint32, jnp.int16])
def test_group_sizes_of_other_integer_types_are_read_as_int32(dtype):
    # tokamax passes uint32 group sizes; any integer type is accepted and cast.
    rng = np.random.default_rng(4)
    lhs = _rand(rng, (24, 128), jnp.bfloat16)
    rhs = _rand(rng, (3, 128, 128), jnp.bfloat16)
    sizes = [9, 0, 11]
    out = ragged_dot(lhs, rhs, jnp.asarray(sizes, dtype), interpret=True)
    _check_rd(out, lhs, rhs, jnp.asarray(sizes, jnp.int32))
    assert np.all(np.asarray(out[20:], np.float32) == 0)


# -- gmm(bias=...): transformers' proj + bias in the epilogue -----------------------


def _group_rows(values, sizes, m):
    """values[g] for each row of group g, zeros for rows past the groups' sum."""
    ids = np.repeat(np.arange(len(sizes)), np.asarray(sizes))
    ids = np.pad(ids, (0, m - len(ids)), constant_values=-1)
    return jnp.where(ids[:, None] >= 0, values[np.maximum(ids, 0)], 0.0)


@st.composite
def bias_problems(draw):
    dtype = draw(st.sampled_from(DTYPES))
    transpose = draw(st.booleans())
    m = draw(st.sampled_from([5, 24, 37, 100]))
    k = draw(st.sampled_from([40, 128]))
    n = draw(st.sampled_from([40, 128, 256, 320]))  # 40, 320: not whole lane tiles / a tail piece
    g = draw(st.integers(1, 4))
    sizes = _sizes(draw, m, g)
    cfg = _maybe_config(draw, m, n, dtype)
    return dtype, transpose, m, k, n, sizes, cfg, draw(st.integers(0, 2**16))


# GPT-OSS's down projection in small: N not a multiple of 128, [K, N] weights;
# 128-column slabs (two bias slices a group) over several row tiles.
@example((jnp.bfloat16, False, 37, 128, 320, [20, 0, 17], None, 1))
@example((jnp.bfloat16, True, 100, 40, 256, [30, 0, 7, 12], tiling.GmmConfig(16, 128, 16), 2))
@settings(max_examples=2, deadline=None, derandomize=True)
@given(bias_problems())
def test_gmm_bias_matches_reference(problem):
    """Each row's group's bias added to its product rounded to the output
    dtype, rounded again: two roundings of at most u times |product| + |bias|."""
    dtype, transpose, m, k, n, sizes, cfg, seed = problem
    rng = np.random.default_rng(seed)
    gs = jnp.asarray(sizes, jnp.int32)
    lhs = _rand(rng, (m, k), dtype)
    w_kn = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    rhs = jnp.swapaxes(w_kn, 1, 2) if transpose else w_kn
    bias = jnp.asarray(rng.standard_normal((len(sizes), n)), dtype)
    out = gmm(lhs, rhs, gs, transpose_rhs=transpose, bias=bias, config=cfg, interpret=True)
    assert out.dtype == dtype and out.shape == (m, n)
    b = _group_rows(_f32(bias), sizes, m)
    ref = ragged_dot_reference(_f32(lhs), _f32(w_kn), gs) + b
    mag = ragged_dot_reference(_abs32(lhs), _abs32(w_kn), gs) + jnp.abs(b)
    assert_close(out, ref, magnitude=mag, roundings=2, what="gmm + bias")
    assert not np.asarray(out[sum(sizes) :], np.float32).any()
    # Bit for bit the unfused program's rounding: the product rounded to the
    # output dtype, then `+ bias` in that dtype (transformers' proj + bias).
    plain = gmm(lhs, rhs, gs, transpose_rhs=transpose, config=cfg, interpret=True)
    unfused = (_f32(plain) + _group_rows(_f32(bias), sizes, m)).astype(dtype)
    rows = slice(0, sum(sizes))
    np.testing.assert_array_equal(np.asarray(out[rows]), np.asarray(unfused[rows]))


# -- gmm(glu=...): act(gate) * up in the epilogue ---------------------------------

GLU_ACTIVATIONS = ["silu", "gelu", "gelu_pytorch_tanh", "relu", "relu2", "gpt_oss"]


def _glu_fn(act):
    return functools.partial(moe.glu, activation=act, alpha=1.702, limit=7.0)


def _check_glu(out, lhs, w_kn, gs, act, i, interleaved=False, bias=None):
    """out = act(gate) * up against the f32 reference products (gate and up
    as halves or, `interleaved`, alternating columns; plus each row's group's
    `bias` in out's dtype). The kernel rounds each product to out's dtype
    once before the activation (twice with a bias: the product, then its sum
    with the bias): that rounding's error (u times the magnitude of the terms)
    reaches the result through the activation's derivatives, |dh/dg| mag_g +
    |dh/du| mag_u."""
    ref = ragged_dot_reference(_f32(lhs), _f32(w_kn), gs)
    mag = ragged_dot_reference(_abs32(lhs), _abs32(w_kn), gs)
    if bias is not None:
        # Rows past the groups' sum are the kernel's zeros: no bias there.
        b = _group_rows(_f32(bias.astype(out.dtype)), gs, lhs.shape[0])
        ref, mag = ref + b, mag + jnp.abs(b)
    want, spread = _glu_and_spread(ref, mag, act, i, interleaved)
    return assert_close(
        out, want, magnitude=spread, roundings=1 + (bias is not None), what=f"glu {act}"
    )


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _glu_and_spread(ref, mag, act, i, interleaved):
    if interleaved:
        split = lambda a: (a[:, 0::2], a[:, 1::2])  # noqa: E731
    else:
        split = lambda a: (a[:, :i], a[:, i:])  # noqa: E731
    f = _glu_fn(act)
    (g, u), (mag_g, mag_u) = split(ref), split(mag)
    _, via_g = jax.jvp(f, (g, u), (mag_g, jnp.zeros_like(u)))
    _, via_u = jax.jvp(f, (g, u), (jnp.zeros_like(g), mag_u))
    return f(g, u), jnp.abs(via_g) + jnp.abs(via_u)


@st.composite
def glu_problems(draw, interleaved=False):
    dtype = draw(st.sampled_from(DTYPES))
    transpose = draw(st.booleans())
    sub = tiling.sublane(dtype)
    if interleaved:
        # Multiples of 64 (tiling.glu_fusable): 64 and 192 end in a lone 128-lane
        # product tile (GPT-OSS's 2,880 does: 11 pieces of 256 and one of 64).
        i = draw(st.sampled_from([64, 128, 192, 320]))
    else:
        # Halves on the slab's tile boundary: lanes ([K, 2I]) or sublanes ([2I, K],
        # where 176 = 128 + 48 also leaves a tail piece).
        tails = [176, 48 if sub == 16 else 40] if transpose else []
        i = draw(st.sampled_from([128, 256, 384] + tails))
    m = draw(st.sampled_from([5, 24, 37, 100]))
    k = draw(st.sampled_from([40, 128]))
    g = draw(st.integers(1, 4))
    sizes = _sizes(draw, m, g)
    act = draw(st.sampled_from(GLU_ACTIVATIONS))
    cfg = _maybe_config(draw, m, i, dtype)
    bias = interleaved and draw(st.booleans())  # a bias goes with the interleaved layout
    return dtype, transpose, m, k, i, sizes, act, cfg, bias, draw(st.integers(0, 2**16))


# Several row tiles, 128-column blocks of a 384-column half (three slabs, each
# carrying a gate and an up block), a short sum; and a transposed slab with a
# 48-row tail piece.
@example(
    (
        jnp.bfloat16,
        False,
        100,
        40,
        384,
        [30, 0, 7, 12],
        "silu",
        tiling.GmmConfig(16, 128, 16),
        False,
        1,
    )
)
@example((jnp.float32, True, 37, 128, 176, [20, 17], "gpt_oss", None, False, 2))
# Slabs of 4 and 5 GLU pieces: all unrolled into one loop body, and 2 a body
# with a remainder of 1 (tiling.piece_unroll).
@example(
    (jnp.bfloat16, False, 24, 40, 1024, [9, 15], "silu", tiling.GmmConfig(16, 1024, 16), False, 3)
)
@example(
    (jnp.bfloat16, False, 24, 40, 1280, [24], "gelu", tiling.GmmConfig(16, 1280, 16), False, 4)
)
# Merged tails on transposed weights (tpu7x's case, tiling.merged_tail_tiles).
@example(
    (
        jnp.bfloat16,
        True,
        240,
        40,
        128,
        [112, 0, 16, 80, 11],
        "silu",
        tiling.GmmConfig(128, 128, 64, merged_tails=(1, 2)),
        False,
        5,
    )
)
@settings(max_examples=4, deadline=None, derandomize=True)
@given(glu_problems())
def test_gmm_glu_epilogue_matches_reference(problem):
    dtype, transpose, m, k, i, sizes, act, cfg, _, seed = problem
    rng = np.random.default_rng(seed)
    gs = jnp.asarray(sizes, jnp.int32)
    lhs = _rand(rng, (m, k), dtype)
    w_kn = jnp.asarray(rng.standard_normal((len(sizes), k, 2 * i)) / np.sqrt(k), dtype)
    rhs = jnp.swapaxes(w_kn, 1, 2) if transpose else w_kn
    out = gmm(
        lhs, rhs, gs, transpose_rhs=transpose, glu=(act, 1.702, 7.0), config=cfg, interpret=True
    )
    assert out.dtype == dtype and out.shape == (m, i)
    _check_glu(out, lhs, w_kn, gs, act, i)
    assert not np.asarray(out[sum(sizes) :], np.float32).any()


# GPT-OSS's layer: interleaved with a bias, [K, 2I] weights; slabs of 128
# columns (two blocks) over several row tiles; a 320-column slab (one 256
# piece and a 64-column tail); transposed weights without a bias.
@example((jnp.bfloat16, False, 37, 128, 192, [20, 0, 17], "gpt_oss", None, True, 1))
@example(
    (
        jnp.bfloat16,
        False,
        100,
        40,
        256,
        [30, 0, 7, 12],
        "silu",
        tiling.GmmConfig(16, 128, 16),
        True,
        2,
    )
)
@example(
    (jnp.float32, False, 24, 40, 320, [9, 15], "gpt_oss", tiling.GmmConfig(8, 320, 8), True, 3)
)
@example((jnp.bfloat16, True, 100, 128, 64, [60, 40], "gelu", None, False, 4))
@settings(max_examples=2, deadline=None, derandomize=True)
@given(glu_problems(interleaved=True))
def test_gmm_interleaved_glu_epilogue_matches_reference(problem):
    """GPT-OSS's layout: gate and up columns alternate, and a bias is added to
    the rounded product before the activation (transformers' proj + bias)."""
    dtype, transpose, m, k, i, sizes, act, cfg, use_bias, seed = problem
    rng = np.random.default_rng(seed)
    gs = jnp.asarray(sizes, jnp.int32)
    lhs = _rand(rng, (m, k), dtype)
    w_kn = jnp.asarray(rng.standard_normal((len(sizes), k, 2 * i)) / np.sqrt(k), dtype)
    rhs = jnp.swapaxes(w_kn, 1, 2) if transpose else w_kn
    bias = jnp.asarray(rng.standard_normal((len(sizes), 2 * i)), dtype) if use_bias else None
    out = gmm(
        lhs,
        rhs,
        gs,
        transpose_rhs=transpose,
        glu=(act, 1.702, 7.0),
        glu_interleaved=True,
        bias=bias,
        config=cfg,
        interpret=True,
    )
    assert out.dtype == dtype and out.shape == (m, i)
    _check_glu(out, lhs, w_kn, gs, act, i, interleaved=True, bias=bias)
    assert not np.asarray(out[sum(sizes) :], np.float32).any()


def test_gmm_interleaved_glu_keeps_a_non_finite_product_in_its_row():
    """The deinterleave moves values (a lane gather), it computes nothing: a
    row whose product overflows keeps its non-finite values to itself, and
    every other row is the same bit for bit."""
    rng = np.random.default_rng(7)
    gs = jnp.asarray([16], jnp.int32)
    lhs = _rand(rng, (16, 128), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1, 128, 256)) / np.sqrt(128), jnp.bfloat16)
    kw = dict(glu=("silu", 1.702, 7.0), glu_interleaved=True, interpret=True)
    out = np.asarray(gmm(lhs, w, gs, **kw), np.float32)
    bad = np.asarray(gmm(lhs.at[5].set(jnp.inf), w, gs, **kw), np.float32)
    assert not np.isfinite(bad[5]).all()
    rest = np.arange(16) != 5
    np.testing.assert_array_equal(bad[rest], out[rest])


def test_gmm_glu_refuses_what_it_cannot_fuse():
    lhs = jnp.zeros((8, 128), jnp.bfloat16)
    gs = jnp.asarray([8], jnp.int32)
    glu = ("silu", 1.702, 7.0)
    # [K, 2I] with I = 40: the up half would start inside a lane tile.
    with pytest.raises(ValueError, match="glu needs"):
        gmm(lhs, jnp.zeros((1, 128, 80), jnp.bfloat16), gs, glu=glu)
    # Quantized weights keep the unfused path.
    with pytest.raises(ValueError, match="glu needs"):
        gmm(
            lhs,
            jnp.zeros((1, 128, 256), jnp.int8),
            gs,
            rhs_scale=jnp.ones((1, 256), jnp.float32),
            scale_axis="n",
            glu=glu,
        )
    # Interleaved: I = 40 would leave a product tile split between pieces.
    with pytest.raises(ValueError, match="interleaved gate/up columns"):
        gmm(lhs, jnp.zeros((1, 128, 80), jnp.bfloat16), gs, glu=glu, glu_interleaved=True)
    w = jnp.zeros((1, 128, 256), jnp.bfloat16)
    # With glu a bias goes with the interleaved layout only; one value a
    # column of each expert.
    with pytest.raises(ValueError, match=r"bias needs .* \[1, 256\]"):
        gmm(lhs, w, gs, glu=glu, bias=jnp.zeros((1, 256), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"bias needs .* \[1, 256\]"):
        gmm(lhs, w, gs, glu=glu, glu_interleaved=True, bias=jnp.zeros((1, 128)))
    with pytest.raises(ValueError, match="goes with glu"):
        gmm(lhs, w, gs, glu_interleaved=True)


# -- rows gathered in the kernel (gmm's gather=) --------------------------------


@st.composite
def gather_problems(draw):
    transpose = draw(st.booleans())
    t = draw(st.sampled_from([5, 40, 96]))
    # 768: three word groups, padded to 8 rows; 320 and 448: a partial last
    # group (its low half 64 columns; its high half 64), as GPT-OSS's 2880.
    k = draw(st.sampled_from([256, 768, 320, 448]))
    i = draw(st.sampled_from([128, 256]))
    m = draw(st.sampled_from([24, 100, 190]))
    sizes = _sizes(draw, m, draw(st.integers(1, 4)))
    chunk = draw(st.sampled_from([16, 32, 64]))
    bm = chunk * draw(st.integers(1, 4))
    merged = _merged(draw, bm, chunk, jnp.bfloat16)
    resident = draw(st.booleans())
    cfg = tiling.GmmConfig(
        bm,
        i,
        chunk,
        weight_buffers=draw(st.integers(2, 3)),
        merged_tails=merged,
        resident_rows=resident,
        stage_rows=draw(st.sampled_from([0, 16, 32])) if resident else 0,
    )
    act = draw(st.sampled_from([None, "silu", "gelu"]))
    return transpose, t, k, i, m, sizes, cfg, act, draw(st.integers(0, 2**16))


def _gather_case(problem):
    transpose, t, k, i, m, sizes, cfg, act, seed = problem
    rng = np.random.default_rng(seed)
    hidden = _rand(rng, (t, k), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, t, m), jnp.int32)
    n = 2 * i if act else i
    w_kn = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), jnp.bfloat16)
    rhs = jnp.swapaxes(w_kn, 1, 2) if transpose else w_kn
    kw = dict(transpose_rhs=transpose, config=cfg, glu=(act, 1.702, 7.0) if act else None)
    return hidden, ids, w_kn, rhs, jnp.asarray(sizes, jnp.int32), kw


# Several tiles, the last one partial, rows past the sum; merged tails; one
# tile only (every pass's prefetch goes to the junk rows); tiles with one
# whole pass for two chunks (the step's end issues the next tile's second);
# a tile with five whole passes for four chunks (two wide merged tails: the
# fifth's copies go to the junk rows).
@example((True, 40, 256, 128, 190, [60, 0, 70, 41], tiling.GmmConfig(64, 128, 32), "silu", 1))
@example(
    (False, 40, 256, 128, 190, [16, 48, 16, 48, 16, 46], tiling.GmmConfig(64, 128, 32), None, 5)
)
@example(
    (
        True,
        96,
        256,
        128,
        300,
        [97, 97, 62, 44],
        tiling.GmmConfig(256, 128, 64, merged_tails=(1, 2)),
        "silu",
        6,
    )
)
@example(
    (
        True,
        96,
        768,
        128,
        190,
        [112, 16, 62],
        tiling.GmmConfig(128, 128, 64, merged_tails=(1, 2)),
        None,
        2,
    )
)
@example((False, 5, 256, 256, 24, [20, 4], tiling.GmmConfig(32, 256, 16), "gelu", 3))
# Rows from the VMEM-resident hidden states: several tiles with merged tails
# and rows past the sum (packed by pack_rows); one tile, K = 768 (words padded
# to 8 rows), staged and packed in the kernel, six copies of 16 rows.
@example(
    (
        False,
        40,
        256,
        128,
        190,
        [60, 0, 70, 41],
        tiling.GmmConfig(64, 128, 32, merged_tails=(1,), resident_rows=True),
        "silu",
        7,
    )
)
@example(
    (
        True,
        96,
        768,
        128,
        100,
        [37, 63],
        tiling.GmmConfig(128, 128, 32, resident_rows=True, stage_rows=16),
        None,
        8,
    )
)
# A partial last word group (GPT-OSS's H = 2880 has one): rows staged and
# packed in the kernel (K = 320), and rows fetched from pack_rows' words (448).
@example(
    (
        False,
        40,
        320,
        128,
        100,
        [60, 40],
        tiling.GmmConfig(64, 128, 32, resident_rows=True, stage_rows=16),
        "silu",
        9,
    )
)
@example((True, 40, 448, 128, 100, [37, 63], tiling.GmmConfig(64, 128, 32), None, 10))
@settings(max_examples=2, deadline=None, derandomize=True)
@given(gather_problems())
def test_gmm_gathers_its_rows_as_xla_would(problem):
    """gmm(hidden, ..., gather=ids) is gmm(hidden[ids], ...) bit for bit, the
    rows fetched one DMA each, a tile ahead, from pairs.pack_rows' layout (or,
    resident_rows, stored from the hidden states' rows copied into VMEM,
    packed by pack_rows or, stage_rows, by the kernel); and both match the
    reference."""
    hidden, ids, w_kn, rhs, gs, kw = _gather_case(problem)
    out = gmm(hidden, rhs, gs, gather=ids, interpret=True, **kw)
    want = gmm(hidden[ids], rhs, gs, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    act = kw["glu"][0] if kw["glu"] else None
    if act:
        _check_glu(out, hidden[ids], w_kn, gs, act, w_kn.shape[2] // 2)
    else:
        _check_rd(out, hidden[ids], w_kn, gs)


@pytest.mark.parametrize("rows", ["copied", "resident", "staged"])
def test_gathered_rows_are_waited_for_under_tpu_interpreter(rows):
    """Row copies complete only when waited on: a chunk read before its wait
    would be stale (zeros, then the tile before's rows); with resident rows,
    a row stored from the hidden states before their copy's wait (or, staged,
    a staging copy packed before its wait) would be the interpreter's
    uninitialized memory. (The interpreter's race detector takes no strided
    slices, which the row unpacking reads.)"""
    from jax.experimental.pallas import tpu as pltpu

    resident = rows != "copied"
    cfg = tiling.GmmConfig(
        64, 128, 32, resident_rows=resident, stage_rows=16 if rows == "staged" else 0
    )
    problem = (True, 40, 256, 128, 190, [60, 0, 70, 41], cfg, None, 4)
    hidden, ids, w_kn, rhs, gs, kw = _gather_case(problem)
    params = pltpu.InterpretParams(dma_execution_mode="on_wait")
    out = gmm(hidden, rhs, gs, gather=ids, interpret=params, **kw)
    _check_rd(out, hidden[ids], w_kn, gs)


def test_gmm_gathers_its_rows_beside_a_bias():
    """Gathered rows with a bias (the ids' blocks and the bias in the
    kernel's operand order): 613 hidden states staged and packed in the
    kernel, 13 copies of 48 rows, the last over rows the one before brought,
    the 5 past the last whole 8-row tile packed by XLA; bit for bit gmm on
    XLA's gathered rows."""
    rng = np.random.default_rng(11)
    hidden = _rand(rng, (613, 256), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, 613, 190), jnp.int32)
    ids = ids.at[:4].set(jnp.asarray([0, 607, 608, 612]))  # around the tile and the tail
    w = jnp.asarray(rng.standard_normal((4, 256, 256)) / 16, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal((4, 256)), jnp.float32)
    cfg = tiling.GmmConfig(64, 128, 32, merged_tails=(1,), resident_rows=True, stage_rows=48)
    kw = dict(config=cfg, glu=("silu", 1.702, 7.0), glu_interleaved=True, bias=bias)
    gs = jnp.asarray([60, 0, 70, 41], jnp.int32)
    out = gmm(hidden, w, gs, gather=ids, interpret=True, **kw)
    want = gmm(hidden[ids], w, gs, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    assert np.isfinite(np.asarray(out, np.float32)).all()


def test_gmm_gather_refuses_what_it_cannot_fetch():
    gs = jnp.asarray([8], jnp.int32)
    ids = jnp.zeros((8,), jnp.int32)
    w = jnp.zeros((1, 256, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="gather needs bfloat16 lhs"):
        gmm(jnp.zeros((4, 256), jnp.float32), jnp.zeros((1, 256, 256), jnp.float32), gs, gather=ids)
    with pytest.raises(ValueError, match="gather needs bfloat16 lhs"):
        gmm(
            jnp.zeros((4, 200), jnp.bfloat16),
            jnp.zeros((1, 200, 256), jnp.bfloat16),
            gs,
            gather=ids,
        )
    with pytest.raises(ValueError, match="gather needs bfloat16 lhs"):
        gmm(jnp.zeros((4, 256), jnp.bfloat16), w, gs, gather=ids.astype(jnp.float32))
    with pytest.raises(ValueError, match="unquantized"):
        gmm(
            jnp.zeros((4, 256), jnp.bfloat16),
            w.astype(jnp.int8),
            gs,
            rhs_scale=jnp.ones((1, 256), jnp.float32),
            scale_axis="n",
            gather=ids,
        )
    for cfg in (tiling.GmmConfig(16, 128, 16), tiling.GmmConfig(48, 256, 32)):
        with pytest.raises(ValueError, match="whole of N in one block and row tiles of whole"):
            gmm(jnp.zeros((4, 256), jnp.bfloat16), w, gs, gather=ids, config=cfg)
