"""Flash attention's backward Pallas kernels: dK/dV (kv-major walk) and dQ
(q-major walk), from the forward's output and per-row logsumexp (no forward
recomputation). Layout, schedule and masks as in kernel_fwd.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import schedule as bsched
from . import tiling
from .kernel_fwd import (
    LOG2E,
    NN_DIMS,
    NT_DIMS,
    KernelParams,
    _common_specs,
    _compiler_params,
    _decode,
    _dot_f32,
    _flag,
    _flat_rows,
    _unit_pairs,
    _k_side,
    _key_valid_row,
    _keys,
    _logits,
    _meta_inputs,
    _minor_dims,
    _q_side,
    _rows,
    _run_pair,
    _set_rows,
    _swap_refs,
    _visible,
    _visible_chunks,
    _zero_tail_rows,
)

# ---------------------------------------------------------------------------
# dK/dV kernel: kv-major schedule, logits transposed (keys on sublanes) so
# the per-query logsumexp and delta are lane-major rows, as stored. The
# outputs are accumulated transposed too, dV^T = dO^T P^T and dK^T = Q^T dS^T
# [D, keys]: row-major, dV = P dO at Dv = 128 half-fills the 256-wide result
# of v6e/tpu7x and pops both halves of every 256-row partial, as the
# forward's PV did (kernel_fwd.py); [D, keys] fills it. dK/dV are transposed
# once per kv block, at the end.
#
# With `fuse_dq` (tiling.plan: when the kv head's whole dQ fits in VMEM) the
# kernel also accumulates dQ^T = K^T dS^T [D, rows] of every q block of the
# kv head, in f32, and writes dQ when the head's walk ends: the dQ kernel
# would compute K q^T, V dO^T and exp again, 2 of its 3 matmuls, for the
# same dS (v6e T = 8k causal d=128: dK/dV 2,850 + dQ 2,054 us -> 3,205).
#
# With `stream_dq` (tiling.plan: when the head's dQ does not fit, tpu7x
# 32k: 64 MiB of 48) dQ^T accumulates in an f32 HBM buffer instead, a q
# block's (Gb, D, br) at a time: each step reads its block into one of three
# VMEM slots (the read issued a step ahead), adds to it and writes it back,
# and XLA scales, transposes and casts the buffer once at the end. A step's
# compute covers the block's read and write (tpu7x, 512 x 1024 blocks at
# 32/8 heads: 1 MiB each way against ~5 us of MXU work); the dQ kernel it
# replaces would compute K q^T, V dO^T and exp again.
#
# A fully visible pair runs as the forward's does, a two-buffer pipeline over
# lane chunks of query rows (tiling.fwd_chunk_lanes): chunk c+1's logits and
# dP, their exp and dS, stored as P and dS in the matmul dtype, while chunk
# c's dV, dK (and dQ) matmuls read the other buffers. A masked pair of a
# dense call runs the same pipeline once per key sub-tile range its rows can
# see, the mask applied to P and dS (masked_pair).
#
# With `own_delta` (fused calls without sinks) the kernel reads O in place
# of delta and derives delta = rowsum(dO * O) (- an lse cotangent) of a q
# block at its first computed pair (the schedule's FIRST flag) into VMEM,
# where its later pairs read it: an XLA pass over O and dO fewer. A fully
# visible first pair derives it chunk by chunk inside its pipeline, where the
# scheduler overlaps it with the matmuls; any other does the block at once.


# A pair's pipeline of up to this many lane chunks runs unrolled, one basic
# block (v6e d=256's 1024-position blocks: 8 chunks). As a loop of two
# chunks a trip it paid ~535 bundles a trip above the trip's 5,120 MXU
# cycles: v6e 4k d=256 dK/dV 924.6 us against 892.5 unrolled, at 1.5x the
# code (60.4k static bundles against 40.5k). Up to 4 chunks the loop had
# one trip, and the code is the same.
UNROLLED_CHUNKS = 8


def _dkdv_kernel(
    sched_ref,
    *refs,
    prm: KernelParams,
    interpret: bool,
    fuse_dq: bool,
    own_delta: bool,
    has_dlse: bool,
    stream_dq: bool = False,
    defer_dq_waits: bool = False,
):
    refs = list(refs)
    if own_delta:  # O's block indices: its index map's alone
        refs.pop(0)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]  # own_delta: O, not delta
    refs = refs[6:]
    dlse_ref = refs.pop(0) if has_dlse else None  # own_delta: the lse cotangent's rows
    qpos_ref = refs.pop(0) if prm.has_qpos else None
    qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if prm.has_segments else (None, None)
    if stream_dq:
        refs.pop(0)  # the zeroed accumulator the output aliases
    dk_ref, dv_ref = refs[:2]
    # (B, Hkv, Gb, q blocks * br, D) (swapped: (..., D, q blocks * br)), in
    # HBM; stream_dq: (B, Hkv, q blocks, Gb, D, br) f32
    dq_hbm = refs.pop(2) if fuse_dq else None
    k_swapped = v_swapped = None
    if prm.swapped:  # K and V row-major, made once a kv block (they stay for its walk)
        k_swapped, v_swapped = k_ref, v_ref
        k_ref, v_ref = refs[-2:]
        refs = refs[:-2]
        q_ref, do_ref = _swap_refs(prm, q_ref, do_ref)
        if own_delta:  # O's blocks
            (delta_ref,) = _swap_refs(prm, delta_ref)
    # dk_acc: (D, bkv); dv_acc: (Dv, bkv); p_bufs, ds_bufs: 2 x (bkv, chunk lanes);
    # fused: dq_acc (q blocks, Gb, D, br) f32, kt (D, bkv), dq_out (2, Gb, br, D), sems (2,),
    # dq_state (3,) SMEM: q blocks of the head whose dQ is written, then a
    # flag a slot: 1 while its copy may be in flight (_write_dq_blocks)
    dk_acc, dv_acc, p0, p1, ds0, ds1 = refs[2:8]
    # stream_dq: dq_acc (3, Gb, D, br) f32 slots, kt, read and write sems (3,)
    # each, state (8,) SMEM (stream_dq_step)
    if fuse_dq and stream_dq:
        dq_acc, kt_ref, sem_r, sem_w, dq_state = refs[8:13]
    elif fuse_dq:
        dq_acc, kt_ref, dq_out, dq_sems, dq_state = refs[8:13]
    o_ref = None
    if own_delta:  # delta_all: (q blocks, Gb, br) f32, each q block's delta rows
        o_ref, delta_all = delta_ref, refs[-1]

    g = prm.geom
    gb, br, bkv = prm.heads_in_block, g.block_pos, g.block_kv
    q_tail = g.q_rows_total % br != 0
    kv_tail = g.kv_len % bkv != 0
    # Full pairs: chunk c of lc query rows is (head, lane offset) of the block.
    lc = prm.block_chunk_lanes
    n_chunks = gb * br // lc
    fold = prm.softcap is None
    per = br // lc if lc <= br else 0  # chunks a head; 0: several heads a chunk
    depth = (per if per % 2 == 0 else 2 * per) if per else 2  # chunks a loop step, even
    if n_chunks <= UNROLLED_CHUNKS:  # no loop: the pipeline is one basic block
        depth = n_chunks
    # (masked pairs: see diagonal_pair)
    ck = prm.sub[1] if prm.sub is not None else bkv
    step_d = math.gcd(br, bkv)
    diagonal_only = (
        n_chunks > 1
        and per >= 1
        and prm.sub is not None
        and prm.right == 0
        and prm.left >= br + bkv  # the window cuts no pair on the diagonal
        and not (prm.has_qpos or prm.has_segments or kv_tail or q_tail)
        and step_d % ck == 0
        and prm.q_offset % bkv == 0
    )
    # Causal self-attention with no window, q_offset >= 0: every q block
    # sees key 0, so its first computed pair is kv block 0's, a full pair or
    # a diagonal one whose first key range reaches every row. That pair's
    # pipeline stores the block's first dQ^T (consume's dq_start) where a
    # loop zeroed every block's at the head's first step (tpu7x 4k d=128:
    # 130 bundles a block, no matmul beside them).
    dq_starts_in_pipeline = (
        fuse_dq
        and not stream_dq
        and own_delta
        and diagonal_only
        and prm.left >= bsched.UNBOUNDED
        and prm.q_offset >= 0
    )
    # Where the grid runs in order (defer_dq_waits) and the diagonal pairs
    # start each kv block's walk (q_offset 0, a kv block one or two q
    # blocks), each kv block's first step (INIT: its d = 0 diagonal pair)
    # writes the dQ of the q blocks the walk has finished, those of the
    # kv block before, or at a head's first step the last head's last ones
    # (no kv block follows theirs): the same number each time, so their
    # scaling, transposes and casts go into that pair's unrolled pipeline,
    # one basic block, where the scheduler overlaps them with its matmuls.
    # Written by a loop of their own, they were 595 bundles a block that no
    # matmul overlapped (v6e 8k d=256: 128 blocks, 76k cycles of 6.08M).
    # The kv block's own start (zeroed dK, dV; K^T for dQ) goes there too.
    dq_writes_in_pipeline = (
        dq_starts_in_pipeline
        and defer_dq_waits
        and prm.q_offset == 0
        and bkv % br == 0
        and bkv // br <= 2
    )
    step = pl.program_id(2)
    bh = pl.program_id(0), pl.program_id(1)  # read here: interpret mode has no program_id in a loop
    heads = pl.num_programs(1)
    last_head = (bh[0] == pl.num_programs(0) - 1) & (bh[1] == heads - 1)
    j, i, flags = _decode(sched_ref, step)
    first_pair = None  # own_delta: this step is its q block's first computed pair
    if own_delta:
        delta_ref = delta_all.at[i]
        first_pair = _flag(flags, bsched.FIRST)

    def init_kv_block():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)
        if prm.swapped:
            k_ref[...] = jnp.transpose(k_swapped[...])
            v_ref[...] = jnp.transpose(v_swapped[...])
        if fuse_dq:
            kt = k_swapped[...] if prm.swapped else jnp.transpose(k_ref[...])
            if kv_tail:  # unspecified keys past the end must not reach K^T dS^T
                kt = jnp.where(_key_valid_row(prm, j, 0, bkv), kt, jnp.zeros_like(kt))
            kt_ref[...] = kt

    if not dq_writes_in_pipeline:  # else the INIT step's diagonal pipeline does it
        pl.when(_flag(flags, bsched.INIT))(init_kv_block)

    dq_here = None  # this step's q block's dQ^T accumulator, (Gb, D, br) f32
    if fuse_dq and stream_dq:
        release_dq, dq_here = _stream_dq_step(
            sched_ref, step, i, flags, dq_acc, dq_hbm.at[bh[0], bh[1]], sem_r, sem_w, dq_state
        )
    elif fuse_dq:
        dq_here = dq_acc.at[i]

        @pl.when(step == 0)
        def _init_dq():
            # a block at a time: no vector shape of the program holds the
            # sequence's length (tests/gate.py covers shorter programs by longer)
            def zero(qi, carry):
                dq_acc[qi] = jnp.zeros(dq_acc.shape[1:], jnp.float32)
                return carry

            if not dq_starts_in_pipeline:
                lax.fori_loop(0, dq_acc.shape[0], zero, 0)
            dq_state[0] = 0

        # Deferred (defer_dq_waits): a head's last dQ copies are waited for
        # where the next head reuses their slots, so their latency (1.35 us
        # each, the last one issued at the head's last step) overlaps that
        # head's first steps instead of ending the step that issued them
        # (tpu7x 4k d=128 dK/dV: 671.3 -> 661.1 us); only the grid's last
        # step waits. The slot flags then carry over from head to head and
        # start at the grid's first step.
        @pl.when(
            jnp.logical_and(step == 0, jnp.logical_and(bh[0] == 0, bh[1] == 0))
            if defer_dq_waits
            else step == 0
        )
        def _no_copies_in_flight():
            dq_state[1] = 0
            dq_state[2] = 0

        # Visible ranges never move back, so when the walk reaches a kv
        # block, the q blocks before its first one have had their last
        # contribution: their dQ is written then, each copy overlapping the
        # steps that follow. Written all at the head's end, each waited for
        # the copy two blocks back, and a copy's latency outlasts two blocks'
        # transposes (tpu7x 8k: 139.7k stalled cycles of the launch's 5.47M).
        if not dq_writes_in_pipeline:

            @pl.when(_flag(flags, bsched.INIT))
            def _write_final_dq():
                dst = dq_hbm.at[bh[0], bh[1]]
                _write_dq_blocks(prm, dq_acc, dq_out, dq_sems, dst, dq_state, i)

    def carried_dq_writes():
        """(q block, slot, its head's dQ in HBM) of each block the INIT step
        writes (dq_writes_in_pipeline), and whether there are any (not at
        the grid's first step)."""
        ratio = bkv // br
        head = bh[0] * heads + bh[1]
        prev = jnp.maximum(head - 1, 0)
        later = j > 0
        dst = dq_hbm.at[
            jnp.where(later, bh[0], lax.div(prev, heads)),
            jnp.where(later, bh[1], lax.rem(prev, heads)),
        ]
        # (nq itself, not nq - r, is the literal: tests/gate.py lets a longer
        # program cover this one where literals equal the accumulator's length)
        nq = dq_acc.shape[0]
        blocks = [jnp.where(later, i, nq) - r for r in range(ratio, 0, -1)]
        return [(qi, lax.rem(qi, 2), dst) for qi in blocks], jnp.logical_or(later, head > 0)

    def add_dq(ds, r0, rc, k0, ck):
        """dQ^T of rows r0:r0+rc of each head += K^T dS^T over keys k0:k0+ck."""
        kt = kt_ref[...] if ck == bkv else kt_ref[:, pl.ds(k0, ck)]
        dqt = _dot_f32(kt, ds.astype(kt.dtype), NN_DIMS, interpret)
        for hh in range(gb):
            part = dqt[:, hh * rc : (hh + 1) * rc]
            if rc == br:
                dq_here[hh] += part
            else:
                dq_here[hh, :, pl.ds(r0, rc)] += part

    def add_kv(dvt, dkt, k0, ck):
        """dV^T, dK^T of keys k0:k0+ck of the block += dvt, dkt."""
        if ck == bkv:
            dv_acc[...] += dvt
            dk_acc[...] += dkt
        else:
            dv_acc[:, pl.ds(k0, ck)] += dvt
            dk_acc[:, pl.ds(k0, ck)] += dkt

    def tile(masked, r0, rc, k0, ck):
        n = gb * rc
        q3 = _rows(q_ref, r0, rc)
        do3 = _rows(do_ref, r0, rc)
        lse = _flat_rows(_rows(lse_ref, r0, rc))
        delta = _flat_rows(_rows(delta_ref, r0, rc))
        if masked:
            qpos, qvalid, qseg = _q_side(prm, i, qpos_ref, qseg_ref, r0, rc)
            if q_tail:
                row = i * br + r0 + lax.broadcasted_iota(jnp.int32, (gb, rc, 1), 1)
                valid3 = row < g.q_rows_total
                q3 = _zero_tail_rows(q3, valid3)
                do3 = _zero_tail_rows(do3, valid3)
                lse = jnp.where(qvalid, lse, 0.0)
                delta = jnp.where(qvalid, delta, 0.0)
        q = q3.reshape(n, prm.head_dim)
        do = do3.reshape(n, prm.head_dim_v)
        k = _keys(k_ref, k0, ck)
        v = _keys(v_ref, k0, ck)
        s, t = _logits(prm, _dot_f32(k, q, NT_DIMS, interpret))
        p = jnp.exp(s - lse)
        if masked:
            kidx, kvalid, kseg = _k_side(prm, j, kseg_ref, k0, ck)
            mask = _visible(prm, qpos, qvalid, qseg, kidx, kvalid, kseg)
            p = jnp.where(mask, p, 0.0)
        dvt = _dot_f32(jnp.transpose(do), p.astype(do.dtype), NT_DIMS, interpret)
        dp = _dot_f32(v, do, NT_DIMS, interpret)
        ds = p * (dp - delta)
        if t is not None:
            ds = ds * (1.0 - t * t)
        dkt = _dot_f32(jnp.transpose(q), ds.astype(q.dtype), NT_DIMS, interpret)
        if fuse_dq:  # keys past the end: dP from unspecified V, 0 * inf in dS
            add_dq(jnp.where(mask, ds, 0.0) if masked else ds, r0, rc, k0, ck)
        add_kv(dvt, dkt, k0, ck)

    def at(k, r):
        """Chunk k * depth + r (k traced or static, r static) as (head, static lane offset)."""
        if per:
            return k * (depth // per) + r // per, (r % per) * lc
        return (k * depth + r) * (lc // br), 0

    def width(c):
        """Lanes of chunk c: (head, lane offset[, lanes]), lc unless given."""
        return c[2] if len(c) > 2 else lc

    def chunk_rows(c, ref):
        hh, off = c[:2]
        if per:
            w = width(c)
            return ref[hh, off : off + w] if w < br else ref[hh]
        return jnp.concatenate([ref[hh + t] for t in range(lc // br)], axis=0)

    def chunk_lane_row(c, ref):
        hh, off = c[:2]
        if per:
            return ref[pl.ds(hh, 1), off : off + width(c)]
        return jnp.concatenate([ref[pl.ds(hh + t, 1), :] for t in range(lc // br)], axis=1)

    def chunk_pos(c, shape, axis):
        """Query positions of chunk c's rows, along `axis` of an iota of `shape`."""
        hh, off = c[:2]
        r = lax.broadcasted_iota(jnp.int32, shape, axis)
        return i * br + off + (r if per else lax.rem(r, br))

    def chunk_mask(c, k0, kc):
        """(kc, lc) visibility of keys k0:k0+kc to chunk c's query rows."""
        pos = chunk_pos(c, (1, lc), 1)
        kidx, kvalid, _ = _k_side(prm, j, None, k0, kc)
        return _visible(  # compares only where a tail is
            prm,
            pos + prm.q_offset,
            pos < g.q_rows_total if q_tail else None,
            None,
            kidx,
            kvalid if kv_tail else None,
            None,
        )

    def zero_tail_rows(c, *xs):
        """xs (chunk c's rows of q, dO) with rows past the end zeroed: unspecified data."""
        valid = chunk_pos(c, (lc, 1), 0) < g.q_rows_total
        return [_zero_tail_rows(x, valid) for x in xs]

    def set_chunk_lane_row(c, ref, x):
        hh, off = c[:2]
        if per:
            ref[pl.ds(hh, 1), off : off + lc] = x
        else:
            for t in range(lc // br):
                ref[pl.ds(hh + t, 1), :] = x[:, t * br : (t + 1) * br]

    def diagonal_mask(c, k0, kc, d):
        """(kc, lanes) visibility of keys k0:k0+kc to chunk c's rows in a
        diagonal pair whose first row's position is d past its first key's
        (key <= position), None where every entry is visible: a static
        triangle."""
        off, w = c[1], width(c)
        if off + d >= k0 + kc - 1:
            return None
        lane = lax.broadcasted_iota(jnp.int32, (1, w), 1)
        return lax.broadcasted_iota(jnp.int32, (kc, w), 0) <= lane + (off + d - k0)

    def far_edge_mask(c, k0, kc, e):
        """(kc, lanes) visibility of keys k0:k0+kc to chunk c's rows in a
        pair a window's far edge cuts, where row r sees the pair's keys from
        r + e on (key >= position - left), None where every entry is
        visible: the diagonal's mirror."""
        off, w = c[1], width(c)
        if off + w - 1 + e <= k0:
            return None
        lane = lax.broadcasted_iota(jnp.int32, (1, w), 1)
        return lax.broadcasted_iota(jnp.int32, (kc, w), 0) >= lane + (off + e - k0)

    def produce(c, bufs, keys=None, first=False, triangle=None):
        """P and dS of chunk c into bufs; keys=(k0, kc): that key range of a
        masked pair, the mask applied (triangle: a static one, triangle(c,
        k0, kc), see diagonal_pair). first: derive the chunk's delta too."""
        q, do = chunk_rows(c, q_ref), chunk_rows(c, do_ref)
        lse = chunk_lane_row(c, lse_ref)
        if first:
            delta = _delta_row(chunk_rows(c, o_ref), do)
            if has_dlse:
                delta = delta - chunk_lane_row(c, dlse_ref)
            set_chunk_lane_row(c, delta_ref, delta)
        else:
            delta = chunk_lane_row(c, delta_ref)
        k, v = k_ref[...], v_ref[...]
        mask = None
        if keys is not None:
            k0, kc = keys
            if triangle is None:
                mask = chunk_mask(c, k0, kc)
            else:
                mask = triangle(c, k0, kc)
            k, v = _keys(k_ref, k0, kc), _keys(v_ref, k0, kc)
            if q_tail:
                q, do = zero_tail_rows(c, q, do)
                qvalid = chunk_pos(c, (1, lc), 1) < g.q_rows_total
                lse = jnp.where(qvalid, lse, 0.0)
                delta = jnp.where(qvalid, delta, 0.0)
        s = _dot_f32(k, q, NT_DIMS, interpret)
        t = None
        if fold:  # exp(s * scale - lse) as one exp2
            p = jnp.exp2(s * (prm.scale * LOG2E) - lse * LOG2E)
        else:
            s, t = _logits(prm, s)
            p = jnp.exp(s - lse)
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        dp = _dot_f32(v, do, NT_DIMS, interpret)
        ds = p * (dp - delta)
        if t is not None:
            ds = ds * (1.0 - t * t)
        if mask is not None and triangle is None:  # keys past the end: dP from unspecified V
            ds = jnp.where(mask, ds, 0.0)  # 0 * inf in dS
        n, w = k.shape[0], width(c)
        bufs[0][0:n, 0:w] = p.astype(bufs[0].dtype)
        bufs[1][0:n, 0:w] = ds.astype(bufs[1].dtype)

    def consume(c, bufs, keys=None, dq_start=False):
        """Chunk c's dV^T, dK^T (and dQ^T) matmuls from bufs. dq_start: this
        chunk's dQ^T is the first its lanes get (True, or a traced bool):
        stored, not added (see dq_starts_in_pipeline)."""
        q, do = chunk_rows(c, q_ref), chunk_rows(c, do_ref)
        if keys is None:
            k0, kc = 0, bkv
        else:
            k0, kc = keys
            if q_tail:  # unspecified rows past the end must not reach dV, dK
                q, do = zero_tail_rows(c, q, do)
        w = width(c)
        p, ds = bufs[0][0:kc, 0:w], bufs[1][0:kc, 0:w]
        dvt = _dot_f32(jnp.transpose(do), p, NT_DIMS, interpret)
        dkt = _dot_f32(jnp.transpose(q), ds, NT_DIMS, interpret)
        add_kv(dvt, dkt, k0, kc)
        if fuse_dq:
            kt = kt_ref[...] if kc == bkv else kt_ref[:, pl.ds(k0, kc)]
            dqt = _dot_f32(kt, ds, NN_DIMS, interpret)
            hh, off = c[:2]

            def accumulate(ref, x):
                if dq_start is True:
                    ref[...] = x
                elif dq_start is False:
                    ref[...] += x
                else:  # unspecified VMEM (NaN) must not reach the sum
                    ref[...] = jnp.where(dq_start, 0.0, ref[...]) + x

            if per:
                accumulate(dq_here.at[hh, :, pl.ds(off, w)], dqt)
            else:
                for t in range(lc // br):
                    accumulate(dq_here.at[hh + t], dqt[:, t * br : (t + 1) * br])

    bufs = ((p0, ds0), (p1, ds1))

    def full_pair():
        if not own_delta:
            _two_buffer_pipeline(n_chunks, depth, at, produce, consume, bufs)
            return

        @pl.when(first_pair)
        def _first():
            first_produce = functools.partial(produce, first=True)
            first_consume = functools.partial(consume, dq_start=dq_starts_in_pipeline)
            _two_buffer_pipeline(n_chunks, depth, at, first_produce, first_consume, bufs)

        @pl.when(jnp.logical_not(first_pair))
        def _later():
            _two_buffer_pipeline(n_chunks, depth, at, produce, consume, bufs)

    # Masked pairs of dense calls: the same pipeline once per key sub-tile
    # range (prm.sub's keys) the block's rows can see, the mask applied to P
    # and dS. Sub-tiles of (G x 256 rows) x 256 keys each ran logits to dQ as
    # one dependency chain over a spilled f32 tile (v6e 8k causal d=128: 640
    # such tiles a head took 1,590 cycles each for 896 of MXU work).
    def masked_range(k0):
        keys = (k0, prm.sub[1])
        _two_buffer_pipeline(
            n_chunks,
            depth,
            at,
            functools.partial(produce, keys=keys),
            functools.partial(consume, keys=keys),
            bufs,
        )

    def masked_pair():  # the key ranges any row of the block can see
        _visible_chunks(prm, i, j, 0, masked_range, rows=br)

    # Causal self-attention over whole blocks (no tail, positions or
    # segments, a window (if any) wider than a q and a kv block together;
    # q_offset a multiple of the kv block, block edges on the sub-tile grid):
    # a masked pair on the diagonal has its first row d positions past its
    # first key, d one of a few static values (0 where q block = kv block;
    # 0 or 512 for 512-row blocks of 1024 keys). Key range c is then visible
    # to the rows from c ck - d on, so the pair runs one pipeline, unrolled,
    # over those rows of each range (lane chunks from there, the last one
    # narrower), a static triangle masking the rows that share the range's
    # positions. Key ranges over the whole block computed the hidden rows
    # too (a 512-position pair of 256-key ranges: 4 lane widths of 3
    # needed) and the mask from positions: tpu7x 8k d=128 dK/dV 2,815.3 ->
    # 2,705.4 us. A pair a window's far edge cuts is the mirror: row r sees
    # its keys from r + e on, e = d - left, so key range c is visible to the
    # rows up to c ck + ck - 1 - e, a triangle at their far end (far_edge_pair).

    def diagonal_pair(d):
        chunks = [
            ((hh, off, min(lc, br - off)), (c * ck, ck))
            for c in range(bkv // ck)
            for hh in range(gb)
            for off in range(max(c * ck - d, 0), br, lc)
        ]
        # d >= 0: key range 0 reaches every row, once each
        starts = dq_starts_in_pipeline and d >= 0
        if not (dq_writes_in_pipeline and d == 0):
            static_pair(chunks, functools.partial(diagonal_mask, d=d), starts)
            return
        writes, any_writes = carried_dq_writes()

        @pl.when(any_writes)
        def _():
            for _, slot, dst in writes:
                _settle_dq_slot(prm, dq_out, dq_sems, dst, dq_state, slot)

        init_kv_block()  # its stores and transposes beside the matmuls, as the dQ's
        for qi, slot, _ in writes:  # before the matmuls: the loads precede dQ's stores
            _fill_dq_slot(prm, dq_acc, dq_out, qi, slot)
        static_pair(chunks, functools.partial(diagonal_mask, d=d), starts)

        @pl.when(any_writes)
        def _():
            for qi, slot, dst in writes:
                _start_dq_copy(prm, dq_out, dq_sems, dst, dq_state, qi, slot)

        dq_state[0] = i  # the last step writes the grid's last blocks from here

    def static_pair(chunks, triangle, dq_starts=False):
        """dq_starts: the chunks of key range 0 start their lanes' dQ where
        this is the q block's first pair."""
        n = len(chunks)  # a step of every chunk: no loop, one basic block

        def consume_chunk(ck_, buf):
            start = first_pair if dq_starts and ck_[1][0] == 0 else False
            consume(ck_[0], buf, ck_[1], dq_start=start)

        _two_buffer_pipeline(
            n,
            n,
            lambda k, r: chunks[r],
            lambda ck_, buf: produce(ck_[0], buf, ck_[1], triangle=triangle),
            consume_chunk,
            bufs,
        )

    def far_edge_pair(e):
        """Each key range over the rows that see any of it, lane-aligned (the
        rows past them see none of the range: the triangle hides them)."""
        chunks = [
            ((hh, off, min(lc, hi - off)), (c * ck, ck))
            for c in range(bkv // ck)
            for hi in [min(br, tiling.round_up(c * ck + ck - e, tiling.LANES))]
            for hh in range(gb)
            for off in range(0, hi, lc)
        ]
        static_pair(chunks, functools.partial(far_edge_mask, e=e))

    def diagonal_pairs():
        """The variant of this pair's d (pairs on the diagonal have -br < d <
        bkv - 1), or of e = d - left for the pairs a window's far edge cuts
        (-br + 1 < e < bkv: those whose last row misses a key and first row
        sees one). Masked pairs are exactly these two kinds here
        (schedule.py: MASK iff not every entry is visible)."""
        d_now = i * br + prm.q_offset - j * bkv
        ds = range(-br + step_d, bkv - 1, step_d)
        if len(ds) == 1 and prm.left >= bsched.UNBOUNDED:
            diagonal_pair(ds[0])
            return
        for d in ds:
            pl.when(d_now == d)(functools.partial(diagonal_pair, d))
        if prm.left < bsched.UNBOUNDED:
            for e in range(-br + 2, bkv):
                if (e + prm.left) % step_d == 0:
                    pl.when(d_now - prm.left == e)(functools.partial(far_edge_pair, e))

    pipelined = n_chunks > 1
    if own_delta:  # a first pair that no full pipeline runs: the block's delta at once

        @pl.when(
            jnp.logical_and(first_pair, _flag(flags, bsched.MASK)) if pipelined else first_pair
        )
        def _block_delta():
            for hh in range(gb):
                delta = _delta_row(o_ref[hh], do_ref[hh])
                if has_dlse:
                    delta = delta - dlse_ref[pl.ds(hh, 1), :]
                delta_ref[pl.ds(hh, 1), :] = delta

    _run_pair(
        prm,
        i,
        j,
        flags,
        tile,
        full_pair if pipelined else None,
        (diagonal_pairs if diagonal_only else masked_pair)
        if pipelined and prm.sub is not None
        else None,
    )

    @pl.when(_flag(flags, bsched.FINAL))
    def _final():
        if prm.swapped:  # the accumulators' own layout
            dk_ref[...] = (dk_acc[...] * prm.scale).astype(dk_ref.dtype)
            dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)
        else:
            dk_ref[...] = jnp.transpose(dk_acc[...] * prm.scale).astype(dk_ref.dtype)
            dv_ref[...] = jnp.transpose(dv_acc[...]).astype(dv_ref.dtype)

    if fuse_dq and stream_dq:
        release_dq()
    elif fuse_dq:
        last_step = step == pl.num_programs(2) - 1

        # dq_writes_in_pipeline: a head's last blocks are the next head's to write
        @pl.when(jnp.logical_and(last_step, last_head) if dq_writes_in_pipeline else last_step)
        def _write_dq():
            dst = dq_hbm.at[bh[0], bh[1]]
            _write_dq_blocks(prm, dq_acc, dq_out, dq_sems, dst, dq_state, dq_acc.shape[0])

            @pl.when(last_head if defer_dq_waits else True)
            def _():
                for slot in range(dq_out.shape[0]):
                    _settle_dq_slot(prm, dq_out, dq_sems, dst, dq_state, slot)


def _stream_dq_step(sched_ref, step, i, flags, slots, acc, sem_r, sem_w, state):
    """The HBM round trip of a streamed dQ step (kernel comment: stream_dq).

    Waits for this step's q block in its VMEM slot (reading it now if the
    step before did not) and issues the next step's read; returns
    (release, slot view): release() issues the block's write back.
    Consecutive steps of one q block keep it in its slot (no DMA). Before a
    read, the writes still in flight from the target slot and of the target
    block are waited for, so a read never overtakes a write. state (SMEM):
    [0] the next computing step's slot, [1] its read is issued, [2 + s] slot
    s has a write in flight, [5 + s] to that q block.
    """
    n = pl.num_programs(2)
    compute = _flag(flags, bsched.COMPUTE)
    _, i_prev, f_prev = _decode(sched_ref, jnp.maximum(step - 1, 0))
    _, i_next, f_next = _decode(sched_ref, jnp.minimum(step + 1, n - 1))
    carry_in = (step > 0) & _flag(f_prev, bsched.COMPUTE) & (i_prev == i)
    next_computes = (step + 1 < n) & _flag(f_next, bsched.COMPUTE)
    carry_out = compute & next_computes & (i_next == i)

    def read(blk, slot):
        return pltpu.make_async_copy(acc.at[blk], slots.at[slot], sem_r.at[slot])

    def write(blk, slot):
        return pltpu.make_async_copy(slots.at[slot], acc.at[blk], sem_w.at[slot])

    def settle(slot):
        @pl.when(state[2 + slot] == 1)
        def _():
            write(0, slot).wait()  # a wait needs the copy's size and semaphore only
            state[2 + slot] = 0

    def settle_block(blk):
        for s in range(slots.shape[0]):

            @pl.when((state[2 + s] == 1) & (state[5 + s] == blk))
            def _():
                write(0, s).wait()
                state[2 + s] = 0

    def start_read(blk, slot):
        settle(slot)
        settle_block(blk)
        read(blk, slot).start()

    @pl.when(step == 0)
    def _init():
        for w in range(5):
            state[w] = 0

    cur = state[0]

    @pl.when(compute & jnp.logical_not(carry_in))
    def _acquire():
        @pl.when(state[1] == 0)
        def _():
            start_read(i, cur)

        read(0, cur).wait()
        state[1] = 0

    @pl.when(compute & next_computes & jnp.logical_not(carry_out))
    def _prefetch():
        start_read(i_next, lax.rem(cur + 1, slots.shape[0]))
        state[1] = 1

    def release():
        @pl.when(compute & jnp.logical_not(carry_out))
        def _():
            write(i, cur).start()
            state[2 + cur] = 1
            state[5 + cur] = i
            state[0] = lax.rem(cur + 1, slots.shape[0])

        @pl.when(step == n - 1)
        def _drain():
            for s in range(slots.shape[0]):
                settle(s)

    return release, slots.at[cur]


def _delta_row(o, do):
    """(1, rows) rowsum(dO * O) in f32 of (rows, Dv) blocks, rows in lanes
    (transposed first: a sublane reduction, not a cross-lane one)."""
    x = jnp.transpose(o).astype(jnp.float32) * jnp.transpose(do).astype(jnp.float32)
    return jnp.sum(x, axis=0, keepdims=True)


def _two_buffer_pipeline(n, depth, at, produce, consume, bufs):
    """produce(at(c)) into bufs[c % 2] while consume(at(c - 1)) reads the
    other: a fori_loop of `depth` chunks a step (even, so each step's buffer
    parity is static), then the last chunks unrolled."""

    def body(k, carry):
        for r in range(depth):
            produce(at(k, r + 1), bufs[(r + 1) % 2])
            consume(at(k, r), bufs[r % 2])
        return carry

    trips = (n - 1) // depth
    produce(at(0, 0), bufs[0])
    if trips:
        lax.fori_loop(0, trips, body, 0)
    for c in range(depth * trips, n):
        if c + 1 < n:
            produce(at(0, c + 1), bufs[(c + 1) % 2])
        consume(at(0, c), bufs[c % 2])


def _dq_copy(prm, dq_out, sems, dq_hbm, qi, slot):
    br = prm.geom.block_pos
    rows = pl.ds(pl.multiple_of(qi * br, br), br)
    dst = dq_hbm.at[:, :, rows] if prm.swapped else dq_hbm.at[:, rows, :]
    return pltpu.make_async_copy(dq_out.at[slot], dst, sems.at[slot])


def _settle_dq_slot(prm, dq_out, sems, dq_hbm, state, slot):
    """Waits for slot's dQ copy if one may be in flight (state[1 + slot])."""

    @pl.when(state[1 + slot] == 1)
    def _():
        # a wait needs the copy's size and semaphore only
        _dq_copy(prm, dq_out, sems, dq_hbm, 0, slot).wait()
        state[1 + slot] = 0


def _fill_dq_slot(prm, dq_acc, dq_out, qi, slot):
    """q block qi's dQ, scaled, transposed and cast, into VMEM slot `slot`."""
    for hh in range(prm.heads_in_block):
        dqt = dq_acc[qi, hh] * prm.scale  # swapped: dQ^T is the layout
        dq_out[slot, hh] = (dqt if prm.swapped else jnp.transpose(dqt)).astype(dq_out.dtype)


def _start_dq_copy(prm, dq_out, sems, dq_hbm, state, qi, slot):
    _dq_copy(prm, dq_out, sems, dq_hbm, qi, slot).start()
    state[1 + slot] = 1


def _write_dq_blocks(prm, dq_acc, dq_out, sems, dq_hbm, state, upto):
    """dQ of the kv head's q blocks state[0]..upto-1 (dq_hbm: (Gb, rows, D)),
    block by block: scaled, transposed and cast into one of two VMEM slots,
    then copied to HBM while the next block is made. A slot's previous copy
    (this head's block two back, or the last head's) is waited for first."""

    def body(qi, carry):
        slot = qi % 2
        _settle_dq_slot(prm, dq_out, sems, dq_hbm, state, slot)
        _fill_dq_slot(prm, dq_acc, dq_out, qi, slot)
        _start_dq_copy(prm, dq_out, sems, dq_hbm, state, qi, slot)
        return carry

    lo = state[0]
    hi = jnp.maximum(lo, upto)
    lax.fori_loop(lo, hi, body, 0)
    state[0] = hi


# ---------------------------------------------------------------------------
# dQ kernel: q-major schedule like the forward, and transposed like it
# (kernel_fwd.py): dS^T [keys, rows] from K q^T and V dO^T, dQ^T = K^T dS^T
# [D, rows], with lse and delta as the lane rows they are stored as; K^T is
# stored once per step, dQ transposed once per q block.


def _dq_kernel(sched_ref, *refs, prm: KernelParams, interpret: bool):
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    refs = refs[6:]
    qpos_ref = refs.pop(0) if prm.has_qpos else None
    qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if prm.has_segments else (None, None)
    dq_ref, dq_acc, kt_ref = refs  # dq_acc: (units, D, Gb * unit); kt: (D, bkv)
    k_swapped = k_ref if prm.swapped else None
    q_ref, k_ref, v_ref, do_ref, dq_ref = _swap_refs(prm, q_ref, k_ref, v_ref, do_ref, dq_ref)

    g = prm.geom
    gb, unit = prm.heads_in_block, prm.unit
    units = g.block_pos // unit
    kv_tail = g.kv_len % g.block_kv != 0
    i, j, flags = _decode(sched_ref, pl.program_id(2))

    @pl.when(_flag(flags, bsched.INIT))
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    @pl.when(_flag(flags, bsched.COMPUTE))
    def _transpose_k():
        kt_ref[...] = k_swapped[...] if prm.swapped else jnp.transpose(k_ref[...])

    def tile(masked, a, k0, ck):
        n, r0 = gb * unit, a * unit
        q = _rows(q_ref, r0, unit).reshape(n, prm.head_dim)
        do = _rows(do_ref, r0, unit).reshape(n, prm.head_dim_v)
        lse = _flat_rows(_rows(lse_ref, r0, unit))
        delta = _flat_rows(_rows(delta_ref, r0, unit))
        k = _keys(k_ref, k0, ck)
        v = _keys(v_ref, k0, ck)
        kt = kt_ref[...] if ck == kt_ref.shape[1] else kt_ref[:, pl.ds(k0, ck)]
        if masked:
            kidx, kvalid, kseg = _k_side(prm, j, kseg_ref, k0, ck)
            if kv_tail:  # keep dS finite (0) past the end (softcap's tanh, dP), and K^T dS
                k = _zero_tail_rows(k, kvalid)
                v = _zero_tail_rows(v, kvalid)
                kt = jnp.where(_key_valid_row(prm, j, k0, ck), kt, jnp.zeros_like(kt))
        s, t = _logits(prm, _dot_f32(k, q, NT_DIMS, interpret))
        p = jnp.exp(s - lse)
        if masked:
            qpos, qvalid, qseg = _q_side(prm, i, qpos_ref, qseg_ref, r0, unit)
            mask = _visible(prm, qpos, qvalid, qseg, kidx, kvalid, kseg)
            p = jnp.where(mask, p, 0.0)
        dp = _dot_f32(v, do, NT_DIMS, interpret)
        ds = p * (dp - delta)
        if t is not None:
            ds = ds * (1.0 - t * t)
        dq_acc[a] += _dot_f32(kt, ds.astype(kt.dtype), NN_DIMS, interpret)

    _unit_pairs(prm, i, j, flags, tile)

    @pl.when(_flag(flags, bsched.FINAL))
    def _final():
        for a in range(units):
            out = jnp.transpose(dq_acc[a] * prm.scale).reshape(gb, unit, prm.head_dim)
            _set_rows(dq_ref, a * unit, unit, out.astype(dq_ref.dtype))


def _bwd_operands(prm, q5, k, v, do5, lse, delta, aux, outer_is_q, batch_meta):
    """Operands and BlockSpecs shared by the dK/dV and dQ kernels (they differ in walk order)."""
    q_spec, kv_spec, row_spec, qmeta_spec, kmeta_spec = _common_specs(prm, outer_is_q, batch_meta)
    args = [q5, k, v, do5, lse, delta]
    specs = [
        q_spec(prm.head_dim),
        kv_spec(prm.head_dim),
        kv_spec(prm.head_dim_v),
        q_spec(prm.head_dim_v),
        row_spec,
        row_spec,
    ]
    margs, mspecs = _meta_inputs(prm, aux, qmeta_spec, kmeta_spec)
    return args + margs, specs + mspecs, q_spec, kv_spec


def dkdv_call(
    prm,
    q5,
    k,
    v,
    do5,
    lse,
    delta,
    aux,
    sched,
    interpret,
    batch_meta,
    fuse_dq,
    o5=None,
    dlse=None,
    stream_dq=False,
):
    """(dk, dv), or (dk, dv, dq5) with fuse_dq. o5 (fused only) in place of
    delta (None): the kernel derives delta itself, minus dlse if given, and
    O's block follows aux["o_blocks_dkdv"] (schedule.o_blocks), a second
    scalar-prefetch array. stream_dq (fused only): dQ accumulates in HBM,
    not in VMEM."""
    b, hkv = k.shape[0], k.shape[1]
    g = prm.geom
    gb = prm.heads_in_block
    own_delta = o5 is not None
    if own_delta and not fuse_dq:
        raise ValueError("o5: the dK/dV kernel derives delta only with fuse_dq")
    if stream_dq and not fuse_dq:
        raise ValueError("stream_dq: the dK/dV kernel streams dQ only with fuse_dq")
    args, specs, q_spec, kv_spec = _bwd_operands(
        prm, q5, k, v, do5, lse, o5 if own_delta else delta, aux, False, batch_meta
    )
    has_dlse = own_delta and dlse is not None
    prefetch = (sched, aux["o_blocks_dkdv"]) if own_delta else (sched,)
    if own_delta:  # O and dlse, read at FIRST steps only: their blocks follow o_blocks
        minor = functools.partial(_minor_dims, prm)
        specs[5] = pl.BlockSpec(
            (None, None, gb) + minor(g.block_pos, prm.head_dim_v),
            lambda b, h, p, s, o: (b, h, 0) + minor(o[p], 0),
        )
        if has_dlse:
            args.insert(6, dlse.astype(jnp.float32))
            specs.insert(
                6,
                pl.BlockSpec((None, None, gb, g.block_pos), lambda b, h, p, s, o: (b, h, 0, o[p])),
            )
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_specs = [kv_spec(prm.head_dim), kv_spec(prm.head_dim_v)]
    lc = prm.block_chunk_lanes
    scratch = [
        pltpu.VMEM((prm.head_dim, g.block_kv), jnp.float32),
        pltpu.VMEM((prm.head_dim_v, g.block_kv), jnp.float32),
    ]
    scratch += [pltpu.VMEM((g.block_kv, lc), q5.dtype)] * 4  # P, P, dS, dS
    nq = g.num_q_blocks
    aliases = {}
    if stream_dq:  # f32 dQ^T by q block, zeroed: q blocks no pair visits stay 0
        acc_shape = (b, hkv, nq, gb, prm.head_dim, g.block_pos)
        aliases = {len(prefetch) + len(args): len(out_shape)}  # after the prefetch, the inputs
        args.append(jnp.zeros(acc_shape, jnp.float32))
        specs.append(pl.BlockSpec(memory_space=pl.ANY))
        out_shape.append(jax.ShapeDtypeStruct(acc_shape, jnp.float32))
        out_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        scratch += [
            pltpu.VMEM((3, gb, prm.head_dim, g.block_pos), jnp.float32),
            pltpu.VMEM((prm.head_dim, g.block_kv), k.dtype),
            pltpu.SemaphoreType.DMA((3,)),
            pltpu.SemaphoreType.DMA((3,)),
            pltpu.SMEM((8,), jnp.int32),
        ]
    elif fuse_dq:  # dQ padded to whole q blocks (sliced below): every copy is a whole block
        blk = _minor_dims(prm, g.block_pos, prm.head_dim)
        full = _minor_dims(prm, nq * g.block_pos, prm.head_dim)
        out_shape.append(jax.ShapeDtypeStruct(q5.shape[:3] + full, q5.dtype))
        out_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        scratch += [
            pltpu.VMEM((nq, gb, prm.head_dim, g.block_pos), jnp.float32),
            pltpu.VMEM((prm.head_dim, g.block_kv), k.dtype),
            pltpu.VMEM((2, gb) + blk, q5.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SMEM((3,), jnp.int32),
        ]
    if own_delta:
        scratch.append(pltpu.VMEM((nq, gb, g.block_pos), jnp.float32))
    if prm.swapped:  # row-major K, V of the kv block (last: the kernel takes them off the end)
        scratch += [
            pltpu.VMEM((g.block_kv, prm.head_dim), k.dtype),
            pltpu.VMEM((g.block_kv, prm.head_dim_v), v.dtype),
        ]
    # Deferred dQ waits carry copies from one grid step to the next: only
    # where the whole grid runs in order on one TensorCore, and marked
    # sequential, so even a megacore the check missed runs it on one core.
    defer = fuse_dq and not stream_dq and tiling.grid_on_one_core()
    kernel = functools.partial(
        _dkdv_kernel,
        prm=prm,
        interpret=bool(interpret),
        fuse_dq=fuse_dq,
        own_delta=own_delta,
        has_dlse=has_dlse,
        stream_dq=stream_dq,
        defer_dq_waits=defer,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(b, hkv, sched.shape[0]),
            in_specs=specs,
            out_specs=tuple(out_specs),
            scratch_shapes=scratch,
        ),
        compiler_params=_compiler_params(prm, sequential=defer),
        input_output_aliases=aliases,
        interpret=interpret,
        name="flash_attention_dkdv",
    )(*prefetch, *args)
    t = g.q_rows_total
    if stream_dq:  # (B, Hkv, nq, Gb, D, br) -> (B, Hkv, Gb, T, D) (swapped: D, T), one XLA pass
        dq = (out[2] * prm.scale).transpose(0, 1, 3, 4, 2, 5)
        dq = dq.reshape(q5.shape[:3] + (prm.head_dim, nq * g.block_pos))[..., :t]
        return out[0], out[1], (dq if prm.swapped else jnp.swapaxes(dq, -1, -2)).astype(q5.dtype)
    if fuse_dq and nq * g.block_pos != t:
        dq = out[2][..., :t] if prm.swapped else out[2][:, :, :, :t]
        return out[0], out[1], dq
    return out


def dq_call(prm, q5, k, v, do5, lse, delta, aux, sched, interpret, batch_meta):
    b, hkv = k.shape[0], k.shape[1]
    g = prm.geom
    args, specs, q_spec, _ = _bwd_operands(prm, q5, k, v, do5, lse, delta, aux, True, batch_meta)
    unit = prm.unit
    return pl.pallas_call(
        functools.partial(_dq_kernel, prm=prm, interpret=bool(interpret)),
        out_shape=jax.ShapeDtypeStruct(q5.shape, q5.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, sched.shape[0]),
            in_specs=specs,
            out_specs=q_spec(prm.head_dim),
            scratch_shapes=[
                pltpu.VMEM(
                    (g.block_pos // unit, prm.head_dim, prm.heads_in_block * unit), jnp.float32
                ),
                pltpu.VMEM((prm.head_dim, g.block_kv), k.dtype),
            ],
        ),
        compiler_params=_compiler_params(prm),
        interpret=interpret,
        name="flash_attention_dq",
    )(sched, *args)
