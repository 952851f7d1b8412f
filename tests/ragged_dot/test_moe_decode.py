"""The one-launch decode layer (kernel_moe_decode), in interpret mode.

moe_experts runs it for layers of bf16 activations and bf16, per-channel
int8 / fp8 or MXFP4 weights, with or without biases, gate/up as halves or
interleaved (GPT-OSS), up to tiling.fused_moe_max_tokens
(~270 tokens for a bf16 Qwen3 layer on v6e); each test first checks the launch really is the fused
one. Forward: against transformers' own layer in f32 on the same bf16 values,
per element (tests/tolerances.py; the bound is test_moe_jax's: |terms| of
each output, six bf16 roundings). Backward: the fused forward keeps no
residuals and the backward recomputes the two-launch program's, so its
gradients must equal that program's bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from transformers.integrations.moe import grouped_mm_experts_forward

from ragged_dot_tpu import moe, reference, tiling
from ragged_dot_tpu.api import moe_experts
from moe_cases import abs_bound_moe as _abs_bound_moe
from moe_cases import experts as _experts
from moe_cases import routing as _routing
from moe_cases import layer_kwargs as _kw
from moe_cases import to_jax as _j
from quantization import quantize
from tolerances import assert_close

BF = jnp.bfloat16
# (name, has_gate, is_transposed, is_concatenated, has_bias, activation):
# layouts the fused kernel carries (GPT_OSS_LAYOUTS: interleaved, biased).
LAYOUTS = [
    ("qwen_mixtral", True, False, True, False, "silu"),
    ("transposed", True, True, True, False, "silu"),
    ("gemma_like", True, False, True, False, "gelu_pytorch_tanh"),
    ("nemotron_h", False, False, True, False, "relu2"),
]


GPT_OSS_LAYOUTS = [
    ("gpt_oss", True, True, False, True, "gpt_oss"),  # [E, H, 2I], [E, I, H]
    ("interleaved_torch", True, False, False, True, "silu"),  # [E, 2I, H], [E, H, I]
]
BIASED_HALVES = ("biased_halves", True, False, True, True, "silu")


def _launches(fn, *args) -> list[str]:
    text = str(jax.make_jaxpr(fn)(*args))
    return [n for n in ("moe_decode_fused", "ragged_dot_gmm") if n in text]


@settings(max_examples=4, deadline=None)
@given(
    t=st.sampled_from([1, 2, 3, 5, 8, 13, 16, 40]),
    k=st.integers(1, 4),
    layout=st.sampled_from(LAYOUTS),
    chunked=st.booleans(),
    shard=st.sampled_from([None, 2]),
    bf16_weights=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(t=16, k=4, layout=LAYOUTS[0], chunked=True, shard=None, bf16_weights=True, seed=1)
@example(t=3, k=2, layout=LAYOUTS[1], chunked=True, shard=2, bf16_weights=False, seed=2)
def test_matches_transformers_per_element(t, k, layout, chunked, shard, bf16_weights, seed):
    e, h, i = 6, 128, 256
    _, gu, dn, _, _ = _experts(layout, e, h, i, seed=seed, dtype=torch.bfloat16)
    idx, w = _routing(t, k, e, seed=seed + 1)
    hid = torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 2)).bfloat16()
    w = w.bfloat16() if bf16_weights else w
    # Expert parallelism: this shard holds experts [2, 6); the others' slots are
    # skipped, which for transformers is their experts' weights at zero.
    num, off = (e, 0) if shard is None else (e - shard, shard)
    ref_self, ref_gu, ref_dn, _, _ = _experts(layout, e, h, i, seed=seed, dtype=torch.bfloat16)
    name = "gate_up_proj" if layout[1] else "up_proj"
    ref_gu, ref_dn = ref_gu.float(), ref_dn.float()
    ref_gu[:off], ref_dn[:off] = 0, 0
    setattr(ref_self, name, ref_gu)
    ref_self.down_proj = ref_dn
    ref = grouped_mm_experts_forward(ref_self, hid.float(), idx, w.float()).numpy()

    args = (_j(hid, BF), _j(idx).astype(jnp.int32), _j(w, BF) if bf16_weights else _j(w))
    weights = (_j(gu, BF)[off:], _j(dn, BF)[off:])
    # Two 128-column items per expert, or the blocks tiling picks (one item).
    config = tiling.FusedMoeConfig(128, 3) if chunked else None
    kw = _kw(layout, num, group_offset=off, config=config)
    fn = lambda *a: moe_experts(*a, **kw)  # noqa: E731
    assert _launches(fn, *args, *weights) == ["moe_decode_fused"]
    out = fn(*args, *weights)
    assert out.dtype == BF and out.shape == (t, h)
    _, has_gate, is_transposed, is_conc, _, act = layout
    mag = _abs_bound_moe(
        _j(hid),
        _j(idx).astype(jnp.int32),
        _j(w),
        ref_gu.numpy(),
        ref_dn.numpy(),
        None,
        None,
        has_gate=has_gate,
        is_transposed=is_transposed,
        is_concatenated=is_conc,
        activation=act,
    )
    assert_close(out, ref, dtype=BF, magnitude=mag, roundings=6, what="out")
    # That bound compounds two matmuls' absolute terms, loose enough to miss a
    # wrong slice of an expert; against the same rounding points (the XLA
    # reference of moe_experts) the bound is the down product's terms only.
    same = reference.moe_experts_reference(
        *args, *weights, None, None, num, has_gate, is_transposed, is_conc, act, off, 1.702, 7.0
    )
    mag = _down_terms(
        *args, *weights, num=num, off=off, has_gate=has_gate, transposed=is_transposed, act=act
    )
    assert_close(out, same.astype(jnp.float32), dtype=BF, magnitude=mag, roundings=5, what="out")


@settings(max_examples=4, deadline=None)
@given(
    t=st.sampled_from([1, 3, 8]),  # float8 takes one launch to 8 tokens on v5e / v6e
    layout=st.sampled_from(LAYOUTS),
    w_dtype=st.sampled_from([jnp.int8, jnp.float8_e4m3fn]),
    s_dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    chunked=st.booleans(),
    shard=st.sampled_from([None, 2]),
    seed=st.integers(0, 2**16),
)
@example(
    t=3, layout=LAYOUTS[1], w_dtype=jnp.int8, s_dtype=jnp.bfloat16, chunked=True, shard=2, seed=3
)
def test_quantized_weights_match_the_same_rounding_points(
    t, layout, w_dtype, s_dtype, chunked, shard, seed
):
    """int8 / fp8 weights with per-output-channel scales: widened in VMEM, the
    scales on the f32 products, as the two-launch program (its XLA reference)."""
    e, h, i, k = 6, 128, 256, 2
    _, gu, dn, _, _ = _experts(layout, e, h, i, seed=seed)
    idx, w = _routing(t, k, e, seed=seed + 1)
    hid = _j(torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 2)), BF)
    is_transposed = layout[2]
    gu_q, gu_s = quantize(_j(gu), w_dtype, 2 if is_transposed else 1)
    dn_q, dn_s = quantize(_j(dn), w_dtype, 2 if is_transposed else 1)
    gu_s, dn_s = gu_s.astype(s_dtype), dn_s.astype(s_dtype)
    num, off = (e, 0) if shard is None else (e - shard, shard)
    args = (hid, _j(idx).astype(jnp.int32), _j(w))
    weights = (gu_q[off:], dn_q[off:], None, None, gu_s[off:], dn_s[off:])
    config = tiling.FusedMoeConfig(128, 3) if chunked else None
    kw = _kw(layout, num, group_offset=off, config=config)
    fn = lambda *a: moe_experts(*a, **kw)  # noqa: E731
    assert _launches(fn, *args, *weights) == ["moe_decode_fused"]
    deq = lambda q, s, axis: (
        q.astype(jnp.float32)
        * jnp.expand_dims(  # noqa: E731
            s.astype(jnp.float32), 3 - axis
        )
    )
    axis = 2 if is_transposed else 1
    _assert_the_programs(
        fn(*args, *weights), args, weights, deq(gu_q, gu_s, axis), deq(dn_q, dn_s, axis),
        layout=layout, num=num, off=off,
    )  # fmt: skip


@settings(max_examples=2, deadline=None)
@given(
    t=st.sampled_from([1, 3, 8]),
    gate=st.sampled_from(["halves", "none", "gpt_oss"]),
    shard=st.sampled_from([None, 2]),
    e8m0=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(t=3, gate="halves", shard=2, e8m0=False, seed=5)
@example(t=1, gate="gpt_oss", shard=None, e8m0=True, seed=6)
def test_mxfp4_weights_decode_in_the_one_launch(t, gate, shard, e8m0, seed):
    """MXFP4 weights in mxfp4's kernel layout: the 4-bit slices and their
    scale rows stream through the one launch and are decoded in VMEM; the
    decoded weights are the checkpoint's values exactly, so the result is the
    two-launch program's (its XLA reference on the dequantized weights) within
    its rounding points. GPT-OSS's checkpoints: interleaved gate/up columns
    (I = 192: 384 of them, a decoded piece and a half) and f32 biases."""
    from ragged_dot_tpu import mxfp4

    layout = {
        "halves": ("transposed", True, True, True, False, "silu"),
        "none": ("up_only", False, True, True, False, "relu2"),
        "gpt_oss": GPT_OSS_LAYOUTS[0],
    }[gate]
    # H = 384: down's columns are two decoded pieces (mxfp4's 256 and a tail).
    e, h, i, k = 6, 384, (192 if gate == "gpt_oss" else 256), 2
    _, gu, dn, b1, b2 = _experts(layout, e, h, i, seed=seed)
    idx, w = _routing(t, k, e, seed=seed + 1)
    hid = _j(torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 2)), BF)
    gu_q, gu_s = mxfp4.quantize(_j(gu))  # [E, H/2, (2)I], [E, 32, (2)I]
    dn_q, dn_s = mxfp4.quantize(_j(dn))  # [E, I/2, H], [E, 32, H]
    if e8m0:
        gu_s, dn_s = (jax.lax.bitcast_convert_type(s_, jnp.float8_e8m0fnu) for s_ in (gu_s, dn_s))
    num, off = (e, 0) if shard is None else (e - shard, shard)
    args = (hid, _j(idx).astype(jnp.int32), _j(w))
    b1, b2 = (None if b is None else _j(b)[off:] for b in (b1, b2))
    weights = (gu_q[off:], dn_q[off:], b1, b2, gu_s[off:], dn_s[off:])
    fn = lambda *a: moe_experts(*a, **_kw(layout, num, group_offset=off))  # noqa: E731
    assert _launches(fn, *args, *weights) == ["moe_decode_fused"]
    deq = lambda q, s_: mxfp4.dequantize(q, mxfp4.scale_bytes(s_))  # noqa: E731
    _assert_the_programs(
        fn(*args, *weights), args, weights, deq(gu_q, gu_s), deq(dn_q, dn_s),
        layout=layout, num=num, off=off,
    )  # fmt: skip


def _assert_the_programs(out, args, weights, gu, dn, *, layout, num, off):
    """The fused layer's `out` against the two-launch program's XLA reference on
    the same (quantized) `weights` (and biases), per element within its
    rounding points; gu, dn: every expert's weights dequantized in f32, for
    the bound."""
    _, has_gate, is_transposed, is_conc, _, act = layout
    same = reference.moe_experts_reference(
        *args, *weights[:4], num, has_gate, is_transposed, is_conc, act, off, 1.702, 7.0,
        *weights[4:],
    )  # fmt: skip
    biased = weights[2] is not None or weights[3] is not None
    mag = _down_terms(
        *args, gu[off:], dn[off:], num=num, off=off, has_gate=has_gate,
        transposed=is_transposed, act=act, interleaved=has_gate and not is_conc,
        biases=weights[2:4],
    )  # fmt: skip
    # A bias adds one rounding to each projection it is added to.
    roundings = 7 if biased else 5
    assert_close(
        out, same.astype(jnp.float32), dtype=BF, magnitude=mag, roundings=roundings, what="out"
    )


# The bounds are jitted: one program per shape; eager, each of their ops is
# compiled per shape (most of this module's time, 2026-12-07).
@functools.partial(
    jax.jit, static_argnames=("num", "off", "has_gate", "transposed", "act", "interleaved")
)
def _down_terms(
    hid, idx, w, gu, dn, *, num, off, has_gate, transposed, act, interleaved=False, biases=()
):
    """Per output element, sum over local slots of |w| x (sum_i s_i |Wd_i| +
    |down bias|), s the scale of activation i's error: a bf16 flip of the
    gate or up projection moves act(g) * u by <= 1.13 u |g| |u| each (|act'|
    <= 1.13 for SiLU and tanh-GELU, |act(g)| <= |g|; GPT-OSS's clamped GLU
    (u + 1) g sigmoid(1.702 g): |g| (|u| + 1)), its own rounding and the
    down product's by u |g| |u| each: 5 roundings of |g| |u| (relu2: p^2,
    4), one more for each bias added. biases: (gate/up bias, down bias), each
    None or [E_local, N]."""
    b_up, b_dn = (tuple(biases) + (None, None))[:2]
    local, ids, p = _slot_projections(
        hid, idx, gu, b_up, num=num, off=off, transposed=transposed, round_product=False
    )
    if has_gate:
        g, u = _gate_and_up(p, interleaved)
        scale = jnp.abs(g) * (jnp.abs(u) + (act == "gpt_oss"))
    else:
        scale = p * p if act == "relu2" else jnp.abs(p)
    eq_dn = "tki,tkih->tkh" if transposed else "tki,tkhi->tkh"
    terms = jnp.einsum(eq_dn, scale, jnp.abs(_f32(dn))[ids], precision="highest")
    if b_dn is not None:
        terms = terms + jnp.abs(_f32(b_dn))[ids]
    return (terms * jnp.where(local, jnp.abs(_f32(w)), 0.0)[..., None]).sum(1)


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _bf16_rounded(x):
    return _f32(x).astype(BF).astype(jnp.float32)


def _slot_projections(hid, idx, gu, b_up, *, num, off, transposed, round_product=True):
    """(which slots' experts are local, their clamped local ids, each slot's
    gate/up projection in bf16: the product rounded where the program rounds
    it (round_product), plus the bf16 bias, rounded again; without
    round_product the f32 product plus the bias is rounded once)."""
    local = jnp.logical_and(idx >= off, idx < off + num)
    ids = jnp.clip(idx - off, 0, num - 1)
    eq_up = "th,tkho->tko" if transposed else "th,tkoh->tko"
    p = jnp.einsum(eq_up, _f32(hid), _f32(gu)[ids], precision="highest")
    if round_product:
        p = _bf16_rounded(p)
    if b_up is not None:
        p = p + _bf16_rounded(b_up)[ids]
    return local, ids, _bf16_rounded(p)


def _gate_and_up(p, interleaved):
    return (p[..., 0::2], p[..., 1::2]) if interleaved else jnp.split(p, 2, axis=-1)


@settings(max_examples=2, deadline=None)
@given(
    t=st.sampled_from([1, 2, 3, 5, 8, 13]),
    k=st.integers(1, 4),
    layout=st.sampled_from([*GPT_OSS_LAYOUTS, BIASED_HALVES]),
    biases=st.sampled_from(["both", "gate_up", "down", "none"]),
    f32_biases=st.booleans(),
    chunked=st.booleans(),
    shard=st.sampled_from([None, 2]),
    seed=st.integers(0, 2**16),
)
@example(
    t=1, k=4, layout=GPT_OSS_LAYOUTS[0], biases="both", f32_biases=True, chunked=True,
    shard=None, seed=1,
)  # fmt: skip
@example(
    t=5, k=2, layout=GPT_OSS_LAYOUTS[1], biases="both", f32_biases=False, chunked=True,
    shard=2, seed=2,
)  # fmt: skip
@example(
    t=3, k=2, layout=BIASED_HALVES, biases="gate_up", f32_biases=False, chunked=True,
    shard=None, seed=3,
)  # fmt: skip
def test_interleaved_gate_up_and_biases_in_the_one_launch(
    t, k, layout, biases, f32_biases, chunked, shard, seed
):
    """GPT-OSS's layout: gate and up columns interleaved, a bias on each
    projection (f32 as its MXFP4 loader keeps them, or bf16), its clamped
    GLU; and biases on gate/up halves. A slice of I is 2 x block_i
    interleaved columns, deinterleaved in the kernel, each bias added in the
    projection's dtype. Against
    transformers' layer in f32 on the same bf16 values, and against the
    two-launch program's rounding points (its XLA reference)."""
    gpt = layout[0] == "gpt_oss"
    # GPT-OSS's [E, I, H] down takes 64-column slices of I; [E, H, I] 128.
    e, h, i = 6, 128, (192 if gpt else 256)
    ref_self, gu, dn, b1, b2 = _experts(layout, e, h, i, seed=seed, dtype=torch.bfloat16)
    b1 = b1 if biases in ("both", "gate_up") else None
    b2 = b2 if biases in ("both", "down") else None
    idx, w = _routing(t, k, e, seed=seed + 1)
    hid = torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 2)).bfloat16()
    num, off = (e, 0) if shard is None else (e - shard, shard)
    bias_dtype = jnp.float32 if f32_biases else BF
    weights = (
        _j(gu, BF)[off:],
        _j(dn, BF)[off:],
        None if b1 is None else _j(b1, bias_dtype)[off:],
        None if b2 is None else _j(b2, bias_dtype)[off:],
    )
    args = (_j(hid, BF), _j(idx).astype(jnp.int32), _j(w))
    config = tiling.FusedMoeConfig(64 if gpt else 128, 3) if chunked else None
    fn = lambda *a: moe_experts(*a, **_kw(layout, num, group_offset=off, config=config))  # noqa: E731
    assert _launches(fn, *args, *weights) == ["moe_decode_fused"]
    out = fn(*args, *weights)
    assert out.dtype == BF and out.shape == (t, h)

    # transformers' layer in f32, the other shard's experts at zero.
    for name, x in (("gate_up_proj", gu), ("down_proj", dn), ("gate_up_proj_bias", b1),
                    ("down_proj_bias", b2)):  # fmt: skip
        x = torch.zeros_like(getattr(ref_self, name)) if x is None else x.clone()
        x[:off] = 0
        setattr(ref_self, name, x.float())
    ref = grouped_mm_experts_forward(ref_self, hid.float(), idx, w.float()).numpy()
    _, has_gate, is_transposed, is_conc, _, act = layout
    mag = _abs_bound_moe(
        _j(hid), _j(idx).astype(jnp.int32), _j(w), ref_self.gate_up_proj.numpy(),
        ref_self.down_proj.numpy(), ref_self.gate_up_proj_bias.numpy(),
        ref_self.down_proj_bias.numpy(), has_gate=has_gate, is_transposed=is_transposed,
        is_concatenated=is_conc, activation=act,
    )  # fmt: skip
    assert_close(out, ref, dtype=BF, magnitude=mag, roundings=8, what="out")
    # Those absolute terms hide a wrong bias (its error sums with random
    # signs); against the same rounding points only the f32 sums' order
    # differs, which can flip a rounding of an expert's output y or of one
    # activation: bounded by |y| and the largest single down term.
    same = reference.moe_experts_reference(
        *args, *weights, num, has_gate, is_transposed, is_conc, act, off, 1.702, 7.0
    )
    mag = _slot_output_terms(*args, *weights, num=num, off=off, layout=layout)
    assert_close(out, same.astype(jnp.float32), dtype=BF, magnitude=mag, roundings=4, what="out")


@functools.partial(jax.jit, static_argnames=("num", "off", "layout"))
def _slot_output_terms(hid, idx, w, gu, dn, b_up, b_dn, *, num, off, layout):
    """Per output element, sum over local slots of |w| x (|y| + max_i |h_i
    Wd_i|): y the slot's expert output, h its activation, in f32 from the
    program's bf16 projections."""
    _, _, transposed, is_conc, _, act = layout
    local, ids, p = _slot_projections(hid, idx, gu, b_up, num=num, off=off, transposed=transposed)
    g, u = _gate_and_up(p, interleaved=not is_conc)
    h = _bf16_rounded(moe.glu(g, u, activation=act, alpha=1.702, limit=7.0))
    wd = _f32(dn)[ids] if transposed else jnp.swapaxes(_f32(dn)[ids], -1, -2)  # [T, k, I, H]
    y = jnp.einsum("tki,tkih->tkh", h, wd, precision="highest")
    if b_dn is not None:
        y = y + _bf16_rounded(b_dn)[ids]
    big = jnp.max(jnp.abs(h)[..., None] * jnp.abs(wd), axis=2)
    return ((jnp.abs(y) + big) * jnp.where(local, jnp.abs(_f32(w)), 0.0)[..., None]).sum(1)


def test_backward_is_the_two_launch_programs():
    layout = LAYOUTS[0]
    e, h, i, t, k = 6, 128, 256, 5, 2
    _, gu, dn, _, _ = _experts(layout, e, h, i, seed=3, dtype=torch.bfloat16)
    idx, w = _routing(t, k, e, seed=4)
    hid = torch.randn(t, h, generator=torch.Generator().manual_seed(5)).bfloat16()
    idx_j = _j(idx).astype(jnp.int32)
    args = (_j(hid, BF), _j(w), _j(gu, BF), _j(dn, BF))

    def loss(config):
        kw = _kw(layout, e, config=config)
        return lambda hid, w, gu, dn: jnp.sum(
            jnp.sin(moe_experts(hid, idx_j, w, gu, dn, **kw).astype(jnp.float32))
        )

    # Two 128-column items per expert; a MoeConfig names the two gmm launches.
    fused, program = loss(tiling.FusedMoeConfig(128, 3)), loss(tiling.MoeConfig())
    assert _launches(fused, *args) == ["moe_decode_fused"]
    assert _launches(program, *args) == ["ragged_dot_gmm"]
    got = jax.grad(fused, argnums=(0, 1, 2, 3))(*args)
    want = jax.grad(program, argnums=(0, 1, 2, 3))(*args)
    for name, g, r in zip(("hidden", "top_k_weights", "gate_up", "down"), got, want):
        np.testing.assert_array_equal(
            np.asarray(g.astype(jnp.float32)), np.asarray(r.astype(jnp.float32)), err_msg=name
        )


def test_non_finite_tokens_stay_their_own():
    """A token whose hidden state is inf gets NaN where it has a local expert
    and exactly zero where it has none (expert parallelism); no other token
    changes. Every token is computed against every active expert, so the
    kernel must mask, not multiply by a zero weight."""
    layout = LAYOUTS[0]
    e, h, i, t = 6, 128, 128, 4
    _, gu, dn, _, _ = _experts(layout, e, h, i, seed=6, dtype=torch.bfloat16)
    idx = jnp.asarray([[0, 1], [3, 4], [2, 5], [0, 3]], jnp.int32)  # token 0: experts 0, 1
    w = jnp.full((t, 2), 0.5, jnp.float32)
    hid = jnp.asarray(np.random.default_rng(7).normal(size=(t, h)), BF)
    bad = hid.at[0, 3].set(jnp.inf)
    weights = (_j(gu, BF)[2:], _j(dn, BF)[2:])  # the shard of experts [2, 6)
    kw = _kw(layout, e - 2, group_offset=2)
    assert _launches(lambda *a: moe_experts(*a, **kw), hid, idx, w, *weights) == [
        "moe_decode_fused"
    ]
    clean = np.asarray(moe_experts(hid, idx, w, *weights, **kw).astype(jnp.float32))
    out = np.asarray(moe_experts(bad, idx, w, *weights, **kw).astype(jnp.float32))
    np.testing.assert_array_equal(out[0], 0.0)  # no local expert
    np.testing.assert_array_equal(out[1:], clean[1:])

    weights = (_j(gu, BF), _j(dn, BF))  # every expert local: token 0's row is NaN
    out = np.asarray(moe_experts(bad, idx, w, *weights, **_kw(layout, e)).astype(jnp.float32))
    clean = np.asarray(moe_experts(hid, idx, w, *weights, **_kw(layout, e)).astype(jnp.float32))
    assert np.isnan(out[0]).all()
    np.testing.assert_array_equal(out[1:], clean[1:])


@pytest.mark.parametrize(
    "case",
    [
        dict(t=tiling.fused_moe_max_tokens(128, 128, 128) + 1),
        dict(dtype=jnp.float32),
        # The up half's bias would start I = 64 lanes into a row.
        dict(bias=True, i=64),
        # A slice's interleaved columns would not fill whole lane tiles.
        dict(layout=GPT_OSS_LAYOUTS[0], i=96),
        dict(block_scales=True),
    ],
    ids=["tokens", "f32", "bias_off_the_lane_tiles", "interleaved_i_96", "block_scales"],
)
def test_layers_the_kernel_does_not_carry_take_two_launches(case):
    layout = case.get("layout", LAYOUTS[0])
    e, h, i, t, k = 4, 128, case.get("i", 128), case.get("t", 3), 2
    dt = case.get("dtype", BF)
    _, gu, dn, _, _ = _experts(layout, e, h, i, seed=8)
    idx, w = _routing(t, k, e, seed=9)
    args = [jnp.zeros((t, h), dt), _j(idx).astype(jnp.int32), _j(w), _j(gu, dt), _j(dn, dt)]
    if case.get("bias"):
        args += [jnp.zeros((e, 2 * i), dt), jnp.zeros((e, h), dt)]
    if case.get("block_scales"):  # FP8 checkpoints' 128 x 128 blocks
        args[3:5] = [a.astype(jnp.float8_e4m3fn) for a in args[3:5]]
        args += [None, None, jnp.ones((e, 2, 1)), jnp.ones((e, 1, 1))]
    assert _launches(lambda *a: moe_experts(*a, **_kw(layout, e)), *args) == ["ragged_dot_gmm"]


def test_hand_written_blocks_are_checked():
    layout = LAYOUTS[0]
    _, gu, dn, _, _ = _experts(layout, 4, 128, 256, seed=10)
    idx, w = _routing(3, 2, 4, seed=11)
    args = (jnp.zeros((3, 128), BF), _j(idx).astype(jnp.int32), _j(w), _j(gu, BF), _j(dn, BF))
    with pytest.raises(ValueError, match="config.block_i: expected I = 256"):
        moe_experts(*args, **_kw(layout, 4, config=tiling.FusedMoeConfig(96, 3)))
    f32 = (*args[:3], _j(gu), _j(dn))
    with pytest.raises(ValueError, match="config: a FusedMoeConfig needs a layer"):
        moe_experts(*f32, **_kw(layout, 4, config=tiling.FusedMoeConfig(128, 3)))
    # Interleaved gate/up: 64-column slices where down's I is on its rows
    # (GPT-OSS's [E, I, H]), 128 where it is on its lanes ([E, H, I]).
    for layout, i, block, want in (
        (GPT_OSS_LAYOUTS[0], 192, 96, 64),
        (GPT_OSS_LAYOUTS[1], 256, 64, 128),
    ):
        _, gu, dn, _, _ = _experts(layout, 4, 128, i, seed=12)
        with pytest.raises(ValueError, match=f"I = {i} or a multiple of {want} dividing it"):
            moe_experts(
                *args[:3], _j(gu, BF), _j(dn, BF),
                **_kw(layout, 4, config=tiling.FusedMoeConfig(block, 3)),
            )  # fmt: skip


@pytest.mark.parametrize("generation", ["v6e", "tpu7x"])
def test_gpt_oss_decode_blocks(generation):
    """GPT-OSS-20B (H = I = 2880): bf16 streams the widest slice of I within
    tiling.FUSED_MOE_ITEM_BYTES (no multiple of 128 divides 2880; 192 of 64
    does, 3.3 MB an item, where 64-column slices would quarter-fill the MXU)
    to its token limit, then 960-column slices (less MXU padding) to theirs;
    MXFP4 whole experts to their limit."""
    from ragged_dot_tpu import mxfp4

    def rule(t, w_dtype):
        cfg = tiling.fused_moe_config(
            t, 2880, 2880, BF, w_dtype, has_gate=True, is_transposed=True,
            is_concatenated=False, has_bias=True, generation=generation,
        )  # fmt: skip
        return cfg and cfg.block_i

    for w_dtype, blocks in ((BF, (192, 960)), (mxfp4.WEIGHT_DTYPE, (2880,))):
        t = 1
        for block in blocks:
            assert rule(t, w_dtype) == block, (t, w_dtype)
            t = tiling.fused_moe_max_tokens(
                2880, 2880, block, w_dtype=w_dtype, generation=generation
            )
            assert rule(t, w_dtype) == block, (t, w_dtype)
            t += 1
        assert rule(t, w_dtype) is None, (t, w_dtype)


@pytest.mark.parametrize("generation", ["v6e", "tpu7x"])
@pytest.mark.parametrize(
    "hidden, inter, block",
    [(2048, 768, 256), (2816, 704, 704), (4096, 1792, 256)],
    ids=["qwen3", "gemma4", "mixtral_tp8"],
)
def test_gate_up_halves_keep_mxu_wide_slices(generation, hidden, inter, block):
    """Gate/up halves in the torch layout take the widest MXU-wide slice
    within the item size, else I whole (Gemma 4's 704, which no multiple of
    128 below it divides): never a narrower slice because it fits the item
    size (GPT-OSS's interleaved fallback)."""
    cfg = tiling.fused_moe_config(
        8, hidden, inter, BF, BF, has_gate=True, is_transposed=False, is_concatenated=True,
        has_bias=False, generation=generation,
    )  # fmt: skip
    assert cfg.block_i == block


def test_mxfp4_past_its_token_limit_takes_two_launches():
    """MXFP4's limit counts half a byte a weight: a quarter of bf16's tokens."""
    from ragged_dot_tpu import mxfp4

    e, h, i, k = 4, 128, 128, 2
    most = tiling.fused_moe_max_tokens(h, i, i, w_dtype=jnp.uint8)
    assert most < tiling.fused_moe_max_tokens(h, i, i, w_dtype=jnp.int8)
    gu, gs = mxfp4.quantize(jnp.ones((e, h, 2 * i), jnp.float32))
    dn, ds = mxfp4.quantize(jnp.ones((e, i, h), jnp.float32))
    layout = ("transposed", True, True, True, False, "silu")
    for t, want in ((most, "moe_decode_fused"), (most + 1, "ragged_dot_gmm")):
        args = (jnp.zeros((t, h), BF), jnp.zeros((t, k), jnp.int32), jnp.ones((t, k)))
        fn = lambda *a: moe_experts(*a, **_kw(layout, e))  # noqa: E731
        assert _launches(fn, *args, gu, dn, None, None, gs, ds) == [want], t
