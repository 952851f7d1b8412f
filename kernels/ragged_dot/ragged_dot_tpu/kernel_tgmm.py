"""Transposed grouped matmul (the d_rhs of ``ragged_dot``) as a Pallas TPU kernel.

out[g] = lhs[rows of g]^T @ grad[rows of g]   -> [G_local, K, N]

Why this design
---------------
The output has one [K, N] block per group, but a row tile of the inputs holds
rows of several groups, so the output block index cannot be a function of the
grid step alone. Rather than a grid over (row tile, group) visits (whose length
grows with G and whose metadata needs several XLA ops to build), the grid is
``(K slabs, N slabs, row tiles)`` like ``gmm``'s, and the kernel walks the
groups touching each tile with a cursor kept in SMEM across steps:

* rows of the current group accumulate into one f32 [block_k, block_n]
  accumulator that survives across row tiles (a group may span many);
* when a group's last row has been seen, the accumulator is cast into one of
  two staging buffers and DMA'd to ``out[g]`` while the next group proceeds;
* empty groups get a DMA from a zero block (written once), so the output is
  exactly zero for them without a separate fill pass over [G, K, N].

Inputs move through the normal BlockSpec pipeline; row tiles outside this
shard's rows re-use the previous block, so they are never read. Rows are
issued to the MXU as gmm's ``row_passes`` issue them (``chunk_m`` passes,
then one or two tail passes that may reach back over rows already summed),
masked to the group's new rows (both operands, so garbage in padded rows
cannot leak through 0 * NaN, and no row is summed twice). The f32
accumulator is not zeroed between groups: a flag makes the next group's
first pass overwrite it (a second copy of the pass's piece loop, which
stores the products; a select in one loop cost the MXU loop more stores).

Expert parallelism: ``group_sizes`` covers all groups; the shard computes
groups ``[group_offset, group_offset + num_groups)``.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from . import tiling
from .kernel_gmm import _local_rows, _shard_rows, for_each_piece, row_passes


def _resolve_config(config, m, k, n, g, dtype, out_dtype):
    if isinstance(config, tiling.TgmmConfig):
        return config
    if config is None or isinstance(config, str):
        return tiling.tgmm_config(m, k, n, g, dtype, out_dtype=out_dtype, generation=config)
    raise ValueError(f"config: expected None, a generation name or a TgmmConfig, got {config!r}")


def _tgmm_kernel(
    ends_ref,
    goff_ref,
    lhs_ref,
    grad_ref,
    out_hbm,
    acc_ref,
    stage_ref,
    zero_ref,
    sem,
    state_ref,
    *,
    m,
    num_groups,
    num_local,
    block_m,
    block_k,
    block_n,
    chunk_m,
    sub,
    compute_dtype,
    precision,
    grid,
):
    k_i, n_i, t_i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = functools.partial(_local_rows, ends_ref, goff_ref, m=m, num_groups=num_groups)
    # state: 0 = cursor over local groups in this (K, N) slab, 1 = output DMAs
    # issued so far (slot = count % 2), 2 = 1 while the accumulator holds a
    # finished group's sums (the next group's first pass overwrites them).

    def out_copy(src, j, slot):
        kc, nc = k_i * block_k, n_i * block_n
        if block_k % 128 == 0:
            kc = pl.multiple_of(kc, 128)
        if block_n % 128 == 0:
            nc = pl.multiple_of(nc, 128)
        dst = out_hbm.at[j, pl.ds(kc, block_k), pl.ds(nc, block_n)]
        return pltpu.make_async_copy(src, dst, sem.at[slot])

    def wait_slot(slot):
        out_copy(zero_ref, 0, slot).wait()

    @pl.when(jnp.logical_and(jnp.logical_and(k_i == 0, n_i == 0), t_i == 0))
    def _init():
        state_ref[1] = 0
        zero_ref[...] = jnp.zeros(zero_ref.shape, zero_ref.dtype)

    @pl.when(t_i == 0)
    def _new_slab():
        state_ref[0] = 0
        state_ref[2] = 1

    def emit_out(j, from_acc):
        c = state_ref[1]
        slot = lax.rem(c, 2)

        @pl.when(c >= 2)
        def _():
            wait_slot(slot)

        if from_acc:
            stage_ref[slot] = acc_ref[...].astype(stage_ref.dtype)
            out_copy(stage_ref.at[slot], j, slot).start()
            # Not zeroed here: the stores are the scarce slot (tpu7x, Qwen3's
            # gate/up at 8,192 tokens: this epilogue's loop was bound by
            # them, 4,770 a group); the next group's first pass overwrites.
            state_ref[2] = 1
        else:
            out_copy(zero_ref, j, slot).start()
        state_ref[1] = c + 1

    tile_lo = t_i * block_m
    tile_hi = jnp.minimum(tile_lo + block_m, m)
    piece_n = tiling.piece(block_n)
    n_pieces = block_n // piece_n

    def accumulate(lo, hi):
        r_lo = jnp.maximum(lo, tile_lo) - tile_lo
        r_hi = jnp.minimum(hi, tile_hi) - tile_lo

        def emit(r0, size, fresh):
            # Rows done by an earlier pass would be summed twice: only
            # [max(r_lo, fresh), r_hi) of a pass are the group's new rows.
            ridx = r0 + lax.broadcasted_iota(jnp.int32, (size, 1), 0)
            keep = jnp.logical_and(ridx >= jnp.maximum(r_lo, fresh), ridx < r_hi)
            x = lhs_ref[pl.ds(r0, size), :]
            x = jnp.where(keep, x, jnp.zeros_like(x)).astype(compute_dtype)

            # Column pieces of the accumulator keep the unrolled MXU code small.
            def piece(c, carry, first):
                c0 = pl.multiple_of(c * piece_n, piece_n) if n_pieces > 1 else 0
                dy = grad_ref[pl.ds(r0, size), pl.ds(c0, piece_n)]
                dy = jnp.where(keep, dy, jnp.zeros_like(dy)).astype(compute_dtype)
                d = lax.dot_general(
                    x,
                    dy,
                    (((0,), (0,)), ((), ())),
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )
                if first:
                    acc_ref[:, pl.ds(c0, piece_n)] = d
                else:
                    acc_ref[:, pl.ds(c0, piece_n)] += d
                return carry

            stale = state_ref[2] != 0

            @pl.when(stale)
            def _():
                for_each_piece(n_pieces, functools.partial(piece, first=True))

            @pl.when(jnp.logical_not(stale))
            def _():
                for_each_piece(n_pieces, functools.partial(piece, first=False))

            state_ref[2] = 0

        row_passes(r_lo, r_hi, sub=sub, chunk=chunk_m, emit=emit)

    def cond(carry):
        j, go = carry
        return jnp.logical_and(go, j < num_local)

    def body(carry):
        j, _ = carry
        lo, hi = rows(j)
        empty = hi <= lo
        in_tile = jnp.logical_and(jnp.logical_not(empty), lo < tile_hi)
        finished = jnp.logical_and(in_tile, hi <= tile_hi)

        @pl.when(empty)
        def _():
            emit_out(j, from_acc=False)

        @pl.when(in_tile)
        def _():
            accumulate(lo, hi)

        @pl.when(finished)
        def _():
            emit_out(j, from_acc=True)

        advance = jnp.logical_or(empty, finished)
        return jnp.where(advance, j + 1, j), advance

    j_end, _ = lax.while_loop(cond, body, (state_ref[0], True))
    state_ref[0] = j_end

    last = jnp.logical_and(
        jnp.logical_and(k_i == grid[0] - 1, n_i == grid[1] - 1), t_i == grid[2] - 1
    )

    @pl.when(last)
    def _drain():
        c = state_ref[1]
        for back in (1, 2):

            @pl.when(c >= back)
            def _():
                wait_slot(lax.rem(c - back, 2))


@functools.partial(
    jax.jit,
    static_argnames=("num_groups", "preferred_element_type", "config", "interpret"),
)
def tgmm(
    lhs,
    grad,
    group_sizes,
    *,
    group_offset=0,
    num_groups=None,
    preferred_element_type=None,
    config=None,
    interpret=False,
):
    """Per-group lhs_g^T @ grad_g -> [num_groups, K, N], f32 accumulation.

    Args:
      lhs: [M, K]; grad: [M, N]; rows sorted by group.
      group_sizes: int32 [G]; G >= num_groups.
      group_offset: first group of this shard (int or int32 scalar).
      num_groups: groups held by this shard (default: len(group_sizes)).
      preferred_element_type: output dtype (default: lhs dtype). grad is cast
        to lhs's dtype for the MXU.
      config: a tiling.TgmmConfig, a generation name, or None (detect).
      interpret: run the kernel in interpret mode.
    """
    m, k = lhs.shape
    n = grad.shape[1]
    g_total = group_sizes.shape[0]
    num_local = g_total if num_groups is None else int(num_groups)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    compute_dtype = lhs.dtype
    if num_local == 0 or k == 0 or n == 0:
        return jnp.zeros((num_local, k, n), out_dtype)
    if m == 0 or g_total == 0:
        return jnp.zeros((num_local, k, n), out_dtype)
    try:
        cfg = _resolve_config(config, m, k, n, num_local, lhs.dtype, out_dtype)
    except ValueError:
        kp, np_ = -(-k // 128) * 128, -(-n // 128) * 128
        if (kp, np_) == (k, n) or isinstance(config, tiling.TgmmConfig):
            raise
        # A K or N that is not a multiple of 128 forces full-extent blocks; when
        # those cannot fit VMEM (GPT-OSS prefill: 2880 x 2880), pad the activations
        # to the lane tile (a copy of M x K and M x N) so aligned blocks can.
        out = tgmm(
            jnp.pad(lhs, ((0, 0), (0, kp - k))),
            jnp.pad(grad, ((0, 0), (0, np_ - n))),
            group_sizes,
            group_offset=group_offset,
            num_groups=num_local,
            preferred_element_type=out_dtype,
            config=config,
            interpret=interpret,
        )
        return out[:, :k, :n]
    sub = tiling.sublane(lhs.dtype, grad.dtype, out_dtype)
    tiling.check_tgmm_config(cfg, k, n, sub)
    bm, bk, bn = cfg.block_m, cfg.block_k, cfg.block_n
    chunk = min(cfg.chunk_m, bm)
    tiles = pl.cdiv(m, bm)
    grid = (pl.cdiv(k, bk), pl.cdiv(n, bn), tiles)

    ends = jnp.cumsum(group_sizes.astype(jnp.int32), dtype=jnp.int32)
    goff = jnp.asarray(group_offset, jnp.int32).reshape(1)

    def row_tile(t_i, ends_ref, goff_ref):
        lo, hi = _shard_rows(ends_ref, goff_ref, m=m, num_groups=g_total, num_local=num_local)
        first = jnp.minimum(lax.div(lo, bm), tiles - 1)
        last = jnp.clip(lax.div(jnp.maximum(hi - 1, 0), bm), first, tiles - 1)
        return jnp.clip(t_i, first, last)

    def lhs_map(k_i, n_i, t_i, ends_ref, goff_ref):
        return row_tile(t_i, ends_ref, goff_ref), k_i

    def grad_map(k_i, n_i, t_i, ends_ref, goff_ref):
        return row_tile(t_i, ends_ref, goff_ref), n_i

    lhs_mode = {"pipeline_mode": pl.Buffered(1)} if tiles == 1 and bk == k else {}
    grad_mode = {"pipeline_mode": pl.Buffered(1)} if tiles == 1 and bn == n else {}
    precision = lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else None
    kernel = functools.partial(
        _tgmm_kernel,
        m=m,
        num_groups=g_total,
        num_local=num_local,
        block_m=bm,
        block_k=bk,
        block_n=bn,
        chunk_m=chunk,
        sub=sub,
        compute_dtype=compute_dtype,
        precision=precision,
        grid=grid,
    )
    isz = lambda d: jnp.dtype(d).itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=int(
            m * k * isz(lhs.dtype) + m * n * isz(grad.dtype) + num_local * k * n * isz(out_dtype)
        ),
    )
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_local, k, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=grid,
            in_specs=[
                pl.BlockSpec((bm, bk), lhs_map, **lhs_mode),
                pl.BlockSpec((bm, bn), grad_map, **grad_mode),
            ],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[
                pltpu.VMEM((bk, bn), jnp.float32),
                pltpu.VMEM((2, bk, bn), out_dtype),
                pltpu.VMEM((bk, bn), out_dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((3,), jnp.int32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary", "arbitrary"),
            vmem_limit_bytes=tiling.vmem_limit_for(
                cfg.vmem_limit_bytes,
                tiling.tgmm_vmem_bytes(m, k, n, bm, bk, bn, chunk, lhs.dtype, out_dtype),
            ),
        ),
        interpret=interpret,
        cost_estimate=cost,
        name="ragged_dot_tgmm",
    )
    return call(ends, goff, lhs, grad)
