"""Weight-only quantized experts (int8, float8_e4m3fn with per-output-channel
or 128 x 128 block scales) in ragged_dot and moe_experts, interpret mode,
against the f32 reference on the dequantized weights.

Tolerances (tests/tolerances.py): the forward widens each weight to bf16
(int8 and e4m3 values are exact in bf16), so bf16 x bf16 products are exact in
f32 and the scale multiplies the f32 sum: one output rounding, as for bf16
weights. d_lhs multiplies the cotangent rows by the scales (the contraction
axis) and rounds them to bf16 before the MXU: one bf16 rounding of terms of
magnitude sum |grad| |s w|. Block scales fold into the lhs rows per
128-column block of the output, in both passes: one bf16 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from ragged_dot_tpu.api import moe_experts, ragged_dot
from ragged_dot_tpu.kernel_gmm import gmm
from ragged_dot_tpu.reference import moe_experts_reference, ragged_dot_reference
from quantization import (
    assert_moe_layer_close,
    group_sizes,
    quantize,
    quantize_blocks,
    small_config,
)
from tolerances import assert_close

QDTYPES = [jnp.int8, jnp.float8_e4m3fn]


@st.composite
def problems(draw):
    wdt = draw(st.sampled_from(QDTYPES))
    m = draw(st.sampled_from([1, 12, 40, 64]))
    k = draw(st.sampled_from([64, 128, 200, 256]))
    n = draw(st.sampled_from([96, 128, 256]))
    blocks = k % 128 == 0 and n % 128 == 0 and draw(st.booleans())
    g_total = draw(st.integers(1, 5))
    sizes = group_sizes(draw, m, g_total)
    g_local = draw(st.integers(1, g_total))
    offset = draw(st.integers(0, g_total - g_local))
    transpose = draw(st.booleans())
    scale_dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    # Small explicit blocks walk several row tiles and N slabs, and wrap the ring.
    small = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return wdt, m, k, n, sizes, g_local, offset, transpose, scale_dtype, small, blocks, seed


# Drawn, but not reliably within 4 examples: several row tiles and N slabs
# with a 2-slot ring, an expert-parallel shard, torch Linear layout.
@example((jnp.int8, 64, 128, 256, [20, 0, 25, 9], 3, 1, True, jnp.float32, True, False, 3))
@example((jnp.float8_e4m3fn, 40, 200, 96, [15, 20], 2, 0, False, jnp.bfloat16, False, False, 4))
@example((jnp.float8_e4m3fn, 64, 256, 256, [30, 0, 20], 3, 0, True, jnp.float32, True, True, 5))
@settings(max_examples=2, deadline=None, derandomize=True)
@given(problems())
def test_quantized_ragged_dot_and_d_lhs_match_dequantized_reference(problem):
    wdt, m, k, n, sizes, g_local, offset, transpose, scale_dtype, small, blocks, seed = problem
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = rng.standard_normal((g_local, n, k) if transpose else (g_local, k, n)) * 0.1
    if blocks:
        q, scale = quantize_blocks(w, wdt)
    else:
        q, scale = quantize(w, wdt, out_axis=1 if transpose else 2)
    scale = scale.astype(scale_dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    ct = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    f = functools.partial(
        ragged_dot,
        rhs=q,
        group_sizes=gs,
        group_offset=offset,
        rhs_scale=scale,
        transpose_rhs=transpose,
        config=small_config(small, k, n),
        interpret=True,
    )
    out, vjp = jax.vjp(f, lhs)
    (d_lhs,) = vjp(ct)
    assert out.dtype == jnp.bfloat16 and d_lhs.dtype == jnp.bfloat16

    w_kn = jnp.swapaxes(q, 1, 2) if transpose else q
    s_kn = jnp.swapaxes(scale, 1, 2) if transpose and blocks else scale

    def ref(a, c, absolute=False):
        rhs = jnp.abs(w_kn.astype(jnp.float32)) if absolute else w_kn
        s = jnp.abs(s_kn.astype(jnp.float32)) if absolute else s_kn
        fn = lambda x: ragged_dot_reference(x, rhs, gs, offset, jnp.float32, rhs_scale=s)  # noqa: E731
        o, v = jax.vjp(fn, a)
        return o, v(c)[0]

    want_out, want_d = ref(lhs.astype(jnp.float32), ct.astype(jnp.float32))
    mag_out, mag_d = ref(jnp.abs(lhs.astype(jnp.float32)), jnp.abs(ct.astype(jnp.float32)), True)
    # Block scales are folded into the lhs rows and rounded to bf16 once.
    assert_close(
        out, want_out, magnitude=mag_out, dtype=jnp.bfloat16, roundings=int(blocks), what="out"
    )
    assert_close(d_lhs, want_d, magnitude=mag_d, dtype=jnp.bfloat16, roundings=1, what="d_lhs")


# Each scale kind once, and each weight layout more than once (suite time:
# each case compiles the whole interpret-mode layer and its backward).
@pytest.mark.parametrize(
    "wdt, blocks, is_transposed",
    [
        (jnp.int8, False, False),
        (jnp.float8_e4m3fn, False, True),
        (jnp.float8_e4m3fn, True, False),  # FP8 checkpoints: Linear layout, blocks
    ],
    ids=["int8_channel-linear_layout", "e4m3_channel-in_out_layout", "e4m3_blocks-linear_layout"],
)
def test_quantized_moe_experts_matches_reference_with_gradients(wdt, blocks, is_transposed):
    rng = np.random.default_rng(7)
    t, h, i, e, k = 12, 128, 256, 6, 2
    hidden = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)
    gu_shape, dn_shape = ((e, h, 2 * i), (e, i, h)) if is_transposed else ((e, 2 * i, h), (e, h, i))
    out_axis = 2 if is_transposed else 1
    if blocks:
        gu, gu_s = quantize_blocks(rng.standard_normal(gu_shape) * 0.05, wdt)
        dn, dn_s = quantize_blocks(rng.standard_normal(dn_shape) * 0.05, wdt)
    else:
        gu, gu_s = quantize(rng.standard_normal(gu_shape) * 0.05, wdt, out_axis)
        dn, dn_s = quantize(rng.standard_normal(dn_shape) * 0.05, wdt, out_axis)
    kw = dict(num_experts=e, is_transposed=is_transposed)

    def ours(x, w):
        return moe_experts(x, ids, w, gu, dn, None, None, gu_s, dn_s, interpret=True, **kw)

    def ref(x, w):
        return moe_experts_reference(
            x, ids, w, gu, dn, None, None, e, True, is_transposed, True, "silu", 0, 1.702, 7.0,
            gu_s, dn_s,
        )  # fmt: skip

    ct = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    out, vjp = jax.vjp(ours, hidden, weights)
    want, vjp_ref = jax.vjp(ref, hidden, weights)
    assert_moe_layer_close(out, want, vjp(ct), vjp_ref(ct))


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("n", [128, 640, 300])
def test_scales_are_applied_per_output_channel_not_ignored(n, transpose):
    # A weight quantized to all ones: the output columns are the row sums of lhs
    # times each channel's scale, so a dropped, shifted or transposed scale
    # cannot match. N = 640 is five 128-column pieces, 300 a 256 piece and a tail.
    lhs = jnp.asarray(np.arange(16 * 64).reshape(16, 64) % 7, jnp.bfloat16)
    q = jnp.ones((2, n, 64) if transpose else (2, 64, n), jnp.int8)
    scale = jnp.asarray(np.stack([np.arange(n), -np.arange(n)]) / 64.0, jnp.float32)
    sizes = jnp.asarray([10, 6], jnp.int32)
    out = ragged_dot(lhs, q, sizes, rhs_scale=scale, transpose_rhs=transpose, interpret=True)
    rows = np.asarray(lhs, np.float32).sum(1, keepdims=True)
    want = np.where(np.arange(16)[:, None] < 10, rows * scale[0], rows * scale[1])
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, jnp.bfloat16))


@pytest.mark.parametrize("transpose", [False, True])
def test_block_scales_are_applied_per_block(transpose):
    # All-ones weights of two 128-deep contraction blocks and five 128-column
    # blocks: out[r, n] = sum over k blocks of (row r's sum over that block)
    # times the scale of (k block, n // 128); distinct powers of two per block
    # make any misplaced block visible, and the f32 sums are exact.
    k, n = 256, 640
    lhs = jnp.asarray(np.arange(16 * k).reshape(16, k) % 3, jnp.bfloat16)
    s_kn = 2.0 ** -np.arange(2 * 2 * 5, dtype=np.float32).reshape(2, 2, 5)  # [G, K/128, N/128]
    q = jnp.ones((2, n, k) if transpose else (2, k, n), jnp.float8_e4m3fn)
    scale = jnp.asarray(np.swapaxes(s_kn, 1, 2) if transpose else s_kn)
    sizes = jnp.asarray([9, 7], jnp.int32)
    out = ragged_dot(lhs, q, sizes, rhs_scale=scale, transpose_rhs=transpose, interpret=True)
    x = np.asarray(lhs, np.float32).reshape(16, 2, 128).sum(-1)  # [rows, K/128]
    grp = (np.arange(16) >= 9).astype(int)
    want = np.einsum("rk,rkn->rn", x, s_kn[grp]).repeat(128, axis=1)
    # The f32 sums are exact; both round them once to bf16.
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, jnp.bfloat16))


BAD = [
    (dict(rhs_scale=None), "rhs_scale: expected \\[2, 128\\] per-output-channel scales"),
    (dict(rhs_scale=jnp.ones((2, 64))), "rhs_scale: expected shape \\(2, 128\\)"),
    (dict(rhs_scale=jnp.ones((2, 1, 2))), "rhs_scale: expected 128 x 128 block scales"),
    (dict(rhs_scale=jnp.ones((2, 128), jnp.int32)), "rhs_scale: expected float32 or bfloat16"),
    (dict(rhs=jnp.ones((2, 64, 128), jnp.bfloat16)), "rhs_scale: expected None for bfloat16"),
    (dict(rhs=jnp.ones((2, 64, 128), jnp.float16)), "rhs.dtype: expected bfloat16 or float32"),
]


@pytest.mark.parametrize(
    "kw, match", BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)]
)
def test_bad_quantized_arguments_raise_value_error(kw, match):
    args = dict(
        lhs=jnp.ones((8, 64), jnp.bfloat16),
        rhs=jnp.ones((2, 64, 128), jnp.int8),
        group_sizes=jnp.asarray([4, 4], jnp.int32),
        rhs_scale=jnp.ones((2, 128), jnp.float32),
    )
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        ragged_dot(**args, interpret=True)


def test_bad_moe_scale_names_the_argument():
    e, h, i = 4, 64, 128
    with pytest.raises(ValueError, match="down_scale: expected shape \\(4, 64\\)"):
        moe_experts(
            jnp.ones((3, h), jnp.bfloat16),
            jnp.zeros((3, 2), jnp.int32),
            jnp.ones((3, 2), jnp.float32),
            jnp.ones((e, 2 * i, h), jnp.int8),
            jnp.ones((e, h, i), jnp.int8),
            None,
            None,
            jnp.ones((e, 2 * i)),
            jnp.ones((e, i)),
            num_experts=e,
        )


def test_gmm_rejects_scales_on_an_unknown_axis():
    with pytest.raises(ValueError, match="int8/fp8 rhs needs rhs_scale and scale_axis"):
        gmm(
            jnp.ones((8, 64), jnp.bfloat16),
            jnp.ones((2, 64, 128), jnp.int8),
            jnp.ones(2, jnp.int32),
        )


@pytest.mark.parametrize("wdt", ["int8", "float8_e4m3fn"])
def test_torch_op_takes_quantized_weights_and_gives_lhs_its_gradient(wdt):
    import torch

    import ragged_dot_tpu

    rng = np.random.default_rng(11)
    q, scale = quantize(rng.standard_normal((3, 96, 128)) * 0.1, getattr(jnp, wdt), out_axis=1)
    q_t = torch.from_numpy(np.asarray(q).view(np.int8)).view(getattr(torch, wdt))
    scale_t = torch.from_numpy(np.asarray(scale))
    lhs = torch.randn(20, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    lhs.requires_grad_(True)
    sizes = torch.tensor([7, 0, 13], dtype=torch.int32)
    out = ragged_dot_tpu.ragged_dot(lhs, q_t, sizes, transpose_rhs=True, rhs_scale=scale_t)
    out.float().sum().backward()
    ref = ragged_dot_reference(
        jnp.asarray(lhs.detach().float().numpy()),
        jnp.swapaxes(q, 1, 2),
        jnp.asarray([7, 0, 13], jnp.int32),
        preferred_element_type=jnp.float32,
        rhs_scale=scale,
    )
    np.testing.assert_allclose(out.detach().float().numpy(), np.asarray(ref), rtol=2**-7, atol=1e-2)
    # d(sum out)/d lhs[r] = sum over n of the dequantized weight row of r's group.
    w = np.asarray(q, np.float32) * np.asarray(scale)[:, :, None]  # [G, N, K]
    group = np.repeat([0, 2], [7, 13])
    want = w.sum(axis=1)[group]
    np.testing.assert_allclose(lhs.grad.float().numpy(), want, rtol=2**-6, atol=2e-2)


def test_fp8_experts_per_tensor_scales_become_per_channel_halves():
    # FP8Experts without blocks keeps one scale per tensor, and one per half of
    # the fused gate_up ([E, 2, 1]): each half's scale covers its own channels.
    import torch

    from ragged_dot_tpu.layers import _fp8_scale

    class Module:
        block_size = None

    w = torch.zeros(3, 8, 4, dtype=torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]).unsqueeze(-1)
    got = _fp8_scale(Module(), w, s)
    want = torch.tensor([[1.0] * 4 + [2.0] * 4, [3.0] * 4 + [4.0] * 4, [5.0] * 4 + [6.0] * 4])
    torch.testing.assert_close(got, want)
    Module.block_size = [64, 64]
    with pytest.raises(NotImplementedError, match="weight_block_size \\[64, 64\\]"):
        _fp8_scale(Module(), w, s)


def test_torch_moe_op_backward_leaves_fp8_weights_and_scales_without_gradient():
    # transformers' FP8Experts holds its FP8 weights and scales as Parameters that
    # require grad; a backward through our op gives the activations and routing
    # weights their gradients (against the reference on the dequantized weights)
    # and the quantized weights and their scales None, as transformers' own FP8
    # matmuls do.
    import torch

    from ragged_dot_tpu import ops as rd_ops

    t, h, i, e = 6, 128, 128, 4
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(t, h, generator=gen).requires_grad_(True)
    idx = torch.randint(0, e, (t, 2), generator=gen, dtype=torch.int32)
    weights = torch.rand(t, 2, generator=gen).requires_grad_(True)
    rng = np.random.default_rng(5)
    gu, gu_s = quantize_blocks(rng.standard_normal((e, 2 * i, h)) * 0.05, jnp.float8_e4m3fn)
    dn, dn_s = quantize_blocks(rng.standard_normal((e, h, i)) * 0.05, jnp.float8_e4m3fn)
    as_torch = lambda q: torch.from_numpy(np.asarray(q).view(np.uint8)).view(torch.float8_e4m3fn)  # noqa: E731
    params = [as_torch(gu), as_torch(dn), torch.from_numpy(np.asarray(gu_s)), torch.from_numpy(np.asarray(dn_s))]  # fmt: skip
    for p in params:
        p.requires_grad_(True)
    statics = (e, True, False, True, "silu", 0, 1.702, 7.0)
    out = rd_ops._moe_experts(
        hidden, idx, weights, *params[:2], None, None, *statics, *params[2:], False
    )
    ct = torch.randn(t, h, generator=gen)
    out.backward(ct)
    assert all(p.grad is None for p in params)

    def ref(x, w):
        return moe_experts_reference(
            x, jnp.asarray(idx.numpy()), w, gu, dn, None, None, *statics, gu_s, dn_s
        )

    f32 = lambda a: jnp.asarray(a.detach().numpy())  # noqa: E731
    want, vjp = jax.vjp(ref, f32(hidden), f32(weights))
    np.testing.assert_allclose(out.detach().numpy(), np.asarray(want), rtol=2e-4, atol=2e-4)
    for name, got, w in zip(("hidden", "weights"), (hidden.grad, weights.grad), vjp(f32(ct))):
        np.testing.assert_allclose(got.numpy(), np.asarray(w), rtol=5e-4, atol=5e-4, err_msg=name)
