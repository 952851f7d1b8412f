"""Shared by the MoE layer tests: transformers experts modules in each model
family's layout, routings, and the per-element bound's magnitudes."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import torch
from transformers.activations import ACT2FN
from transformers.integrations.moe import _default_apply_gate


def gpt_oss_gate(is_concatenated, alpha=1.702, limit=7.0):
    def apply(gate_up):  # transcribed from modeling_gpt_oss / privacy filter
        if is_concatenated:
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return apply


def experts(layout, e, h, i, seed, dtype=torch.float32, expert_parallel=False):
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
        self._apply_gate = gpt_oss_gate(is_conc)
    else:
        self.act_fn = ACT2FN[act]
        self._apply_gate = lambda x: _default_apply_gate(self, x)
    return self, gu.to(dtype), dn.to(dtype), b1, b2


def routing(t, k, e, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    return idx, w


def to_jax(x, dtype=None):
    if x is None:
        return None
    a = jnp.asarray(x.float().numpy())
    return a.astype(dtype) if dtype is not None else a


def layer_kwargs(layout, e, **extra):
    """moe_experts' layout arguments for `layout` (a LAYOUTS row), interpreted."""
    _, has_gate, is_transposed, is_conc, _, act = layout
    return dict(
        num_experts=e,
        has_gate=has_gate,
        is_transposed=is_transposed,
        is_concatenated=is_conc,
        activation=act,
        interpret=True,
        **extra,
    )


# jitted: one program per shape; eager, each of its ops compiled per shape.
@functools.partial(
    jax.jit, static_argnames=("has_gate", "is_transposed", "is_concatenated", "activation")
)
def abs_bound_moe(
    hidden, idx, w, gu, dn, b1, b2, *, has_gate, is_transposed, is_concatenated, activation
):
    """Sum of absolute terms behind each output element, per (token, k) pair in f32.

    |act(gate) * up| <= |gate| |up| for SiLU and GELU, and GPT-OSS's clamped GLU is at
    most (|up| + 1) |gate|: the layer on absolute values with those bounds.
    """
    f = lambda x: None if x is None else jnp.abs(jnp.asarray(x, jnp.float32))  # noqa: E731
    wg, wd = f(gu)[idx], f(dn)[idx]
    eq_up = "th,tkho->tko" if is_transposed else "th,tkoh->tko"
    eq_dn = "tki,tkih->tkh" if is_transposed else "tki,tkhi->tkh"
    p = jnp.einsum(eq_up, f(hidden), wg, precision="highest")
    if b1 is not None:
        p = p + f(b1)[idx]
    if not has_gate:  # up_proj alone: |act(p)| <= |p|, or p^2 for relu2
        a = p * p if activation == "relu2" else p
    else:
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
