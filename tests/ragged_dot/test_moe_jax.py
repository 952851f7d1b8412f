"""moe_experts (one JAX program per MoE experts layer) vs transformers 5.22.2.

The reference is transformers' own `grouped_mm_experts_forward` run in torch on
the CPU, with a stand-in module carrying the layout flags each model family
declares (Qwen/Mixtral, GPT-OSS, the privacy filter, Nemotron-H). Gradients
are checked against a dense per-(token, k) JAX implementation.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.activations import ACT2FN
from transformers.integrations.moe import _default_apply_gate, grouped_mm_experts_forward

from ragged_dot_tpu.api import moe_experts
from ragged_dot_tpu.reference import tolerance
from tolerances import assert_close

# (name, has_gate, is_transposed, is_concatenated, has_bias, activation)
LAYOUTS = [
    ("qwen_mixtral", True, False, True, False, "silu"),
    ("gpt_oss", True, True, False, True, "gpt_oss"),
    ("privacy_filter", True, True, True, True, "gpt_oss"),
    ("gemma_like", True, False, True, False, "gelu_pytorch_tanh"),
    ("nemotron_h", False, False, True, False, "relu2"),
]


def _gpt_oss_gate(is_concatenated, alpha=1.702, limit=7.0):
    def apply(gate_up):  # transcribed from modeling_gpt_oss / privacy filter
        if is_concatenated:
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return apply


def _experts(layout, e, h, i, seed, dtype=torch.float32, expert_parallel=False):
    _, has_gate, is_transposed, is_conc, has_bias, act = layout
    g = torch.Generator().manual_seed(seed)
    up_out = 2 * i if has_gate else i
    gu = torch.randn((e, h, up_out) if is_transposed else (e, up_out, h), generator=g) * h**-0.5
    dn = torch.randn((e, i, h) if is_transposed else (e, h, i), generator=g) * i**-0.5
    self = types.SimpleNamespace(
        num_experts=e,
        has_gate=has_gate,
        has_bias=has_bias,
        is_transposed=is_transposed,
        _is_expert_parallel=expert_parallel,
        has_post_expert_norm=False,
    )
    setattr(self, "gate_up_proj" if has_gate else "up_proj", gu.to(dtype))
    self.down_proj = dn.to(dtype)
    b1 = b2 = None
    if has_bias:
        b1 = (torch.randn((e, up_out), generator=g) * 0.1).to(dtype)
        b2 = (torch.randn((e, h), generator=g) * 0.1).to(dtype)
        setattr(self, "gate_up_proj_bias" if has_gate else "up_proj_bias", b1)
        self.down_proj_bias = b2
    if act == "gpt_oss":
        self._apply_gate = _gpt_oss_gate(is_conc)
    else:
        self.act_fn = ACT2FN[act]
        self._apply_gate = lambda x: _default_apply_gate(self, x)
    return self, gu.to(dtype), dn.to(dtype), b1, b2


def _routing(t, k, e, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    return idx, w


def _j(x, dtype=None):
    if x is None:
        return None
    a = jnp.asarray(x.float().numpy())
    return a.astype(dtype) if dtype is not None else a


def _kw(layout, e):
    _, has_gate, is_transposed, is_conc, _, act = layout
    return dict(
        num_experts=e,
        has_gate=has_gate,
        is_transposed=is_transposed,
        is_concatenated=is_conc,
        activation=act,
        interpret=True,
    )


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


def _abs_bound_moe(
    hidden, idx, w, gu, dn, b1, b2, *, has_gate, is_transposed, is_concatenated, activation
):
    """Sum of absolute terms behind each output element, per (token, k) pair in f32.

    |act(gate) * up| <= |gate| |up| for SiLU, and GPT-OSS's clamped GLU is at
    most (|up| + 1) |gate|: the layer on absolute values with those bounds.
    """
    f = lambda x: None if x is None else jnp.abs(jnp.asarray(x, jnp.float32))  # noqa: E731
    wg, wd = f(gu)[idx], f(dn)[idx]
    eq_up = "th,tkho->tko" if is_transposed else "th,tkoh->tko"
    eq_dn = "tki,tkih->tkh" if is_transposed else "tki,tkhi->tkh"
    p = jnp.einsum(eq_up, f(hidden), wg, precision="highest")
    if b1 is not None:
        p = p + f(b1)[idx]
    gate, up = (
        (p[..., : p.shape[-1] // 2], p[..., p.shape[-1] // 2 :])
        if is_concatenated
        else (p[..., 0::2], p[..., 1::2])
    )
    a = (up + 1.0) * gate if activation == "gpt_oss" else gate * up
    o = jnp.einsum(eq_dn, a, wd, precision="highest")
    if b2 is not None:
        o = o + f(b2)[idx]
    return (o * f(w)[..., None]).sum(1)


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=[l[0] for l in LAYOUTS[:2]])
def test_matches_transformers_bf16(layout):
    """bf16 layer per element (tests/tolerances.py) against transformers' layer in
    f32 on the same bf16-rounded weights and inputs. Both round the projections,
    the activation and the down projection to bf16 in the kernel path: each
    rounding costs at most u times the absolute terms it feeds."""
    e, h, i, t, k = 8, 128, 64, 9, 3
    self, gu, dn, b1, b2 = _experts(layout, e, h, i, seed=4, dtype=torch.bfloat16)
    idx, w = _routing(t, k, e, seed=5)
    hid = torch.randn(t, h, generator=torch.Generator().manual_seed(6)).bfloat16()
    w16 = w.bfloat16()
    ref_self, *_ = _experts(layout, e, h, i, seed=4, dtype=torch.bfloat16)
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        if hasattr(ref_self, name):
            setattr(ref_self, name, getattr(ref_self, name).float())
    ref = grouped_mm_experts_forward(ref_self, hid.float(), idx, w16.float()).numpy()
    bf = jnp.bfloat16
    out = moe_experts(
        _j(hid, bf),
        _j(idx).astype(jnp.int32),
        _j(w16, bf),
        _j(gu, bf),
        _j(dn, bf),
        _j(b1, bf),
        _j(b2, bf),
        **_kw(layout, e),
    )
    assert out.dtype == bf
    _, has_gate, is_transposed, is_conc, _, act = layout
    mag = _abs_bound_moe(
        _j(hid),
        _j(idx).astype(jnp.int32),
        _j(w16),
        _j(gu),
        _j(dn),
        _j(b1),
        _j(b2),
        has_gate=has_gate,
        is_transposed=is_transposed,
        is_concatenated=is_conc,
        activation=act,
    )
    assert_close(out, ref, dtype=bf, magnitude=mag, roundings=6, what="out")


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
