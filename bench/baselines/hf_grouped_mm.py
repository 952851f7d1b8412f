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

TorchTPU 0.2.0 lowers `aten::_grouped_mm` in C++ (`BuildGroupedMmShlo` in
`csrc/common/glue_*/libpywrap_*_common.so`, which calls
`mlir::chlo::RaggedDot(type, lhs, rhs, group_sizes, dnums, precision)`).
`jax.lax.ragged_dot` lowers on TPU to the same `chlo.ragged_dot` with the
default dimension numbers (lhs [M, K] ragged on M, rhs [G, K, N] grouped on
G, contracting K), the only ones that fit a 2D x 3D grouped_mm, so the
program below is the same op sequence. Not readable from the binary without a
TPU, hence stated choices: the `.transpose(-2, -1)` view reaches XLA as a
`stablehlo.transpose` of the weight as stored (row-major [E, 2I, H]), and XLA
TPU then transposes both expert weight tensors on every call (its cost
analysis: +2.4 GB of HBM traffic per call at Qwen3-30B-A3B, 808 MB of temp);
offsets -> group sizes is `diff(offsets)`; `histc` of ints is a scatter-add
count (what `jnp.bincount` emits); indices are int32 (torch's are int64,
which XLA TPU emulates with pairs of 32-bit words: ours are cheaper); the
activation runs in f32 and rounds to the weights' dtype, as torch's bf16 SiLU
does. The program is the `torch.compile` form (one XLA program); TorchTPU
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
    return jax.lax.ragged_dot(inp.astype(weight.dtype), weight, group_sizes_from_offsets(offsets))


def silu_gate(h, act=jax.nn.silu):
    """`_default_apply_gate`: gate, up = h.chunk(2, -1); act(gate) * up, each
    torch op rounding to h's dtype."""
    gate, up = jnp.split(h, 2, axis=-1)
    g = act(gate.astype(jnp.float32)).astype(h.dtype)
    return (g.astype(jnp.float32) * up.astype(jnp.float32)).astype(h.dtype)


def experts_forward(
    hidden_states,
    gate_up_proj,
    down_proj,
    top_k_index,
    top_k_weights,
    *,
    is_transposed: bool = False,
    apply_gate=silu_gate,
):
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
        (expert_ids, jnp.arange(s, dtype=jnp.int32)), num_keys=1, is_stable=False
    )
    selected_hidden_states_g = hidden_states[perm // num_top_k]
    sample_weights_g = sample_weights[perm]

    # histc(int ids, bins=E, min=0, max=E-1), then cumsum(dtype=int32).
    tokens_per_expert = jnp.zeros((num_experts,), jnp.int32).at[expert_ids_g].add(1, mode="drop")
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


def _storage(a, perm):
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(tuple(a.shape[p] for p in perm), a.dtype)
    return jnp.transpose(a, perm)


def storage_args(x, w_gate_up, w_down, ids, weights, is_transposed: bool = False):
    """The bench's inputs (weights [E, in, out]) as transformers holds them:
    for `is_transposed=False` models gate_up_proj [E, 2I, H] and down_proj
    [E, H, I] (the same layer). Works on ShapeDtypeStructs (the program's
    parameter shapes for tracing and compiling) and on arrays."""
    if not is_transposed:
        w_gate_up, w_down = _storage(w_gate_up, (0, 2, 1)), _storage(w_down, (0, 2, 1))
    return x, w_gate_up, w_down, ids, weights


def bench_program(is_transposed: bool = False):
    """fn(x, gate_up_proj, down_proj, top_k_index, top_k_weights) with the
    weights in transformers' storage layout (`storage_args`): the compiled
    program's weight parameters are then transformers' arrays, and the
    `.transpose(-2, -1)` views are real transposes for XLA to deal with. (Giving
    it the bench's [E, in, out] arrays and transposing twice would let XLA
    cancel both; reshaping them to transformers' shape is not free on TPU,
    whose tiled layouts make that reshape a copy.)"""

    def fn(x, gate_up_proj, down_proj, ids, weights):
        if not is_transposed and gate_up_proj.shape[-1] != x.shape[-1]:
            raise ValueError(
                "hf_grouped_mm takes transformers' weight layout (gate_up_proj "
                f"[E, 2I, H], H={x.shape[-1]}), got {gate_up_proj.shape}: pass the "
                "point's arguments through bench.registry.program_args(built, args)"
            )
        return experts_forward(
            x, gate_up_proj, down_proj, ids, weights, is_transposed=is_transposed
        )

    return fn
