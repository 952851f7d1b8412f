"""The MoE glue around the two grouped matmuls: a transformers experts layer as
one jittable JAX program, `experts_program`, parametrised by the matmul (the
kernels in api.moe_experts, jax.lax.ragged_dot in reference.moe_experts_reference).

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

import jax
import jax.numpy as jnp


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
    # Each half is widened where it is used: a widened [S, 2I] would be one
    # more f32 array in HBM (XLA keeps a convert with two consumers unfused).
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if activation == "gpt_oss":
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1.0) * (gate * jax.nn.sigmoid(gate * alpha))
    return _act(activation, gate) * up


def experts_program(
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
    # Projections come out in the weights' dtype, as in transformers; quantized
    # (one-byte) weights compute in the activations' dtype instead.
    dtype = gate_up.dtype if jnp.dtype(gate_up.dtype).itemsize > 1 else hidden.dtype
    ids = top_k_index.reshape(-1).astype(jnp.int32) - jnp.asarray(group_offset, jnp.int32)
    valid = jnp.logical_and(ids >= 0, ids < num_experts)
    key = jnp.where(valid, ids, num_experts)
    order = jnp.argsort(key, stable=True)
    key_sorted = key[order]
    group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)
    group_sizes = group_sizes[:num_experts]
    x = hidden[order // k].astype(dtype)

    proj = matmul(x, gate_up, group_sizes, "up")
    ids_clamped = jnp.minimum(key_sorted, num_experts - 1)
    if gate_up_bias is not None:
        proj = proj + gate_up_bias[ids_clamped].astype(proj.dtype)

    def activate(p):
        if has_gate:
            return _gate(
                p,
                activation=activation,
                is_concatenated=is_concatenated,
                alpha=alpha,
                limit=limit,
            ).astype(dtype)
        return _act(activation, p.astype(jnp.float32)).astype(dtype)

    # Rematerialised in the backward: the gradient keeps the projection (in the
    # weights' dtype) instead of the activation's f32 intermediates.
    act = jax.checkpoint(activate)(proj)
    out = matmul(act, down, group_sizes, "down")
    if down_bias is not None:
        out = out + down_bias[ids_clamped].astype(out.dtype)
    # Combine in (token, slot) order: gather each pair's row of `out` in the
    # weights' dtype, then weight and sum over k in f32 in the same fusion. An
    # f32 [S, H] weighted copy in sorted order, gathered afterwards, costs two
    # more passes over the largest array of the layer (2 ms at 8k-token prefill).
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    rows = jnp.take(out, inv, axis=0, unique_indices=True, mode="clip")
    w = jnp.where(valid, top_k_weights.reshape(-1).astype(jnp.float32), 0.0)
    weighted = jnp.where(valid[:, None], rows.astype(jnp.float32), 0.0) * w[:, None]
    return weighted.reshape(t, k, h).sum(axis=1).astype(hidden.dtype)
