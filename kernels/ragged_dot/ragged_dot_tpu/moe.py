"""A transformers MoE experts layer as one jittable JAX program.

Mirrors transformers' ``grouped_mm_experts_forward`` (integrations/moe.py):
sort the (token, k) pairs by expert, count rows per expert, gather, up/gate
projection, activation, down projection, routing weights, unpermute, sum over
k in f32, cast to the hidden dtype.

Why it looks like this
----------------------
* Weights are used in the layout the model stores them: torch Linear layout
  ([E, out, in], ``is_transposed=False``) goes to ragged_dot with
  ``transpose_rhs=True`` so no transposed copy of the expert weights is ever
  made; ``is_transposed=True`` ([E, in, out]) is used directly.
* Rounding points follow transformers: both projections come out in the
  weights' dtype, the activation is evaluated in f32 and rounded once, and the
  routing weights multiply and sum over k in f32.
* Expert parallelism: ids are shifted by ``group_offset``; pairs whose local
  id falls outside [0, num_experts) are sentinels. They sort to the tail,
  are not counted in ``group_sizes`` (so the kernels never compute or fetch
  anything for them; their rows come out zero), and are masked out of the
  output and of the router-weight gradient, as transformers does.
* Differentiable end to end: the ragged_dots carry custom_vjps, the rest is
  plain JAX (gathers, sort permutation, activation).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import checks
from . import reference
from .api import ragged_dot

ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "relu2", "gpt_oss")


def _act(name: str, x):
    if name in ("silu", "swish"):
        return jax.nn.silu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return jax.nn.gelu(x, approximate=True)
    if name == "relu":
        return jax.nn.relu(x)
    if name == "relu2":
        return jnp.square(jax.nn.relu(x))
    raise ValueError(f"activation: expected one of {list(ACTIVATIONS)}, got {name!r}")


def _gate(h, *, activation, is_concatenated, alpha, limit):
    """[S, 2I] -> [S, I]: act(gate) * up, or GPT-OSS's clamped GLU."""
    if is_concatenated:
        gate, up = jnp.split(h, 2, axis=-1)
    else:
        gate, up = h[:, 0::2], h[:, 1::2]
    if activation == "gpt_oss":
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1.0) * (gate * jax.nn.sigmoid(gate * alpha))
    return _act(activation, gate) * up


def _check(
    hidden,
    top_k_index,
    top_k_weights,
    gate_up,
    down,
    gate_up_bias,
    down_bias,
    num_experts,
    has_gate,
    is_transposed,
    activation,
):
    if hidden.ndim != 2:
        raise ValueError(f"hidden: expected [T, H], got shape {tuple(hidden.shape)}")
    checks.check_dtype("hidden.dtype", hidden.dtype)
    t, h = hidden.shape
    if top_k_index.ndim != 2 or top_k_index.shape[0] != t:
        raise ValueError(f"top_k_index: expected [T={t}, k], got shape {tuple(top_k_index.shape)}")
    if not jnp.issubdtype(top_k_index.dtype, jnp.integer):
        raise ValueError(f"top_k_index: expected integers, got {top_k_index.dtype}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_weights: expected shape {tuple(top_k_index.shape)}, got"
            f" {tuple(top_k_weights.shape)}"
        )
    if gate_up.ndim != 3 or down.ndim != 3:
        raise ValueError(
            f"gate_up/down: expected 3-D expert weights, got {tuple(gate_up.shape)}"
            f" and {tuple(down.shape)}"
        )
    if gate_up.shape[0] != num_experts or down.shape[0] != num_experts:
        raise ValueError(
            f"gate_up/down: expected {num_experts} experts (num_experts), got"
            f" {gate_up.shape[0]} and {down.shape[0]}"
        )
    up_in, up_out = gate_up.shape[1:] if is_transposed else gate_up.shape[:0:-1]
    dn_in, dn_out = down.shape[1:] if is_transposed else down.shape[:0:-1]
    if up_in != h:
        raise ValueError(
            f"gate_up: expected input dim H={h} (is_transposed={is_transposed}),"
            f" got shape {tuple(gate_up.shape)}"
        )
    inter = up_out // 2 if has_gate else up_out
    if has_gate and up_out % 2:
        raise ValueError(f"gate_up: expected an even gate+up dim, got {up_out}")
    if dn_in != inter or dn_out != h:
        raise ValueError(
            f"down: expected [E, {inter}, {h}] (is_transposed) or [E, {h}, {inter}],"
            f" got shape {tuple(down.shape)}"
        )
    if activation == "gpt_oss" and not has_gate:
        raise ValueError("activation: 'gpt_oss' is a gated activation; has_gate=False")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(ACTIVATIONS)}, got {activation!r}")
    for name, b, dim in (("gate_up_bias", gate_up_bias, up_out), ("down_bias", down_bias, h)):
        if b is not None and tuple(b.shape) != (num_experts, dim):
            raise ValueError(f"{name}: expected shape ({num_experts}, {dim}), got {tuple(b.shape)}")


@functools.partial(
    jax.jit,
    static_argnames=(
        "num_experts",
        "has_gate",
        "is_transposed",
        "is_concatenated",
        "activation",
        "alpha",
        "limit",
        "config",
        "interpret",
    ),
)
def moe_experts(
    hidden,
    top_k_index,
    top_k_weights,
    gate_up,
    down,
    gate_up_bias=None,
    down_bias=None,
    *,
    num_experts: int,
    has_gate: bool = True,
    is_transposed: bool = False,
    is_concatenated: bool = True,
    activation: str = "silu",
    group_offset=0,
    alpha: float = 1.702,
    limit: float = 7.0,
    config=None,
    interpret=False,
):
    """Fused MoE experts: [T, H] hidden -> [T, H] in hidden.dtype.

    Args:
      hidden: [T, H]. top_k_index: [T, k] expert ids. top_k_weights: [T, k].
      gate_up: [E, 2I, H] (or [E, H, 2I] if is_transposed); [E, I, H] / [E, H, I]
        when has_gate is False (up_proj only).
      down: [E, H, I] (or [E, I, H] if is_transposed).
      gate_up_bias: [E, 2I] or None. down_bias: [E, H] or None.
      num_experts: experts held here (E). group_offset: id of the first one;
        ids outside [group_offset, group_offset + E) are ignored.
      is_concatenated: gate/up halves ([gate; up]) vs interleaved (GPT-OSS).
      activation: "silu", "gelu", "gelu_pytorch_tanh", "relu", "relu2" or
        "gpt_oss" (clamped GLU with alpha/limit).
      config: None or a generation name (blocks picked per projection), or a
        pair (gate_up RaggedDotConfig, down RaggedDotConfig).
      interpret: run the kernels in interpret mode.
    """
    _check(
        hidden,
        top_k_index,
        top_k_weights,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        num_experts,
        has_gate,
        is_transposed,
        activation,
    )
    if isinstance(config, tuple):
        up_config, down_config = config
    else:
        up_config = down_config = config

    def matmul(x, w, group_sizes, which):
        return ragged_dot(
            x,
            w,
            group_sizes,
            transpose_rhs=not is_transposed,
            config=up_config if which == "up" else down_config,
            interpret=interpret,
        )

    return _experts_program(
        hidden,
        top_k_index,
        top_k_weights,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        matmul=matmul,
        num_experts=num_experts,
        has_gate=has_gate,
        is_concatenated=is_concatenated,
        activation=activation,
        group_offset=group_offset,
        alpha=alpha,
        limit=limit,
    )


def moe_experts_reference(
    hidden,
    top_k_index,
    top_k_weights,
    gate_up,
    down,
    gate_up_bias,
    down_bias,
    num_experts,
    has_gate,
    is_transposed,
    is_concatenated,
    activation,
    group_offset,
    alpha,
    limit,
):
    """moe_experts on jax.lax.ragged_dot (f32, HIGHEST), positional arguments.

    Same routing, rounding points and sentinel handling as moe_experts; the
    expert matmuls are reference.ragged_dot_reference. Tolerances: reference.py.
    """
    _check(
        hidden,
        top_k_index,
        top_k_weights,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        num_experts,
        has_gate,
        is_transposed,
        activation,
    )

    def matmul(x, w, group_sizes, which):
        del which
        if not is_transposed:
            w = jnp.swapaxes(w, 1, 2)
        return reference.ragged_dot_reference(x, w, group_sizes, preferred_element_type=x.dtype)

    return _experts_program(
        hidden,
        top_k_index,
        top_k_weights,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        matmul=matmul,
        num_experts=num_experts,
        has_gate=has_gate,
        is_concatenated=is_concatenated,
        activation=activation,
        group_offset=group_offset,
        alpha=alpha,
        limit=limit,
    )


def _experts_program(
    hidden,
    top_k_index,
    top_k_weights,
    gate_up,
    down,
    gate_up_bias,
    down_bias,
    *,
    matmul,
    num_experts,
    has_gate,
    is_concatenated,
    activation,
    group_offset,
    alpha,
    limit,
):
    t, h = hidden.shape
    k = top_k_index.shape[1]
    dtype = gate_up.dtype
    ids = top_k_index.reshape(-1).astype(jnp.int32) - jnp.asarray(group_offset, jnp.int32)
    valid = jnp.logical_and(ids >= 0, ids < num_experts)
    key = jnp.where(valid, ids, num_experts)
    order = jnp.argsort(key, stable=True)
    key_sorted = key[order]
    valid_sorted = key_sorted < num_experts
    group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)
    group_sizes = group_sizes[:num_experts]
    x = hidden[order // k].astype(dtype)

    proj = matmul(x, gate_up, group_sizes, "up")
    ids_clamped = jnp.minimum(key_sorted, num_experts - 1)
    if gate_up_bias is not None:
        proj = proj + gate_up_bias[ids_clamped].astype(proj.dtype)
    p32 = proj.astype(jnp.float32)
    if has_gate:
        act = _gate(
            p32, activation=activation, is_concatenated=is_concatenated, alpha=alpha, limit=limit
        )
    else:
        act = _act(activation, p32)
    out = matmul(act.astype(dtype), down, group_sizes, "down")
    if down_bias is not None:
        out = out + down_bias[ids_clamped].astype(out.dtype)
    w = top_k_weights.reshape(-1)[order].astype(jnp.float32)
    w = jnp.where(valid_sorted, w, 0.0)
    weighted = jnp.where(valid_sorted[:, None], out.astype(jnp.float32), 0.0)
    weighted = weighted * w[:, None]
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    final = weighted[inv].reshape(t, k, h).sum(axis=1)
    return final.astype(hidden.dtype)
