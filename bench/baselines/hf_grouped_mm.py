"""transformers' default `grouped_mm` experts path, as TorchTPU runs it.

transformers 5.22.2 `integrations/moe.py::grouped_mm_experts_forward` (the
default `experts_implementation` of Qwen3-MoE, Mixtral, Gemma 4, GPT-OSS, ...)
does, for hidden states [T, H], top_k_index / top_k_weights [T, k]:

    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
    selected = hidden_states[perm // k]                       # gather [S, H]
    sample_weights_g = top_k_weights.reshape(-1)[perm]
    tokens_per_expert = torch.histc(expert_ids_g.int(), bins=E, min=0, max=E-1)
    offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    h = torch._grouped_mm(selected, gate_up_proj.transpose(-2, -1), offs=offsets)
    h = act_fn(gate) * up            # gate, up = h.chunk(2, -1)   (_apply_gate)
    y = torch._grouped_mm(h, down_proj.transpose(-2, -1), offs=offsets)
    y = y * sample_weights_g[:, None]
    inv_perm[perm] = arange(S); y = y[inv_perm]               # scatter, gather
    out = y.view(T, k, H).sum(1).to(hidden_states.dtype)

(`is_transposed=False` models — Qwen3-MoE, Mixtral, Gemma 4 — store
gate_up_proj as [E, 2I, H] and down_proj as [E, H, I] and pass a transposed
view; GPT-OSS (`is_transposed=True`) stores [E, in, out] and passes it as is.)

TorchTPU 0.2.0 lowers `aten::_grouped_mm` (C++ `BuildGroupedMmShlo`, in
`libpywrap_*_common.so`) to `chlo.ragged_dot(lhs, rhs, group_sizes)`; the
transposed view reaches it as a `stablehlo.transpose` of the stored weight.
`jax.lax.ragged_dot` lowers on TPU to the same `chlo.ragged_dot` (default
dimension numbers: lhs [M, K] ragged on M, rhs [G, K, N] grouped on G), so the
program below is the same op sequence with the same operand layouts. What
could not be read from TorchTPU's binary and is a stated choice here:
offsets -> group sizes is `diff(offsets)`; `histc` of ints is a scatter-add
count (what `jnp.bincount` emits); indices are int32 (torch's are int64,
which XLA TPU emulates with pairs of 32-bit words: our indices are cheaper);
the activation runs in f32 and rounds to the weights' dtype, as torch's bf16
SiLU does. The program is the `torch.compile` form (one XLA program); TorchTPU
eager runs each aten op as its own executable, which only adds launches and
HBM round trips.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_sizes_from_offsets(offsets):
  """`torch._grouped_mm` offsets (inclusive cumsum) -> ragged_dot sizes."""
  return jnp.diff(offsets, prepend=jnp.zeros((1,), offsets.dtype))


def grouped_mm(inp, weight, offsets):
  """`torch._grouped_mm(inp [S, K], weight [G, K, N], offs=offsets)` on TPU."""
  return jax.lax.ragged_dot(inp.astype(weight.dtype), weight,
                            group_sizes_from_offsets(offsets))


def silu_gate(h, act=jax.nn.silu):
  """`_default_apply_gate`: gate, up = h.chunk(2, -1); act(gate) * up, each
  torch op rounding to h's dtype."""
  gate, up = jnp.split(h, 2, axis=-1)
  g = act(gate.astype(jnp.float32)).astype(h.dtype)
  return (g.astype(jnp.float32) * up.astype(jnp.float32)).astype(h.dtype)


def experts_forward(hidden_states, gate_up_proj, down_proj, top_k_index,
                    top_k_weights, *, is_transposed: bool = False,
                    apply_gate=silu_gate):
  """transformers' `grouped_mm_experts_forward` (no bias, gated, no EP).

  Weights in transformers' storage layout: [E, 2I, H] and [E, H, I] when
  `is_transposed` is False (Qwen3-MoE, Mixtral, Gemma 4), [E, H, 2I] and
  [E, I, H] when True (GPT-OSS).
  """
  num_tokens, hidden_dim = hidden_states.shape
  num_top_k = top_k_index.shape[-1]
  num_experts = gate_up_proj.shape[0]

  sample_weights = top_k_weights.reshape(-1)
  expert_ids = top_k_index.reshape(-1).astype(jnp.int32)
  s = expert_ids.shape[0]

  # torch.sort(expert_ids): values and the permutation (not stable).
  expert_ids_g, perm = jax.lax.sort(
      (expert_ids, jnp.arange(s, dtype=jnp.int32)), num_keys=1,
      is_stable=False)
  selected_hidden_states_g = hidden_states[perm // num_top_k]
  sample_weights_g = sample_weights[perm]

  # histc(int ids, bins=E, min=0, max=E-1), then cumsum(dtype=int32).
  tokens_per_expert = jnp.zeros((num_experts,), jnp.int32).at[expert_ids_g].add(
      1, mode="drop")
  offsets = jnp.cumsum(tokens_per_expert, dtype=jnp.int32)

  def linear(inp, weight):  # _grouped_linear
    if is_transposed:
      return grouped_mm(inp, weight, offsets)
    return grouped_mm(inp, jnp.swapaxes(weight, -2, -1), offsets)

  proj_out = linear(selected_hidden_states_g, gate_up_proj)
  proj_out = apply_gate(proj_out)
  proj_out = linear(proj_out, down_proj)

  weighted_out = proj_out * sample_weights_g[:, None]
  inv_perm = jnp.zeros_like(perm).at[perm].set(jnp.arange(s, dtype=perm.dtype))
  weighted_out = weighted_out[inv_perm]
  final = weighted_out.reshape(num_tokens, num_top_k, hidden_dim).sum(axis=1)
  return final.astype(hidden_states.dtype)


def bench_program(is_transposed: bool = False):
  """The experts layer on the bench's inputs (x, w_gate_up [E, H, 2I],
  w_down [E, I, H], ids, weights) with transformers' operand layouts.

  For `is_transposed=False` models the weight buffers are read as
  transformers' storage: w_gate_up's bytes as [E, 2I, H] and w_down's as
  [E, H, I] (a reshape of a row-major array: free, no data moves), which the
  program then passes as `.transpose(-2, -1)` views, exactly as transformers
  does. So the compiled program has transformers' parameter layouts; the
  layer it computes is the one whose weights are
  `swapaxes(w.reshape(E, out, in), -2, -1)` (what `storage_weights` returns),
  which the numerics test checks. (Transposing the bench's [E, in, out]
  arrays instead would let XLA cancel the two transposes and hide the
  layout transformers actually hands the compiler.)
  """

  def fn(x, w_gate_up, w_down, ids, weights):
    gu, d = w_gate_up, w_down
    if not is_transposed:
      e, h, n2 = w_gate_up.shape
      _, i, _ = w_down.shape
      gu = w_gate_up.reshape(e, n2, h)
      d = w_down.reshape(e, h, i)
    return experts_forward(x, gu, d, ids, weights, is_transposed=is_transposed)

  return fn


def storage_weights(w_gate_up, w_down, is_transposed: bool = False):
  """The [E, in, out] weights of the layer `bench_program` computes from the
  bench's buffers (for checking it against a reference)."""
  if is_transposed:
    return w_gate_up, w_down
  e, h, n2 = w_gate_up.shape
  _, i, _ = w_down.shape
  return (jnp.swapaxes(w_gate_up.reshape(e, n2, h), -2, -1),
          jnp.swapaxes(w_down.reshape(e, h, i), -2, -1))
