"""MXFP4 expert weights (e2m1 values two a byte, e8m0 scales per 32 k) in
ragged_dot, moe_experts and transformers' FP4 experts, interpret mode, against
the f32 reference on weights decoded by the code table (mxfp4.dequantize; the
kernel decodes by bit arithmetic, mxfp4.decode_pairs).

Tolerances (tests/tolerances.py): an e2m1 value times a power-of-two scale is
exact in bf16, so the kernel's bf16 weights are the dequantized weights
exactly, bf16 x bf16 products are exact in f32, and the forward rounds once,
at the output: roundings=0. d_lhs runs a bf16 gmm on the same exact weights
and rounds once to bf16: roundings=0 as well.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from ragged_dot_tpu import moe, mxfp4, tiling
from ragged_dot_tpu.api import moe_experts, ragged_dot
from ragged_dot_tpu.kernel_gmm import gmm
from ragged_dot_tpu.reference import moe_experts_reference, ragged_dot_reference
from quantization import assert_moe_layer_close, group_sizes, small_config
from tolerances import assert_close

E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]  # the OCP MX spec's FP4 values, by code 0..7


def _table_value(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    return sign * E2M1[code & 7]


def test_decode_pairs_gives_every_byte_its_two_e2m1_values():
    # All 256 bytes, as the kernel widens its uint8 slab (0..255): rows 2j
    # and 2j + 1 of the result are byte j's low and high nibbles.
    b = jnp.arange(256, dtype=jnp.int32).reshape(128, 2)
    got = np.asarray(jax.jit(mxfp4.decode_pairs)(b).astype(jnp.float32))
    assert got.shape == (256, 2)
    u = np.asarray(b) & 0xFF
    want = np.empty((256, 2), np.float32)
    want[0::2] = np.vectorize(_table_value)(u & 15)
    want[1::2] = np.vectorize(_table_value)(u >> 4)
    np.testing.assert_array_equal(got, want)
    # -0.0 keeps its sign bit (the MXU cannot tell, but a decode that drops it
    # would be dropping the sign of every value).
    assert np.array_equal(np.signbit(got), np.signbit(want))


def test_decode_pairs_folds_each_scale_into_the_values():
    """The scales folded into the decode (no multiply): every byte under
    every scale of a 32-row block is its two e2m1 values times 2^(s - 127),
    exactly, signs included; scales outside mxfp4.FOLDED_SCALES decode as its
    nearest end, and a NaN scale (255) makes its block non-finite."""
    lo, hi = mxfp4.FOLDED_SCALES
    scales = [lo, lo + 1, 100, 117, 127, 128, 140, hi - 1, hi, 0, 1, 253, 254, 255]
    # Byte rows j and 16 + j hold byte 16 * col_group + j: every byte in both
    # of the two 32-value blocks of each column; column c takes scale c (and
    # in its second block the scale of column c + 1).
    c = len(scales)
    b = (jnp.arange(32)[:, None] % 16 + 16 * (jnp.arange(c)[None, :] % 16)).astype(jnp.int32)
    s = jnp.asarray([scales, scales[1:] + scales[:1]], jnp.uint8)
    got = np.asarray(jax.jit(mxfp4.decode_pairs)(b, s).astype(jnp.float32))
    u = np.asarray(b)
    vals = np.empty((64, c), np.float32)
    vals[0::2] = np.vectorize(_table_value)(u & 15)
    vals[1::2] = np.vectorize(_table_value)(u >> 4)
    blocks = np.repeat(np.asarray(s, np.int64), 32, axis=0)  # [64, c]
    scale = np.exp2(np.clip(blocks, lo, hi) - 127.0).astype(np.float32)
    want = (vals * scale).astype(np.float32)
    nan_scale = blocks == 255
    assert not np.isfinite(got[nan_scale]).any()
    np.testing.assert_array_equal(got[~nan_scale], want[~nan_scale])
    assert np.array_equal(np.signbit(got[~nan_scale]), np.signbit(want[~nan_scale]))


def test_quantize_keeps_grid_values_and_round_trips_the_checkpoint_layout():
    rng = np.random.default_rng(0)
    g, k, n = 2, 96, 40
    codes = rng.integers(0, 16, (g, k, n))
    codes[:, ::32, :] = 7  # every block holds a 6, so its quantized scale is exps
    codes[codes == 8] = 0  # quantize writes a zero as +0
    exps = rng.integers(-4, 3, (g, k // 32, n))
    vals = np.vectorize(_table_value)(codes) * np.exp2(np.repeat(exps, 32, axis=1))
    packed, scales = mxfp4.quantize(vals)
    assert packed.dtype == jnp.uint8 and packed.shape == (g, k // 2, n)
    assert scales.shape == (g, mxfp4.scale_rows(k), n)
    np.testing.assert_array_equal(np.asarray(mxfp4.dequantize(packed, scales)), vals)
    np.testing.assert_array_equal(np.asarray(scales)[:, : k // 32], exps + 127)
    # Checkpoint layout ([G, N, K/2] bytes, the even k in the low nibble;
    # GPT-OSS's [G, N, K/32, 16] blocks) -> kernel layout.
    ck = np.zeros((g, n, k // 2), np.uint8)
    ck[:] = np.swapaxes((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), 1, 2)
    ck_s = np.swapaxes(np.asarray(scales)[:, : k // 32], 1, 2)
    for blocks in (ck, ck.reshape(g, n, k // 32, 16)):
        w, s = mxfp4.to_kernel_layout(blocks, ck_s)
        np.testing.assert_array_equal(w, np.asarray(packed))
        np.testing.assert_array_equal(np.asarray(mxfp4.dequantize(w, s)), vals)


@st.composite
def problems(draw):
    m = draw(st.sampled_from([1, 12, 40, 64]))
    k = draw(st.sampled_from([64, 160, 256]))
    n = draw(st.sampled_from([96, 128, 256, 512]))
    g_total = draw(st.integers(1, 4))
    sizes = group_sizes(draw, m, g_total)
    g_local = draw(st.integers(1, g_total))
    offset = draw(st.integers(0, g_total - g_local))
    lhs_dtype = draw(st.sampled_from([jnp.bfloat16, jnp.float32]))
    scale_dtype = draw(st.sampled_from([jnp.uint8, jnp.float8_e8m0fnu]))
    padded = draw(st.booleans())  # scale rows K/32, or rounded up to 32
    small = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return m, k, n, sizes, g_local, offset, lhs_dtype, scale_dtype, padded, small, seed


# Several row tiles and N slabs with a 2-slot ring and an expert-parallel
# shard; f32 activations; unpadded float8_e8m0fnu scale rows; a slab of two
# 256-column pieces (each decoded with its own scales).
@example((64, 256, 256, [20, 0, 25, 9], 3, 1, jnp.bfloat16, jnp.uint8, True, True, 3))
@example((12, 64, 512, [12], 1, 0, jnp.bfloat16, jnp.uint8, True, False, 5))
# A group of more rows than tiling.MXFP4_DECODE_ONCE_ROWS: each piece decoded
# once into VMEM for all its row passes.
@example((160, 640, 512, [150, 10], 2, 0, jnp.bfloat16, jnp.uint8, True, False, 6))
@example((40, 160, 96, [15, 20], 2, 0, jnp.float32, jnp.float8_e8m0fnu, False, False, 4))
@settings(max_examples=2, deadline=None, derandomize=True)
@given(problems())
def test_mxfp4_ragged_dot_and_d_lhs_match_dequantized_reference(problem):
    m, k, n, sizes, g_local, offset, lhs_dtype, scale_dtype, padded, small, seed = problem
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), lhs_dtype)
    # Scales spread over 2^-9 .. 2^2: a decode that lost the exponent shows.
    w = rng.standard_normal((g_local, k, n)) * np.exp2(rng.integers(-9, 3, (g_local, 1, n)))
    packed, scales = mxfp4.quantize(w)
    if not padded:
        scales = scales[:, : k // 32]
    scales = jax.lax.bitcast_convert_type(scales, scale_dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    ct = jnp.asarray(rng.standard_normal((m, n)), lhs_dtype)
    f = functools.partial(
        ragged_dot,
        rhs=packed,
        group_sizes=gs,
        group_offset=offset,
        rhs_scale=scales,
        config=small_config(small, k, n),
        interpret=True,
    )
    out, vjp = jax.vjp(f, lhs)
    (d_lhs,) = vjp(ct)
    assert out.dtype == lhs_dtype and d_lhs.dtype == lhs_dtype

    def ref(a, c, absolute=False):
        rhs = mxfp4.dequantize(packed, scales)
        rhs = jnp.abs(rhs) if absolute else rhs
        fn = lambda x: ragged_dot_reference(x, rhs, gs, offset, jnp.float32)  # noqa: E731
        o, v = jax.vjp(fn, a)
        return o, v(c)[0]

    want_out, want_d = ref(lhs.astype(jnp.float32), ct.astype(jnp.float32))
    mag_out, mag_d = ref(jnp.abs(lhs.astype(jnp.float32)), jnp.abs(ct.astype(jnp.float32)), True)
    assert_close(out, want_out, magnitude=mag_out, dtype=lhs_dtype, roundings=0, what="out")
    assert_close(d_lhs, want_d, magnitude=mag_d, dtype=lhs_dtype, roundings=0, what="d_lhs")


@st.composite
def glu_problems(draw):
    m = draw(st.sampled_from([12, 40, 64]))
    k = draw(st.sampled_from([64, 160]))
    i = draw(st.sampled_from([64, 128, 192]))  # multiples of 64 (tiling.glu_fusable)
    sizes = group_sizes(draw, m, draw(st.integers(1, 3)))
    block_n = draw(st.sampled_from([None] + [128] * (i % 128 == 0 and i > 128)))
    return m, k, i, sizes, block_n, draw(st.booleans()), draw(st.integers(0, 2**16))


# GPT-OSS's layer in small: a group of more rows than
# tiling.MXFP4_DECODE_ONCE_ROWS (each piece decoded once into VMEM for its
# row passes) and a tail piece; 128-column blocks of a 256-column output.
@example((160, 160, 192, [140, 20], None, True, 1))
@example((40, 64, 256, [15, 0, 25], 128, True, 2))
@settings(max_examples=2, deadline=None, derandomize=True)
@given(glu_problems())
def test_mxfp4_interleaved_glu_is_the_unfused_program_bit_for_bit(problem):
    """GPT-OSS's checkpoints: FP4 weights with gate and up columns
    interleaved and a bias. The fused epilogue (bias, deinterleave, GLU)
    gives what the plain FP4 product plus XLA's activation gives, bit for
    bit: the product is the same kernel's, and each later step rounds where
    the unfused program does (the product's own accuracy is the plain FP4
    tests')."""
    m, k, i, sizes, block_n, bias, seed = problem
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    g = len(sizes)
    packed, scales = mxfp4.quantize(rng.standard_normal((g, k, 2 * i)) * 0.1)
    b = jnp.asarray(rng.standard_normal((g, 2 * i)) * 0.3, jnp.bfloat16) if bias else None
    gs = jnp.asarray(sizes, jnp.int32)
    cfg = None if block_n is None else tiling.GmmConfig(16, block_n, 16)
    kw = dict(rhs_scale=scales, scale_axis="mx", bias=b, interpret=True)
    glu = ("gpt_oss", 1.702, 7.0)
    fused = gmm(lhs, packed, gs, glu=glu, glu_interleaved=True, config=cfg, **kw)
    plain_cfg = None if cfg is None else tiling.GmmConfig(16, 2 * block_n, 16)
    proj = gmm(lhs, packed, gs, config=plain_cfg, **kw)
    want = moe.glu(proj[:, 0::2], proj[:, 1::2], activation=glu[0], alpha=glu[1], limit=glu[2])
    rows = slice(0, sum(sizes))
    assert fused.shape == (m, i) and fused.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(fused[rows], np.float32), np.asarray(want.astype(jnp.bfloat16)[rows], np.float32)
    )
    assert not np.asarray(fused[sum(sizes) :], np.float32).any()


def _layer_arrays(rng, t, h, i, e, k, bias_scale=None):
    """A layer's bf16 hidden states, routing, MXFP4 gate/up and down weights
    with their scales, and f32 biases of bias_scale (None: no biases)."""
    hidden = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)
    gu, gu_s = mxfp4.quantize(rng.standard_normal((e, h, 2 * i)) * 0.1)
    dn, dn_s = mxfp4.quantize(rng.standard_normal((e, i, h)) * 0.1)
    gu_b = dn_b = None
    if bias_scale is not None:
        gu_b = jnp.asarray(rng.standard_normal((e, 2 * i)) * bias_scale, jnp.float32)
        dn_b = jnp.asarray(rng.standard_normal((e, h)) * bias_scale, jnp.float32)
    return hidden, ids, weights, gu, gu_s, dn, dn_s, gu_b, dn_b


@pytest.mark.parametrize("h", [160, 192], ids=["xla_combine", "kernel_combine"])
def test_mxfp4_gpt_oss_inference_applies_bias_and_activation_in_its_kernels(h):
    """GPT-OSS's checkpoint layer without a gradient: the gate/up gmm writes
    act(gate + b) * (up + b) ([S, I], not the [S, 2I] projection) and the
    down gmm adds its bias; the result is the unfused (training) forward's,
    bit for bit where XLA combines (H = 160 does not pack: pairs.packable).
    Where H packs (192: a partial word group, as GPT-OSS's 2880) the down
    gmm writes its biased rows packed and kernel_combine sums them in f32 in
    its own order: within a bf16 ulp of the output's scale."""
    rng = np.random.default_rng(9)
    # 100 tokens: 33 rows an expert (tiling.GLU_INTERLEAVED_MIN_GROUP_ROWS);
    # h apart from i and 2i: the launches tell apart.
    t, i, e, k = 100, 128, 6, 2
    hidden, ids, weights, gu, gu_s, dn, dn_s, gu_b, dn_b = _layer_arrays(rng, t, h, i, e, k, 0.3)
    kw = dict(num_experts=e, is_transposed=True, is_concatenated=False, activation="gpt_oss")

    def layer(x, w):
        return moe_experts(x, ids, w, gu, dn, gu_b, dn_b, gu_s, dn_s, interpret=True, **kw)

    text = str(jax.make_jaxpr(layer)(hidden, weights))
    assert f"bf16[{t * k},{i}] = pallas_call" in text
    assert f"bf16[{t * k},{2 * i}] = pallas_call" not in text
    packs = h % 64 == 0
    assert ("moe_combine" in text) == packs
    inference = np.asarray(layer(hidden, weights), np.float32)
    training = np.asarray(jax.vjp(layer, hidden, weights)[0], np.float32)
    if packs:
        scale = np.abs(training).max()
        np.testing.assert_allclose(inference, training, rtol=2**-7, atol=2**-7 * scale)
    else:
        np.testing.assert_array_equal(inference, training)


@pytest.mark.parametrize(
    "activation, concatenated, bias",
    [("silu", True, False), ("gpt_oss", False, True)],
    ids=["qwen3_style", "gpt_oss_style"],
)
def test_mxfp4_moe_experts_matches_reference_with_gradients(activation, concatenated, bias):
    rng = np.random.default_rng(7)
    t, h, i, e, k = 12, 128, 96, 6, 2
    layer = _layer_arrays(rng, t, h, i, e, k, 0.1 if bias else None)
    hidden, ids, weights, gu, gu_s, dn, dn_s, gu_b, dn_b = layer
    kw = dict(num_experts=e, is_transposed=True, activation=activation)
    kw["is_concatenated"] = concatenated

    def ours(x, w):
        return moe_experts(x, ids, w, gu, dn, gu_b, dn_b, gu_s, dn_s, interpret=True, **kw)

    def ref(x, w):
        return moe_experts_reference(
            x, ids, w, gu, dn, gu_b, dn_b, e, True, True, concatenated, activation, 0, 1.702,
            7.0, gu_s, dn_s,
        )  # fmt: skip

    ct = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    out, vjp = jax.vjp(ours, hidden, weights)
    want, vjp_ref = jax.vjp(ref, hidden, weights)
    assert_moe_layer_close(out, want, vjp(ct), vjp_ref(ct))


def test_each_scale_reaches_its_own_32_rows_and_column():
    # One block scaled up at a time: only the output column of that block
    # changes, by the block's own contribution times the scale change.
    k, n = 128, 128
    rng = np.random.default_rng(3)
    packed, scales = mxfp4.quantize(rng.standard_normal((1, k, n)))
    lhs = jnp.asarray(rng.standard_normal((8, k)), jnp.bfloat16)
    sizes = jnp.asarray([8], jnp.int32)
    run = functools.partial(ragged_dot, lhs, packed, sizes, interpret=True)
    base = np.asarray(run(rhs_scale=scales, preferred_element_type=jnp.float32))
    w = np.asarray(mxfp4.dequantize(packed, scales))
    x = np.asarray(lhs, np.float32)
    for blk, col in ((0, 0), (3, 77), (1, 127)):
        bumped = np.asarray(scales).copy()
        bumped[0, blk, col] += 1  # doubles that block
        got = np.asarray(run(rhs_scale=jnp.asarray(bumped), preferred_element_type=jnp.float32))
        rows = slice(32 * blk, 32 * blk + 32)
        want = base.copy()
        want[:, col] += x[:, rows] @ w[0, rows, col]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


BAD = [
    (
        dict(rhs_scale=jnp.ones((2, 32, 128), jnp.float32)),
        "rhs_scale: expected uint8 or float8_e8m0fnu",
    ),
    (
        dict(rhs_scale=jnp.ones((2, 5, 128), jnp.uint8)),
        "rhs_scale: expected shape \\(2, 32, 128\\)",
    ),
    (dict(rhs_scale=None), "rhs_scale: expected e8m0 scales \\[2, 32, 128\\]"),
    (dict(transpose_rhs=True, rhs=jnp.ones((2, 128, 32), jnp.uint8)), "mxfp4.to_kernel_layout"),
    (dict(lhs=jnp.ones((8, 32), jnp.bfloat16)), "rhs: expected shape \\[G, K=32/2, N\\]"),
]


@pytest.mark.parametrize("kw, match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_mxfp4_arguments_raise_value_error(kw, match):
    args = dict(
        lhs=jnp.ones((8, 64), jnp.bfloat16),
        rhs=jnp.ones((2, 32, 128), jnp.uint8),
        group_sizes=jnp.asarray([4, 4], jnp.int32),
        rhs_scale=jnp.full((2, 32, 128), 127, jnp.uint8),
    )
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        ragged_dot(**args, interpret=True)


def test_moe_experts_names_the_layout_of_checkpoint_mxfp4_weights():
    e, h, i = 4, 64, 128
    with pytest.raises(ValueError, match="gate_up: MXFP4 .*mxfp4.to_kernel_layout"):
        moe_experts(
            jnp.ones((3, h), jnp.bfloat16),
            jnp.zeros((3, 2), jnp.int32),
            jnp.ones((3, 2), jnp.float32),
            jnp.ones((e, 2 * i, h // 2), jnp.uint8),  # [E, 2I, H/2]: the checkpoint's layout
            jnp.ones((e, h, i // 2), jnp.uint8),
            None,
            None,
            jnp.ones((e, 2 * i, h // 32), jnp.uint8),
            jnp.ones((e, h, i // 32), jnp.uint8),
            num_experts=e,
        )


def test_gmm_takes_mxfp4_only_with_its_scale_axis():
    with pytest.raises(ValueError, match="scale_axis='mx'"):
        gmm(
            jnp.ones((8, 64), jnp.bfloat16),
            jnp.ones((2, 32, 128), jnp.uint8),
            jnp.ones(2, jnp.int32),
            rhs_scale=jnp.ones((2, 2, 128), jnp.uint8),
            scale_axis="n",
        )
    with pytest.raises(ValueError, match="needs uint8 \\(FP4\\) rhs"):
        gmm(
            jnp.ones((8, 64), jnp.bfloat16),
            jnp.ones((2, 64, 128), jnp.int8),
            jnp.ones(2, jnp.int32),
            rhs_scale=jnp.ones((2, 2, 128), jnp.uint8),
            scale_axis="mx",
        )


def test_torch_fp4_experts_convert_like_to_kernel_layout_and_check_float_scales():
    # transformers' FP4 experts hold int8 [E, N, K/2] and scales [E, N, K/32],
    # e8m0 or float32 (scale_fmt="float"); experts_forward converts them in
    # torch ops, by to_kernel_layout's rule.
    import torch

    from ragged_dot_tpu.layers import _fp4_projection

    rng = np.random.default_rng(4)
    e, n, k = 2, 48, 96
    w = rng.integers(-128, 128, (e, n, k // 2)).astype(np.int8)
    s = rng.integers(120, 131, (e, n, k // 32)).astype(np.uint8)
    want_w, want_s = mxfp4.to_kernel_layout(w.view(np.uint8), s)
    as_e8m0 = torch.from_numpy(s).view(torch.float8_e8m0fnu)
    as_float = torch.from_numpy(np.exp2(s.astype(np.float32) - 127))
    for scale in (as_e8m0, as_float):
        got_w, got_s = _fp4_projection(torch.from_numpy(w), scale)
        np.testing.assert_array_equal(got_w.numpy(), want_w)
        np.testing.assert_array_equal(got_s.numpy(), want_s)
    with pytest.raises(NotImplementedError, match="not powers of two"):
        _fp4_projection(torch.from_numpy(w), as_float * 1.5)


def test_torch_fp4_experts_with_misshapen_scales_raise():
    import torch

    from ragged_dot_tpu.layers import _fp4_weights

    class Experts:
        has_gate = True
        gate_up_proj_scale_inv = torch.zeros(2, 8, 3)  # K = 64 needs 2 scales a row
        down_proj_scale_inv = torch.zeros(2, 4, 1)

    gate_up = torch.zeros(2, 8, 32, dtype=torch.int8)
    down = torch.zeros(2, 4, 16, dtype=torch.int8)
    with pytest.raises(NotImplementedError, match=r"one scale per 32 inputs, \(2, 8, 2\)"):
        _fp4_weights(Experts(), gate_up, down)
