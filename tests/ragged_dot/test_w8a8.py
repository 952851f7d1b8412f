"""w8a8: int8 / float8_e4m3fn weights with per-channel scales, and the
activations quantized per row inside gmm (ragged_dot's quantize_lhs,
moe_experts' quantize_activations), interpret mode.

The kernel and the reference quantize the rows by the same rule
(w8a8.quantize_rows, itself checked against numpy here), so they see the
same 8-bit operands: int8 x int8 sums are exact in int32 and e4m3 x e4m3
products exact in f32; the row and column scales multiply the f32 sum, and
the output is rounded once: roundings=0 against the reference on the
quantized, dequantized activations. d_lhs is weight-only (the cotangent is
not quantized; the activations' rounding is passed straight through), so it
is checked against the weight-only reference with one rounding, as
test_quantized.py does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from ragged_dot_tpu import w8a8
from ragged_dot_tpu.api import moe_experts, ragged_dot
from ragged_dot_tpu.reference import moe_experts_reference, ragged_dot_reference
from quantization import group_sizes, quantize
from tolerances import assert_close


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_rows_quantize_to_their_largest_magnitude(dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 40)) * np.exp2(rng.integers(-6, 6, (6, 1)))).astype(np.float32)
    x[2] = 0.0  # a zero row: scale 0, values 0
    q, scale = jax.jit(w8a8.quantize_rows, static_argnums=1)(jnp.asarray(x), jnp.dtype(dtype))
    qmax = {"int8": 127.0, "float8_e4m3fn": 448.0}[dtype]
    amax = np.abs(x).max(axis=1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(scale), amax * np.float32(1 / qmax))
    inv = np.divide(np.float32(qmax), amax, out=np.zeros_like(amax), where=amax > 0)
    if dtype == "int8":
        want = np.rint(x * inv).astype(np.int8)  # rint: ties to even
    else:
        want = (x * inv).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want.view(np.uint8))
    # Each nonzero row reaches the dtype's largest value exactly once at least.
    top = np.abs(np.asarray(q.astype(jnp.float32))).max(axis=1)
    np.testing.assert_array_equal(top, np.where(amax[:, 0] > 0, qmax, 0.0))


@st.composite
def problems(draw):
    wdt = draw(st.sampled_from([jnp.int8, jnp.float8_e4m3fn]))
    m = draw(st.sampled_from([1, 12, 40, 64]))
    k = draw(st.sampled_from([64, 128, 200]))
    n = draw(st.sampled_from([96, 128, 256]))
    g_total = draw(st.integers(1, 4))
    sizes = group_sizes(draw, m, g_total)
    g_local = draw(st.integers(1, g_total))
    offset = draw(st.integers(0, g_total - g_local))
    transpose = draw(st.booleans())
    lhs_dtype = draw(st.sampled_from([jnp.bfloat16, jnp.float32]))
    seed = draw(st.integers(0, 2**16))
    return wdt, m, k, n, sizes, g_local, offset, transpose, lhs_dtype, seed


@example((jnp.int8, 64, 128, 256, [20, 0, 25, 9], 3, 1, True, jnp.bfloat16, 3))
@example((jnp.float8_e4m3fn, 40, 200, 96, [15, 20], 2, 0, False, jnp.float32, 4))
@settings(max_examples=2, deadline=None, derandomize=True)
@given(problems())
def test_w8a8_ragged_dot_matches_reference_on_quantized_rows(problem):
    wdt, m, k, n, sizes, g_local, offset, transpose, lhs_dtype, seed = problem
    rng = np.random.default_rng(seed)
    # Rows of very different magnitudes: a shared scale would zero the small ones.
    lhs = rng.standard_normal((m, k)) * np.exp2(rng.integers(-8, 4, (m, 1)))
    lhs = jnp.asarray(lhs, lhs_dtype)
    w = rng.standard_normal((g_local, n, k) if transpose else (g_local, k, n)) * 0.1
    q, scale = quantize(w, wdt, out_axis=1 if transpose else 2)
    gs = jnp.asarray(sizes, jnp.int32)
    ct = jnp.asarray(rng.standard_normal((m, n)), lhs_dtype)
    f = functools.partial(
        ragged_dot,
        rhs=q,
        group_sizes=gs,
        group_offset=offset,
        rhs_scale=scale,
        transpose_rhs=transpose,
        quantize_lhs=True,
        config="v6e",
        interpret=True,
    )
    out, vjp = jax.vjp(f, lhs)
    (d_lhs,) = vjp(ct)
    assert out.dtype == lhs_dtype and d_lhs.dtype == lhs_dtype
    w_kn = jnp.swapaxes(q, 1, 2) if transpose else q

    def ref(a, quantized, absolute=False):
        rhs = jnp.abs(w_kn.astype(jnp.float32)) if absolute else w_kn
        return ragged_dot_reference(
            a, rhs, gs, offset, jnp.float32, rhs_scale=scale, quantize_lhs=quantized
        )

    x32 = lhs.astype(jnp.float32)
    want = ref(x32, True)
    q_rows, row_scale = w8a8.quantize_rows(lhs, wdt)
    mag = ref(jnp.abs(q_rows.astype(jnp.float32)) * row_scale, False, True)
    assert_close(out, want, magnitude=mag, dtype=lhs_dtype, roundings=0)
    # The flag is not ignored: the weight-only product is another result.
    weight_only = ref(x32, False)
    if float(jnp.max(jnp.abs(weight_only))) > 0:  # some row of a local group
        assert float(jnp.max(jnp.abs(want - weight_only))) > 0
    _, vjp_ref = jax.vjp(lambda a: ref(a, False), x32)
    _, vjp_mag = jax.vjp(lambda a: ref(a, False, True), jnp.abs(x32))
    assert_close(
        d_lhs,
        vjp_ref(ct.astype(jnp.float32))[0],
        magnitude=vjp_mag(jnp.abs(ct.astype(jnp.float32)))[0],
        dtype=lhs_dtype,
        roundings=1,
        what="d_lhs",
    )


@pytest.mark.parametrize("wdt", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "e4m3"])
def test_w8a8_moe_experts_matches_reference(wdt):
    rng = np.random.default_rng(7)
    t, h, i, e, k = 12, 128, 128, 6, 2
    hidden = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)
    gu, gu_s = quantize(rng.standard_normal((e, 2 * i, h)) * 0.05, wdt, 1)
    dn, dn_s = quantize(rng.standard_normal((e, h, i)) * 0.05, wdt, 1)

    def ours(x, w):
        return moe_experts(
            x, ids, w, gu, dn, None, None, gu_s, dn_s, num_experts=e,
            quantize_activations=True, interpret=True,
        )  # fmt: skip

    def ref(x, w, quantized=True):
        return moe_experts_reference(
            x, ids, w, gu, dn, None, None, e, True, False, True, "silu", 0, 1.702, 7.0,
            gu_s, dn_s, quantize_activations=quantized,
        )  # fmt: skip

    out = ours(hidden, weights)
    want = ref(hidden, weights)
    # Same quantized operands, same rounding points as the reference: summation
    # order only, a bf16 ulp of the output scale.
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2**-7 * scale, rtol=2**-7
    )
    # The gradient is the straight-through one: the weight-only layer's, taken
    # at the same hidden states.
    got = jax.grad(lambda x: jnp.sum(ours(x, weights).astype(jnp.float32)))(hidden)
    wo = jax.grad(lambda x: jnp.sum(ref(x, weights, False).astype(jnp.float32)))(hidden)
    wo = np.asarray(wo, np.float32)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), wo, atol=2**-4 * np.abs(wo).max(), rtol=2**-4
    )


@pytest.mark.parametrize(
    "rhs, scale",
    [
        (jnp.ones((2, 64, 128), jnp.bfloat16), None),
        (jnp.ones((2, 128, 128), jnp.int8), jnp.ones((2, 1, 1), jnp.float32)),
    ],
    ids=["bf16_weights", "block_scales"],
)
def test_w8a8_needs_per_channel_quantized_weights(rhs, scale):
    with pytest.raises(ValueError, match="quantize_lhs: w8a8 needs int8 or float8_e4m3fn"):
        ragged_dot(
            jnp.ones((8, rhs.shape[1]), jnp.bfloat16),
            rhs,
            jnp.asarray([4, 4], jnp.int32),
            rhs_scale=scale,
            quantize_lhs=True,
            interpret=True,
        )


def test_torch_op_quantize_lhs_matches_reference_and_keeps_weight_only_gradient():
    """The torch op's quantize_lhs reaches the kernel: the result is the
    reference's on quantized rows (not the weight-only one), d_lhs the
    weight-only product."""
    import torch

    import ragged_dot_tpu

    rng = np.random.default_rng(11)
    q, scale = quantize(rng.standard_normal((3, 96, 128)) * 0.1, jnp.int8, out_axis=1)
    lhs = torch.from_numpy(rng.standard_normal((20, 128)) * np.exp2(rng.integers(-6, 3, (20, 1))))
    lhs = lhs.bfloat16().requires_grad_(True)
    sizes = [7, 0, 13]
    out = ragged_dot_tpu.ragged_dot(
        lhs,
        torch.from_numpy(np.array(q)),
        torch.tensor(sizes, dtype=torch.int32),
        transpose_rhs=True,
        rhs_scale=torch.from_numpy(np.asarray(scale)),
        quantize_lhs=True,
    )
    ct = torch.from_numpy(rng.standard_normal((20, 96))).bfloat16()
    out.backward(ct)
    x = jnp.asarray(lhs.detach().float().numpy())
    gs = jnp.asarray(sizes, jnp.int32)

    def ref(a, quantized, w=jnp.swapaxes(q, 1, 2)):
        return ragged_dot_reference(
            a, w, gs, 0, jnp.float32, rhs_scale=scale, quantize_lhs=quantized
        )

    want = ref(x, True)
    q_rows, row_scale = w8a8.quantize_rows(x.astype(jnp.bfloat16), jnp.int8)
    absw = jnp.abs(jnp.swapaxes(q, 1, 2).astype(jnp.float32))
    mag = ref(jnp.abs(q_rows.astype(jnp.float32)) * row_scale, False, absw)
    got = jnp.asarray(out.detach().float().numpy()).astype(jnp.bfloat16)  # exact: out is bf16
    assert_close(got, want, magnitude=mag, dtype=jnp.bfloat16, roundings=0)
    assert float(jnp.max(jnp.abs(want - ref(x, False)))) > 0
    _, vjp_ref = jax.vjp(lambda a: ref(a, False), x)
    _, vjp_mag = jax.vjp(lambda a: ref(a, False, absw), jnp.abs(x))
    ct32 = jnp.asarray(ct.float().numpy())
    assert_close(
        jnp.asarray(lhs.grad.float().numpy()).astype(jnp.bfloat16),
        vjp_ref(ct32)[0],
        magnitude=vjp_mag(jnp.abs(ct32))[0],
        dtype=jnp.bfloat16,
        roundings=1,
        what="d_lhs",
    )


def _fp8_experts(block_size):
    """transformers' FP8Experts of a tiny Qwen3-MoE layer, random e4m3 weights
    and scales (per tensor: one per half of gate_up and one for down)."""
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.integrations.finegrained_fp8 import FP8Experts

    config = Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=128, num_experts=4)
    module = FP8Experts(config, block_size=block_size)
    gen = torch.Generator().manual_seed(2)
    for name, p in module.named_parameters():
        if p.dtype == torch.float8_e4m3fn:
            p.data = (torch.randn(p.shape, generator=gen) * 100).to(torch.float8_e4m3fn)
        else:
            p.data = torch.rand(p.shape, generator=gen) * 1e-3 + 1e-4
    return module


def test_experts_forward_w8a8_quantizes_fp8_experts_activations():
    """experts_forward_w8a8 on transformers' FP8Experts with per-tensor scales:
    the reference layer with quantized activations (the per-tensor scales
    spread over their channels by the test), not the weight-only one; block
    scales are refused naming the w8a8 argument."""
    import torch

    import ragged_dot_tpu

    module = _fp8_experts(None)
    t, e = 10, 4
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(t, 128, generator=gen).bfloat16()
    idx = torch.randint(0, e, (t, 2), generator=gen, dtype=torch.int32)
    weights = torch.rand(t, 2, generator=gen)
    with torch.no_grad():
        out = ragged_dot_tpu.experts_forward_w8a8(module, hidden, idx, weights)
    as_jnp = lambda x: jnp.asarray(x.detach().float().numpy())  # noqa: E731
    as_e4m3 = lambda x: jnp.asarray(x.detach().view(torch.uint8).numpy()).view(jnp.float8_e4m3fn)  # noqa: E731
    gu_s = as_jnp(module.gate_up_proj_scale_inv[..., 0].repeat_interleave(128, dim=1))
    dn_s = as_jnp(module.down_proj_scale_inv[..., 0].repeat_interleave(128, dim=1))

    def ref(quantized):
        return moe_experts_reference(
            jnp.asarray(hidden.float().numpy()).astype(jnp.bfloat16), jnp.asarray(idx.numpy()),
            as_jnp(weights), as_e4m3(module.gate_up_proj), as_e4m3(module.down_proj), None, None,
            e, True, False, True, "silu", 0, 1.702, 7.0, gu_s, dn_s,
            quantize_activations=quantized,
        ).astype(jnp.float32)  # fmt: skip

    want = ref(True)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(as_jnp(out), want, atol=2**-7 * scale, rtol=2**-7)
    # The weight-only layer is outside that tolerance: the flag reached both launches.
    assert float(jnp.max(jnp.abs(ref(False) - want))) > 4 * 2**-7 * scale
    with pytest.raises(ValueError, match="quantize_activations: w8a8 needs"):
        ragged_dot_tpu.experts_forward_w8a8(_fp8_experts((128, 128)), hidden, idx, weights)
