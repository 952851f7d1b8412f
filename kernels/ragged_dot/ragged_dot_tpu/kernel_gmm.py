"""Grouped matmul (``jax.lax.ragged_dot`` forward and d_lhs) as a Pallas TPU kernel.

out[rows of group g] = lhs[rows of group g] @ rhs[g], rows of group g being the
consecutive block after the rows of groups < g.

Why this design
---------------
The product's headline is MoE decode: a few rows per expert, so the cost is
reading each active expert's weights from HBM once. Everything follows from
that:

* Weights stay in HBM (``memory_space=ANY``) and the kernel DMAs them itself,
  one expert slab at a time, double-buffered: while expert ``a`` is on the
  MXU, the DMA of the next *active* expert is in flight. A BlockSpec over
  groups would have to visit every group id (or an upper bound on the active
  ones) as a grid step; at 0.35 us per step that is as much as the whole
  weight DMA of a small expert on tpu7x. Here the grid is
  ``(N slabs, row tiles)`` and does not grow with the number of groups:
  a Qwen3-30B-A3B decode layer is 1-2 grid steps.
* Experts with zero rows are never named by a DMA: the list of active groups
  is built inside the kernel (a scalar loop over ``group_sizes`` in SMEM at
  the first step), and only its entries are fetched. Each active expert's
  slab is fetched once per N slab, i.e. each weight byte once.
* Full contraction depth per slab: no K grid axis, no accumulator round trip.
* lhs/out move as row tiles through the normal BlockSpec pipeline. At decode
  there is a single tile (all rows), single-buffered; in prefill a group's
  weights stay resident while its rows stream through several tiles. Row
  tiles beyond the rows of this shard's groups re-use the previous lhs block,
  so padded rows past ``sum(group_sizes)`` are never read.
* MXU work per group is its rows rounded to the sublane tile (8 rows f32,
  16 bf16), issued in ``chunk_m`` passes while that many remain; the tail
  is one pass of a power of two sublane tiles ending at the group's last
  row (two past half a chunk; ``row_passes``), since every pass pushes the
  group's weights into the MXU again. Rows a pass covers that are not the
  group's, or were stored by an earlier pass, are merged with a row mask
  on store. Where the MXUs bind (``GmmConfig.merged_tails``: tpu7x prefill),
  a group's tail rides in its last whole pass instead, one pass of
  ``chunk_m`` + 32 or + 128 rows: a narrow pass is bound by pushing the
  weights (and on [N, K] weights under 256 rows by transposing them on the
  XLU), not by its rows. Qwen3's tpu7x launches at 8,192 tokens, scheduled:
  gate/up 614.9 -> 547.9 us, down 343.7 -> 309.0. There a group part of
  under a chunk but over half of one (a row tile boundary splits most
  groups) with [N, K] weights is one whole pass rather than half a chunk
  and the rest (a 128-row pass against a [512, 2048] piece of them
  schedules 1,654 cycles on tpu7x, its XLU transposes included, a 256-row
  one 1,966; of [K, N] weights 1,289 and 1,895, where two narrow passes
  won): Qwen3's launches in the model's layout 618.4 -> 610.0 and 309.0
  -> 305.8 us.
* An output tile holding rows that no group of this shard writes is zeroed
  before its groups write into it, so rows past ``sum(group_sizes)`` and rows
  of other shards' groups are exactly zero; a tile inside the shard's groups
  is not (its passes write every row).

The only op outside the kernel is a cumsum of ``group_sizes`` (row ends, fed
by scalar prefetch so the lhs index map can skip tiles without rows).

``transpose_rhs`` takes rhs as [G, N, K] (the forward weights, for d_lhs) and
contracts on its last axis, so no transposed copy of the weights is ever made.

Expert parallelism: ``group_sizes`` covers all groups; this shard holds rhs
for groups ``[group_offset, group_offset + G_local)``; rows of other groups are
left zero.

Quantized weights (int8, fp8 e4m3; weight-only): rhs keeps its one-byte
elements in HBM and in the weight stream, so the DMA moves half the bytes of
bf16; each slab piece is widened to lhs's dtype on its way to the MXU. Scales
are per channel, ``rhs_scale`` [G_local, S] f32, and ride the same ring as
their expert's slab (one small DMA beside each weight DMA, so only active
experts' scales are read). On the output axis (``scale_axis="n"``, the
forward) they multiply the f32 product; on the contraction axis
(``scale_axis="k"``, d_lhs: grad @ (s * W)^T) they multiply the lhs rows
before the pass, which costs rows x K instead of K x N per pass.
Block scales (``scale_axis="block"``: one scale per 128 x 128 block of rhs,
[G_local, A/128 * B/128] for rhs [G_local, A, B], flattened in rhs's own
order, FP8 checkpoints' format) do not factor out of the contraction as a
whole, but within one 128-column block of the output they vary only along K:
they fold into the lhs rows (a lane row over K built from scalars in SMEM,
where each expert's scales land beside its slab), and each column block is
one full-depth MXU pass, rows x K work per column block instead of
dequantizing K x N.

FP4 weights (``scale_axis="mx"``, mxfp4.py's kernel layout): rhs
[G_local, K/2, N] bytes with [G_local, S, N] e8m0 scales. The DMA moves a
quarter of bf16's bytes (plus 1/64 for scales). Each slab piece is decoded on
the VPU into bf16 weights in k order (mxfp4.decode_pairs: both nibbles of a
byte at once, as the halves of a 32-bit word, each 32-row block's scale
folded into the decode's exponent bias), and contracted as bf16 is.

GLU epilogue (``glu``, inference's gate/up projection): rhs holds [gate | up]
halves; each stream item carries, piece by piece, a piece's gate columns
beside its up columns (two DMAs a piece), so one MXU pass of twice the piece
width yields both and act(gate) * up is stored: [M, N/2]. Each product is
rounded to the output dtype first, as the unfused program rounds its
projection. The pieces of a slab are unrolled (whole up to 4 pieces, else 2
a body: tiling.piece_unroll), so one piece's epilogue overlaps the next
piece's MXU work (unrolling helps the plain product too: 8,192 Qwen3
tokens, down projection, tpu7x 362 -> 307 us).

Rows gathered in the kernel (``gather``, prefill inference's gate/up
projection): lhs is the hidden states [T, K] and ``gather`` each row's token,
so the layer needs no [T * top_k, K] gathered copy (XLA wrote and this
kernel re-read 537 MB at 8,192 Qwen3 tokens). The hidden states are packed
once (kernel_pack.pack_rows: a bf16 row shares its 32-bit words with its
neighbour, packed its words are whole tiles of its own) and each row of a
tile is one DMA from them, landing in one of two tile buffers: the next
tile's rows are issued a chunk at a time from the whole row passes, whose
MXU-bound bundles leave the scalar slots free (~7 scalar ops a copy, bounds
checks compiled out, ids clamped before the kernel), the rest at the step's
end; a pass waits only for the chunks it reads, and unpacks its rows with a
shift and a mask a word. Copies past a tile's rows (a pass that is not the
chunk's, the last tile) land in junk rows under their own semaphore, so the
pass body has no branch; they are drained at the end. Qwen3 at 8,192 tokens,
scheduled: v6e gate/up 834.5 -> 842.6 us plus a 48.9 us pack for the 377.5
us gather; tpu7x 547.9 -> 618.4 plus 22.3 for 167.3.
Where the packed hidden states fit in VMEM beside the launch's blocks
(``GmmConfig.resident_rows``, tiling.gmm_config), they are copied there
once, at the first step, and each row is a vector load and store from them
instead of a DMA from HBM: each token's row is then read from HBM once, not
once for each of its top_k experts (Qwen3 at 8,192 tokens: 33.5 MB for 268).
Where a few staging copies fit too (``GmmConfig.stage_rows``), the hidden
states come as they are and the kernel packs them on their way in (pack_rows'
body, four copies of up to 256 rows in flight), so no pack_rows launch reads
and writes them in HBM first; only the rows past the last whole 8-row tile
(a DMA of bf16 rows moves whole tiles) are packed by XLA, a few words.

``gmm_dma_schedule`` is the same walk in numpy for the performance model and
tests; ``gmm(..., _trace=True)`` makes the kernel itself log every weight DMA it
issues so the two can be compared.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from . import kernel_pack, moe, mxfp4, pairs, tiling, w8a8


def resolve_config(
    config,
    m,
    k,
    n,
    g,
    lhs_dtype,
    rhs_dtype,
    out_dtype,
    glu=False,
    packed=False,
    gather=False,
    interleaved=False,
    bias=False,
    gather_tokens=0,
):
    if isinstance(config, tiling.GmmConfig):
        return config
    if config is None or isinstance(config, str):
        return tiling.gmm_config(
            m,
            k,
            n,
            g,
            lhs_dtype,
            w_dtype=rhs_dtype,
            out_dtype=out_dtype,
            generation=config,
            glu=glu,
            packed=packed,
            gather=gather,
            interleaved=interleaved,
            bias=bias,
            gather_tokens=gather_tokens,
        )
    raise ValueError(f"config: expected None, a generation name or a GmmConfig, got {config!r}")


def _local_rows(ends_ref, goff_ref, j, *, m, num_groups):
    """Rows [lo, hi) of local group j, clamped to [0, m]; empty if out of range."""
    g = goff_ref[0] + j
    valid = jnp.logical_and(g >= 0, g < num_groups)
    gc = jnp.clip(g, 0, num_groups - 1)
    hi = ends_ref[gc]
    lo = jnp.where(gc > 0, ends_ref[jnp.maximum(gc - 1, 0)], 0)
    lo = jnp.clip(lo, 0, m)
    hi = jnp.clip(hi, lo, m)
    return lo, jnp.where(valid, hi, lo)


def _shard_rows(ends_ref, goff_ref, *, m, num_groups, num_local):
    """Rows [lo, hi) covered by this shard's groups."""
    g0 = jnp.clip(goff_ref[0], 0, num_groups)
    g1 = jnp.clip(goff_ref[0] + num_local, 0, num_groups)
    lo = jnp.where(g0 > 0, ends_ref[jnp.maximum(g0 - 1, 0)], 0)
    hi = jnp.where(g1 > 0, ends_ref[jnp.maximum(g1 - 1, 0)], 0)
    lo = jnp.clip(lo, 0, m)
    return lo, jnp.clip(hi, lo, m)


def lhs_row_tile(t_i, ends_ref, goff_ref, *, m, block_m, num_groups, num_local):
    """Row tile of lhs to hold at grid row t_i: t_i clamped to the tiles that
    hold this shard's rows, so the others repeat a block and are not fetched."""
    tiles = -(-m // block_m)
    lo, hi = _shard_rows(ends_ref, goff_ref, m=m, num_groups=num_groups, num_local=num_local)
    first = jnp.minimum(lax.div(lo, block_m), tiles - 1)
    last = jnp.clip(lax.div(jnp.maximum(hi - 1, 0), block_m), first, tiles - 1)
    return jnp.clip(t_i, first, last)


def row_passes(r_lo, r_hi, *, sub, chunk, emit, merged=(), on_whole=None, alone_whole=False):
    """Calls emit(r0, size, fresh) over sublane-aligned passes covering
    [r_lo, r_hi); rows of a pass before `fresh` were covered by an earlier
    pass, so emit keeps rows [max(r_lo, fresh), r_hi) of it.

    `chunk`-row passes while that many rows remain; the tail (fewer than
    `chunk` rows) is one pass of the smallest power of two sublane tiles
    that covers it, ending at the group's last tile (so it reaches back over
    rows already done, or before the group, which emit does not keep), after
    one pass of the widest tail size where the tail is wider than that.
    Each pass pushes the group's weights into the MXU again, and a narrow
    pass is bound by those pushes, not by its rows: one tail pass, or two,
    instead of one per set bit of the tail's tile count (up to five at
    512-row chunks).

    `merged` (ascending tail sizes in sublane tiles, each under a chunk): a
    group with a whole pass takes a tail of up to merged[-1] tiles into its
    last whole pass, one pass of `chunk` + the smallest merged size that
    covers the tail, ending at the group's last tile. Its weights are then
    pushed once for both, where a separate tail pass is bound by pushing them
    (and, on tpu7x with [N, K] weights narrower than 256 rows, by
    transposing them on the XLU). A wider tail takes one more whole pass,
    ending at the group's last tile. With `alone_whole` (the weights [N, K],
    which a narrow pass transposes on the XLU), a group without a whole pass
    whose rows are more than half a chunk takes one whole pass too, reaching
    back over rows before it (or from the tile's first row) instead of half a
    chunk and the rest, two passes that each transpose the weights. The
    caller guarantees the tile holds `chunk` + merged[-1] tiles.
    """
    # lax.div, not //: floor division lowers through sign(), which Mosaic
    # resolves against the attached chip (none when compiling ahead of time).
    a_lo = lax.div(r_lo, sub) * sub
    a_hi = lax.div(r_hi + sub - 1, sub) * sub
    n_sub = jnp.where(r_hi > r_lo, lax.div(a_hi - a_lo, sub), 0)
    per_chunk = chunk // sub
    n_big = lax.div(n_sub, per_chunk)
    n_small = n_sub - n_big * per_chunk

    def whole(i, c):
        # A pass past the whole ones (a wide merged tail, or a group of under a
        # chunk) ends at the group's last tile, or starts at the tile's first row.
        r0 = a_lo + i * chunk
        emit(pl.multiple_of(jnp.maximum(jnp.minimum(r0, a_hi - chunk), 0), sub), chunk, r0)
        if on_whole is not None:
            on_whole()
        return c

    if per_chunk == 1:
        lax.fori_loop(0, n_big, whole, 0)
        return
    r0 = a_lo + n_big * chunk
    widest = 1 << ((per_chunk - 1).bit_length() - 1)  # tail sizes: 1, 2, 4, ..., widest tiles
    alone = None
    if merged:
        has_big = n_big > 0
        wide = jnp.logical_and(has_big, n_small > merged[-1])
        merge = jnp.logical_and(jnp.logical_and(has_big, n_small > 0), jnp.logical_not(wide))
        # alone_whole: a group under a chunk but over half of one takes one whole pass.
        whole_alone = jnp.logical_and(alone_whole, jnp.logical_and(~has_big, n_small > widest))
        extra = wide.astype(jnp.int32) + whole_alone.astype(jnp.int32)
        lax.fori_loop(0, n_big - merge.astype(jnp.int32) + extra, whole, 0)
        last_r0 = a_lo + jnp.maximum(n_big - 1, 0) * chunk
        below = 0
        for tiles in merged:
            size = chunk + tiles * sub

            @pl.when(jnp.logical_and(merge, jnp.logical_and(n_small > below, n_small <= tiles)))
            def _():
                emit(pl.multiple_of(jnp.maximum(a_hi - size, 0), sub), size, last_r0)
                if on_whole is not None:
                    on_whole()

            below = tiles
        alone = jnp.logical_not(jnp.logical_or(has_big, whole_alone))
    else:
        lax.fori_loop(0, n_big, whole, 0)
    lead = n_small > widest
    if alone is not None:  # the tails of groups without a whole pass
        lead = jnp.logical_and(alone, lead)
    rest = n_small - jnp.where(lead, widest, 0)
    fresh = r0 + jnp.where(lead, widest * sub, 0)
    for b in range(widest.bit_length()):
        tiles = 1 << b
        rows_b = sub << b
        window = jnp.logical_and(rest > tiles // 2, rest <= tiles)
        if alone is not None:
            window = jnp.logical_and(alone, window)
        window_r0 = pl.multiple_of(jnp.maximum(a_hi - rows_b, 0), sub)
        if tiles < widest:

            @pl.when(window)
            def _():
                emit(window_r0, rows_b, fresh)

            continue

        # The widest size runs the lead pass and the window from one site
        # (Mosaic gives every site its own temporaries: tiling.pass_rows).
        def widest_pass(i, c):
            first = jnp.logical_and(lead, i == 0)
            emit(
                pl.multiple_of(jnp.where(first, r0, window_r0), sub),
                rows_b,
                jnp.where(first, r0, fresh),
            )
            return c

        count = lead.astype(jnp.int32) + window.astype(jnp.int32)
        lax.fori_loop(0, count, widest_pass, 0)


def pass_sizes(
    r_lo: int, r_hi: int, *, sub: int, chunk: int, merged=(), alone_whole=False
) -> list[int]:
    """The rows of each pass row_passes emits for [r_lo, r_hi), on the host
    (the performance model's MXU rows; tests compare it with the kernel's
    traced flops)."""
    r_lo, r_hi = int(r_lo), int(r_hi)
    n_sub = -(-r_hi // sub) - r_lo // sub if r_hi > r_lo else 0
    per_chunk = chunk // sub
    n_big, n_small = divmod(n_sub, per_chunk)
    widest = 1 << max((per_chunk - 1).bit_length() - 1, 0)
    if merged and per_chunk > 1 and n_big and n_small:
        if n_small > merged[-1]:
            return [chunk] * (n_big + 1)
        return [chunk] * (n_big - 1) + [chunk + min(t for t in merged if t >= n_small) * sub]
    if merged and alone_whole and per_chunk > 1 and n_small > widest:  # no whole pass: one
        return [chunk]
    sizes = [chunk] * n_big
    if n_small:
        if n_small > widest:
            sizes.append(widest * sub)
            n_small -= widest
        sizes.append(sub << (n_small - 1).bit_length())
    return sizes


def deinterleave(y, parity):
    """Columns parity, parity + 2, parity + 4, ... of y [R, 2W] f32, 2W a
    multiple of 128: [R, W]. Each 128-lane tile of the result gathers the
    even (or odd) lanes of two tiles of y within their vregs (an XLU lane
    gather; Mosaic has no strided lane slice), so every value is moved, not
    computed: exact, non-finite values included, and each stays in its row."""
    r, n2 = y.shape
    lane = lax.broadcasted_iota(jnp.int32, (r, 128), 1)
    src = jnp.bitwise_and(2 * lane + parity, 127)

    def take(t0):
        return jnp.take_along_axis(y[:, t0 : t0 + 128], src, axis=1, mode="promise_in_bounds")

    parts = []
    for t0 in range(0, n2, 256):
        if t0 + 128 < n2:
            parts.append(jnp.where(lane < 64, take(t0), take(t0 + 128)))
        else:  # a last lone tile: its 64 values
            parts.append(take(t0)[:, :64])
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def for_each_piece(n_pieces, piece, unroll=1):
    """Runs piece(c, carry) over the column pieces of a slab, `unroll` pieces
    to a loop body (the scheduler overlaps one piece's epilogue with the next
    piece's MXU work within a body, not across bodies)."""
    if n_pieces == 1:
        piece(0, 0)
    else:
        lax.fori_loop(0, n_pieces, piece, 0, unroll=unroll)


def _gmm_kernel(
    ends_ref,
    goff_ref,
    lhs_ref,
    rhs_hbm,
    *rest,
    m,
    num_groups,
    num_local,
    block_m,
    block_n,
    chunk_m,
    sub,
    n_blocks,
    buffers,
    manual_lhs,
    transpose_rhs,
    compute_dtype,
    precision,
    scale_axis,
    contraction,
    rhs_b,
    trace,
    quantize_lhs=False,
    glu=None,
    packed=False,
    merged_tails=(),
    gather_rw=0,
    tiles=1,
    interleaved=False,
    has_bias=False,
    rolled_gather=False,
    resident=False,
    staged=False,
    stage_rows=0,
    resident_tail=0,
):
    if gather_rw:
        ids_first, ids_next, *rest = rest
    scale_hbm = bias_hbm = None
    if scale_axis:
        scale_hbm, *rest = rest
    if has_bias:
        bias_hbm, *rest = rest
    if resident_tail:
        tail_hbm, *rest = rest  # the last hidden states' rows, packed by XLA
    out_ref, *rest = rest
    if trace:
        trace_ref, *rest = rest
    else:
        trace_ref = None
    wbuf, sem, active_ref, state_ref, *rest = rest
    if scale_axis:
        sbuf, ssem, *rest = rest
    if scale_axis == "mx":
        wdec, *rest = rest  # a slab piece decoded, [K, piece]
    if has_bias:
        bbuf, *rest = rest  # a slot's bias row, [1, slab_n] f32
    if gather_rw:
        xw, xsem, *rest = rest
        if resident:
            # The packed hidden states, all of them (and, staged, slots of
            # their rows as they are, on their way to being packed); the
            # copies' semaphores.
            hid, *rest = rest
            stage = rest.pop(0) if staged and stage_rows else None
            (hsem,) = rest
        lhs_hbm = lhs_ref
    if manual_lhs:
        # One row tile: lhs is copied by hand, so its DMA is queued with the
        # weights' instead of being waited for (a whole DMA latency) before
        # the kernel body, i.e. before the first weight DMA, can start.
        lhs_hbm, (lhs_ref, lhs_sem) = lhs_ref, rest
        lhs_copy = pltpu.make_async_copy(lhs_hbm, lhs_ref.at[pl.ds(0, m)], lhs_sem.at[0])
    n_i = pl.program_id(0)
    t_i = pl.program_id(1)
    piece_n, n_pieces, tail_n = tiling.gmm_pieces(
        block_n, tiling.widest_piece(wbuf.dtype, glu is not None), packed
    )
    rows = functools.partial(_local_rows, ends_ref, goff_ref, m=m, num_groups=num_groups)
    if gather_rw:
        # state 3: rows of the next tile issued this step; 4: chunks of this
        # tile waited for; 5: chunks of copies sent to the junk rows.
        rw = gather_rw
        n_ck = block_m // chunk_m  # row chunks of a tile, one semaphore each
        junk = 2 * n_ck  # the semaphore of copies past a tile's rows
        gslot = lax.rem(t_i, 2)

        def issue_batch(ids_ref, slot, c, valid):
            """Rows [c, c + chunk_m) of the tile whose ids ids_ref holds, into
            `slot`'s buffer, one DMA a row; where not `valid` they land in the
            junk rows under the junk semaphore instead (no branch in the
            caller's pass body)."""
            c = jnp.where(valid, c, 0)
            base = jnp.where(valid, (slot * block_m + c) * rw, 2 * block_m * rw)
            sem_i = jnp.where(valid, slot * n_ck + lax.div(c, chunk_m), junk)

            def row(j):
                tok = ids_ref[0, c + j]
                if resident:  # a whole tile a row: one vector load and store
                    src = hid.at[pl.ds(pl.multiple_of(tok * rw, 8), rw)]
                    xw[pl.ds(pl.multiple_of(base + j * rw, 8), rw)] = src[...]
                    return
                pltpu.make_async_copy(
                    lhs_hbm.at[pl.ds(pl.multiple_of(tok * rw, 8), rw)],
                    xw.at[pl.ds(pl.multiple_of(base + j * rw, 8), rw)],
                    xsem.at[sem_i],
                ).start()

            if rolled_gather:
                # The same copies from a loop: interpret mode turns each
                # unrolled copy into ~25 HLO ops (a layer's gate/up kernel
                # lowered 4x slower), not worth it where there is no schedule.
                lax.fori_loop(0, chunk_m, lambda j, c_: row(j) or c_, 0, unroll=8)
            else:
                # Unrolled for the TPU: the scalar unit issues a tile's copies
                # between the MXU passes that call this (a rolled loop, 8 a
                # trip, scheduled Qwen3's v6e layer at 8,192 tokens 1,700 ->
                # 1,814 us).
                for j in range(chunk_m):
                    row(j)

        if resident:
            # How the hidden states arrive in `hid`: start() before the first
            # weights' DMAs, finish() after them, before the first tile's rows.
            if not staged:  # packed by pack_rows in HBM: one copy
                whole = pltpu.make_async_copy(lhs_hbm, hid, hsem.at[0])

                def arrive_start():
                    whole.start()

                def arrive_finish():
                    whole.wait()

            else:  # as they are: staged, then packed here (kernel_pack's body)
                t_main = hid.shape[0] // rw - resident_tail  # rows packed here
                bt, slots = stage_rows, tiling.RESIDENT_STAGE_SLOTS
                n_stage = -(-t_main // bt) if bt else 0

                def stage_start(c):
                    # The last copy ends at t_main, over rows the one before
                    # brought (packed again, the same words): every copy is bt
                    # rows at an 8-row tile, as DMAs of bf16 rows must be.
                    return pl.multiple_of(jnp.minimum(c * bt, t_main - bt), 8)

                def stage_copy(c):
                    return pltpu.make_async_copy(
                        lhs_hbm.at[pl.ds(stage_start(c), bt)],
                        stage.at[lax.rem(c, slots)],
                        hsem.at[lax.rem(c, slots)],
                    )

                # The last rows (under a tile; all of them under 16 tokens),
                # packed by XLA.
                tail = (
                    pltpu.make_async_copy(
                        tail_hbm, hid.at[pl.ds(t_main * rw, resident_tail * rw)], hsem.at[slots]
                    )
                    if resident_tail
                    else None
                )

                def arrive_start():
                    for c in range(min(slots, n_stage)):
                        stage_copy(c).start()
                    if tail is not None:
                        tail.start()

                def pack(c, carry):
                    # Each 256-column group of a copy's rows is its two 128-lane
                    # halves packed, stored as every rw-th word row. Padding word
                    # rows (Gemma 4's 5 of 16) are never unpacked: left as they are.
                    stage_copy(c).wait()
                    rows = stage.at[lax.rem(c, slots)]
                    for g in range(pairs.groups(contraction)):
                        hid[pl.ds(stage_start(c) * rw + g, bt, stride=rw), :] = pairs.group_words(
                            rows, g
                        )

                    @pl.when(c + slots < n_stage)
                    def _():
                        stage_copy(c + slots).start()

                    return carry

                def arrive_finish():
                    if n_stage:
                        lax.fori_loop(0, n_stage, pack, 0)
                    if tail is not None:
                        tail.wait()

        def wait_chunk(sem_i):
            span = xw.at[pl.ds(0, chunk_m * rw)]
            pltpu.make_async_copy(span, span, xsem.at[sem_i]).wait()

        def issue_next():
            # Called from each whole row pass: the next tile's rows, a chunk
            # at a time, while this tile's passes keep the MXU busy.
            c = state_ref[3]
            valid = jnp.logical_and(c < block_m, t_i + 1 < tiles)
            issue_batch(ids_next, 1 - gslot, c, valid)
            state_ref[3] = c + chunk_m
            state_ref[5] = state_ref[5] + jnp.where(valid, 0, 1)

        def landed(r_end):
            """Waits for the chunks of this tile's rows [0, r_end) not yet waited."""
            if resident:  # the rows were stored, not copied: nothing to wait for
                return
            last = lax.div(r_end - 1, chunk_m)

            def body(c):
                wait_chunk(gslot * n_ck + c)
                return c + 1

            state_ref[4] = lax.while_loop(lambda c: c <= last, body, state_ref[4])

        def gathered(r0, size):
            """Rows [r0, r0 + size) of the tile, unpacked from their words."""
            base = gslot * block_m * rw + r0 * rw
            parts = []
            for g in range(pairs.groups(contraction)):
                words = xw[pl.ds(base + g, size, stride=rw), :]
                parts.extend(pairs.group_values(words, contraction, g))
            return jnp.concatenate(parts, axis=1)

    # state: 0 = number of active groups, 1 = cursor into the active list for
    # this N slab, 2 = weight stream items already waited for (3-5: the row
    # gather's, above). Stream item
    # q = n * na + a is slab n of active group a; its buffer slot is q % buffers.
    # `buffers - 1` items are in flight while one is on the MXU, so each DMA's
    # issue latency hides behind the transfers queued before it (with one in
    # flight, every expert paid it in full).
    def scale_row(j):
        # Block scales land in SMEM as a flat [L] row; channel scales in VMEM as [1, S].
        return scale_hbm.at[j] if scale_axis == "block" else scale_hbm.at[pl.ds(j, 1)]

    slab_n = 2 * block_n if glu else block_n  # rhs columns a stream item holds

    def copies(n_q, a, slot):
        """The DMAs of stream item (slab n_q, active group a): weights, then
        scales or the bias (its slab's columns of the group's row)."""
        dmas = weight_copies(n_q, active_ref[a], slot)
        if has_bias:
            j = active_ref[a]
            if n_blocks == 1:
                b_src = bias_hbm.at[pl.ds(j, 1)]
            else:
                b_src = bias_hbm.at[pl.ds(j, 1), pl.ds(pl.multiple_of(n_q * slab_n, 128), slab_n)]
            dmas.append(pltpu.make_async_copy(b_src, bbuf.at[slot], sem.at[slot]))
        return dmas

    def weight_copies(n_q, j, slot):
        # Interleaved gate and up columns (glu_interleaved) take the plain
        # slab's copies: a block's output columns are one contiguous run of
        # slab_n = twice as many rhs columns (and of their FP4 scales).
        if glu and not interleaved:
            # Piece by piece, the gate columns and then the up columns of the
            # same output columns, side by side: one MXU pass of 2 x piece
            # columns gives both (separate gate and up passes of one piece
            # each ran at ~1.5x the bundles on tpu7x).
            half = n_blocks * block_n  # where the up half starts in rhs
            col = n_q * block_n if n_blocks > 1 else 0
            if n_blocks > 1 and block_n % 128 == 0:
                col = pl.multiple_of(col, 128)
            dmas = []
            for c in range(n_pieces + (1 if tail_n else 0)):
                width = piece_n if c < n_pieces else tail_n
                for h, src_col in enumerate((col + c * piece_n, half + col + c * piece_n)):
                    dst = 2 * c * piece_n + h * width
                    if transpose_rhs:
                        a_src = rhs_hbm.at[j, pl.ds(src_col, width), :]
                        a_dst = wbuf.at[slot, pl.ds(dst, width), :]
                    else:
                        a_src = rhs_hbm.at[j, :, pl.ds(src_col, width)]
                        a_dst = wbuf.at[slot, :, pl.ds(dst, width)]
                    dmas.append(pltpu.make_async_copy(a_src, a_dst, sem.at[slot]))
            return dmas
        if n_blocks == 1:
            # The whole expert: a static offset, so N need not be a multiple of the
            # 128-lane tile (GPT-OSS: 2880) for Mosaic to prove the DMA aligned.
            src = rhs_hbm.at[j]
            # One row of the [G, S] scales (a [G, 1, S] view would make XLA
            # pad each row to a sublane tile: an 8x copy of every expert's
            # scales on every call).
            scale_src = None if scale_axis is None else scale_row(j)
            if scale_axis == "mx":
                scale_src = scale_hbm.at[j]
        else:
            col = n_q * slab_n
            if slab_n % 128 == 0:
                col = pl.multiple_of(col, 128)
            if transpose_rhs:
                src = rhs_hbm.at[j, pl.ds(col, slab_n), :]
            else:
                src = rhs_hbm.at[j, :, pl.ds(col, slab_n)]
            if scale_axis == "n":
                scale_src = scale_hbm.at[pl.ds(j, 1), pl.ds(col, slab_n)]
            elif scale_axis == "mx":
                scale_src = scale_hbm.at[j, :, pl.ds(col, slab_n)]
            elif scale_axis in ("k", "block"):  # the whole expert's scales
                scale_src = scale_row(j)
        dmas = [pltpu.make_async_copy(src, wbuf.at[slot], sem.at[slot])]
        if scale_axis:
            dmas.append(pltpu.make_async_copy(scale_src, sbuf.at[slot], ssem.at[slot]))
        return dmas

    def start(n_q, a, slot):
        for dma in copies(n_q, a, slot):
            dma.start()
        if trace:
            c = trace_ref[0]
            trace_ref[c + 1] = n_q * num_local + active_ref[a]
            trace_ref[0] = c + 1

    def start_item(q, na):
        n_q = lax.div(q, na)
        start(n_q, q - n_q * na, lax.rem(q, buffers))

    @pl.when(jnp.logical_and(n_i == 0, t_i == 0))
    def _init():
        if trace:
            trace_ref[0] = 0
        if manual_lhs:
            lhs_copy.start()
        if gather_rw:
            state_ref[5] = 0
            # The first chunk's rows, then the first weights, then the rest of
            # the tile's rows: issuing a tile's row copies takes the scalar unit
            # ~0.8 us a chunk, and the first pass needs one chunk and one slab.
            # Resident rows: the hidden states' copy, then the first weights,
            # then the first tile's rows (any of the hidden states').
            if resident:
                arrive_start()
            else:
                issue_batch(ids_first, 0, 0, True)
        # The active list. Group ends are monotonic, so a group is active iff
        # its clamped end passes the previous one; out-of-range group ids
        # (shards past the last group) are never active. Two passes over the
        # same loop body: the first stops at the first `buffers - 1` active
        # experts and issues their DMAs, so the weights start moving while the
        # second (no DMA code in its body, so it schedules tightly) finishes
        # the list.
        g0 = goff_ref[0]
        first_lo = jnp.where(g0 > 0, ends_ref[jnp.clip(g0 - 1, 0, num_groups - 1)], 0)

        def visit(j, count, prev):
            g = g0 + j
            valid = jnp.logical_and(g >= 0, g < num_groups)
            hi = jnp.clip(ends_ref[jnp.clip(g, 0, num_groups - 1)], prev, m)
            active = jnp.logical_and(valid, hi > prev)
            active_ref[count] = j
            return active, jnp.where(active, count + 1, count), jnp.where(valid, hi, prev)

        def head_cond(carry):
            j, count, _ = carry
            return jnp.logical_and(j < num_local, count < buffers - 1)

        def head(carry):
            j, count, prev = carry
            active, count_next, prev = visit(j, count, prev)

            @pl.when(active)
            def _():
                start(0, count, count)

            return j + 1, count_next, prev

        j1, count, prev = lax.while_loop(head_cond, head, (0, 0, jnp.clip(first_lo, 0, m)))
        if gather_rw:
            if resident:
                arrive_finish()
                issue_batch(ids_first, 0, 0, True)

            def first(b, c):
                issue_batch(ids_first, 0, b * chunk_m, True)
                return c

            lax.fori_loop(1, n_ck, first, 0)

        def tail(j, carry):
            return visit(j, *carry)[1:]

        count, _ = lax.fori_loop(j1, num_local, tail, (count, prev))
        state_ref[0] = count
        state_ref[2] = 0
        # Fewer active experts than slots: the next slabs fill the rest.
        for q in range(1, buffers - 1):

            @pl.when(jnp.logical_and(q >= count, q < count * n_blocks))
            def _():
                start_item(q, count)

        if manual_lhs:
            lhs_copy.wait()

    @pl.when(t_i == 0)
    def _new_slab():
        state_ref[1] = 0

    if gather_rw:
        state_ref[3] = 0
        state_ref[4] = 0
    na = state_ref[0]
    tile_lo = t_i * block_m
    tile_hi = jnp.minimum(tile_lo + block_m, m)
    shard_lo, shard_hi = _shard_rows(
        ends_ref, goff_ref, m=m, num_groups=num_groups, num_local=num_local
    )

    # Only a tile with rows no group of this shard writes is zeroed first: the
    # passes write every row of the shard's groups (row_passes), so a tile
    # inside them needs no zeros (Qwen3's tpu7x down projection at 8,192
    # tokens stored zeros for 20 us, 2,048 stores a tile). Packed rows padded
    # to whole tiles (Gemma 4: 11 word rows of 16) keep the tile's zeros, their
    # padding words being pack_rows' zeros: zeroing those alone, five strided
    # stores a tile, scheduled slower (down gmm at 8,192 tokens, tpu7x, 518.9
    # -> 528.8 us).
    padded = packed and pairs.row_words(block_n) > pairs.groups(block_n)
    inside = jnp.logical_and(tile_lo >= shard_lo, tile_hi <= shard_hi)

    @pl.when(jnp.logical_or(padded, jnp.logical_not(inside)))
    def _zero():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    def process(a, lo, hi):
        q = n_i * na + a
        slot = lax.rem(q, buffers)

        @pl.when(q >= state_ref[2])
        def _first_visit():
            for dma in copies(n_i, a, slot):
                dma.wait()
            state_ref[2] = q + 1
            # Refill the slot item q - 1 used: it is done (items are consumed
            # in order, and a revisit of q - 1 in a later row tile never
            # happens once q has been reached).
            ahead = q + buffers - 1

            @pl.when(ahead < na * n_blocks)
            def _():
                start_item(ahead, na)

        r_lo = jnp.maximum(lo, tile_lo) - tile_lo
        r_hi = jnp.minimum(hi, tile_hi) - tile_lo

        def slab_dot(x, c0, width):
            """x @ the slab's columns [c0, c0 + width), widened to compute_dtype, in f32
            (w8a8: quantized x against the slab as it is, in int32 or f32)."""
            if transpose_rhs:
                w = wbuf[slot, pl.ds(c0, width), :]
                dims = (((1,), (1,)), ((), ()))
            else:
                w = wbuf[slot, :, pl.ds(c0, width)]
                dims = (((1,), (0,)), ((), ()))
            if quantize_lhs:
                acc = jnp.int32 if jnp.issubdtype(w.dtype, jnp.integer) else jnp.float32
                y = lax.dot_general(x, w, dims, preferred_element_type=acc)
                return y.astype(jnp.float32)
            return lax.dot_general(
                x,
                w.astype(compute_dtype),
                dims,
                precision=precision,
                preferred_element_type=jnp.float32,
            )

        def block_dot(r0, size, c0, width):
            """x @ (s * W) for columns [c0, c0 + width) with 128 x 128 block scales.
            Within one 128-column block of the output the scales vary only along
            the contraction, so they fold into the lhs rows: one full-depth MXU
            pass per column block on x times that block's scales (a lane row
            over K built from SMEM scalars), rows x K work per column block."""
            col = n_i * block_n + c0  # the piece's first column of rhs's N
            b_blocks = rhs_b // 128
            lane_block = lax.div(lax.broadcasted_iota(jnp.int32, (1, contraction), 1), 128)
            x = lhs_ref[pl.ds(r0, size), :].astype(jnp.float32)
            outs = []
            for cb in range(width // 128):
                nb = lax.div(col, 128) + cb
                row = jnp.zeros((1, contraction), jnp.float32)
                for kb in range(contraction // 128):
                    # rhs [G, K, N]: (a, b) = (k, n); transposed [G, N, K]: (n, k).
                    a, b = (nb, kb) if transpose_rhs else (kb, nb)
                    row = jnp.where(lane_block == kb, sbuf[slot, a * b_blocks + b], row)
                outs.append(slab_dot((x * row).astype(compute_dtype), c0 + cb * 128, 128))
            return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)

        def mx_piece(c0, width):
            """The FP4 slab's columns [c0, c0 + width) as bf16 in k order: each
            byte's nibbles decoded with its 32-row block's scale."""
            b = wbuf[slot, :, pl.ds(c0, width)].astype(jnp.int32)
            w = mxfp4.decode_pairs(b, sbuf[slot, :, pl.ds(c0, width)])
            return w.astype(compute_dtype)

        def rows_dot(r0, size, w):
            """lhs rows [r0, r0 + size) @ w [K, width], in f32."""
            return lax.dot_general(
                lhs_ref[pl.ds(r0, size), :],
                w,
                (((1,), (0,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )

        def kept_rows(r0, size, fresh):
            """Which rows of a pass are the group's and not already stored (a
            sublane tile shared with the neighbouring group is merged, not
            overwritten; row_passes' tail window reaches back)."""
            ridx = r0 + lax.broadcasted_iota(jnp.int32, (size, 1), 0)
            return jnp.logical_and(ridx >= jnp.maximum(r_lo, fresh), ridx < r_hi)

        def add_bias(y, c0, width):
            """The group's bias on slab columns [c0, c0 + width) added to the
            product rounded to the output dtype, rounded again (proj + bias)."""
            dtype = jnp.bfloat16 if packed else out_ref.dtype  # packed: bf16 words
            y = y.astype(dtype).astype(jnp.float32)
            return (y + bbuf[slot, :, pl.ds(c0, width)]).astype(dtype)

        def store(r0, size, c0, width, y, keep):
            if has_bias and not glu:  # glu adds it before the activation
                y = add_bias(y, c0, width)
            if packed:
                # pairs.pack_rows: each 256-column group of the piece is one
                # row of words a token, every rw-th row of the block.
                rw = pairs.row_words(block_n)
                for gg in range(pairs.groups(width)):
                    g = lax.div(c0, pairs.GROUP) + gg
                    words = pairs.group_words(y, gg)
                    dst = (pl.ds(r0 * rw + g, size, stride=rw), slice(None))
                    out_ref[dst] = jnp.where(keep, words, out_ref[dst])
                return
            dst = (pl.ds(r0, size), pl.ds(c0, width))
            out_ref[dst] = jnp.where(keep, y.astype(out_ref.dtype), out_ref[dst])

        def over_pieces(columns):
            """columns(c0, width) over the slab's piece_n-column pieces and its
            tail: the unrolled MXU code (and its f32 temporaries) stays small
            however wide the slab is."""

            def piece(c, carry):
                columns(pl.multiple_of(c * piece_n, piece_n) if n_pieces > 1 else 0, piece_n)
                return carry

            for_each_piece(
                n_pieces,
                piece,
                unroll=tiling.piece_unroll(n_pieces, widened=scale_axis is not None),
            )
            if tail_n:
                columns(n_pieces * piece_n, tail_n)

        def activated(y, c0, width):
            """act(gate) * up for output columns [c0, c0 + width) from their
            product y, each product rounded to the output dtype first (and
            again after its bias), as the unfused program rounds its projection."""
            y = y.astype(out_ref.dtype)
            if has_bias:
                y = add_bias(y, 2 * c0, 2 * width)
            if interleaved:
                y = y.astype(jnp.float32)
                gate, up = deinterleave(y, 0), deinterleave(y, 1)
            else:
                gate, up = y[:, :width], y[:, width:]
            activation, alpha, limit = glu
            return moe.glu(gate, up, activation=activation, alpha=alpha, limit=limit)

        def mx_decode_once(c0, width):
            """A group with many rows (prefill): the piece decoded once into
            wdec, then every row pass of the group against it, so the decode,
            the VPU's work, is paid once per piece, not once per pass. With
            glu the piece's product columns are twice its output columns."""
            slab_c0, slab_w = (2 * c0, 2 * width) if glu else (c0, width)
            wdec[:, pl.ds(0, slab_w)] = mx_piece(slab_c0, slab_w)

            def emit_mx(r0, size, fresh):
                y = rows_dot(r0, size, wdec[:, pl.ds(0, slab_w)])
                if glu:
                    y = activated(y, c0, width)
                store(r0, size, c0, width, y, kept_rows(r0, size, fresh))

            row_passes(r_lo, r_hi, sub=sub, chunk=chunk_m, emit=emit_mx, merged=merged_tails)

        def emit(r0, size, fresh):
            row_scale = None
            if gather_rw:
                landed(r0 + size)
                x = gathered(r0, size).astype(compute_dtype)
            elif scale_axis in ("n", "k", None):  # block_dot and the FP4 path read their own rows
                x = lhs_ref[pl.ds(r0, size), :]
                if scale_axis == "k":
                    x = x.astype(jnp.float32) * sbuf[slot]
                if quantize_lhs:
                    x, row_scale = w8a8.quantize_rows(x, wbuf.dtype)
                else:
                    x = x.astype(compute_dtype)
            keep = kept_rows(r0, size, fresh)

            def columns(c0, width):
                if glu:
                    if scale_axis == "mx":  # decoded straight into the MXU
                        y = rows_dot(r0, size, mx_piece(2 * c0, 2 * width))
                    else:
                        y = slab_dot(x, 2 * c0, 2 * width)
                    store(r0, size, c0, width, activated(y, c0, width), keep)
                    return
                if scale_axis == "block":
                    y = block_dot(r0, size, c0, width)
                elif scale_axis == "mx":  # decoded straight into the MXU
                    y = rows_dot(r0, size, mx_piece(c0, width))
                else:
                    y = slab_dot(x, c0, width)
                if scale_axis == "n":
                    y = y * sbuf[slot, :, pl.ds(c0, width)]
                if row_scale is not None:
                    y = y * row_scale
                store(r0, size, c0, width, y, keep)

            over_pieces(columns)

        if scale_axis != "mx":
            row_passes(
                r_lo,
                r_hi,
                sub=sub,
                chunk=chunk_m,
                emit=emit,
                merged=merged_tails,
                on_whole=issue_next if gather_rw else None,
                alone_whole=transpose_rhs,
            )
            return
        # Decoding straight into the MXU wins while a group takes one or two
        # passes (its stores and reloads of the piece cost more than a second
        # decode); past that, decoding each piece once does (scheduled, v6e,
        # Qwen3: at 8 tokens 952 bundles a piece straight against 1,570 via
        # VMEM; at 8,192 tokens two decodes a piece per group straight).
        many = r_hi - r_lo > tiling.MXFP4_DECODE_ONCE_ROWS

        @pl.when(jnp.logical_not(many))
        def _():
            row_passes(r_lo, r_hi, sub=sub, chunk=chunk_m, emit=emit, merged=merged_tails)

        @pl.when(many)
        def _():
            over_pieces(mx_decode_once)

    def cond(carry):
        a, go = carry
        return jnp.logical_and(go, a < na)

    def body(carry):
        a, _ = carry
        lo, hi = rows(active_ref[a])
        in_tile = lo < tile_hi

        @pl.when(in_tile)
        def _():
            process(a, lo, hi)

        done = jnp.logical_and(in_tile, hi <= tile_hi)
        return jnp.where(done, a + 1, a), done

    a_end, _ = lax.while_loop(cond, body, (state_ref[1], True))
    state_ref[1] = a_end
    if gather_rw:
        # The next tile's rows no whole pass issued, then this tile's chunks
        # no pass waited for (its slot is refilled next step).
        @pl.when(t_i + 1 < tiles)
        def _():
            def rest_batch(b, c):
                issue_batch(ids_next, 1 - gslot, state_ref[3] + b * chunk_m, True)
                return c

            lax.fori_loop(
                0, lax.div(jnp.maximum(block_m - state_ref[3], 0), chunk_m), rest_batch, 0
            )

        landed(block_m)

        if not resident:  # (resident rows sent to the junk rows were stored)

            @pl.when(t_i + 1 == tiles)
            def _():
                lax.fori_loop(0, state_ref[5], lambda b, c: wait_chunk(junk) or c, 0)


@functools.partial(
    jax.jit,
    static_argnames=(
        "transpose_rhs",
        "scale_axis",
        "preferred_element_type",
        "config",
        "interpret",
        "_trace",
        "quantize_lhs",
        "glu",
        "packed",
        "glu_interleaved",
    ),
)
def gmm(
    lhs,
    rhs,
    group_sizes,
    *,
    group_offset=0,
    rhs_scale=None,
    scale_axis=None,
    transpose_rhs=False,
    preferred_element_type=None,
    config=None,
    interpret=False,
    _trace=False,
    quantize_lhs=False,
    glu=None,
    packed=False,
    gather=None,
    glu_interleaved=False,
    bias=None,
):
    """Grouped matmul with ``jax.lax.ragged_dot`` semantics.

    Args:
      lhs: [M, K], rows sorted by group.
      rhs: [G_local, K, N] (or [G_local, N, K] with transpose_rhs).
      group_sizes: int32 [G], G >= G_local; rows per group, in order.
      group_offset: first group held by this shard (int or int32 scalar).
      rhs_scale: with int8 / float8_e4m3fn rhs, f32 per-channel scales
        [G_local, S]: the weights are rhs * scale along `scale_axis`; or
        block scales [G_local, A/128 * B/128] for rhs [G_local, A, B]
        (rhs[g, a, b] * scale[g, (a // 128) * (B // 128) + b // 128]).
        With uint8 (FP4) rhs in mxfp4's kernel layout, [G_local, K/2, N]
        (not transpose_rhs): its e8m0 scales [G_local, S, N], uint8 or
        float8_e8m0fnu, S = K/32 or mxfp4.scale_rows(K).
      scale_axis: "n" (S = N, the output columns), "k" (S = K, the
        contraction), "block" (A, B multiples of 128) or "mx" (FP4); required
        with rhs_scale.
      transpose_rhs: contract rhs on its last axis (rhs given as [G, N, K]).
      preferred_element_type: output dtype (default: result type of inputs).
        Accumulation is always f32; lhs is cast to rhs's dtype for the MXU
        (quantized rhs is widened to lhs's dtype instead).
      config: a tiling.GmmConfig, a generation name, or None (detect).
      interpret: run the kernel in interpret mode (bool or InterpretParams).
      quantize_lhs: w8a8 with int8 or float8_e4m3fn rhs and per-channel
        scales on N: each row of lhs is quantized to rhs's dtype in the kernel
        (w8a8.quantize_rows: one scale per row, its largest magnitude to the
        dtype's largest value) and the MXU runs int8 x int8 or fp8 x fp8.
      glu: None, or (activation, alpha, limit) of moe.glu: rhs holds gate and
        up halves of N/2 columns each ([gate | up], moe's concatenated
        layout; tiling.glu_fusable says which); the output is
        act(gate) * up, [M, N/2], each product rounded to the output dtype
        before the activation (in f32). Unquantized rhs, or FP4 with
        glu_interleaved.
      glu_interleaved: with glu, rhs's N columns alternate gate, up, gate,
        up, ... (GPT-OSS's layout) instead of two halves; N/2 a multiple of
        64 (tiling.glu_fusable).
      bias: None or [G_local, N] (N rhs's output columns, gate and up
        interleaved with glu): each group's row added to its rows' products
        rounded to the output dtype, in that dtype (rounded again), before
        any activation: transformers' ``proj + bias``. Not with glu's halves.
      packed: the bf16 output written as pairs.pack_rows lays it out, uint32
        [M * pairs.row_words(N), 128] (N the output's columns): each row's words are
        contiguous, for the combine kernel to fetch by DMA. Needs a bf16
        output, N a multiple of 64 (pairs.packable) and the whole of N
        in one block.

    Returns:
      [M, N] ([M, N/2] with glu); rows outside this shard's groups (and past the sum) are zero.
      With _trace=True also an int32 log of weight DMAs: [count, n*G_local+g...].
    """
    m, k = lhs.shape
    if gather is not None:
        if (
            lhs.dtype != jnp.bfloat16
            or not pairs.packable(k)
            or gather.ndim != 1
            or not jnp.issubdtype(gather.dtype, jnp.integer)
        ):
            raise ValueError(
                "gmm: gather needs bfloat16 lhs [T, K] with K a multiple of"
                f" {pairs.PIECE} and integer row ids [M]; got lhs {lhs.dtype}"
                f" {tuple(lhs.shape)}, gather {gather.dtype} {tuple(gather.shape)}"
            )
        if scale_axis is not None or quantize_lhs:
            raise ValueError("gmm: gather takes unquantized rhs only")
        m = gather.shape[0]
    num_local = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    rhs_k = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    w_dtype = jnp.dtype(rhs.dtype)
    mx = mxfp4.is_mxfp4(w_dtype)
    if mx:
        rhs_k *= 2
        if transpose_rhs or scale_axis != "mx" or rhs_scale is None:
            raise ValueError(
                "gmm: uint8 (FP4) rhs is [G, K/2, N] (mxfp4's kernel layout), with"
                f" scale_axis='mx'; got transpose_rhs={transpose_rhs}, scale_axis={scale_axis!r}"
            )
        rows = {k // mxfp4.BLOCK, mxfp4.scale_rows(k)}
        if (
            k % mxfp4.BLOCK
            or rhs_scale.ndim != 3
            or tuple(rhs_scale.shape[::2]) != (num_local, n)
            or rhs_scale.shape[1] not in rows
        ):
            raise ValueError(
                f"gmm: FP4 rhs needs K a multiple of 32 and rhs_scale [{num_local},"
                f" {sorted(rows)}, {n}]; got lhs {tuple(lhs.shape)}, rhs_scale"
                f" {tuple(rhs_scale.shape)}"
            )
    elif scale_axis == "mx":
        raise ValueError(f"gmm: scale_axis='mx' needs uint8 (FP4) rhs, got {rhs.dtype}")
    if quantize_lhs and (mx or scale_axis != "n" or not tiling.is_quantized(w_dtype)):
        raise ValueError(
            "gmm: quantize_lhs (w8a8) needs int8 or float8_e4m3fn rhs with per-channel"
            f" scales on N (scale_axis='n'); got rhs {w_dtype.name}, scale_axis {scale_axis!r}"
        )
    if lhs.ndim != 2 or rhs.ndim != 3 or rhs_k != k:
        layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
        raise ValueError(
            f"gmm: expected lhs [M, K] and rhs {layout} with the same K, got lhs "
            f"{tuple(lhs.shape)} and rhs {tuple(rhs.shape)}"
        )
    num_groups = group_sizes.shape[0]
    half = n // 2
    if glu is None and glu_interleaved:
        raise ValueError("gmm: glu_interleaved goes with glu, which is None")
    sub_in = tiling.sublane(lhs.dtype, w_dtype)
    if glu is not None and (
        n % 2
        or quantize_lhs
        or not tiling.glu_fusable(half, transpose_rhs, w_dtype, sub_in, glu_interleaved)
    ):
        layout = (
            "interleaved gate/up columns, N/2 a multiple of 64"
            if glu_interleaved
            else ("gate/up halves on a tile boundary")
        )
        raise ValueError(
            f"gmm: glu needs unquantized (or interleaved FP4) rhs with {layout}"
            f" (tiling.glu_fusable); got rhs {w_dtype.name} {tuple(rhs.shape)},"
            f" transpose_rhs={transpose_rhs}, quantize_lhs={quantize_lhs}"
        )
    if bias is not None and (
        (glu is not None and not glu_interleaved)
        or tuple(bias.shape) != (num_local, n)
        or not jnp.issubdtype(bias.dtype, jnp.floating)
    ):
        raise ValueError(
            f"gmm: bias needs a float [G_local, N] = [{num_local}, {n}] array (with glu,"
            f" interleaved gate/up columns); got bias {bias.dtype} {tuple(bias.shape)},"
            f" glu {'interleaved' if glu_interleaved else glu}"
        )
    n_out = half if glu is not None else n
    quantized = tiling.is_quantized(rhs.dtype)
    if quantized != (rhs_scale is not None) or (rhs_scale is None) != (scale_axis is None):
        raise ValueError(
            f"gmm: int8/fp8 rhs needs rhs_scale and scale_axis, other rhs neither; got rhs"
            f" {jnp.dtype(rhs.dtype).name}, rhs_scale {rhs_scale is not None},"
            f" scale_axis {scale_axis!r}"
        )
    if mx:
        rhs_scale = mxfp4.scale_bytes(rhs_scale)
        compute_dtype = lhs.dtype
    elif quantized:
        if scale_axis == "block":
            a_dim, b_dim = rhs.shape[1:]
            want = (num_local, (a_dim // 128) * (b_dim // 128))
            if a_dim % 128 or b_dim % 128 or tuple(rhs_scale.shape) != want:
                raise ValueError(
                    f"gmm: block scales need rhs dims that are multiples of 128 and rhs_scale"
                    f" {want}; got rhs {tuple(rhs.shape)}, rhs_scale {tuple(rhs_scale.shape)}"
                )
        else:
            s_len = {"n": n, "k": k}.get(scale_axis)
            if s_len is None or tuple(rhs_scale.shape) != (num_local, s_len):
                raise ValueError(
                    f"gmm: expected rhs_scale [{num_local}, {s_len}] on axis"
                    f" {scale_axis!r}, got {tuple(rhs_scale.shape)}"
                )
        rhs_scale = rhs_scale.astype(jnp.float32)
        compute_dtype = lhs.dtype
    else:
        compute_dtype = rhs.dtype
    out_dtype = jnp.dtype(preferred_element_type or tiling.default_out_dtype(lhs.dtype, rhs.dtype))
    if packed and (out_dtype != jnp.bfloat16 or not pairs.packable(n_out)):
        raise ValueError(
            f"gmm: packed needs a bfloat16 output of N a multiple of {pairs.PIECE} columns; got"
            f" {out_dtype.name}, N={n_out}"
        )
    if m == 0 or n_out == 0 or k == 0 or num_local == 0 or num_groups == 0:
        if packed:
            out = jnp.zeros((m * pairs.row_words(n_out), pairs.GROUP // 2), jnp.uint32)
        else:
            out = jnp.zeros((m, n_out), out_dtype)
        return (out, jnp.zeros((1,), jnp.int32)) if _trace else out
    cfg = resolve_config(
        config,
        m,
        k,
        n_out,
        num_local,
        lhs.dtype,
        w_dtype,
        out_dtype,
        glu is not None,
        packed,
        gather is not None,
        glu_interleaved,
        bias is not None,
        lhs.shape[0],
    )
    sub = tiling.sublane(lhs.dtype, rhs.dtype, out_dtype)  # quantized rhs does not count
    tiling.check_gmm_config(cfg, n_out, sub)
    bm, bn = cfg.block_m, cfg.block_n
    if packed and bn != n_out:
        raise ValueError(
            f"gmm: packed needs the whole of N in one block: config.block_n expected {n_out},"
            f" got {bn}"
        )
    chunk = min(cfg.chunk_m, bm)
    if gather is not None and (bn != n_out or bm % chunk):
        raise ValueError(
            "gmm: gather needs the whole of N in one block and row tiles of whole chunks"
            f" (its rows are fetched a chunk at a time): config.block_n expected {n_out},"
            f" got {bn}; block_m {bm} a multiple of chunk_m {chunk}"
        )
    resident = cfg.resident_rows and gather is not None  # (no rows to gather: no effect)
    tiles = pl.cdiv(m, bm)
    n_blocks = pl.cdiv(n_out, bn)

    ends = jnp.cumsum(group_sizes.astype(jnp.int32), dtype=jnp.int32)
    goff = jnp.asarray(group_offset, jnp.int32).reshape(1)

    def lhs_map(n_i, t_i, ends_ref, goff_ref):
        return lhs_row_tile(
            t_i, ends_ref, goff_ref, m=m, block_m=bm, num_groups=num_groups, num_local=num_local
        ), 0

    def out_map(n_i, t_i, ends_ref, goff_ref):
        return t_i, n_i

    # Mosaic copies whole 8-row tiles only (37 or 12 rows fail to compile).
    manual_lhs = tiles == 1 and m % 8 == 0 and gather is None
    gather_rw = pairs.row_words(k) if gather is not None else 0
    out_single = {} if tiles * n_blocks > 1 else {"pipeline_mode": pl.Buffered(1)}
    hbm_lhs = manual_lhs or gather is not None  # copied by the kernel itself
    in_specs = [
        pl.BlockSpec(memory_space=pl.ANY) if hbm_lhs else pl.BlockSpec((bm, k), lhs_map),
        pl.BlockSpec(memory_space=pl.ANY),
    ]
    # In the kernel's order: the gathered rows' ids (never with scales), then
    # scales, then the bias.
    if gather is not None:
        in_specs += [
            pl.BlockSpec((None, 1, bm), lambda n_i, t_i, *_: (0, 0, 0), memory_space=pltpu.SMEM),
            pl.BlockSpec(
                (None, 1, bm),
                lambda n_i, t_i, *_: (jnp.minimum(t_i + 1, tiles - 1), 0, 0),
                memory_space=pltpu.SMEM,
            ),
        ]
    if quantized:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    if bias is not None:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    if packed:
        rw = pairs.row_words(n_out)
        out_specs = [pl.BlockSpec((bm * rw, pairs.GROUP // 2), out_map, **out_single)]
        out_shape = [jax.ShapeDtypeStruct((m * rw, pairs.GROUP // 2), jnp.uint32)]
    else:
        out_specs = [pl.BlockSpec((bm, bn), out_map, **out_single)]
        out_shape = [jax.ShapeDtypeStruct((m, n_out), out_dtype)]
    if _trace:
        out_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        out_shape.append(jax.ShapeDtypeStruct((n_blocks * num_local + 1,), jnp.int32))
    buffers = cfg.weight_buffers
    slab_n = 2 * bn if glu is not None else bn
    wshape = (buffers, slab_n, k) if transpose_rhs else (buffers, k // 2 if mx else k, slab_n)
    scratch = [
        pltpu.VMEM(wshape, rhs.dtype),
        pltpu.SemaphoreType.DMA((buffers,)),
        pltpu.SMEM((num_local,), jnp.int32),
        pltpu.SMEM((6,), jnp.int32),
    ]
    if scale_axis == "block":
        scratch += [
            pltpu.SMEM((buffers, rhs_scale.shape[1]), jnp.float32),
            pltpu.SemaphoreType.DMA((buffers,)),
        ]
    elif mx:
        scratch += [
            pltpu.VMEM((buffers, rhs_scale.shape[1], slab_n), jnp.uint8),
            pltpu.SemaphoreType.DMA((buffers,)),
            pltpu.VMEM(
                (
                    k,
                    slab_n
                    // bn
                    * tiling.gmm_pieces(bn, tiling.widest_piece(w_dtype, glu is not None), packed)[
                        0
                    ],
                ),
                compute_dtype,
            ),
        ]
    elif quantized:
        s_width = bn if scale_axis == "n" else k
        scratch += [
            pltpu.VMEM((buffers, 1, s_width), jnp.float32),
            pltpu.SemaphoreType.DMA((buffers,)),
        ]
    if bias is not None:
        scratch.append(pltpu.VMEM((buffers, 1, slab_n), jnp.float32))
    if manual_lhs:
        scratch += [pltpu.VMEM((bm, k), lhs.dtype), pltpu.SemaphoreType.DMA((1,))]
    if gather is not None:
        scratch += [
            pltpu.VMEM(((2 * bm + chunk) * gather_rw, pairs.GROUP // 2), jnp.uint32),
            pltpu.SemaphoreType.DMA((2 * (bm // chunk) + 1,)),
        ]
    # Resident rows staged in the kernel: copies of bt rows (none under 16
    # tokens), the rows past the last whole 8-row tile packed by XLA.
    staged = resident and cfg.stage_rows > 0
    bt = tiling.stage_copy_rows(cfg.stage_rows, lhs.shape[0]) if staged else 0
    resident_tail = lhs.shape[0] - (lhs.shape[0] // 8 * 8 if bt else 0) if staged else 0
    if resident:
        scratch.append(pltpu.VMEM((lhs.shape[0] * gather_rw, pairs.GROUP // 2), jnp.uint32))
        if bt:
            scratch.append(pltpu.VMEM((tiling.RESIDENT_STAGE_SLOTS, bt, k), lhs.dtype))
        scratch.append(pltpu.SemaphoreType.DMA((tiling.RESIDENT_STAGE_SLOTS + 1 if staged else 1,)))
    if resident_tail:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    precision = lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else None
    kernel = functools.partial(
        _gmm_kernel,
        m=m,
        num_groups=num_groups,
        num_local=num_local,
        block_m=bm,
        block_n=bn,
        chunk_m=chunk,
        sub=sub,
        n_blocks=n_blocks,
        buffers=buffers,
        manual_lhs=manual_lhs,
        transpose_rhs=transpose_rhs,
        compute_dtype=compute_dtype,
        precision=precision,
        scale_axis=scale_axis,
        contraction=k,
        rhs_b=rhs.shape[2],
        trace=_trace,
        quantize_lhs=quantize_lhs,
        glu=glu,
        packed=packed,
        merged_tails=cfg.merged_tails,
        gather_rw=gather_rw,
        tiles=tiles,
        interleaved=glu_interleaved,
        has_bias=bias is not None,
        rolled_gather=bool(interpret),
        resident=resident,
        staged=staged,
        stage_rows=bt,
        resident_tail=resident_tail,
    )
    isz = lambda d: jnp.dtype(d).itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=m * n_out if glu is not None else 0,
        bytes_accessed=int(
            m * k * isz(lhs.dtype)
            + m * n_out * isz(out_dtype)
            + num_local * rhs_k * n * isz(rhs.dtype) // (2 if mx else 1)
            + (rhs_scale.size * isz(rhs_scale.dtype) if quantized else 0)
            + (bias.size * 4 if bias is not None else 0)
        ),
    )
    call = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(n_blocks, tiles),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"),
            disable_bounds_checks=gather is not None,
            vmem_limit_bytes=tiling.vmem_limit_for(
                cfg.vmem_limit_bytes,
                tiling.gmm_vmem_bytes(
                    m,
                    k,
                    n_out,
                    bm,
                    bn,
                    chunk,
                    lhs.dtype,
                    w_dtype,
                    out_dtype,
                    buffers,
                    glu=glu is not None,
                    packed=packed,
                    merged=cfg.merged_tails,
                    gather=gather is not None,
                    interleaved=glu_interleaved,
                    bias=bias is not None,
                    resident_tokens=lhs.shape[0] if resident else 0,
                    stage_rows=cfg.stage_rows if resident else 0,
                ),
            ),
        ),
        interpret=interpret,
        cost_estimate=cost,
        name="ragged_dot_gmm",
    )
    # The bias in the projection's dtype (as transformers adds it), carried as f32.
    extra = () if bias is None else (bias.astype(out_dtype).astype(jnp.float32),)
    if gather is not None:
        ids = jnp.clip(gather.astype(jnp.int32), 0, lhs.shape[0] - 1)
        ids = jnp.pad(ids, (0, tiles * bm - m)).reshape(tiles, 1, bm)
        if staged:  # packed in the kernel, but for its last rows (under a tile)
            tail = (pairs.pack_rows(lhs[lhs.shape[0] - resident_tail :]),) if resident_tail else ()
            res = call(ends, goff, lhs, rhs, ids, ids, *extra, *tail)
        else:
            words = kernel_pack.pack_rows(lhs, interpret=interpret)
            res = call(ends, goff, words, rhs, ids, ids, *extra)
    else:
        res = call(ends, goff, lhs, rhs, *((rhs_scale,) if quantized else ()), *extra)
    return (res[0], res[1]) if _trace else res[0]


def gmm_dma_schedule(
    group_sizes,
    m,
    k,
    n,
    num_local,
    cfg: tiling.GmmConfig,
    *,
    group_offset=0,
    lhs_bytes=2,
    rhs_bytes=2,
    out_bytes=2,
    transpose_rhs=False,
):
    """Walks the gmm grid on the host for the performance model.

    lhs fetches come from evaluating the kernel's own lhs index map
    (``lhs_row_tile``) step by step; a block is fetched when its index changes.
    Weight DMAs are listed in the order the kernel issues them (tests compare
    this list with the kernel's own log, ``gmm(..., _trace=True)``).

    Returns a dict with the grid step count, the weight DMAs as (n_slab,
    local_group), HBM bytes of each operand, and MXU rows issued per N slab
    (mxu_flops covers all slabs).
    """
    gs = np.asarray(group_sizes, np.int64)
    ends = np.minimum(np.cumsum(gs), m)
    starts = np.concatenate([[0], ends[:-1]])
    starts = np.minimum(starts, m)
    bm, bn = cfg.block_m, cfg.block_n
    tiles = -(-m // bm)
    n_blocks = -(-n // bn)
    sub = 16 if min(lhs_bytes, rhs_bytes, out_bytes) == 2 else 8
    local = [group_offset + j for j in range(num_local)]
    active = [j for j, g in enumerate(local) if 0 <= g < len(gs) and ends[g] > starts[g]]
    dmas = [(nb, j) for nb in range(n_blocks) for j in active]
    ends_i32 = jnp.asarray(np.cumsum(gs), jnp.int32)
    goff = jnp.asarray([group_offset], jnp.int32)
    lhs_total, prev = 0, None
    for nb in range(n_blocks):
        for t in range(tiles):
            # The kernel's own lhs index map, evaluated on the host.
            idx = int(
                lhs_row_tile(
                    jnp.int32(t),
                    ends_i32,
                    goff,
                    m=m,
                    block_m=bm,
                    num_groups=len(gs),
                    num_local=num_local,
                )
            )
            if idx != prev:
                # A block that overhangs the array end only moves the rows that exist.
                lhs_total += min(bm, m - idx * bm) * k * lhs_bytes
                prev = idx
    mxu_rows = 0
    for j in active:
        g = local[j]
        for t in range(tiles):
            a, b = max(starts[g], t * bm), min(ends[g], t * bm + bm)
            if a >= b:
                continue
            chunk = min(cfg.chunk_m, bm)
            mxu_rows += sum(
                pass_sizes(
                    a - t * bm,
                    b - t * bm,
                    sub=sub,
                    chunk=chunk,
                    merged=cfg.merged_tails,
                    alone_whole=transpose_rhs,
                )
            )
    w_slab = k * bn * rhs_bytes
    return {
        "grid_steps": n_blocks * tiles,
        "weight_dmas": dmas,
        "active_groups": active,
        "rhs_bytes": len(dmas) * w_slab,
        "lhs_bytes": int(lhs_total),
        "out_bytes": m * n * out_bytes,
        "mxu_rows": int(mxu_rows),
        "mxu_flops": 2 * int(mxu_rows) * k * n,
    }
