"""Decode attention over a KV cache (flash-attn's `flash_attn_with_kvcache`):
the Pallas kernel and the compact schedule it walks.

Layout. The cache is read where it lies: flash-attn's contiguous
[B_cache, S, Hkv, D] or paged [num_pages, page, Hkv, D] (MQA caches viewed as
[.., S, D]), or transformers' [B_cache, Hkv, S, D] with an optional per-key
keep mask. It stays in HBM: the kernel copies each step's pages itself, into
a ring of `slots` items so that slots - 1 copies (each a DMA latency long) are
in flight while one is computed, across sequence boundaries. The G = Hq / Hkv
query heads sharing a kv head are stacked into the matmul rows of that head,
ordered (query position, head), so one decode token still fills G rows: q is
handed over as [B, Hkv, Sq * G, D]. In flash-attn's layout the kv heads of a
position are interleaved in each VMEM tile, so one matmul scores every head
against every key of a chunk and a mask keeps the same-head pairs (taking a
head out of its strided place costs more VPU work than the wasted MXU work);
in transformers' layout each head's keys are whole tiles and get their own
matmuls.

Schedule. Which cache blocks a step reads is data: each sequence has its own
length (and window start), so the wrapper builds a flat list of (sequence,
block) work items from the scalar-prefetched lengths and the grid walks
exactly that list (a dynamic grid dimension): blocks past a sequence's end,
or before its window, cost neither a DMA nor a grid step. With several
TensorCores per device (v5p) the list is cut into equal parts along a
parallel grid axis: a long sequence of a small batch is then split across
cores (flash-decoding), each core writes a partial (output, logsumexp) per
sequence it touched, and `combine` merges them (plus the attention sinks).

Numerics. Logits and the online softmax are f32; p is cast to the value dtype
for the PV matmul (f32 accumulate). Cache rows past a sequence's length may
hold anything (an empty cache is uninitialised memory): their logits are
masked and their V rows zeroed before the PV matmul, so not even a NaN there
reaches the output.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG_INF = -1e30
DECODE_CHUNK = 256  # positions scored at a time in a [.., S, Hkv, D] block
UNBOUNDED = 1 << 29
NT_DIMS = (((1,), (1,)), ((), ()))
NN_DIMS = (((1,), (0,)), ((), ()))

# A schedule word: flags in the low bits, then the sequence, then its block.
INIT, FINAL, COMPUTE = 1, 2, 4
SEQ_SHIFT = 3
MAX_SEQS = 1 << 12
BLOCK_SHIFT = SEQ_SHIFT + 12
MAX_BLOCKS = 1 << (31 - BLOCK_SHIFT)


@dataclasses.dataclass(frozen=True)
class DecodeParams:
    """Static description of one decode launch (hashable)."""

    q_len: int  # Sq: query positions per sequence
    group: int  # G: query heads per kv head
    block_rows: int  # matmul rows per q block (of the Sq * G rows)
    heads_per_block: int
    page: int  # positions per cache block input (a page, or a contiguous block)
    pages_per_step: int  # cache block inputs per step (paged: pages; else 1)
    head_dim: int
    head_dim_v: int
    scale: float
    softcap: float | None
    causal: bool
    left: int  # UNBOUNDED when unbounded
    right: int
    paged: bool
    squeezed: bool  # one kv head: the cache is viewed as [.., S, D]
    cores: int
    vmem_limit: int
    slots: int = 4  # the DMA ring's items (slots - 1 in flight)
    heads_major: bool = False  # contiguous cache laid out [B, Hkv, S, D] (transformers')
    has_kv_mask: bool = False  # heads_major only: per-key keep mask [B, S] int32
    # Every sequence's q, output (and lse) rows stay in VMEM, as [B, hb * br, ..]:
    # q is copied once beside the first cache blocks, the outputs written back
    # once at the end (needs block_rows == all rows).
    resident: bool = False
    direct: bool = False  # resident, one core, no sinks: o is final, no combine step
    o_dtype: str = "float32"  # the output's: q's when direct
    with_lse: bool = True
    cache_len: int = 0  # contiguous: positions per cache row

    @property
    def block_kv(self) -> int:
        return self.page * self.pages_per_step


def _row_to_col(x):
    n = x.shape[1]
    return jnp.transpose(jnp.broadcast_to(x, (8, n)))[:, 0:1]


def _div(x, n: int):
    """x // n for int32 vectors x >= 0: a shift for powers of two, else an
    exact float floor (x < 2**22), as Mosaic has no vector integer division."""
    if n & (n - 1) == 0:
        return x >> (n.bit_length() - 1)
    return jnp.floor((x.astype(jnp.float32) + 0.5) * (1.0 / n)).astype(jnp.int32)


def _decode_kernel(lens_ref, sched_ref, table_ref, q_ref, k_hbm, v_hbm, *refs, prm: DecodeParams):
    refs = list(refs)
    mask_hbm = refs.pop(0) if prm.has_kv_mask else None
    o_ref = refs.pop(0)
    lse_ref = refs.pop(0) if prm.with_lse else None
    kbuf, vbuf, sem, m_ref, l_ref, acc_ref = (refs.pop(0) for _ in range(6))
    mbuf = refs.pop(0) if prm.has_kv_mask else None
    if prm.resident:  # q_ref is the HBM array; qbuf its VMEM copy
        qbuf, qsem = refs
    n, hb, br, nslot = prm.pages_per_step, prm.heads_per_block, prm.block_rows, prm.slots
    c, h, qblk, t = (pl.program_id(i) for i in range(4))

    def item(u):
        """(live, sequence, block, length, flags) of work item u of this core
        (the schedule has `slots` dead items past the longest core's list)."""
        word = sched_ref[c, u]
        b = (word >> SEQ_SHIFT) & (MAX_SEQS - 1)
        return (word & COMPUTE) != 0, b, word >> BLOCK_SHIFT, lens_ref[b], word & 7

    def page_start(blk, p):
        """Nominal first position of page p of a block, and where its copy starts
        (a contiguous cache's last block is copied from S - page, inside the cache)."""
        start = (blk * n + p) * prm.page
        if prm.paged:
            return start, start
        return start, jnp.minimum(start, prm.cache_len - prm.page)

    def copies(u, slot):
        """The K and V copies of item u's pages into `slot`, each with whether it runs."""
        live, b, blk, length, _ = item(u)
        out = []
        for p in range(n):
            start, src = page_start(blk, p)
            if prm.paged:
                lead = table_ref[b, jnp.minimum(blk * n + p, table_ref.shape[1] - 1)]
                pos = pl.ds(0, prm.page)
            else:
                lead, pos = table_ref[b], pl.ds(src, prm.page)
            run = jnp.logical_and(live, start < length)
            for i, (hbm, buf) in enumerate(((k_hbm, kbuf), (v_hbm, vbuf))):
                if prm.squeezed:
                    view = hbm.at[lead, pos]
                elif prm.heads_major:
                    view = hbm.at[lead, pl.ds(h * hb, hb), pos]
                else:
                    view = hbm.at[lead, pos, pl.ds(h * hb, hb)]
                cp = pltpu.make_async_copy(view, buf.at[slot, p], sem.at[slot, i, p])
                out.append((run, cp))
            if prm.has_kv_mask:
                view = mask_hbm.at[pl.ds(b, 1), pos]
                out.append((run, pltpu.make_async_copy(view, mbuf.at[slot, p], sem.at[slot, 2, p])))
        return out

    def start_item(u):
        for run, cp in copies(u, lax.rem(u, nslot)):

            @pl.when(run)
            def _():
                cp.start()

    # A ring of `slots` items: item t + slots - 1 is requested while item t is
    # computed, so slots - 1 items (each a DMA latency long) stay in flight.
    @pl.when(t == 0)
    def _prologue():
        if prm.resident:
            rows_h = pl.ds(h * hb * br, hb * br)
            q_copy = pltpu.make_async_copy(q_ref.at[:, rows_h], qbuf, qsem)
            q_copy.start()
        for u in range(nslot - 1):
            start_item(u)
        if prm.resident:
            q_copy.wait()
            # Sequences with no work are never visited: their rows read as
            # empty (output 0, lse -inf).
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
            if prm.with_lse:
                lse_ref[...] = jnp.full(lse_ref.shape, -jnp.inf, jnp.float32)

    start_item(t + nslot - 1)
    for run, cp in copies(t, lax.rem(t, nslot)):

        @pl.when(run)
        def _():
            cp.wait()

    _, b, blk, length, flags = item(t)
    slot = lax.rem(t, nslot)

    @pl.when((flags & INIT) != 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # The matmul rows are (kv head, row) of every head in the block; the
    # keys are the block's (position, kv head) pairs as they lie in VMEM, so
    # one matmul scores every head against every key and the mask keeps the
    # same-head pairs. That wastes MXU work (hb x) that decode has to spare,
    # and never takes a head out of its strided place in the block.
    rows = hb * br
    ri = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    row_head = _div(ri, br)
    qrow = qblk * br + ri - row_head * br
    qpos = length - prm.q_len + _div(qrow, prm.group)
    # Scores are computed a chunk of positions at a time: the f32 tile of a
    # whole 1k-position block of 8 heads (32 x 8192) is spilled and reloaded
    # between its phases (tpu7x: VALU-bound, 1.44x the KV roofline at 64 x 4k
    # vs 1.31x with the same bytes as four 256-position pages).
    chunk = DECODE_CHUNK if prm.page % DECODE_CHUNK == 0 else prm.page
    cols = chunk * hb
    ci = lax.broadcasted_iota(jnp.int32, (1, cols), 1)
    col_head = ci - _div(ci, hb) * hb
    col_pos = _div(ci, hb)
    vi = lax.broadcasted_iota(jnp.int32, (cols, 1), 0)
    v_pos = _div(vi, hb)

    def page(p, tail):
        start, src = page_start(blk, p)

        def body(c, carry):
            first = src + c * chunk
            kidx = first + col_pos
            visible = row_head == col_head
            if tail:  # positions past the length, or before the page (a shifted copy)
                visible = jnp.logical_and(visible, jnp.logical_and(kidx < length, kidx >= start))
            if prm.right < UNBOUNDED:
                visible = jnp.logical_and(visible, kidx <= qpos + prm.right)
            if prm.left < UNBOUNDED:
                visible = jnp.logical_and(visible, kidx >= qpos - prm.left)
            at = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
            k = kbuf[slot, p, at].reshape(cols, prm.head_dim)
            v = vbuf[slot, p, at].reshape(cols, prm.head_dim_v)
            if tail:  # rows past the length may hold NaN
                vpos = first + v_pos
                v = jnp.where(jnp.logical_and(vpos < length, vpos >= start), v, jnp.zeros_like(v))
            q = qbuf[b] if prm.resident else q_ref[...].reshape(rows, prm.head_dim)
            s = lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32) * prm.scale
            if prm.softcap is not None:
                s = prm.softcap * jnp.tanh(s * (1.0 / prm.softcap))
            s = jnp.where(visible, s, NEG_INF)
            m_prev = m_ref[...].reshape(rows, 1)
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p_ = jnp.where(visible, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_new = alpha * l_ref[...].reshape(rows, 1) + jnp.sum(p_, axis=1, keepdims=True)
            acc = alpha * acc_ref[...].reshape(rows, prm.head_dim_v) + lax.dot_general(
                p_.astype(v.dtype), v, NN_DIMS, preferred_element_type=jnp.float32
            )
            m_ref[...] = m_new.reshape(m_ref.shape)
            l_ref[...] = l_new.reshape(l_ref.shape)
            acc_ref[...] = acc.reshape(acc_ref.shape)
            return carry

        lax.fori_loop(0, prm.page // chunk, body, 0)

    def page_heads_major(p, tail):
        """One page of a [.., Hkv, S, D] cache: each head's keys are whole
        tiles, so every head runs its own small matmuls, nothing wasted."""
        start, src = page_start(blk, p)
        kidx = src + lax.broadcasted_iota(jnp.int32, (1, prm.page), 1)
        r = qblk * br + lax.broadcasted_iota(jnp.int32, (br, 1), 0)
        qpos_h = length - prm.q_len + _div(r, prm.group)
        visible = None
        if tail:
            visible = jnp.logical_and(kidx < length, kidx >= start)
        if prm.has_kv_mask:
            keep = mbuf[slot, p] != 0
            visible = keep if visible is None else jnp.logical_and(visible, keep)
        if prm.right < UNBOUNDED:
            v_r = kidx <= qpos_h + prm.right
            visible = v_r if visible is None else jnp.logical_and(visible, v_r)
        if prm.left < UNBOUNDED:
            v_l = kidx >= qpos_h - prm.left
            visible = v_l if visible is None else jnp.logical_and(visible, v_l)
        vcol = None
        if tail:
            vp = src + lax.broadcasted_iota(jnp.int32, (prm.page, 1), 0)
            vcol = jnp.logical_and(vp < length, vp >= start)
        for hh in range(hb):
            k = kbuf[slot, p, hh]
            v = vbuf[slot, p, hh]
            if vcol is not None:  # rows past the length may hold NaN
                v = jnp.where(vcol, v, jnp.zeros_like(v))
            q = qbuf[b, pl.ds(hh * br, br)] if prm.resident else q_ref[hh]
            s = lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32) * prm.scale
            if prm.softcap is not None:
                s = prm.softcap * jnp.tanh(s * (1.0 / prm.softcap))
            if visible is not None:
                s = jnp.where(visible, s, NEG_INF)
            m_prev = m_ref[hh]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p_ = jnp.exp(s - m_new)
            if visible is not None:
                p_ = jnp.where(visible, p_, 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_ref[hh] = alpha * l_ref[hh] + jnp.sum(p_, axis=1, keepdims=True)
            acc_ref[hh] = alpha * acc_ref[hh] + lax.dot_general(
                p_.astype(v.dtype), v, NN_DIMS, preferred_element_type=jnp.float32
            )
            m_ref[hh] = m_new

    if prm.heads_major:
        page = page_heads_major  # noqa: F811 - the layout picks the page body

    compute = (flags & COMPUTE) != 0
    for p in range(n):
        # Pages of a step past the sequence's end were not copied and are
        # skipped; only a page holding the end (or a shifted last block) pays
        # for the tail mask.
        start, src = page_start(blk, p)
        end = start + prm.page
        whole = jnp.logical_and(end <= length, src == start)

        @pl.when(jnp.logical_and(compute, whole))
        def _whole(p=p):
            page(p, tail=False)

        @pl.when(jnp.logical_and(compute, jnp.logical_and(jnp.logical_not(whole), start < length)))
        def _tail(p=p):
            page(p, tail=True)

    @pl.when((flags & FINAL) != 0)
    def _final():
        l = l_ref[...]
        empty = l == 0.0
        o = (acc_ref[...] / jnp.where(empty, 1.0, l)).astype(o_ref.dtype)
        lse = jnp.where(empty, -jnp.inf, m_ref[...] + jnp.log(jnp.where(empty, 1.0, l)))
        if prm.resident:
            o_ref[b] = o.reshape(hb * br, prm.head_dim_v)
            if prm.with_lse:
                lse_ref[b] = lse.reshape(hb * br, 1)
        else:
            o_ref[...] = o
            if prm.with_lse:
                lse_ref[...] = lse


# ---------------------------------------------------------------------------
# The schedule (traced JAX, built per call from the lengths).


def block_range(prm: DecodeParams, lengths):
    """(first, count) cache blocks of each sequence that hold a visible key."""
    bkv = prm.block_kv
    end = lax.div(lengths + (bkv - 1), jnp.int32(bkv))
    first = jnp.zeros_like(lengths)
    if prm.left < UNBOUNDED:
        lo = jnp.maximum(lengths - prm.q_len - prm.left, 0)
        first = jnp.minimum(lax.div(lo, jnp.int32(bkv)), end)
    return first, end - first


def schedule(prm: DecodeParams, lengths, max_blocks: int):
    """(sched [cores, steps_cap], steps, touched [cores, B]) for the grid walk.

    steps is the dynamic grid extent (work items per core, at least 1);
    touched says which (core, sequence) partials the kernel wrote.
    """
    nseq = lengths.shape[0]
    first, count = block_range(prm, lengths)
    end_cum = jnp.cumsum(count)
    start_cum = end_cum - count
    total = end_cum[-1]
    cores = prm.cores
    per_core = lax.div(total + (cores - 1), jnp.int32(cores))
    # Room for every block of every sequence on one core, plus the DMA ring's
    # look-ahead past the last item (dead items: no flags).
    cap = -(-(nseq * max_blocks) // cores) + prm.slots
    t = jnp.arange(cap, dtype=jnp.int32)[None, :]
    core = jnp.arange(cores, dtype=jnp.int32)[:, None]
    g = core * per_core + t
    core_end = jnp.minimum((core + 1) * per_core, total)
    live = g < core_end
    g_live = jnp.minimum(g, jnp.maximum(core_end - 1, 0))  # padding repeats the last item
    # Item g's sequence is the number of sequences that end at or before it,
    # and its block g - off[seq] with off = start_cum - first. Both are one
    # compare-and-sum over the sequences: gathers (searchsorted, first[seq])
    # would each cost the TPU a round trip through SMEM. off[seq] telescopes:
    # off[0] plus the steps off[j + 1] - off[j] of the sequences before it.
    before = end_cum[None, None, :] <= g_live[..., None]
    seq = jnp.minimum(jnp.sum(before, axis=-1, dtype=jnp.int32), nseq - 1)
    off = start_cum - first
    step = jnp.concatenate([off[1:] - off[:-1], jnp.zeros((1,), jnp.int32)])
    blk = g_live - off[0] - jnp.sum(jnp.where(before, step, 0), axis=-1, dtype=jnp.int32)
    prev_seq = jnp.concatenate([jnp.full((cores, 1), -1, jnp.int32), seq[:, :-1]], axis=1)
    next_seq = jnp.concatenate([seq[:, 1:], jnp.full((cores, 1), -1, jnp.int32)], axis=1)
    last_live = g == core_end - 1
    flags = (
        jnp.where(live & (prev_seq != seq), INIT, 0)
        | jnp.where(live & ((next_seq != seq) | last_live), FINAL, 0)
        | jnp.where(live, COMPUTE, 0)
    )
    sched = (blk << BLOCK_SHIFT) | (seq << SEQ_SHIFT) | flags
    core_start = jnp.arange(cores, dtype=jnp.int32)[:, None] * per_core
    touched = (
        (count[None, :] > 0) & (start_cum[None, :] < core_end) & (end_cum[None, :] > core_start)
    )
    return sched.astype(jnp.int32), jnp.maximum(per_core, 1), touched


def safe_table(prm: DecodeParams, block_table, lengths):
    """The block table with every slot past a sequence's last page (and
    before its window) replaced by a page it does read, so no index map
    can point outside the cache and skipped slots repeat a DMA'd page."""
    pages = jnp.arange(block_table.shape[1], dtype=jnp.int32)[None, :]
    last = jnp.maximum(lax.div(lengths + (prm.page - 1), jnp.int32(prm.page)) - 1, 0)[:, None]
    first, _ = block_range(prm, lengths)
    lo = jnp.minimum(first * prm.pages_per_step, last[:, 0])[:, None]
    idx = jnp.clip(pages, lo, last)
    return jnp.take_along_axis(block_table.astype(jnp.int32), idx, axis=1)


# ---------------------------------------------------------------------------
# The pallas_call.


def decode_call(
    prm: DecodeParams, q4, k_cache, v_cache, lengths, sched, steps, table, interpret, kv_mask=None
):
    """Partial outputs (o [cores, B, Hkv, R, Dv] in prm.o_dtype, lse [cores, B,
    Hkv, R, 1] f32 or None without prm.with_lse).

    q4 [B, Hkv, R, D]; caches contiguous [Bc, S, Hkv, D] (or [Bc, S, D] when
    squeezed) with `table` [B] the cache row of each sequence, or paged
    [P, page, Hkv, D] (or [P, page, D]) with `table` [B, pages] (safe_table).
    The caches stay in HBM: the kernel copies each step's pages itself.
    """
    nseq, hkv, rows, d = q4.shape
    hb, br, n, nslot = prm.heads_per_block, prm.block_rows, prm.pages_per_step, prm.slots
    cores = prm.cores
    nq = -(-rows // br)
    grid = (cores, hkv // hb, nq, steps)

    def unpack(s, c, t):
        word = s[c, t]
        return (word >> SEQ_SHIFT) & (MAX_SEQS - 1), word >> BLOCK_SHIFT

    def q_map(c, h, i, t, lens, s, tab):
        b, _ = unpack(s, c, t)
        return (b, h, i, 0)

    def out_map(c, h, i, t, lens, s, tab):
        b, _ = unpack(s, c, t)
        return (c, b, h, i, 0)

    o_dtype = jnp.dtype(prm.o_dtype)
    if prm.resident:  # every sequence's q and outputs in VMEM, (head, row) as one axis
        flat = hb * br
        q_spec = pl.BlockSpec(memory_space=pl.ANY)
        q4 = q4.reshape(nseq, hkv * rows, d)
        out_shape = [jax.ShapeDtypeStruct((cores, nseq, hkv * rows, prm.head_dim_v), o_dtype)]
        out_specs = [
            pl.BlockSpec((None, nseq, flat, prm.head_dim_v), lambda c, h, *_: (c, 0, h, 0))
        ]
        if prm.with_lse:
            out_shape.append(jax.ShapeDtypeStruct((cores, nseq, hkv * rows, 1), jnp.float32))
            out_specs.append(pl.BlockSpec((None, nseq, flat, 1), lambda c, h, *_: (c, 0, h, 0)))
    else:
        q_spec = pl.BlockSpec((None, hb, br, d), q_map)
        out_shape = [jax.ShapeDtypeStruct((cores, nseq, hkv, rows, prm.head_dim_v), o_dtype)]
        out_specs = [pl.BlockSpec((None, None, hb, br, prm.head_dim_v), out_map)]
        if prm.with_lse:
            out_shape.append(jax.ShapeDtypeStruct((cores, nseq, hkv, rows, 1), jnp.float32))
            out_specs.append(pl.BlockSpec((None, None, hb, br, 1), out_map))
    in_specs = [
        q_spec,
        pl.BlockSpec(memory_space=pl.ANY),
        pl.BlockSpec(memory_space=pl.ANY),
    ]
    if prm.squeezed:
        block = lambda dim: (prm.page, dim)  # noqa: E731
    elif prm.heads_major:
        block = lambda dim: (hb, prm.page, dim)  # noqa: E731
    else:
        block = lambda dim: (prm.page, hb, dim)  # noqa: E731
    scratch = [
        pltpu.VMEM((nslot, n, *block(prm.head_dim)), k_cache.dtype),
        pltpu.VMEM((nslot, n, *block(prm.head_dim_v)), v_cache.dtype),
        pltpu.SemaphoreType.DMA((nslot, 3, n)),
        pltpu.VMEM((hb, br, 1), jnp.float32),
        pltpu.VMEM((hb, br, 1), jnp.float32),
        pltpu.VMEM((hb, br, prm.head_dim_v), jnp.float32),
    ]
    operands = [q4, k_cache, v_cache]
    if prm.has_kv_mask:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        scratch.append(pltpu.VMEM((nslot, n, 1, prm.page), jnp.int32))
        operands.append(kv_mask)
    if prm.resident:
        scratch += [pltpu.VMEM((nseq, hb * br, d), q4.dtype), pltpu.SemaphoreType.DMA(())]
    # Per the cache's capacity: the lengths are data, unknown when tracing.
    keys = prm.cache_len or table.shape[1] * prm.page
    q_rows = nseq * hkv * rows
    cost = pl.CostEstimate(
        flops=int(2 * q_rows * keys * (prm.head_dim + prm.head_dim_v)),
        transcendentals=int(q_rows * keys),
        bytes_accessed=int(
            k_cache.dtype.itemsize * (q4.size + nseq * hkv * keys * (prm.head_dim + prm.head_dim_v))
        ),
    )
    res = pl.pallas_call(
        functools.partial(_decode_kernel, prm=prm),
        out_shape=tuple(out_shape),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=grid,
            in_specs=in_specs,
            out_specs=tuple(out_specs),
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            # The step axis carries the DMA ring; the others restart it.
            dimension_semantics=("parallel", "arbitrary", "arbitrary", "arbitrary"),
            vmem_limit_bytes=prm.vmem_limit,
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="flash_attention_decode",
    )(lengths, sched, table, *operands)
    o = res[0].reshape(cores, nseq, hkv, rows, prm.head_dim_v)
    lse = res[1].reshape(cores, nseq, hkv, rows, 1) if prm.with_lse else None
    return o, lse


def combine(o, lse, touched, sinks_rows):
    """Merges the cores' partials: (out [B, Hkv, R, Dv] f32, lse [B, Hkv, R] f32).

    sinks_rows [Hkv, R] f32 or None: each row's sink logit, one more term in
    the softmax denominator. Rows that see no key and have no sink: output 0,
    logsumexp +inf (flash-attn's convention).
    """
    lse = jnp.where(touched[:, :, None, None], lse[..., 0], -jnp.inf)
    if sinks_rows is not None:
        lse = jnp.concatenate([lse, jnp.broadcast_to(sinks_rows, lse.shape[1:])[None]], axis=0)
    top = jnp.max(lse, axis=0)
    top_safe = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - top_safe)  # 0 for untouched partials and empty rows
    total = jnp.sum(w, axis=0)
    empty = total == 0.0
    w = w / jnp.where(empty, 1.0, total)
    parts = o.shape[0]
    out = jnp.sum(jnp.where(w[:parts, ..., None] > 0, o, 0.0) * w[:parts, ..., None], axis=0)
    lse_out = jnp.where(empty, jnp.inf, top_safe + jnp.log(jnp.where(empty, 1.0, total)))
    return out, lse_out
