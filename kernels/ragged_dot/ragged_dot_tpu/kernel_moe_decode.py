"""A whole MoE experts layer at decode batch sizes as one Pallas TPU launch.

out[t] = sum over t's slots (t, j) of w[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])),
e = top_k_index[t, j], the layer ``moe.experts_program`` computes with two gmm
launches and XLA routing around them.

Why this design
---------------
At a few tokens the layer costs its active experts' weights, read once, plus
fixed costs; the two-launch program adds a sort, a histogram, row gathers and
a combine that XLA runs as ~20 small fusions, each waiting on its own DMAs
(14 us on v6e and 21 on tpu7x at one Qwen3 token, by their schedules), and a
second launch's prologue and epilogue. Here:

* No routing ops at all. top_k_index is scalar-prefetched; the kernel walks
  it once on the scalar unit, listing each local expert the first time a slot
  names it, and issues that expert's weight DMAs while the walk goes on.
* Every token is computed against each active expert and the expert's
  result is masked into the f32 accumulator with the token's routing weight
  (tokens that did not pick it are masked out, never multiplied by zero: their
  rows may be non-finite). Nothing is gathered, sorted or scattered. The MXU
  work this adds (all tokens instead of the expert's own) stays under the
  expert's weight DMA up to ``tiling.fused_moe_max_tokens`` (~270 tokens for
  Qwen3 on v6e, ~100 for its TP-8 shard); at a few tokens the pass is one
  sublane tile either way.
* One weight stream, item (expert a, slice c) = the gate and up rows and the
  down columns of a block_i-wide slice of the intermediate dimension, through
  ``buffers`` VMEM slots with all but one in flight (the gmm kernel's ring).
  A slice's down product adds into an f32 [T, H] partial that is rounded to
  the weights' dtype after the expert's last slice: the rounding points of
  ``experts_program`` (projections in the weights' dtype, the activation in
  f32 rounded once, routing weights and the sum over slots in f32).
* Weights stay where the model keeps them: torch Linear layout ([E, 2I, H],
  [E, H, I]) contracts on the last axis, the transposed one ([E, H, 2I],
  [E, I, H]) on the first, each weight taken in the orientation XLA stores
  it in (a [128, 2048, 96] TP-8 shard lives as [128, 96, 2048]): nothing is
  transposed or copied in HBM.

* The small inputs (hidden states, ids, routing weights) are copied by hand,
  queued ahead of the first weights, so no DMA latency passes before the
  weight stream starts; only the scalar-prefetched ids are waited for.

* int8 / float8_e4m3fn weights with per-output-channel scales (weight-only)
  stream their one-byte elements; each slice is widened to bf16 in VMEM and
  the slice's scales (DMA'd beside it) multiply the f32 products, as in gmm.
  MXFP4 weights (mxfp4's kernel layout, whole experts per item) stream their
  4-bit bytes and e8m0 scale rows and are decoded on the VPU piece by piece
  of columns (mxfp4.decode_pairs), as gmm decodes them; only the active
  experts' scales move, where two launches let XLA copy every expert's.

* GPT-OSS's layer: gate and up columns interleaved (an item's slice of I
  is one run of 2 x block_i columns, its product deinterleaved by an XLU
  lane gather, kernel_gmm.deinterleave) and a bias on each projection (the
  slice's gate/up bias and the expert's down bias DMA'd beside its weights,
  each added to its projection rounded to bf16, as experts_program adds
  them). Its I = 2880 has no multiple of 128 below it that divides it: bf16
  streams 192-column slices (its [E, I, H] down sliced on rows), MXFP4
  whole experts. At one token on v6e the layer went 174.9 -> 150.8 us
  (bf16) and 150.2 -> 118.7 (MXFP4): no routing ops, one launch's prologue.

What it does not carry (``tiling.fused_moe_config`` says None and the layer
runs as two gmm launches): more tokens, f32 weights, 128 x 128 block scales,
gate/up halves, scales or biases that would not start on a lane tile. The
backward is the two-launch program's (``api``), recomputed from the inputs:
decode does not differentiate, and a training step at these sizes pays one
more forward.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from . import kernel_gmm, moe, mxfp4, tiling


def _kernel(
    ids_smem,
    goff_smem,
    x_hbm,
    ids_hbm,
    w_hbm,
    gu_hbm,
    dn_hbm,
    *rest,
    tokens,
    top_k,
    num_experts,
    inter,
    block_i,
    buffers,
    has_gate,
    gu_transposed,
    dn_transposed,
    quantized,
    mx,
    interleaved,
    gu_bias,
    dn_bias,
    activation,
    alpha,
    limit,
):
    gs_hbm = ds_hbm = gub_hbm = dnb_hbm = None
    if quantized:
        gs_hbm, ds_hbm, *rest = rest
    if gu_bias:
        gub_hbm, *rest = rest
    if dn_bias:
        dnb_hbm, *rest = rest
    out_ref, gbuf, dbuf, sem, seen, active, acc_ref, x_ref, ids_ref, w_ref, in_sem, *rest = rest
    if quantized:
        gsbuf, dsbuf, *rest = rest
    if gu_bias:
        gubuf, *rest = rest
    if dn_bias:
        dnbuf, *rest = rest
    (yacc_ref,) = rest if rest else (None,)
    n_chunks = inter // block_i
    # Interleaved gate/up columns: a slice of I is one run of 2 * block_i
    # columns (gate and up alternating), copied and multiplied as one.
    n_proj = 2 if has_gate and not interleaved else 1
    width = 2 * block_i if interleaved else block_i
    goff = goff_smem[0]
    dtype = x_ref.dtype  # quantized weights are widened to the activations' dtype

    def copies(a, c, slot):
        e = active[a]
        col = c * block_i if n_chunks > 1 else 0
        if n_chunks > 1:
            # Interleaved slices start at 2 * col on a lane tile, down's rows
            # ([E, I, H]) on a sublane tile; lanes of halves, scales, biases
            # and down's [E, H, I] on a lane tile.
            col = pl.multiple_of(col, tiling.fused_moe_block_multiple(interleaved, dn_transposed))
        dmas = []
        for p in range(n_proj):
            if n_chunks > 1:
                start = pl.multiple_of(2 * col if interleaved else p * inter + col, 128)
            else:
                start = p * inter  # static: Mosaic proves the tile alignment itself
            if n_proj == 1 and n_chunks == 1:
                src = gu_hbm.at[e]
            elif gu_transposed:  # [E, H, 2I]
                src = gu_hbm.at[e, :, pl.ds(start, width)]
            else:  # [E, 2I, H]
                src = gu_hbm.at[e, pl.ds(start, width), :]
            dmas.append(pltpu.make_async_copy(src, gbuf.at[slot, p], sem.at[slot, p]))
            if mx:  # the slice's e8m0 scale rows, [S(H), width]
                src = gs_hbm.at[e] if n_proj == 1 else gs_hbm.at[e, :, pl.ds(start, width)]
                dmas.append(pltpu.make_async_copy(src, gsbuf.at[slot, p], sem.at[slot, 3 + p]))
            elif quantized:  # this slice's output-channel scales (I % 128 == 0 here)
                src = gs_hbm.at[pl.ds(e, 1), pl.ds(start, width)]
                dmas.append(pltpu.make_async_copy(src, gsbuf.at[slot, p], sem.at[slot, 3 + p]))
            if gu_bias:  # the slice's bias, [1, width] f32
                if n_proj == 1 and n_chunks == 1:
                    src = gub_hbm.at[pl.ds(e, 1)]
                else:
                    src = gub_hbm.at[pl.ds(e, 1), pl.ds(start, width)]
                dmas.append(pltpu.make_async_copy(src, gubuf.at[slot, p], sem.at[slot, 6 + p]))
        if n_chunks == 1:
            # The whole expert, not a slice of its lanes: a lane slice would make
            # XLA copy every expert's weights to another HBM layout first when I
            # is not a multiple of 128 (Qwen3 TP-8: [128, 2048, 96]).
            src = dn_hbm.at[e]
        elif dn_transposed:  # [E, I, H]
            src = dn_hbm.at[e, pl.ds(col, block_i), :]
        else:  # [E, H, I]
            src = dn_hbm.at[e, :, pl.ds(col, block_i)]
        dmas.append(pltpu.make_async_copy(src, dbuf.at[slot], sem.at[slot, 2]))
        if quantized:
            src = ds_hbm.at[e] if mx else ds_hbm.at[pl.ds(e, 1)]
            dmas.append(pltpu.make_async_copy(src, dsbuf.at[slot], sem.at[slot, 5]))
        if dn_bias:  # the expert's down bias, [1, H] f32, beside each of its slices
            src = dnb_hbm.at[pl.ds(e, 1)]
            dmas.append(pltpu.make_async_copy(src, dnbuf.at[slot], sem.at[slot, 8]))
        return dmas

    def start_item(q):
        a = lax.div(q, n_chunks)
        for dma in copies(a, q - a * n_chunks, lax.rem(q, buffers)):
            dma.start()

    # The small inputs are copied by hand, queued ahead of the weights and
    # waited for only before the first product: as BlockSpec operands the body
    # (and so every weight DMA) would wait for them, a whole DMA latency.
    inputs = [
        pltpu.make_async_copy(src, dst, in_sem.at[i])
        for i, (src, dst) in enumerate(((x_hbm, x_ref), (ids_hbm, ids_ref), (w_hbm, w_ref)))
    ]
    for dma in inputs:
        dma.start()

    # The active list: each local expert once, in the order the slots first
    # name it. An expert's items that fit the ring are started as soon as it
    # is found, so its weights move while the walk goes on.
    def clear(e, carry):
        seen[e] = 0
        return carry

    lax.fori_loop(0, num_experts, clear, 0, unroll=8 if num_experts % 8 == 0 else 1)

    def walk(t, count):
        for j in range(top_k):
            e = ids_smem[t, j] - goff
            ec = jnp.clip(e, 0, num_experts - 1)
            new = jnp.logical_and(jnp.logical_and(e >= 0, e < num_experts), seen[ec] == 0)

            @pl.when(new)
            def _(count=count, ec=ec):
                seen[ec] = 1
                active[count] = ec
                for c in range(n_chunks):
                    q = count * n_chunks + c

                    @pl.when(q < buffers - 1)
                    def _(q=q):
                        start_item(q)

            count = count + new.astype(jnp.int32)
        return count

    n_active = lax.fori_loop(0, tokens, walk, jnp.int32(0))
    for dma in inputs:
        dma.wait()
    total = n_active * n_chunks
    acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)
    x = x_ref[...].astype(dtype)

    def dot(lhs, w, contract_w):
        dims = (((1,), (contract_w,)), ((), ()))
        return lax.dot_general(lhs, w, dims, preferred_element_type=jnp.float32)

    def mx_dot(lhs, w_ref, s_ref):
        """lhs @ the FP4 weights w_ref [K/2, N] with e8m0 scales s_ref [S, N],
        decoded piece by piece of columns (mxfp4.decode_pairs, as gmm does)."""
        n = w_ref.shape[1]
        outs = []
        for c0 in range(0, n, tiling.MXFP4_PIECE):
            width = min(tiling.MXFP4_PIECE, n - c0)
            b = w_ref[:, pl.ds(c0, width)].astype(jnp.int32)
            w = mxfp4.decode_pairs(b, s_ref[:, pl.ds(c0, width)])
            outs.append(dot(lhs, w.astype(dtype), 0))
        return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)

    def add_expert(a, y, slot):
        """acc += w_e * round(y) on the rows of the tokens that chose expert a."""
        if quantized and not mx:  # per output channel: commutes with the sum over slices
            y = y * dsbuf[slot].astype(jnp.float32)
        y = y.astype(dtype).astype(jnp.float32)
        if dn_bias:  # out + its bias in the projection's dtype, as experts_program
            y = (y + dnbuf[slot]).astype(dtype).astype(jnp.float32)
        mine = ids_ref[...] == active[a] + goff  # [T, k]
        w = jnp.sum(jnp.where(mine, w_ref[...].astype(jnp.float32), 0.0), axis=1, keepdims=True)
        chose = jnp.max(mine.astype(jnp.int32), axis=1, keepdims=True) > 0
        acc_ref[...] += jnp.where(chose, w * y, 0.0)

    def item(q, carry):
        a = lax.div(q, n_chunks)
        c = q - a * n_chunks
        slot = lax.rem(q, buffers)
        for dma in copies(a, c, slot):
            dma.wait()

        # Refill the slot item q - 1 used (done: items run in order).
        @pl.when(q + buffers - 1 < total)
        def _():
            start_item(q + buffers - 1)

        # Projections come out in the weights' dtype (quantized: the
        # activations'), scaled in f32 first, as in experts_program.
        proj = []
        for p in range(n_proj):
            if mx:
                y = mx_dot(x, gbuf.at[slot, p], gsbuf.at[slot, p])
            else:
                w = gbuf[slot, p]
                y = dot(x, w.astype(dtype) if quantized else w, 0 if gu_transposed else 1)
            if quantized and not mx:
                y = y * gsbuf[slot, p].astype(jnp.float32)
            y = y.astype(dtype)
            if gu_bias:  # proj + its bias, rounded again (experts_program's order)
                y = (y.astype(jnp.float32) + gubuf[slot, p]).astype(dtype)
            proj.append(y)
        if interleaved:
            # Mosaic's lane gather wants whole sublane tiles of rows.
            y = proj[0].astype(jnp.float32)
            rows = tiling.round_up(tokens, 8)
            if rows > tokens:
                y = jnp.concatenate([y, jnp.zeros((rows - tokens, y.shape[1]), y.dtype)])
            gate, up = (kernel_gmm.deinterleave(y, p)[:tokens] for p in (0, 1))
            h = moe.glu(gate, up, activation=activation, alpha=alpha, limit=limit)
        elif has_gate:
            h = moe.glu(proj[0], proj[1], activation=activation, alpha=alpha, limit=limit)
        else:
            h = moe.act(activation, proj[0].astype(jnp.float32))
        if mx:
            y = mx_dot(h.astype(dtype), dbuf.at[slot], dsbuf.at[slot])
        else:
            wd = dbuf[slot]
            y = dot(
                h.astype(dtype), wd.astype(dtype) if quantized else wd, 0 if dn_transposed else 1
            )
        if n_chunks == 1:
            add_expert(a, y, slot)
        else:
            yacc_ref[...] = jnp.where(c == 0, 0.0, yacc_ref[...]) + y

            @pl.when(c == n_chunks - 1)
            def _():
                add_expert(a, yacc_ref[...], slot)

        return carry

    lax.fori_loop(0, total, item, 0)
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "num_experts",
        "has_gate",
        "gu_transposed",
        "dn_transposed",
        "interleaved",
        "activation",
        "alpha",
        "limit",
        "config",
        "interpret",
    ),
)
def fused_moe_decode(
    hidden,
    top_k_index,
    top_k_weights,
    gate_up,
    down,
    group_offset,
    gate_up_scale=None,
    down_scale=None,
    gate_up_bias=None,
    down_bias=None,
    *,
    num_experts: int,
    has_gate: bool,
    gu_transposed: bool,
    dn_transposed: bool,
    interleaved: bool = False,
    activation: str,
    alpha: float,
    limit: float,
    config: tiling.FusedMoeConfig,
    interpret=False,
):
    """moe_experts' forward in one launch (see the module notes): hidden [T, H]
    bf16, top_k_index [T, k] int32, top_k_weights [T, k], gate_up [E, 2I, H]
    ([E, I, H] without a gate; gu_transposed: [E, H, 2I]), down [E, H, I]
    (dn_transposed: [E, I, H]), group_offset an int32 scalar. Each weight is
    given in the orientation XLA stores it in (api: tiling.weight_minor_swapped).
    int8 / float8_e4m3fn weights come with per-output-channel scales,
    gate_up_scale [E, 2I] and down_scale [E, H] (f32 or bf16), and are widened
    to hidden's dtype in VMEM. MXFP4 (uint8) weights come in mxfp4's kernel
    layout, gate_up [E, H/2, 2I] and down [E, I/2, H] (both "transposed"),
    with e8m0 scales [E, S(H), 2I] and [E, S(I), H]. Returns [T, H] in
    hidden's dtype. interleaved: gate_up's 2I columns (rows in the torch
    layout) alternate gate and up, GPT-OSS's layout. gate_up_bias [E, 2I]
    (in gate_up's column order) and down_bias [E, H] are added to their
    projections in the projection's dtype, as experts_program adds them."""
    t, h = hidden.shape
    k = top_k_index.shape[1]
    mx = mxfp4.is_mxfp4(gate_up.dtype)
    if mx and not (gu_transposed and dn_transposed):
        raise ValueError("fused_moe_decode: MXFP4 weights come in mxfp4's kernel layout")
    packed = 2 if mx else 1  # contraction rows per stored row
    inter = packed * (down.shape[1] if dn_transposed else down.shape[2])
    bi, buffers = config.block_i, config.buffers
    n_proj = 2 if has_gate and not interleaved else 1
    wi = 2 * bi if interleaved else bi  # gate/up columns of a projection's slice
    gshape = (buffers, n_proj, h // packed, wi) if gu_transposed else (buffers, n_proj, wi, h)
    dshape = (buffers, bi // packed, h) if dn_transposed else (buffers, h, bi)
    scratch = [
        pltpu.VMEM(gshape, gate_up.dtype),
        pltpu.VMEM(dshape, down.dtype),
        # per slot: gate/up weights (2), down weights, gate/up scales (2),
        # down scales, gate/up biases (2), down bias
        pltpu.SemaphoreType.DMA((buffers, 9)),
        pltpu.SMEM((num_experts,), jnp.int32),
        pltpu.SMEM((min(num_experts, t * k),), jnp.int32),
        pltpu.VMEM((t, h), jnp.float32),
        pltpu.VMEM((t, h), hidden.dtype),
        pltpu.VMEM((t, k), jnp.int32),
        pltpu.VMEM((t, k), top_k_weights.dtype),
        pltpu.SemaphoreType.DMA((3,)),
    ]
    quantized = gate_up_scale is not None
    if mx:
        gate_up_scale, down_scale = map(mxfp4.scale_bytes, (gate_up_scale, down_scale))
        scratch += [
            pltpu.VMEM((buffers, n_proj, gate_up_scale.shape[1], wi), jnp.uint8),
            pltpu.VMEM((buffers, down_scale.shape[1], h), jnp.uint8),
        ]
    elif quantized:
        scratch += [
            pltpu.VMEM((buffers, n_proj, 1, wi), gate_up_scale.dtype),
            pltpu.VMEM((buffers, 1, h), down_scale.dtype),
        ]
    # Biases in the projection's dtype (as experts_program adds them), carried as f32.
    biases = [
        b.astype(hidden.dtype).astype(jnp.float32)
        for b in (gate_up_bias, down_bias)
        if b is not None
    ]
    if gate_up_bias is not None:
        scratch.append(pltpu.VMEM((buffers, n_proj, 1, wi), jnp.float32))
    if down_bias is not None:
        scratch.append(pltpu.VMEM((buffers, 1, h), jnp.float32))
    if inter // bi > 1:
        scratch.append(pltpu.VMEM((t, h), jnp.float32))
    ids = top_k_index.astype(jnp.int32)
    full = lambda shape: pl.BlockSpec(shape, lambda i, *_: (0,) * len(shape))
    kernel = functools.partial(
        _kernel,
        tokens=t,
        top_k=k,
        num_experts=num_experts,
        inter=inter,
        block_i=bi,
        buffers=buffers,
        has_gate=has_gate,
        gu_transposed=gu_transposed,
        dn_transposed=dn_transposed,
        quantized=quantized,
        mx=mx,
        interleaved=interleaved,
        gu_bias=gate_up_bias is not None,
        dn_bias=down_bias is not None,
        activation=activation,
        alpha=alpha,
        limit=limit,
    )
    active = min(num_experts, t * k)
    wbytes = active * tiling.fused_moe_item_bytes(h, inter, has_gate, gate_up.dtype)
    cost = pl.CostEstimate(
        flops=2 * t * h * inter * (3 if has_gate else 2) * active,
        transcendentals=t * inter * active,
        bytes_accessed=int(wbytes + 2 * t * h * hidden.dtype.itemsize),
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((t, h), hidden.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * (5 + 2 * quantized + len(biases)),
            out_specs=full((t, h)),
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=config.vmem_limit_bytes
        ),
        interpret=interpret,
        cost_estimate=cost,
        name="moe_decode_fused",
    )(
        ids,
        jnp.asarray(group_offset, jnp.int32).reshape(1),
        hidden,
        ids,
        top_k_weights,
        gate_up,
        down,
        *((gate_up_scale, down_scale) if quantized else ()),
        *biases,
    )
