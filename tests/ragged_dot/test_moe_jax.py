"""moe_experts (one JAX program per MoE experts layer) vs transformers 5.22.2.

The reference is transformers' own `grouped_mm_experts_forward` run in torch on
the CPU, with a stand-in module carrying the layout flags each model family
declares (Qwen/Mixtral, GPT-OSS, the privacy filter, Nemotron-H). Gradients
are checked against a dense per-(token, k) JAX implementation.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.integrations.moe import grouped_mm_experts_forward

from ragged_dot_tpu import mxfp4, pairs, tiling
from ragged_dot_tpu.api import moe_experts
from ragged_dot_tpu.reference import tolerance
from moe_cases import abs_bound_moe as _abs_bound_moe
from moe_cases import experts as _experts
from moe_cases import routing as _routing
from moe_cases import layer_kwargs as _kw
from moe_cases import to_jax as _j
from tolerances import assert_close

# (name, has_gate, is_transposed, is_concatenated, has_bias, activation)
LAYOUTS = [
    ("qwen_mixtral", True, False, True, False, "silu"),
    ("gpt_oss", True, True, False, True, "gpt_oss"),
    ("privacy_filter", True, True, True, True, "gpt_oss"),
    ("gemma_like", True, False, True, False, "gelu_pytorch_tanh"),
    ("nemotron_h", False, False, True, False, "relu2"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_matches_transformers_grouped_mm_f32(layout):
    e, h, i, t, k = 6, 64, 40, 13, 2
    self, gu, dn, b1, b2 = _experts(layout, e, h, i, seed=1)
    idx, w = _routing(t, k, e, seed=2)
    hid = torch.randn(t, h, generator=torch.Generator().manual_seed(3))
    ref = grouped_mm_experts_forward(self, hid, idx, w)
    out = moe_experts(
        _j(hid), _j(idx).astype(jnp.int32), _j(w), _j(gu), _j(dn), _j(b1), _j(b2), **_kw(layout, e)
    )
    assert out.dtype == jnp.float32 and out.shape == (t, h)
    np.testing.assert_allclose(np.asarray(out), ref.numpy(), **tolerance(jnp.float32, h))


def _bf16_case(layout, e, h, i, t, k, seed):
    """A bf16 layer's arguments (moe_experts' order, biases included) and
    transformers' layer in f32 on the same bf16-rounded weights and inputs,
    with the per-element magnitudes of its terms (tests/tolerances.py)."""
    self, gu, dn, b1, b2 = _experts(layout, e, h, i, seed=seed, dtype=torch.bfloat16)
    idx, w = _routing(t, k, e, seed=seed + 1)
    hid = torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 2)).bfloat16()
    w16 = w.bfloat16()
    ref_self, *_ = _experts(layout, e, h, i, seed=seed, dtype=torch.bfloat16)
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        if hasattr(ref_self, name):
            setattr(ref_self, name, getattr(ref_self, name).float())
    ref = grouped_mm_experts_forward(ref_self, hid.float(), idx, w16.float()).numpy()
    bf = jnp.bfloat16
    tensors = (hid, idx, w16, gu, dn, b1, b2)
    args = tuple(_j(x).astype(jnp.int32) if x is idx else _j(x, bf) for x in tensors)
    _, has_gate, is_transposed, is_conc, _, act = layout
    mag = _abs_bound_moe(
        *(_j(x).astype(jnp.int32) if x is idx else _j(x) for x in tensors),
        has_gate=has_gate,
        is_transposed=is_transposed,
        is_concatenated=is_conc,
        activation=act,
    )
    return args, ref, mag


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=[l[0] for l in LAYOUTS[:2]])
def test_matches_transformers_bf16(layout):
    """bf16 layer per element (tests/tolerances.py) against transformers' layer in
    f32 on the same bf16-rounded weights and inputs. Both round the projections,
    the activation and the down projection to bf16 in the kernel path: each
    rounding costs at most u times the absolute terms it feeds."""
    e, h, i, t, k = 8, 128, 64, 9, 3
    args, ref, mag = _bf16_case(layout, e, h, i, t, k, seed=4)
    out = moe_experts(*args, **_kw(layout, e))
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref, dtype=jnp.bfloat16, magnitude=mag, roundings=6, what="out")


def test_expert_parallel_sentinels_and_shards():
    layout = LAYOUTS[1]  # GPT-OSS: biases too, which must not leak into sentinel rows
    e, h, i, t, k = 8, 64, 32, 10, 2
    self, gu, dn, b1, b2 = _experts(layout, e, h, i, seed=7)
    idx, w = _routing(t, k, e, seed=8)
    hid = torch.randn(t, h, generator=torch.Generator().manual_seed(9))
    full = moe_experts(
        _j(hid), _j(idx).astype(jnp.int32), _j(w), _j(gu), _j(dn), _j(b1), _j(b2), **_kw(layout, e)
    )
    kw = _kw(layout, e // 2)
    shards = []
    for off in (0, e // 2):
        sl = slice(off, off + e // 2)
        shards.append(
            moe_experts(
                _j(hid),
                _j(idx).astype(jnp.int32),
                _j(w),
                _j(gu[sl]),
                _j(dn[sl]),
                _j(b1[sl]),
                _j(b2[sl]),
                group_offset=off,
                **kw,
            )
        )
        # transformers' EP convention: local ids, sentinel = num_local_experts.
        local = idx - off
        local = torch.where((local >= 0) & (local < e // 2), local, e // 2)
        ref_self, *_ = _experts(layout, e, h, i, seed=7, expert_parallel=True)
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            setattr(ref_self, name, getattr(ref_self, name)[sl])
        ref_self.num_experts = e // 2
        ref = grouped_mm_experts_forward(ref_self, hid, local, w)
        np.testing.assert_allclose(np.asarray(shards[-1]), ref.numpy(), **tolerance(jnp.float32, h))
    np.testing.assert_allclose(
        np.asarray(shards[0] + shards[1]), np.asarray(full), **tolerance(jnp.float32, h)
    )


def _dense_moe(
    hidden, idx, w, gu, dn, b1, b2, *, has_gate, is_transposed, is_concatenated, activation
):
    """Every (token, k) pair against its expert's gathered weights, in f32."""
    wg, wd = gu[idx], dn[idx]  # [T, k, ...]
    eq_up = "th,tkho->tko" if is_transposed else "th,tkoh->tko"
    eq_dn = "tki,tkih->tkh" if is_transposed else "tki,tkhi->tkh"
    p = jnp.einsum(eq_up, hidden, wg, precision="highest")
    if b1 is not None:
        p = p + b1[idx]
    if has_gate:
        gate, up = (
            (p[..., : p.shape[-1] // 2], p[..., p.shape[-1] // 2 :])
            if is_concatenated
            else (p[..., 0::2], p[..., 1::2])
        )
        if activation == "gpt_oss":
            gate, up = jnp.minimum(gate, 7.0), jnp.clip(up, -7.0, 7.0)
            a = (up + 1) * gate * jax.nn.sigmoid(gate * 1.702)
        else:
            a = jax.nn.silu(gate) * up
    else:
        a = jnp.square(jax.nn.relu(p))
    o = jnp.einsum(eq_dn, a, wd, precision="highest")
    if b2 is not None:
        o = o + b2[idx]
    return (o * w[..., None]).sum(1)


@pytest.mark.parametrize(
    "layout", [LAYOUTS[0], LAYOUTS[1], LAYOUTS[4]], ids=["qwen_mixtral", "gpt_oss", "nemotron_h"]
)
def test_gradients_match_dense_reference(layout):
    e, h, i, t, k = 5, 32, 24, 7, 2
    _, gu, dn, b1, b2 = _experts(layout, e, h, i, seed=10)
    idx, w = _routing(t, k, e, seed=11)
    hid = torch.randn(t, h, generator=torch.Generator().manual_seed(12))
    kw = _kw(layout, e)
    idx_j = _j(idx).astype(jnp.int32)
    args = [_j(hid), _j(w), _j(gu), _j(dn)] + ([_j(b1), _j(b2)] if b1 is not None else [])

    def loss(fn):
        def f(hid, w, gu, dn, *b):
            b1, b2 = b if b else (None, None)
            return jnp.sum(jnp.sin(fn(hid, idx_j, w, gu, dn, b1, b2)))

        return f

    got = jax.grad(loss(lambda *a: moe_experts(*a, **kw)), argnums=tuple(range(len(args))))(*args)
    dense_kw = {x: kw[x] for x in ("has_gate", "is_transposed", "is_concatenated", "activation")}
    want = jax.grad(loss(lambda *a: _dense_moe(*a, **dense_kw)), argnums=tuple(range(len(args))))(
        *args
    )
    for g_, w_ in zip(got, want):
        scale = max(1.0, float(jnp.abs(w_).max()))
        np.testing.assert_allclose(
            np.asarray(g_), np.asarray(w_), **tolerance(jnp.float32, h, scale)
        )


def test_bad_layout_raises_value_error():
    layout = LAYOUTS[0]
    _, gu, dn, _, _ = _experts(layout, 4, 32, 24, seed=0)
    hid, idx, w = jnp.zeros((3, 32)), jnp.zeros((3, 2), jnp.int32), jnp.zeros((3, 2))
    with pytest.raises(ValueError, match="gate_up: expected input dim H=32"):
        moe_experts(hid, idx, w, _j(gu), _j(dn), **{**_kw(layout, 4), "is_transposed": True})
    with pytest.raises(ValueError, match="activation: expected one of"):
        moe_experts(hid, idx, w, _j(gu), _j(dn), **{**_kw(layout, 4), "activation": "tanhh"})
    with pytest.raises(ValueError, match="expected 5 experts"):
        moe_experts(hid, idx, w, _j(gu), _j(dn), **_kw(layout, 5))


def test_reference_matches_transformers_and_kernel():
    """moe_experts_reference (the torch layer's reference path) agrees with both."""
    from ragged_dot_tpu.reference import moe_experts_reference

    layout = LAYOUTS[1]
    e, h, i, t, k = 6, 64, 40, 13, 2
    self, gu, dn, b1, b2 = _experts(layout, e, h, i, seed=13)
    idx, w = _routing(t, k, e, seed=14)
    hid = torch.randn(t, h, generator=torch.Generator().manual_seed(15))
    ref = grouped_mm_experts_forward(self, hid, idx, w).numpy()
    _, has_gate, is_transposed, is_conc, _, act = layout
    out = moe_experts_reference(
        _j(hid),
        _j(idx).astype(jnp.int32),
        _j(w),
        _j(gu),
        _j(dn),
        _j(b1),
        _j(b2),
        e,
        has_gate,
        is_transposed,
        is_conc,
        act,
        0,
        1.702,
        7.0,
    )
    np.testing.assert_allclose(np.asarray(out), ref, **tolerance(jnp.float32, h))


def _pallas_widths(closed):
    """(rows, columns) of every pallas_call output in a jaxpr, sub-jaxprs included."""
    return [shape for _, outs in _pallas_io(closed) for shape in outs]


def _pallas_io(closed):
    """(input shapes, output shapes) of every pallas_call in a jaxpr, sub-jaxprs included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                shapes = lambda vs: [tuple(v.aval.shape) for v in vs]  # noqa: E731
                found.append((shapes(eqn.invars), shapes(eqn.outvars)))
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    return found


@pytest.mark.parametrize(
    "layout", [LAYOUTS[0], LAYOUTS[3], LAYOUTS[1]], ids=["qwen_mixtral", "gemma_like", "gpt_oss"]
)
def test_inference_applies_the_activation_in_the_gate_up_kernel(layout):
    """Without a gradient the gate/up gmm writes act(gate) * up ([S, I]); with
    one it writes the projection ([S, 2I]) the backward needs. Both match
    transformers' layer with the bf16 test's bound (300 tokens: two launches,
    past the one-launch decode kernel's limit). GPT-OSS's gate and up columns
    alternate and carry a bias, which its kernel adds before the activation."""
    e, h, i, t, k = 8, 384, 128, 300, 2  # h apart from i and 2i: the launches tell apart
    args, ref, mag = _bf16_case(layout, e, h, i, t, k, seed=11)
    f = lambda x, *rest: moe_experts(x, *rest, **_kw(layout, e))  # noqa: E731
    inference = _pallas_widths(jax.make_jaxpr(f)(*args))
    training = _pallas_widths(jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[0])(*args))
    assert (t * k, i) in inference and (t * k, 2 * i) not in inference
    assert (t * k, 2 * i) in training and (t * k, i) not in training
    outs = {"inference": f(*args), "training": jax.vjp(f, *args)[0]}
    for what, out in outs.items():
        assert out.dtype == jnp.bfloat16
        assert_close(out, ref, dtype=jnp.bfloat16, magnitude=mag, roundings=6, what=what)
    # The epilogues round where the unfused program does (each product, then
    # its bias, then the activation), so with the same ops on the CPU
    # (interpret mode) the two layers agree bit for bit.
    np.testing.assert_array_equal(
        np.asarray(outs["inference"], np.float32), np.asarray(outs["training"], np.float32)
    )


def test_inference_adds_the_gate_up_bias_in_the_gate_up_kernel():
    """A biased layer whose gate/up gmm does not apply the activation (gate
    and up halves with a bias, the privacy filter's layout; tpu7x's bf16
    GPT-OSS): without a gradient the gmm adds the bias in its epilogue, with
    no [S, 2I] copy of each row's bias gathered and added by XLA; training
    keeps XLA's add. Bit for bit the same layer (the epilogue rounds the
    product, then its sum with the bias, as XLA's bf16 add does)."""
    layout = LAYOUTS[2]
    e, h, i, t, k = 8, 384, 128, 300, 2  # past the one-launch decode kernel's limit
    args, ref, mag = _bf16_case(layout, e, h, i, t, k, seed=12)
    f = lambda x, *rest: moe_experts(x, *rest, **_kw(layout, e))  # noqa: E731
    gathers = rf"\[{t * k},{2 * i}\] = gather"
    assert not re.findall(gathers, str(jax.make_jaxpr(f)(*args)))
    assert len(re.findall(gathers, str(jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[0])(*args)))) == 1
    outs = {"inference": f(*args), "training": jax.vjp(f, *args)[0]}
    for what, out in outs.items():
        assert_close(out, ref, dtype=jnp.bfloat16, magnitude=mag, roundings=6, what=what)
    np.testing.assert_array_equal(
        np.asarray(outs["inference"], np.float32), np.asarray(outs["training"], np.float32)
    )


@pytest.mark.parametrize(
    "weights, generation, t, fused, packs, gathers",
    [
        ("bf16", "v5e", 8192, True, True, True),
        ("bf16", "v6e", 8192, True, True, True),
        ("bf16", "tpu7x", 8192, False, False, False),
        ("bf16", "v6e", 240, False, True, False),  # past the one-launch layer (238 tokens)
        ("mxfp4", "v6e", 2048, True, True, False),
        ("mxfp4", "tpu7x", 2048, False, False, False),
        ("mxfp4", "tpu7x", 8192, True, False, False),
    ],
)
def test_gpt_oss_layer_takes_the_kernels_its_shapes_allow(
    weights, generation, t, fused, packs, gathers
):
    """GPT-OSS-20B (traced, not run): I = 2,880 columns admit no block but
    the whole expert, [2880, 5760] bf16 = 33 MB a weight slot. Two fit v5e's
    and v6e's VMEM, not tpu7x's: there the gate/up gmm writes the projection
    and XLA applies the bias and activation. Nor below
    tiling.GLU_INTERLEAVED_MIN_GROUP_ROWS rows an expert (240 tokens: 30), nor
    in FP4 where the whole-expert slabs leave smaller row tiles than the
    unfused product's (tpu7x at 2,048 tokens). Fused or not, the gate/up gmm
    adds its bias and the down gmm its own (no bias rows gathered).
    H = 2880 packs with a partial last word group (12 word rows of 16 a
    token): the down gmm writes packed rows for kernel_combine but on tpu7x
    (tiling.combine_in_kernel), and the fused bf16 gate/up gmm gathers its
    own rows; XLA gathers [S, H] rows only where neither does."""
    e, k, h, i = 32, 4, 2880, 2880
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    if weights == "mxfp4":
        (gu, gu_s), (dn, dn_s) = mxfp4.abstract((e, h, 2 * i)), mxfp4.abstract((e, i, h))
        extra = (sds((e, 2 * i), jnp.float32), sds((e, h), jnp.float32), gu_s, dn_s)
    else:
        gu, dn = sds((e, h, 2 * i), bf), sds((e, i, h), bf)
        extra = (sds((e, 2 * i), bf), sds((e, h), bf))
    args = (sds((t, h), bf), sds((t, k), jnp.int32), sds((t, k), jnp.float32), gu, dn, *extra)
    kw = _kw(LAYOUTS[1], e, config=generation)
    assert kw["is_concatenated"] is False and kw["activation"] == "gpt_oss"
    closed = jax.make_jaxpr(lambda *a: moe_experts(*a, **kw))(*args)
    assert tiling.combine_in_kernel(h, generation) == packs
    # The gate/up gmm's [S, I] or [S, 2I], and the down gmm's [S, H] (I = H)
    # or its packed rows.
    widths = _pallas_widths(closed)
    assert widths.count((t * k, i)) == fused + (not packs)
    assert ((t * k, 2 * i) in widths) != fused
    assert ((t * k * 16, 128) in widths) == packs
    assert ((t, h) in widths) == packs  # kernel_combine's output
    # [S, H] gathers: the dispatch's rows where the gate/up gmm does not
    # gather them and the combine's where no kernel sums them, past the
    # one-hot routing's range; never rows of either bias (the gate/up gmm
    # adds its bias fused or not).
    routed = 0 if tiling.route_by_matmul(t, bf, bf) else (not gathers) + (not packs)
    text = str(closed)
    assert len(re.findall(rf"\[{t * k},{h}\] = gather", text)) == routed
    assert not re.findall(rf"\[{t * k},{2 * i}\] = gather", text)
    # [S, H] rows a kernel reads: the down gmm's [S, I], and the gate/up
    # gmm's gathered rows where it does not gather them itself.
    inputs = [shape for ins, _ in _pallas_io(closed) for shape in ins]
    assert inputs.count((t * k, h)) == 1 + (not gathers)


@pytest.mark.parametrize(
    "layout, t",
    [(LAYOUTS[0], 520), (LAYOUTS[3], 520), (LAYOUTS[0], 300)],
    ids=["qwen_mixtral", "gemma_like", "one_hot_range"],
)
def test_prefill_inference_gathers_rows_in_the_gate_up_kernel(layout, t):
    """Past the one-launch kernel's limit (300 and 520 tokens here) inference
    hands the hidden states to the gate/up gmm, which fetches each row from
    their packed copy (kernel_pack's, or its own where they stay in VMEM and
    its staging copies fit: tiling's stage_rows) instead of a [T * k, H]
    copy made first: XLA's gather past the one-hot routing's range (520),
    the dispatch matmul in it (300). Training keeps the copy. Both match
    transformers' layer with the bf16 test's bound."""
    e, h, i, k = 4, 256, 128, 2
    args, ref, mag = _bf16_case(layout, e, h, i, t, k, seed=13)
    f = lambda x, *rest: moe_experts(x, *rest, **_kw(layout, e))  # noqa: E731
    one_hot = tiling.route_by_matmul(t, jnp.bfloat16, jnp.bfloat16)
    assert one_hot == (t <= tiling.ROUTE_BY_MATMUL_MAX_TOKENS)
    packed_hidden = (t * pairs.row_words(h), 128)
    cfg = tiling.gmm_config(t * k, h, i, e, jnp.bfloat16, glu=True, gather=True, gather_tokens=t)
    rows = (t, h) if cfg.stage_rows else packed_hidden  # what the gate/up gmm reads

    def gate_up_inputs(closed):
        return [ins for ins, outs in _pallas_io(closed) if outs[0] == (t * k, i)]

    inference = jax.make_jaxpr(f)(*args)
    assert any(rows in ins for ins in gate_up_inputs(inference))
    assert (packed_hidden in _pallas_widths(inference)) == (not cfg.stage_rows)
    copy = f"[{t * k},{h}] = {'dot_general' if one_hot else 'gather'}"
    assert copy not in str(inference)
    training = jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[0])(*args)
    assert not any(rows in ins for ins in gate_up_inputs(training)) and copy in str(training)
    if one_hot:
        # The one-hot dispatch zeroed a non-finite hidden state and restored
        # its token's row as NaN; fetched rows keep it to their own token.
        out = np.asarray(f(*args), np.float32)
        bad = np.asarray(f(args[0].at[3, 5].set(jnp.inf), *args[1:]), np.float32)
        assert not np.isfinite(bad[3]).any()
        rest = np.arange(t) != 3
        np.testing.assert_array_equal(bad[rest], out[rest])
    for what, out in (("inference", f(*args)), ("training", jax.vjp(f, *args)[0])):
        assert out.dtype == jnp.bfloat16
        assert_close(out, ref, dtype=jnp.bfloat16, magnitude=mag, roundings=6, what=what)


@pytest.mark.parametrize("t", [6, 9], ids=["gathers", "one_hot"])
def test_inference_combines_each_tokens_rows_in_the_combine_kernel(t):
    """Whether the layer gathers its rows (6 tokens) or routes them by one-hot
    matmuls (9: tiling.route_by_matmul's range), with blocks given so the
    one-launch kernel stands aside, inference has the down gmm write packed
    rows and kernel_combine sum each token's; training keeps the projection
    (its numerics: the tests above). Inference matches transformers' layer
    with the bf16 test's bound, and a token whose hidden state is not finite
    gets a non-finite row while every other token's row is bit for bit what
    it was (the one-hot dispatch zeroes that state, so the layer restores
    the row as NaN after the combine)."""
    layout = LAYOUTS[0]
    e, h, i, k = 4, 2048, 64, 2
    args, ref, mag = _bf16_case(layout, e, h, i, t, k, seed=12)
    cfg = tiling.MoeConfig(down=tiling.RaggedDotConfig(fwd=tiling.GmmConfig(16, h, 16)))
    f = lambda x, *rest: moe_experts(x, *rest, **_kw(layout, e), config=cfg)  # noqa: E731
    assert tiling.route_by_matmul(t, jnp.bfloat16, jnp.bfloat16) == (t == 9)
    packed = (t * k * h // 256, 128)
    assert packed in _pallas_widths(jax.make_jaxpr(f)(*args))
    training = _pallas_widths(jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[0])(*args))
    assert packed not in training and (t * k, h) in training
    out = f(*args)
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref, dtype=jnp.bfloat16, magnitude=mag, roundings=6, what="inference")
    bad = np.asarray(f(args[0].at[1, 7].set(jnp.inf), *args[1:]), np.float32)
    assert not np.isfinite(bad[1]).any()
    rest = np.arange(t) != 1
    np.testing.assert_array_equal(bad[rest], np.asarray(out, np.float32)[rest])
