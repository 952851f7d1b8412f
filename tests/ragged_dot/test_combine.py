"""The MoE combine kernel (kernel_combine), the packed rows it reads (pairs.py)
and gmm's packed output, in interpret mode against references.

- pairs: pack / unpack are exact inverses on bf16 values, bit for bit (NaN,
  inf, signed zeros and subnormals included).
- gmm(packed=True) writes, bit for bit, pairs.pack_rows of the output gmm
  writes unpacked (whose numerics test_gmm.py checks against ragged_dot).
- kernel_pack.pack_rows writes pairs.pack_rows bit for bit.
- combine against an f32 sum of the same bf16 rows (tests/tolerances.py): one
  rounding to the output dtype plus f32 reordering over the k terms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from ragged_dot_tpu import pairs, tiling
from ragged_dot_tpu.kernel_combine import combine, combine_reference
from ragged_dot_tpu.kernel_gmm import gmm
from tolerances import assert_close


def _bits(x):
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.bfloat16), jnp.uint16))


SPECIAL = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, -3e-39, 65504.0, 3.4e38]


# Whole 256-column groups, Gemma 4's padded 2816 and partial last groups:
# GPT-OSS's 2880 (its last low half 64 columns), 448 (a 64-column high half).
@example(3, 2880, 1)
@example(2, 448, 2)
@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    st.integers(1, 5),
    st.sampled_from([256, 512, 2048, 2816, 2880, 320, 448]),
    st.integers(0, 2**16),
)
def test_pack_unpack_round_trip_bit_for_bit(rows, n, seed):
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((rows, n)).astype(np.float32) * 10.0 ** rng.integers(-30, 30)
    y.flat[rng.integers(0, y.size, 12)] = rng.choice(SPECIAL, 12)
    g = -(-n // 256)
    words = pairs.pack(y)
    assert words.dtype == jnp.uint32 and words.shape == (rows, g * 128)
    np.testing.assert_array_equal(_bits(pairs.unpack(words, n=n)), _bits(y))
    # The layout the module states: column 256g + c low, 256g + 128 + c high,
    # zero where a partial last group has no column.
    low = np.asarray(words) & 0xFFFF
    high = np.asarray(words) >> 16
    ref = np.pad(_bits(y), ((0, 0), (0, g * 256 - n))).reshape(rows, g, 2, 128)
    np.testing.assert_array_equal(low.reshape(rows, g, 128), ref[:, :, 0])
    np.testing.assert_array_equal(high.reshape(rows, g, 128), ref[:, :, 1])
    # pack_rows: a token's word rows, zero rows up to a whole tile.
    flat = np.asarray(pairs.pack_rows(y)).reshape(rows, -1, 128)
    assert flat.shape[1] == pairs.row_words(n) == -(-n // 2048) * 8
    np.testing.assert_array_equal(flat[:, :g].reshape(rows, g * 128), np.asarray(words))
    assert not flat[:, g:].any()
    np.testing.assert_array_equal(_bits(pairs.unpack_rows(pairs.pack_rows(y), n)), _bits(y))


@example(40, 2880, 16, 3)  # GPT-OSS: a partial last word group
@settings(max_examples=3, deadline=None, derandomize=True)
@given(
    st.sampled_from([1, 40, 100]),
    st.sampled_from([256, 768, 2816, 320, 448]),
    st.sampled_from([None, 16, 32]),
    st.integers(0, 2**16),
)
def test_pack_rows_kernel_writes_pack_rows_bit_for_bit(t, n, block_t, seed):
    """kernel_pack.pack_rows (what gmm's in-kernel gather reads) is
    pairs.pack_rows, special values, padding word rows and a partial last
    block included."""
    from ragged_dot_tpu.kernel_pack import pack_rows

    rng = np.random.default_rng(seed)
    y = rng.standard_normal((t, n)).astype(np.float32) * 10.0 ** rng.integers(-30, 30)
    y.flat[rng.integers(0, y.size, 12)] = rng.choice(SPECIAL, 12)
    y = jnp.asarray(y, jnp.bfloat16)
    got = pack_rows(y, block_t=block_t, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(pairs.pack_rows(y)))


def test_pack_rows_kernel_refuses_what_it_cannot_pack():
    from ragged_dot_tpu.kernel_pack import pack_rows

    with pytest.raises(ValueError, match="pack_rows: x: expected bfloat16"):
        pack_rows(jnp.zeros((4, 256), jnp.float32))
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_rows(jnp.zeros((4, 2848), jnp.bfloat16))


# -- gmm(packed=True) --------------------------------------------------------------


@st.composite
def packed_problems(draw):
    transpose = draw(st.booleans())
    m = draw(st.sampled_from([5, 37, 100]))
    k = draw(st.sampled_from([40, 128]))
    g = draw(st.integers(1, 3))
    total = draw(st.sampled_from([m, m - 3, m // 2]))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=g - 1, max_size=g - 1)))
    sizes = np.diff([0, *cuts, total]).tolist()
    weights = draw(st.sampled_from(["bfloat16", "int8"]))
    n = draw(st.sampled_from([2048, 2816, 2880]))
    cfg = None
    if draw(st.booleans()):
        bm = draw(st.sampled_from([16, 32, 112]))
        cfg = tiling.GmmConfig(bm, n, draw(st.sampled_from([16, 32])), weight_buffers=2)
    return transpose, m, k, n, sizes, weights, cfg, draw(st.integers(0, 2**16))


# Several row tiles with groups across them and a short sum; int8 weights with
# per-channel scales (the scaled product goes through the same store) and
# Gemma 4's H = 2816 (11 word rows a token, padded to 16); GPT-OSS's 2880
# (256-column pieces and a 64-column tail: a partial last word group).
@example((False, 100, 40, 2048, [30, 0, 50], "bfloat16", tiling.GmmConfig(32, 2048, 16), 1))
@example((True, 37, 128, 2816, [20, 14], "int8", None, 2))
@example((True, 37, 128, 2880, [20, 14], "bfloat16", None, 3))
@settings(max_examples=1, deadline=None, derandomize=True)
@given(packed_problems())
def test_gmm_packed_writes_the_packed_rows_of_its_output(problem):
    transpose, m, k, n, sizes, weights, cfg, seed = problem
    rng = np.random.default_rng(seed)
    gs = jnp.asarray(sizes, jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    shape = (len(sizes), n, k) if transpose else (len(sizes), k, n)
    kw = dict(transpose_rhs=transpose, config=cfg, interpret=True)
    if weights == "int8":
        rhs = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        kw.update(rhs_scale=jnp.asarray(rng.uniform(0.001, 0.01, (len(sizes), n)), jnp.float32))
        kw.update(scale_axis="n")
    else:
        rhs = jnp.asarray(rng.standard_normal(shape) / np.sqrt(k), jnp.bfloat16)
    plain = gmm(lhs, rhs, gs, **kw)
    packed = gmm(lhs, rhs, gs, packed=True, **kw)
    assert plain.dtype == jnp.bfloat16 and packed.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(pairs.pack_rows(plain)))


@pytest.mark.parametrize("n", [2048, 2816, 320])
@pytest.mark.parametrize("offset", [0, 1])
def test_gmm_writes_every_word_of_the_tiles_its_groups_fill(offset, n):
    """gmm zeroes only the row tiles holding rows no group of its shard
    writes: every row of a tile inside the shard's groups must come from a
    pass (groups across tile boundaries, tails reaching back), and packed,
    such a tile's padding words (H = 2816: 11 word rows a token, padded to
    16; H = 320: a partial second group, its last 64 lanes) must still be
    pack_rows' zeros. InterpretParams leaves memory nothing
    wrote at NaN (the integer max for words), so a row or word left
    unwritten shows. 32-row tiles: with offset 1 the shard's rows [16, 96)
    fill the second and third tile only."""
    from jax.experimental.pallas import tpu as pltpu

    rng = np.random.default_rng(offset + n)
    sizes = [16, 45, 35, 32] if offset else [30, 0, 50, 16, 32]
    gs = jnp.asarray(sizes, jnp.int32)
    m, k = sum(sizes), 40
    g_local = 2 if offset else len(sizes)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((g_local, k, n)) / np.sqrt(k), jnp.bfloat16)
    kw = dict(group_offset=offset, config=tiling.GmmConfig(32, n, 16, weight_buffers=2))
    plain = gmm(lhs, rhs, gs, interpret=pltpu.InterpretParams(), **kw)
    packed = gmm(lhs, rhs, gs, packed=True, interpret=pltpu.InterpretParams(), **kw)
    lo = sum(sizes[:offset])
    hi = lo + sum(sizes[offset:][:g_local])
    local = jnp.asarray(sizes[offset:][:g_local], jnp.int32)

    def dot(a, b):
        return jax.lax.ragged_dot(a[lo:hi].astype(jnp.float32), b.astype(jnp.float32), local)

    got = np.asarray(plain, np.float32)
    assert not got[:lo].any() and not got[hi:].any()
    assert_close(plain[lo:hi], dot(lhs, rhs), magnitude=dot(jnp.abs(lhs), jnp.abs(rhs)))
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(pairs.pack_rows(plain)))


def test_gmm_packed_adds_its_bias_before_packing():
    """The down gmm's bias (GPT-OSS's) rides into the packed rows: the words
    are pack_rows of the unpacked gmm's biased bf16 output, bit for bit. N =
    384: a partial last word group (its high half empty), and 128-column
    pieces unpacked, which packed take 256 (tiling.gmm_pieces: a piece
    starts on a word group)."""
    rng = np.random.default_rng(4)
    gs = jnp.asarray([20, 0, 17], jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((37, 128)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((3, 128, 384)) / 11, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal((3, 384)), jnp.bfloat16)
    plain = gmm(lhs, rhs, gs, bias=bias, interpret=True)
    packed = gmm(lhs, rhs, gs, bias=bias, packed=True, interpret=True)
    assert not np.array_equal(np.asarray(plain), np.asarray(gmm(lhs, rhs, gs, interpret=True)))
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(pairs.pack_rows(plain)))


def test_gmm_packed_refuses_what_it_cannot_pack():
    gs = jnp.asarray([8], jnp.int32)
    lhs = jnp.zeros((8, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="packed needs a bfloat16 output of N a multiple of 64"):
        gmm(lhs, jnp.zeros((1, 128, 2848), jnp.bfloat16), gs, packed=True)
    with pytest.raises(ValueError, match="packed needs a bfloat16 output.*float32"):
        gmm(lhs.astype(jnp.float32), jnp.zeros((1, 128, 2048), jnp.float32), gs, packed=True)
    with pytest.raises(ValueError, match="config.block_n expected 2048, got 1024"):
        gmm(
            lhs,
            jnp.zeros((1, 128, 2048), jnp.bfloat16),
            gs,
            packed=True,
            config=tiling.GmmConfig(16, 1024, 16),
        )


# -- combine -----------------------------------------------------------------------


def _expected(rows_bf16, slots, weights):
    """f32 sum of the same bf16 rows, and the per-element magnitude of its terms."""
    r = np.asarray(rows_bf16, np.float32)[slots]  # [T, k, H]
    w = np.asarray(weights, np.float32)[..., None]
    return (r * w).sum(axis=1), (np.abs(r) * np.abs(w)).sum(axis=1)


@st.composite
def combine_problems(draw):
    t = draw(st.integers(1, 40))
    k = draw(st.sampled_from([1, 2, 4]))
    extra = draw(st.sampled_from([0, 5]))
    block_t = draw(st.sampled_from([None, 16, 32]))
    out = draw(st.sampled_from(["bfloat16", "float32"]))
    h = draw(st.sampled_from([2048, 2816]))
    return t, k, extra, block_t, out, h, draw(st.integers(0, 2**16))


# Several token tiles and a partial last one (the three slots wrap around, the
# last tile is fetched again); a single tile with rows no slot names, at
# Gemma 4's H = 2816 (padded word rows); partial last word groups, as
# GPT-OSS's 2880 has: 320 (its low half 64 columns, as 2880's), 448 (a
# partial high half).
@example((40, 8, 0, 16, "bfloat16", 2048, 3))
@example((7, 2, 5, None, "float32", 2816, 4))
@example((20, 2, 5, 16, "bfloat16", 320, 5))
@example((9, 2, 0, None, "bfloat16", 448, 6))
@settings(max_examples=1, deadline=None, derandomize=True)
@given(combine_problems())
def test_combine_matches_f32_sum_of_the_same_rows(problem):
    t, k, extra, block_t, out_dtype, h, seed = problem
    rng = np.random.default_rng(seed)
    s = t * k + extra
    rows = jnp.asarray(rng.standard_normal((s, h)), jnp.bfloat16)
    slots = rng.permutation(s)[: t * k].reshape(t, k).astype(np.int32)
    weights = rng.uniform(0, 1, (t, k)).astype(np.float32)
    weights[rng.random((t, k)) < 0.2] = 0.0
    res = combine(
        pairs.pack_rows(rows),
        jnp.asarray(slots),
        jnp.asarray(weights),
        hidden=h,
        out_dtype=jnp.dtype(out_dtype),
        block_t=block_t,
        interpret=True,
    )
    assert res.dtype == jnp.dtype(out_dtype) and res.shape == (t, h)
    want, mag = _expected(rows, slots, weights)
    assert_close(res, want, magnitude=mag, what="combine")


def test_combine_clamps_ids_and_keeps_xlas_non_finite_values():
    """Out-of-range ids read the nearest row (jnp.take's mode="clip"); a
    weight of 0 on an inf row gives NaN, a weighted inf stays inf, as the XLA
    sum of the same rows does."""
    h = 2048
    rows = np.ones((4, h), np.float32)
    rows[1, :5] = np.inf
    slots = np.array([[-7, 1], [9, 2], [0, 3]], np.int32)
    weights = np.array([[0.5, 0.0], [0.25, 1.0], [0.5, 0.5]], np.float32)
    packed = pairs.pack_rows(jnp.asarray(rows, jnp.bfloat16))
    res = combine(
        packed,
        jnp.asarray(slots),
        jnp.asarray(weights),
        hidden=h,
        out_dtype=jnp.float32,
        interpret=True,
    )
    ref = combine_reference(
        packed,
        jnp.asarray(np.clip(slots, 0, 3)),
        jnp.asarray(weights),
        hidden=h,
        out_dtype=jnp.float32,
    )
    res = np.asarray(res)
    np.testing.assert_array_equal(res, np.asarray(ref))
    assert np.isnan(res[0, :5]).all() and (res[0, 5:] == 0.5).all()
    assert (res[1] == 1.25).all()


def test_combine_refuses_bad_input():
    rows = jnp.zeros((16, 128), jnp.uint32)  # two rows of H = 2048
    slots = jnp.zeros((2, 1), jnp.int32)
    w = jnp.ones((2, 1), jnp.float32)
    with pytest.raises(ValueError, match="hidden: expected a multiple of 64, got 2848"):
        combine(rows, slots, w, hidden=2848)
    with pytest.raises(ValueError, match=r"rows: expected uint32 \[S \* 8, 128\]"):
        combine(rows.astype(jnp.int32), slots, w, hidden=2048)
    with pytest.raises(ValueError, match=r"rows: expected a multiple of 8 rows \(pairs.row_words"):
        combine(rows[:12], slots, w, hidden=2048)
    with pytest.raises(ValueError, match=r"slots: expected integer \[T, k\]"):
        combine(rows, w, w, hidden=2048)
    with pytest.raises(ValueError, match=r"weights: expected floating \(2, 1\)"):
        combine(rows, slots, jnp.ones((2, 2)), hidden=2048)
    with pytest.raises(ValueError, match="out_dtype: expected bfloat16 or float32"):
        combine(rows, slots, w, hidden=2048, out_dtype=jnp.float16)
    with pytest.raises(ValueError, match="block_t: expected a multiple of 16, got 8"):
        combine(rows, slots, w, hidden=2048, block_t=8)


def test_combine_reads_its_rows_where_the_gmm_wrote_them():
    """The rows stay in HBM: left to XLA, 512 Qwen3 tokens' rows (16.8 MB)
    were copied whole into VMEM before the kernel, a serial copy the
    kernel's own row copies (bound by their issue) did not need. Compiled
    for tpu7x, not run: the optimized program has no copy of them."""
    import functools

    from torch_bindings.aot import tpu_compile

    t, k, h = 512, 8, 2048
    spec = jax.ShapeDtypeStruct
    rows = spec((t * k * pairs.row_words(h), 128), jnp.uint32)
    args = [rows, spec((t, k), jnp.int32), spec((t, k), jnp.float32)]
    compiled = tpu_compile(functools.partial(combine, hidden=h, generation="tpu7x"), args, "tpu7x")
    shape = f"u32[{rows.shape[0]},{rows.shape[1]}]"
    copies = [ln for ln in compiled.as_text().splitlines() if "copy-start" in ln and shape in ln]
    assert not copies, copies[0][:200]


@pytest.mark.parametrize("generation", ["v5e", "v6e", "tpu7x"])
@pytest.mark.parametrize("hidden, k", [(2048, 8), (2816, 8), (4096, 2)], ids=str)
def test_combine_steps_copy_for_about_a_dma_latency(generation, hidden, k):
    """A combine step issues the tile two ahead's copies, so its last ones
    land only if a step lasts about a DMA latency (Gemma 4 on tpu7x waited
    half its combine at 32-token steps), and larger tiles expose more of the
    first two tiles' copies: a step's tile is the most tokens (a multiple of
    16) whose rows copy within a DMA latency at the generation's HBM
    bandwidth, unless COMBINE_BLOCK_T, the slots' VMEM or an eighth of the
    tokens caps it."""
    from torch_bindings import tpu_info

    gen = tiling.get_generation(generation)
    per_token = k * pairs.row_words(hidden) * 128 * 4
    slots = tiling.COMBINE_SLOTS * per_token

    def copy_s(tokens):
        return tokens * per_token / gen.hbm_bytes_per_s

    for tokens in (512, 8192):
        bt = tiling.combine_block_t(tokens, k, hidden, generation)
        eighth = tokens // 8 // 16 * 16
        assert bt % 16 == 0 and bt * slots <= tiling.COMBINE_ROWS_BYTES and bt <= eighth
        assert bt == 16 or copy_s(bt) <= tpu_info.DMA_LATENCY_S
        capped = (
            bt in (tiling.COMBINE_BLOCK_T, eighth) or (bt + 16) * slots > tiling.COMBINE_ROWS_BYTES
        )
        assert capped or copy_s(bt + 16) > tpu_info.DMA_LATENCY_S, (tokens, bt)


@pytest.mark.parametrize(
    "hidden, generation, packs",
    [
        (2048, "tpu7x", True),
        (2816, "v6e", True),
        (2816, "tpu7x", True),
        (2880, "v6e", True),
        (2880, "tpu7x", False),
        (2848, "v6e", False),
    ],
)
def test_the_layer_combines_in_the_kernel_where_tiling_says(hidden, generation, packs):
    """Past the one-hot routing's range (520 tokens) inference writes packed
    rows for the combine where tiling.combine_in_kernel allows: unpadded rows
    and Gemma 4's padded ones on every generation, GPT-OSS's partial last
    word group (H = 2880) but on tpu7x, H not a multiple of 64 nowhere
    (traced, not run)."""
    from ragged_dot_tpu.api import moe_experts

    e, i, t, k = 4, 128, 520, 2
    spec = jax.ShapeDtypeStruct
    args = (
        spec((t, hidden), jnp.bfloat16),
        spec((t, k), jnp.int32),
        spec((t, k), jnp.float32),
        spec((e, 2 * i, hidden), jnp.bfloat16),
        spec((e, hidden, i), jnp.bfloat16),
    )
    kw = dict(num_experts=e, has_gate=True, is_transposed=False, is_concatenated=True)
    jaxpr = jax.make_jaxpr(lambda *a: moe_experts(*a, **kw, activation="silu", config=generation))(
        *args
    )
    assert tiling.combine_in_kernel(hidden, generation) == packs
    assert ("moe_combine" in str(jaxpr)) == packs
