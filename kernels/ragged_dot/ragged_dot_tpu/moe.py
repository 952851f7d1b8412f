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
* Routing by matmul from 8 to 512 tokens (``tiling.route_by_matmul``):
  dispatch = one-hot [S, T] @ hidden, combine = routing-weight matrix
  [T, S] @ rows, instead of two row gathers, which XLA runs as scalar-driven
  copy loops (17.6 us each at 512 tokens on v6e, scheduled by
  bench.xla_fusions) where the matmuls use the MXU. The XLA part of the
  layer, scheduled: v6e 17.6 -> 14.7 us at 8 tokens, 23.5 -> 23.1 at 64,
  92.5 -> 94.5 at 512 (its fusions 91.0 -> 82.6, plus a 16.8 MB async copy
  XLA adds); tpu7x 20.1 -> 20.0, 26.9 -> 22.4, 122.5 -> 87.5. Every product
  has one nonzero term per output element, so both are exact in bf16 with
  f32 accumulation; the f32 routing weights are split into two bf16 terms
  (16 bits of mantissa, vs transformers' f32 product: the output's bf16
  rounding sees a relative change of at most 2^-16). A matmul would let
  0 * inf spread one token's non-finite values to the whole batch, so
  non-finite inputs are zeroed before the products and the elements the
  gather path would make non-finite are set to NaN afterwards
  (``combine_by_matmul``): no token's output depends on another token's
  values.
* Differentiable end to end: the ragged_dots carry custom_vjps, the rest is
  plain JAX (gathers or one-hot matmuls, sort permutation, activation).
* Inference fuses the activation (``matmul_glu``, api.moe_experts_primal):
  without a gradient to take, nothing needs the [S, 2I] projection, so the
  gate/up gmm computes act(gate) * up in its epilogue and writes [S, I]: one
  XLA pass over [S, 2I] and [S, I] fewer, and half the gmm's output bytes
  (8,192 Qwen3 tokens on v6e: 214 us of activation pass gone, the gate/up
  launch 903 -> 835 us by its schedule). GPT-OSS's interleaved gate/up
  columns and bias too (kernel_gmm.deinterleave). Training keeps the
  projection (the backward differentiates the activation from it).
* Inference lets that gmm gather its own rows (``glu_gathers``,
  kernel_gmm's ``gather``): XLA's [T * k, H] gathered copy was written and
  read again, 537 MB at 8,192 Qwen3 tokens; in the one-hot range it takes
  the dispatch matmul's place too (tiling.GATHER_MIN_TOKENS).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import tiling


ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "relu2", "gpt_oss")


def act(name: str, x):
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
    return glu(gate, up, activation=activation, alpha=alpha, limit=limit)


def glu(gate, up, *, activation, alpha, limit):
    """act(gate) * up in f32 from the two projections (also the fused decode
    kernel's, on its chunk of the intermediate dimension)."""
    # Each half is widened where it is used: a widened [S, 2I] would be one
    # more f32 array in HBM (XLA keeps a convert with two consumers unfused).
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if activation == "gpt_oss":
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1.0) * (gate * jax.nn.sigmoid(gate * alpha))
    return act(activation, gate) * up


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
    routing="auto",
    matmul_glu=None,
    down_combine=None,
    glu_gathers=False,
    matmul_down=None,
    matmul_up=None,
):
    """routing: "auto" (tiling.route_by_matmul decides) or "gather" (always
    gathers: the reference's choice). matmul_glu: None, or (x, gate_up,
    group_sizes) -> act(gate + its bias) * (up + its bias) in `dtype`, the
    bias and the activation applied in the matmul's epilogue (the caller has
    checked the layer's gate/up layout and bias allow it); not differentiated. down_combine:
    None, or (activated, down, group_sizes, slots, weights) -> [T, H] in
    hidden's dtype, the down projection and the combine as kernels where the
    layer gathers (slots [T, k]: each token's rows in sorted order; weights
    [T, k], 0 where a slot is not this shard's; the down bias, if any, added
    in the down matmul's epilogue); not differentiated. glu_gathers: matmul_glu takes the
    hidden states and the rows' token ids (gather=) and fetches each row
    itself, in place of a [T * k, H] copy made first (XLA's gather, or in
    the one-hot range the dispatch matmul); the caller has checked
    matmul_glu can: bf16 hidden states, H pairs.packable. matmul_down:
    None, or (activated, down, group_sizes) -> [S, H] in `dtype` with the
    down bias added in the matmul's epilogue, where down_combine is None;
    not differentiated. matmul_up: None, or (x, gate_up, group_sizes) ->
    [S, 2I] in `dtype` with the gate/up bias added in the matmul's epilogue,
    where matmul_glu is None; not differentiated."""
    t, h = hidden.shape
    k = top_k_index.shape[1]
    # Projections come out in the weights' dtype, as in transformers; quantized
    # (one-byte) weights compute in the activations' dtype instead.
    dtype = gate_up.dtype if jnp.dtype(gate_up.dtype).itemsize > 1 else hidden.dtype
    ids = top_k_index.reshape(-1).astype(jnp.int32) - jnp.asarray(group_offset, jnp.int32)
    valid = jnp.logical_and(ids >= 0, ids < num_experts)
    key = jnp.where(valid, ids, num_experts)
    w = jnp.where(valid, top_k_weights.reshape(-1).astype(jnp.float32), 0.0)
    # One stable sort carries the slot ids and routing weights along: no
    # element gathers (XLA runs those as scalar loops).
    key_sorted, order, w_sorted = jax.lax.sort(
        (key, jnp.arange(key.shape[0], dtype=jnp.int32), w), num_keys=1, is_stable=True
    )
    group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)
    group_sizes = group_sizes[:num_experts]
    kernel_gathers = glu_gathers and matmul_glu is not None
    by_matmul = (
        routing == "auto" and not kernel_gathers and tiling.route_by_matmul(t, hidden.dtype, dtype)
    )
    tok_sorted = order // k
    if by_matmul:
        # Non-finite hidden values are zeroed here and restored as NaN at the end.
        finite = jnp.isfinite(hidden)
        onehot = _slots_of(tok_sorted, t).T.astype(dtype)  # [S, T]
        x = _exact_dot(onehot, jnp.where(finite, hidden, 0)).astype(dtype)
        hidden_bad = ~jnp.all(finite, axis=1)
    elif kernel_gathers:
        x = None  # the gate/up gmm fetches each row itself
    else:
        x = hidden[tok_sorted].astype(dtype)

    ids_clamped = jnp.minimum(key_sorted, num_experts - 1)

    def project(x, w, bias, in_epilogue, which):
        """x @ w (+ bias): the bias added in the gmm's epilogue where the
        caller gave one that does (in_epilogue), else each row's gathered and
        added by XLA."""
        if in_epilogue is not None:
            return in_epilogue(x, w, group_sizes)
        y = matmul(x, w, group_sizes, which)
        return y if bias is None else y + bias[ids_clamped].astype(y.dtype)

    def activate(p):
        if has_gate:
            return _gate(
                p,
                activation=activation,
                is_concatenated=is_concatenated,
                alpha=alpha,
                limit=limit,
            ).astype(dtype)
        return act(activation, p.astype(jnp.float32)).astype(dtype)

    if matmul_glu is not None:
        # One pass fewer over [S, 2I] and [S, I]: the projection never leaves VMEM.
        if x is None:
            activated = matmul_glu(hidden, gate_up, group_sizes, gather=tok_sorted)
        else:
            activated = matmul_glu(x, gate_up, group_sizes)
    else:
        proj = project(x, gate_up, gate_up_bias, matmul_up, "up")
        # Rematerialised in the backward: the gradient keeps the projection (in
        # the weights' dtype) instead of the activation's f32 intermediates.
        activated = jax.checkpoint(activate)(proj)
    # The inverse permutation by a second sort, not a scatter: XLA runs an
    # int32 scatter of S = tokens x top_k values as a scalar loop (302 us at
    # 8,192 Qwen3 tokens on v6e, by its own schedule), its sort in 25 us.
    if not by_matmul or down_combine is not None:
        _, inv = jax.lax.sort((order, jnp.arange(order.shape[0], dtype=order.dtype)), num_keys=1)
    if down_combine is not None:
        # Each token's rows fetched where the gmm wrote them (kernel_combine):
        # no [k, T, H] gathered copy, and in the one-hot range no [T, S]
        # products either (512 Qwen3 tokens: v6e 964 -> 943 us, tpu7x 478 -> 464).
        res = down_combine(activated, down, group_sizes, inv.reshape(t, k), w.reshape(t, k))
    else:
        out = project(activated, down, down_bias, matmul_down, "down")
        if not by_matmul:
            return _combine_by_gather(out, inv, valid, w, t, k, h, hidden.dtype)
        res = combine_by_matmul(out, tok_sorted, w_sorted, key_sorted < num_experts, t)
    if by_matmul:
        # A token's output is non-finite where the gather path's would be: the
        # whole row if its hidden state is and one of its slots is local, else
        # the columns where one of its local slots' rows is.
        bad = jnp.logical_and(hidden_bad, valid.reshape(t, k).any(axis=1))
        res = jnp.where(bad[:, None], jnp.nan, res)
    return res.astype(hidden.dtype)


def _combine_by_gather(out, inv, valid, w, t, k, h, dtype):
    # Combine: gather each pair's row of `out` in the weights' dtype, then
    # weight and sum over k in f32 in the same fusion. An f32 [S, H] weighted
    # copy in sorted order, gathered afterwards, costs two more passes over the
    # largest array of the layer (2 ms at 8k-token prefill). The rows are
    # gathered slot-major, [k, T, H], so the sum over k adds whole (8, 128)
    # tiles of tokens: token-major, k sat on the sublanes and every tile took
    # a cross-sublane reduction (the fusion was VALU-bound, 318 us at 8,192
    # Qwen3 tokens on v6e; now 215, its bytes at copy bandwidth).
    inv_km = inv.reshape(t, k).T.reshape(-1)  # slot-major: rows [k, T, H]
    rows = jnp.take(out, inv_km, axis=0, unique_indices=True, mode="clip").reshape(k, t, h)
    valid_km, w_km = valid.reshape(t, k).T, w.reshape(t, k).T
    weighted = jnp.where(valid_km[..., None], rows.astype(jnp.float32), 0.0) * w_km[..., None]
    return weighted.sum(axis=0).astype(dtype)


def _exact_dot(a, b):
    # HIGHEST: f32 operands (the backward's cotangents) would be rounded to bf16
    # by the TPU's default precision (not by the CPU's).
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


def _slots_of(tok_sorted, t):
    return tok_sorted[None, :] == jnp.arange(t, dtype=tok_sorted.dtype)[:, None]  # [T, S]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def combine_by_matmul(out, tok_sorted, w_sorted, valid_sorted, t):
    """[S, H] rows in sorted order -> [T, H] f32: each token's sum over its
    slots of weight x row, as matmuls (see the module notes). w_sorted is 0
    where valid_sorted is False."""
    mine = _slots_of(tok_sorted, t)
    weights = jnp.where(mine, w_sorted[None, :], 0.0)
    hi = weights.astype(out.dtype)
    lo = (weights - hi.astype(jnp.float32)).astype(out.dtype)
    finite = jnp.isfinite(out)
    clean = jnp.where(finite, out, 0)
    res = _exact_dot(hi, clean) + _exact_dot(lo, clean)
    # Count, per output element, the local slots whose row is non-finite there.
    slots = jnp.logical_and(mine, valid_sorted[None, :]).astype(out.dtype)
    nonfinite = _exact_dot(slots, (~finite).astype(out.dtype))
    return jnp.where(nonfinite > 0, jnp.nan, res)


def _combine_fwd(out, tok_sorted, w_sorted, valid_sorted, t):
    return combine_by_matmul(out, tok_sorted, w_sorted, valid_sorted, t), (
        out,
        tok_sorted,
        w_sorted,
        valid_sorted,
    )


def _combine_bwd(t, res, g):
    # The gather path's gradients, with its rounding: each slot's row of the
    # cotangent (a one-hot product, exact), times its weight in f32, rounded
    # once to the rows' dtype; the weight's gradient is the f32 dot of the two.
    out, tok_sorted, w_sorted, valid_sorted = res
    g_rows = _exact_dot(_slots_of(tok_sorted, t).T.astype(jnp.float32), g)  # [S, H]
    d_out = (g_rows * w_sorted[:, None]).astype(out.dtype)
    rows = jnp.where(valid_sorted[:, None], out.astype(jnp.float32), 0.0)
    d_w = jnp.sum(rows * g_rows, axis=1)
    return d_out, None, d_w, None


combine_by_matmul.defvjp(_combine_fwd, _combine_bwd)
