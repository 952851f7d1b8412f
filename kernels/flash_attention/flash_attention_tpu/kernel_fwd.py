"""Flash attention's forward Pallas kernel, and the tile machinery the backward
kernels (kernel_bwd.py) share with it: launch parameters, masks, sub-tiles,
BlockSpecs. The custom_vjp that joins them is in api.py.

Layout. The entry takes q [B, Hq, Sq, D] and k, v [B, Hkv, Skv, D|Dv]. The
G = Hq / Hkv query heads sharing a K/V head are stacked into the matmul rows
of one block, so each K/V block is read from HBM once per group, never
repeated in memory:

* prefill layout (Sq >= 128): q is viewed (free reshape) as
  [B, Hkv, G, Sq, D]; a block (G, block_q, D) becomes G * block_q rows
  ordered (head, position).
* decode layout (Sq < 128): q is transposed (cheap, q is small) to
  [B, Hkv, 1, Sq * G, D]; rows are ordered (position, head) so a single
  decode token still fills G rows.

Grid. (batch, kv head, step) where steps walk a compact scalar-prefetched
schedule of visible (q block, kv block) pairs (see schedule.py): the
forward and dQ kernels walk it q-major, the dK/dV kernel kv-major. Hidden
pairs cost no grid step. Pairs that are fully visible skip the elementwise
mask; the rest (diagonal, window edges, sequence tails, segments) apply it,
and in dense calls only the key sub-tile ranges holding a visible entry run
(so the diagonal's hidden triangle mostly costs nothing): where a block has
several lane chunks, as the fully visible pairs' pipeline over each range,
else as sub-tiles.
The K/V block index of consecutive steps in a q row is what changes, so K/V
blocks stream while the q block and the accumulators stay resident.

Numerics. Logits and the online softmax are f32; p is cast to the value
dtype for the PV matmul (f32 accumulate). The forward saves the per-row
logsumexp compactly as [B, Hkv, G, Sq] f32 (one float per query row).
Rows that see no key produce output 0, logsumexp +inf, and zero gradients.

Sequence tails are masked in-kernel (no padding copies): edge blocks hold
unspecified data past the array end, so those rows of K/V (or Q/dO in the
dK/dV kernel) are zeroed before they can reach a matmul.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import schedule as bsched
from . import tiling

NEG_INF = -1e30  # finite: exp(NEG_INF - NEG_INF) stays 1, never NaN
LOG2E = 1.4426950408889634
ONES_ROWS = 16  # the forward's row of ones below V^T, padded to a packed bf16 tile
NT_DIMS = (((1,), (1,)), ((), ()))
NN_DIMS = (((1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class KernelParams:
    """Static description of one kernel launch (hashable)."""

    geom: tiling.Geometry
    group: int
    head_dim: int
    head_dim_v: int
    scale: float
    softcap: float | None
    causal: bool
    left: int  # bsched.UNBOUNDED when unbounded
    right: int
    q_offset: int  # dense: Skv - Sq (bottom-right alignment)
    has_qpos: bool  # per-row query positions come from an array
    has_segments: bool
    has_sinks: bool
    vmem_limit: int
    sub: tuple[int, int] | None  # (rows, keys) sub-tile of masked pairs; None: whole
    slab: int | None = None  # positions per step over fully visible pairs; None: whole
    # q/k/v-side operands and results arrive and leave with their last two
    # axes swapped, (..., D, positions): see swapped_layout
    swapped: bool = False

    @property
    def heads_in_block(self) -> int:
        return 1 if self.geom.seq_major else self.group

    @property
    def unit(self) -> int:
        """Positions of a q block whose state (softmax statistics, accumulator)
        the forward and dQ kernels keep as one unit: a masked sub-tile's rows,
        else a slab, else the whole block."""
        if self.sub is not None:
            return self.sub[0]
        return self.slab or self.geom.block_pos

    @property
    def chunk_lanes(self) -> int:
        """Query rows of one lane chunk of the forward's fully visible pairs."""
        return tiling.fwd_chunk_lanes(self.heads_in_block, self.unit)

    @property
    def block_chunk_lanes(self) -> int:
        """Query rows of one lane chunk of the dK/dV kernel's fully visible
        pairs (its chunks cut the whole block, not a state unit)."""
        return tiling.fwd_chunk_lanes(self.heads_in_block, self.geom.block_pos)


# ---------------------------------------------------------------------------
# Small in-kernel helpers.


def _row_to_col(x):
    """(1, n) -> (n, 1) through a 32-bit transpose (XLU)."""
    n = x.shape[1]
    return jnp.transpose(jnp.broadcast_to(x, (8, n)))[:, 0:1]


def _flat_rows(x):
    """(Gb, br) per-head rows -> (1, Gb * br) in matmul-row order."""
    if x.shape[0] == 1:
        return x
    return jnp.concatenate([x[g : g + 1, :] for g in range(x.shape[0])], axis=1)


def _split_rows(x, gb):
    """(1, Gb * br) -> (Gb, br)."""
    if gb == 1:
        return x
    br = x.shape[1] // gb
    return jnp.concatenate([x[:, g * br : (g + 1) * br] for g in range(gb)], axis=0)


def _tile_row(x, gb):
    return x if gb == 1 else jnp.concatenate([x] * gb, axis=1)


def _decode(sched_ref, p):
    word = sched_ref[p]
    return (
        word >> bsched.OUTER_SHIFT,
        (word >> bsched.INNER_SHIFT) & (bsched.MAX_INNER_BLOCKS - 1),
        word & bsched.FLAG_BITS,
    )


def _flag(flags, bit):
    return (flags & bit) != 0


def _q_side(prm, i, qpos_ref, qseg_ref, r0, rc):
    """Query-side (position, valid, segment) of rows r0:r0+rc of each head, as
    (1, Gb * rc) lane rows in matmul-row order (every kernel's tiles hold the
    query rows in lanes)."""
    g = prm.geom
    gb = prm.heads_in_block
    full = rc == g.block_pos
    row = i * g.block_pos + r0 + lax.broadcasted_iota(jnp.int32, (1, rc), 1)
    valid = row < g.q_rows_total
    if prm.has_qpos:
        pos = qpos_ref[...] if full else qpos_ref[:, r0 : r0 + rc]  # (1, rc)
    else:
        pos = row + prm.q_offset
    seg = None
    if prm.has_segments:
        seg = qseg_ref[...] if full else qseg_ref[:, r0 : r0 + rc]
    valid = _tile_row(valid.astype(jnp.int32), gb) != 0
    return _tile_row(pos, gb), valid, (_tile_row(seg, gb) if seg is not None else None)


def _k_side(prm, j, kseg_ref, k0, ck):
    """Key index, validity and segment of keys k0:k0+ck of the kv block, as
    (ck, 1) columns (every kernel's tiles hold the keys in sublanes)."""
    kidx = j * prm.geom.block_kv + k0 + lax.broadcasted_iota(jnp.int32, (ck, 1), 0)
    seg = None
    if prm.has_segments:  # never sub-tiled: whole block
        seg = _row_to_col(kseg_ref[...])  # (1, bkv) -> (bkv, 1)
    return kidx, kidx < prm.geom.kv_len, seg


def _key_valid_row(prm, j, k0, ck):
    """(1, ck): which keys k0:k0+ck of kv block j lie before the sequence end."""
    kpos = j * prm.geom.block_kv + k0 + lax.broadcasted_iota(jnp.int32, (1, ck), 1)
    return kpos < prm.geom.kv_len


def _dot_f32(x, y, dims, interpret):
    """dot_general(x, y, dims) with f32 accumulation. Under interpret mode on
    bf16 operands the dot runs on f32 copies: XLA:CPU has no bf16 x bf16 ->
    f32 dot for the transposed kernels' operand orders, and the products of
    two bf16 values are exact in f32, so it is the same sum."""
    if interpret and x.dtype != jnp.float32:
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
    return lax.dot_general(x, y, dims, preferred_element_type=jnp.float32)


def _visible(prm, qpos, qvalid, qseg, kidx, kvalid, kseg):
    """Elementwise visibility; operands broadcast to the logits block.
    qvalid / kvalid None: every row / key lies before its sequence's end."""
    terms = [t for t in (qvalid, kvalid) if t is not None]
    if prm.right < bsched.UNBOUNDED:
        terms.append(kidx <= qpos + prm.right)
    if prm.left < bsched.UNBOUNDED:
        terms.append(kidx >= qpos - prm.left)
    if prm.has_segments:
        terms.append(qseg == kseg)
    if not terms:
        return jnp.ones(jnp.broadcast_shapes(qpos.shape, kidx.shape), jnp.bool_)
    return functools.reduce(jnp.logical_and, terms)


def _logits(prm, s):
    """Scaled (and soft-capped) logits; also returns tanh for the backward."""
    s = s * prm.scale
    if prm.softcap is None:
        return s, None
    t = jnp.tanh(s * (1.0 / prm.softcap))
    return prm.softcap * t, t


def _zero_tail_rows(x, valid_col):
    return jnp.where(valid_col, x, jnp.zeros_like(x))


def swapped_layout(head_dim: int, head_dim_v: int, seq_major: bool) -> bool:
    """Whether a call's q/k/v-side arrays cross into the kernels as (..., D,
    positions). A TPU lays out an array whose minor dim is under 128 (and
    not the larger one) with its two minor dims swapped ({2,3,1,0}:
    positions minor, no lanes wasted); a kernel operand must be row-major,
    so each such input and result paid an XLA transposing copy (tpu7x 4k
    d=64 training: 107 us beside the kernels' 944). Swapped at the
    boundary, the same bytes are a row-major (..., D, positions) array and
    the copy is a bitcast; the kernels see their blocks through _Swapped.
    Decode's rows interleave positions and heads: no such view."""
    return not seq_major and max(head_dim, head_dim_v) < tiling.LANES


class _Swapped:
    """A VMEM block ref (..., D, n) read and written as (..., n, D), the
    layout the kernels' code indexes (KernelParams.swapped). The row index
    must be a slice (static or pl.ds), so the two minor axes stay."""

    def __init__(self, ref):
        self.ref = ref

    @property
    def shape(self):
        s = self.ref.shape
        return s[:-2] + (s[-1], s[-2])

    @property
    def dtype(self):
        return self.ref.dtype

    def _index(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        n = len(self.shape)
        if Ellipsis in idx:
            e = idx.index(Ellipsis)
            idx = idx[:e] + (slice(None),) * (n - len(idx) + 1) + idx[e + 1 :]
        idx = idx + (slice(None),) * (n - len(idx))
        if not all(isinstance(x, (slice, pl.Slice)) for x in idx[-2:]):
            raise TypeError("_Swapped: the two minor axes take slices only")
        return idx[:-2] + (idx[-1], idx[-2])

    def __getitem__(self, idx):
        return jnp.swapaxes(self.ref[self._index(idx)], -1, -2)

    def __setitem__(self, idx, value):
        self.ref[self._index(idx)] = jnp.swapaxes(value, -1, -2)


def _minor_dims(prm, n, d):
    """The two minor dims of a q/k/v-side array or block of n positions
    by d: (d, n) where the call's layout is swapped, else (n, d)."""
    return (d, n) if prm.swapped else (n, d)


def _swap_refs(prm, *refs):
    """refs seen row-major (None stays None) where the call's layout is swapped."""
    if not prm.swapped:
        return refs
    return tuple(None if r is None else _Swapped(r) for r in refs)


def _rows(ref, r0, rc):
    """Rows r0:r0+rc of every head of a (Gb, br, ...) block (r0 static or traced)."""
    if rc == ref.shape[1]:
        return ref[...]
    return ref[:, r0 : r0 + rc] if isinstance(r0, int) else ref[:, pl.ds(r0, rc)]


def _set_rows(ref, r0, rc, x):
    if rc == ref.shape[1]:
        ref[...] = x
    elif isinstance(r0, int):
        ref[:, r0 : r0 + rc] = x
    else:
        ref[:, pl.ds(r0, rc)] = x


def _keys(ref, k0, ck):
    """Keys k0:k0+ck (k0 dynamic, a multiple of ck) of a (bkv, d) block."""
    return ref[...] if ck == ref.shape[0] else ref[pl.ds(k0, ck), :]


def _chunk_range(prm, i, j, a, rows=None):
    """[c_lo, c_hi): the key sub-tiles (of prm.sub's keys) of pair (i, j) that
    row chunk a (of prm.sub's rows, or of `rows`) can see."""
    return bsched.chunk_bounds(
        i,
        j,
        a,
        geom=prm.geom,
        sub=(rows or prm.sub[0], prm.sub[1]),
        q_offset=prm.q_offset,
        left=prm.left,
        right=prm.right,
        xp=jnp,
    )


def _visible_chunks(prm, i, j, a, run, rows=None):
    """Calls run(k0) for each key sub-tile of pair (i, j) that row chunk a
    (of prm.sub's rows, or of `rows`) can see."""
    ck = prm.sub[1]
    c_lo, c_hi = _chunk_range(prm, i, j, a, rows)

    def body(c, carry):
        run(pl.multiple_of(c * ck, ck))
        return carry

    lax.fori_loop(c_lo, c_hi, body, 0)


def _run_pair(prm, i, j, flags, tile, full=None, masked_pair=None):
    """Dispatches one step of the backward kernels to tile(masked, r0, rc, k0, ck).

    Fully visible pairs run one whole-block tile without mask work, or
    `full()`. Masked pairs run `masked_pair()` if given (dense calls only),
    else in dense calls are cut into sub-tiles and only those that hold a visible entry run (the
    diagonal's upper triangle, a window's far side and sequence tails cost no
    MXU work); other masked pairs run whole.
    """
    g = prm.geom
    br, bkv = g.block_pos, g.block_kv
    compute = _flag(flags, bsched.COMPUTE)
    masked = _flag(flags, bsched.MASK)

    @pl.when(jnp.logical_and(compute, masked))
    def _masked():
        if masked_pair is not None:
            masked_pair()
            return
        if prm.sub is None:
            tile(True, 0, br, 0, bkv)
            return
        rc, ck = prm.sub
        for a in range(br // rc):
            _visible_chunks(prm, i, j, a, lambda k0, a=a: tile(True, a * rc, rc, k0, ck))

    @pl.when(jnp.logical_and(compute, jnp.logical_not(masked)))
    def _full():
        if full is not None:
            full()
            return
        tile(False, 0, br, 0, bkv)


# ---------------------------------------------------------------------------
# Forward kernel: q-major schedule, online softmax, transposed tiles.
#
# The forward computes every tile transposed: scores s^T = K q^T [keys, rows]
# and the output acc^T = V^T p^T [Dv, rows], with the query rows in lanes.
# The MXU result pops (one f32 vreg a bundle) bind the forward's schedule:
# row-major, p @ V at Dv = 128 half-fills the 256-wide result of v6e/tpu7x and
# pops both halves of every 256-key partial (512 pops per 256 rows x 1024
# keys); transposed, the rows fill the result's width (384 pops). The
# softmax statistics become lane-dense rows, the row maximum a VALU
# reduction over sublanes instead of cross-lane XLU work, and alpha a
# sublane broadcast.
#
# V is transposed once per step into VMEM, below a row of ones (padded to a
# packed bf16 tile of 16 rows): the PV matmul then also yields the row sums
# l = sum(p), rescaled with the accumulator, where 256 VALU adds a tile did
# it before (v6e T = 8k causal: 2,410 -> 2,104 us). l is thus the sum of
# the p the numerator uses, rounded to V's dtype. The output is transposed
# once per q block, at the end.
#
# A fully visible pair runs as a software pipeline over lane chunks of its
# units (tiling.fwd_chunk_lanes: 512 query rows, both 256-wide MXUs): chunk
# c+1's scores go into one of two VMEM buffers while chunk c's exp and PV
# matmul read the other. Scores held as one value of a whole unit spilled:
# the compiler popped every QK result to a spill slot, reloaded it, scaled it
# and spilled it again, and the pair was bound by vector stores (v6e T = 8k
# causal: 7,548 stores and 6,139 bundles a pair against 3,200 MXU cycles).
# The explicit buffers store each score once. The pipeline is unrolled, one
# basic block a pair: as a fori_loop of two chunks a trip, each trip and the
# straight-line code around the loop filled and drained the MXUs (tpu7x 8k
# d=128: 7,730 bundles a pair, 1,883 a trip for 1,600 MXU cycles; unrolled
# 7,207 for 6,400; v6e 8k forward 1,490 -> 1,387 us). Without a soft cap,
# the softmax scale folds into exp2's multiplier: one VALU multiply per
# score fewer.


def _unit_pairs(prm, i, j, flags, tile, full=None, masked_pair=None):
    """Dispatches one schedule step to tile(masked, a, k0, ck), a = unit index
    (a Python int: the units are unrolled).

    Like _run_pair, but every tile covers exactly one state unit of
    `prm.unit` positions (its statistics and accumulator live per unit).
    `full`, if given, runs a fully visible pair's units in its own order
    instead (the forward's pipelined loop); `masked_pair`, if given, a masked
    pair's (its pipeline over each unit's visible key ranges).
    """
    g = prm.geom
    bkv, unit = g.block_kv, prm.unit
    units = g.block_pos // unit
    compute = _flag(flags, bsched.COMPUTE)
    masked = _flag(flags, bsched.MASK)

    @pl.when(jnp.logical_and(compute, masked))
    def _masked():
        if masked_pair is not None:
            masked_pair()
            return
        for a in range(units):
            if prm.sub is None:
                tile(True, a, 0, bkv)
            else:
                _visible_chunks(prm, i, j, a, lambda k0, a=a: tile(True, a, k0, prm.sub[1]))

    @pl.when(jnp.logical_and(compute, jnp.logical_not(masked)))
    def _full():
        if full is not None:
            full()
            return
        for a in range(units):
            tile(False, a, 0, bkv)


def _fwd_kernel(sched_ref, *refs, prm: KernelParams, interpret: bool):
    refs = list(refs)
    sinks_ref = refs.pop(0) if prm.has_sinks else None
    q_ref, k_ref, v_ref = refs[:3]
    refs = refs[3:]
    qpos_ref = refs.pop(0) if prm.has_qpos else None
    qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if prm.has_segments else (None, None)
    # m: (units, 1, Gb * unit); acc: (units, Dv + 16, Gb * unit), row Dv = l;
    # vt: (Dv + 16, bkv), row Dv = ones; s0/s1: (bkv, chunk lanes) score buffers
    o_ref, lse_ref, m_ref, acc_ref, vt_ref, s0_ref, s1_ref = refs[:7]
    o_swapped = o_ref if prm.swapped else None  # (Gb, Dv, br): written as acc is, no transpose
    q_swapped = q_ref if prm.swapped else None
    if prm.swapped:  # the q block, row-major, made once a block (it stays for the kv walk)
        q_ref = refs[7]
    k_ref, v_ref, o_ref = _swap_refs(prm, k_ref, v_ref, o_ref)
    dv = prm.head_dim_v

    g = prm.geom
    gb, unit = prm.heads_in_block, prm.unit
    units = g.block_pos // unit
    kv_tail = g.kv_len % g.block_kv != 0
    q_tail = g.q_rows_total % g.block_pos != 0
    h = pl.program_id(1)
    i, j, flags = _decode(sched_ref, pl.program_id(2))

    # Where a masked pair can be a diagonal one whose edge falls on sub-tile
    # boundaries (causal self-attention over whole blocks: no tail,
    # positions or segments, a window (if any) of at least a block; q block =
    # kv block, q_offset a multiple of it; lane chunks of whole units), in
    # such a pair unit a sees keys 0:(a + 1) ck, all but the last ck of them
    # whole. Its chunks then run through the fully visible
    # pairs' pipeline with key spans that grow with a, and only the last
    # range takes a mask, a static triangle (diagonal_pair). As ranges of
    # their own, two in flight (unit_ranges), a diagonal pair was bound by
    # the ranges' dependency chains, not by a slot (tpu7x 8k d=128: 1,297
    # bundles a trip of two ranges, 888 of VALU work, 800 MXU cycles); the
    # forward went 1,237.0 -> 1,131.9 us there, v6e 1,389.2 -> 1,259.1.
    # Without a window every masked pair is one (diagonal_only); with one,
    # the window's far edge keeps the masked-range pipelines.
    lc = prm.chunk_lanes
    per = gb * unit // lc  # chunks per unit
    pipelined = per > 1 and prm.sub is not None and prm.sub[0] == unit
    diagonal = (
        pipelined
        and lc % unit == 0
        and not g.seq_major
        and prm.sub == (unit, unit)
        and prm.right == 0
        and prm.left + 1 >= g.block_pos  # the window cuts no diagonal pair
        and not (prm.has_qpos or prm.has_segments or kv_tail or q_tail)
        and g.block_pos == g.block_kv
        and prm.q_offset % g.block_kv == 0
    )
    diagonal_only = diagonal and prm.left >= bsched.UNBOUNDED
    offset = i * g.block_pos + prm.q_offset - j * g.block_kv  # first row's - first key's
    on_diagonal = offset == 0
    # A window of whole kv blocks cuts one pair a row of pairs, at offset
    # left + 1: unit a sees keys a ck + 1 + (row offset) on, an upper
    # triangle in its first range, the diagonal's mirror (far_edge_pair).
    far_edge = diagonal and not diagonal_only and (prm.left + 1) % g.block_kv == 0
    on_far_edge = offset == prm.left + 1
    own_pipeline = jnp.logical_or(on_diagonal, on_far_edge) if far_edge else on_diagonal

    # A full pair's pipeline, and a diagonal pair's, update every lane of
    # every unit once. On a q row's first step they start the statistics and
    # the accumulator themselves (`fresh`: a select where they read them), so
    # the step stores no zeros first: as a block of its own, the zeroing was
    # 281 bundles a q row that no matmul overlapped (tpu7x 4k d=128).
    compute = _flag(flags, bsched.COMPUTE)
    masked_step = jnp.logical_and(compute, _flag(flags, bsched.MASK))
    # the steps that run diagonal_pair (masked_pair's dispatch below)
    diagonal_step = jnp.logical_and(masked_step, on_diagonal) if diagonal else None
    covers_every_unit = jnp.logical_and(compute, jnp.logical_not(masked_step))
    if diagonal:
        covers_every_unit = jnp.logical_or(covers_every_unit, diagonal_step)
    fresh = jnp.logical_and(_flag(flags, bsched.INIT), covers_every_unit)

    @pl.when(jnp.logical_and(_flag(flags, bsched.INIT), jnp.logical_not(covers_every_unit)))
    def _zero_state():
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    if prm.swapped:

        @pl.when(_flag(flags, bsched.INIT))
        def _transpose_q():
            for hh in range(gb):
                q_ref[hh] = jnp.transpose(q_swapped[hh])

    def transpose_v():
        vt_ref[0:dv, :] = v_ref.ref[...] if prm.swapped else jnp.transpose(v_ref[...])
        ones = lax.broadcasted_iota(jnp.int32, (ONES_ROWS, vt_ref.shape[1]), 0) == 0
        vt_ref[dv:, :] = ones.astype(vt_ref.dtype)

    # A fully visible pair transposes V inside its pipeline (full_pair), where
    # the scheduler overlaps the transposes with its first chunk's QK matmul.
    if not diagonal_only:  # a diagonal pair's pipeline transposes V itself

        @pl.when(
            jnp.logical_and(masked_step, jnp.logical_not(own_pipeline)) if diagonal else masked_step
        )
        def _transpose_v():
            transpose_v()

    def scores(a, k0, ck):
        q = _rows(q_ref, a * unit, unit).reshape(gb * unit, prm.head_dim)
        k = _keys(k_ref, k0, ck)
        s, _ = _logits(prm, _dot_f32(k, q, NT_DIMS, interpret))
        return s

    def update(masked, a, k0, ck, s):
        vt = vt_ref[...] if ck == vt_ref.shape[1] else vt_ref[:, pl.ds(k0, ck)]
        if masked:
            kidx, kvalid, kseg = _k_side(prm, j, kseg_ref, k0, ck)
            if kv_tail:  # unspecified data past the end must not reach the matmul
                vt = jnp.where(_key_valid_row(prm, j, k0, ck), vt, jnp.zeros_like(vt))
            qpos, qvalid, qseg = _q_side(prm, i, qpos_ref, qseg_ref, a * unit, unit)
            mask = _visible(prm, qpos, qvalid, qseg, kidx, kvalid, kseg)
            s = jnp.where(mask, s, NEG_INF)
        m_prev = m_ref[a]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=0, keepdims=True))
        p = jnp.exp(s - m_new)
        if masked:
            p = jnp.where(mask, p, 0.0)  # rows with nothing visible yet
        alpha = jnp.exp(m_prev - m_new)
        acc_ref[a] = alpha * acc_ref[a] + _dot_f32(vt, p.astype(vt.dtype), NN_DIMS, interpret)
        m_ref[a] = m_new

    def tile(masked, a, k0, ck):
        update(masked, a, k0, ck, scores(a, k0, ck))

    kc = tiling.fwd_chunk_keys(g.block_kv)
    fold = prm.softcap is None

    def chunk_q(a, l0):
        """Query rows of lanes l0:l0+lc (static) of unit a (traced)."""
        start = a * unit if isinstance(a, int) else pl.multiple_of(a * unit, unit)
        if lc > unit:  # whole units of several heads
            heads = range(l0 // unit, (l0 + lc) // unit)
            return jnp.concatenate([q_ref[hh, pl.ds(start, unit), :] for hh in heads], axis=0)
        return q_ref[l0 // unit, pl.ds(start + l0 % unit, lc), :]

    def chunk_mask(a, l0, k0, ck):
        """(ck, lc) visibility of keys k0:k0+ck to the query rows of lanes
        l0:l0+lc of unit a."""
        lane = lax.broadcasted_iota(jnp.int32, (1, lc), 1)
        off = a * unit + (lax.rem(lane, unit) if lc > unit else l0 % unit + lane)
        row = i * g.block_pos + off
        kidx, kvalid, _ = _k_side(prm, j, None, k0, ck)
        qvalid = row < g.q_rows_total if q_tail else None  # compares only where a tail is
        return _visible(
            prm, row + prm.q_offset, qvalid, None, kidx, kvalid if kv_tail else None, None
        )

    def diagonal_mask(edge=False):
        """(ck, lc): which of a diagonal range's keys each lane's row sees
        (key offset <= row offset in the unit; a chunk holds whole units);
        edge: of the range a window's far edge cuts (key offset > row's)."""
        lane = lax.broadcasted_iota(jnp.int32, (1, lc), 1)
        rel = lax.rem(lane, unit) if lc > unit else lane
        kr = lax.broadcasted_iota(jnp.int32, (ck, lc), 0)
        return kr > rel if edge else kr <= rel

    def chunk_scores(a, l0, s_buf, keys=None, row0=0, span=None):
        """Scores of a chunk into s_buf (from row row0); returns its (m_new,
        alpha). keys: (k0, ck), that key range of a masked pair, the mask
        applied. span: (lo, hi, edge), a chunk of a pair on the diagonal or
        on a window's far edge (see diagonal_pair): keys lo:hi, the last ck
        of them on the diagonal, or (edge) the first ck on the window's edge."""
        if keys is not None:
            k = _keys(k_ref, *keys)
        else:
            k = k_ref[...] if span is None else k_ref[span[0] : span[1], :]
        s = _dot_f32(k, chunk_q(a, l0), NT_DIMS, interpret)
        if not fold:
            s, _ = _logits(prm, s)
        if keys is not None:
            s = jnp.where(chunk_mask(a, l0, *keys), s, NEG_INF)
        if span is not None:
            lo, hi, edge = span
            t0 = lo if edge else hi - ck  # the masked range's first key
            tri = jnp.where(diagonal_mask(edge), s[t0 - lo : t0 - lo + ck], NEG_INF)
            s_buf[t0 : t0 + ck, :] = tri
            row_max = jnp.max(tri, axis=0, keepdims=True)
            w0, w1 = (t0 + ck, hi) if edge else (lo, t0)  # the whole keys
            if w1 > w0:
                whole = s[w0 - lo : w1 - lo]
                s_buf[w0:w1, :] = whole
                row_max = jnp.maximum(row_max, jnp.max(whole, axis=0, keepdims=True))
        else:
            s_buf[row0 : row0 + s.shape[0], :] = s
            row_max = jnp.max(s, axis=0, keepdims=True)
        m_prev = jnp.where(fresh, NEG_INF, m_ref[a, :, l0 : l0 + lc])
        m_new = jnp.maximum(m_prev, row_max * prm.scale if fold else row_max)
        m_ref[a, :, l0 : l0 + lc] = m_new
        return m_new, jnp.exp(m_prev - m_new)

    def chunk_update(a, l0, s_buf, m_new, alpha, keys=None, row0=0, span=None):
        acc = jnp.where(fresh, 0.0, acc_ref[a, :, l0 : l0 + lc]) * alpha
        if keys is None:  # s_buf's rows are the block's keys lo:hi
            lo, hi, empty_rows = span or (0, g.block_kv, False)
            steps = range(lo, hi, math.gcd(kc, hi - lo))
        else:
            k_lo, span = keys
            steps, empty_rows = range(0, span, span), True
        m = m_new
        # A row that saw nothing yet (a masked range's, a window edge's; a
        # diagonal chunk's rows each see a key): its masked s - m is 0.
        if empty_rows:
            m = jnp.where(m_new < 0.5 * NEG_INF * (prm.scale if fold else 1.0), 0.0, m_new)
        step = steps.step
        for k0 in steps:
            s = s_buf[row0 + k0 : row0 + k0 + step, :]
            if fold:  # m is in logit units: exp(s * scale - m) as one exp2
                p = jnp.exp2(s * (prm.scale * LOG2E) - m * LOG2E)
            else:
                p = jnp.exp(s - m)
            if keys is None:
                vt = vt_ref[:, k0 : k0 + step]
            else:
                vt = vt_ref[:, pl.ds(k_lo, span)]
                if kv_tail:  # unspecified data past the end must not reach the matmul
                    vt = jnp.where(_key_valid_row(prm, j, k_lo, span), vt, jnp.zeros_like(vt))
            acc = acc + _dot_f32(vt, p.astype(vt_ref.dtype), NN_DIMS, interpret)
        acc_ref[a, :, l0 : l0 + lc] = acc

    def finish(a):
        """Normalises unit a's accumulator into its output rows and logsumexp."""
        m, acc = m_ref[a], acc_ref[a]
        l, acc = acc[dv : dv + 1], acc[:dv]
        if prm.has_sinks:
            sink = _sink_row(prm, sinks_ref, h, i, a)
            m_fin = jnp.maximum(m, sink)
            keep = jnp.exp(m - m_fin)
            l = l * keep + jnp.exp(sink - m_fin)
            acc = acc * keep
            m = m_fin
        empty = l == 0.0
        inv = 1.0 / jnp.where(empty, 1.0, l)
        lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
        if prm.swapped:
            out = (acc * inv).astype(o_swapped.dtype)
            for hh in range(gb):
                o_swapped[hh, :, a * unit : (a + 1) * unit] = out[:, hh * unit : (hh + 1) * unit]
        else:
            out = jnp.transpose(acc * inv).reshape(gb, unit, dv)
            _set_rows(o_ref, a * unit, unit, out.astype(o_ref.dtype))
        _set_rows(lse_ref, a * unit, unit, _split_rows(lse, gb))

    bufs = (s0_ref, s1_ref)

    def chunk_pipeline(chunks, finishes=False):
        """chunks: (unit, first lane, key span or None) each; chunk c's
        scores go to buffer c % 2 while chunk c - 1 updates from the other.
        finishes: each unit is normalised after its last chunk (the step's
        FINAL work, see _final)."""
        n = len(chunks)
        last = {ch[0]: c for c, ch in enumerate(chunks)}
        a, l0, span = chunks[0]
        st = chunk_scores(a, l0, bufs[0], span=span)
        transpose_v()
        for c in range(n):
            nxt = None
            if c + 1 < n:
                a, l0, span = chunks[c + 1]
                nxt = chunk_scores(a, l0, bufs[(c + 1) % 2], span=span)
            a, l0, span = chunks[c]
            chunk_update(a, l0, bufs[c % 2], *st, span=span)
            if finishes and last[a] == c:
                finish(a)
            st = nxt

    def full_pair():
        chunk_pipeline([(c // per, (c % per) * lc, None) for c in range(units * per)])

    # A masked pair of a dense call: per unit, the key sub-tile ranges
    # (prm.sub's keys) the unit can see, each through the same pipeline over
    # the unit's lane chunks, masked. Sub-tiles of (G x 256 rows) x 256 keys
    # held a spilled f32 score tile (v6e 8k causal d=128: 1,071 cycles each
    # for 400 of MXU work). A range's chunk fills ck of a buffer's block_kv
    # rows, so the buffers hold two ranges' scores side by side (`slot`), and
    # a unit runs with two ranges in flight: range c + 1 is scored while range
    # c updates, and neither waits for the other's loads and stores. With one
    # range in flight, each range's update and the next one's scores shared
    # a buffer, and a 256-key range took 800 bundles for 400 MXU cycles (tpu7x
    # 8k d=128); two ranges now take 1,325, and a diagonal pair 7,672 cycles,
    # was 8,621. The units run as a loop (a traced unit index): unrolled, their
    # code doubled the kernel (21.9k bundles against 12.0k, twice the compile
    # time) for 1.4 us of its 1,237.
    ck = prm.sub[1] if prm.sub is not None else g.block_kv

    def diagonal_pair():
        chunk_pipeline(
            [(a, r * lc, (0, (a + 1) * ck, False)) for a in range(units) for r in range(per)],
            finishes=True,
        )

    def far_edge_pair():
        chunk_pipeline(
            [(a, r * lc, (a * ck, g.block_kv, True)) for a in range(units) for r in range(per)]
        )

    def masked_range(a, k0):
        """One key range's pipeline over unit a's lane chunks, chunk r in
        buffer r % 2: what a unit runs where two ranges' scores do not fit
        the buffers at once (per * ck > block_kv)."""
        keys = (k0, ck)
        st = chunk_scores(a, 0, s0_ref, keys)
        for r in range(per):
            nxt = chunk_scores(a, (r + 1) * lc, bufs[(r + 1) % 2], keys) if r + 1 < per else None
            chunk_update(a, r * lc, bufs[r % 2], *st, keys)
            st = nxt

    def slot(p, r):
        """(buffer, first row) of chunk r of a range in slot set p."""
        s = p * per + r
        return bufs[s % 2], (s // 2) * ck

    def unit_ranges(a):
        """Unit a's visible key ranges, two in flight: a loop of two ranges
        a trip (the slot sets static), then the one or two ranges left."""
        c_lo, c_hi = _chunk_range(prm, i, j, a)  # pipelined: prm.sub's rows are a unit

        def keys(c):
            return (pl.multiple_of(c * ck, ck), ck)

        def step(c, p, st, last=False):
            """Scores range c + 1 into set 1 - p (unless last) and updates
            range c from set p; returns range c + 1's (m_new, alpha)s."""
            nxt = []
            for r in range(per):
                if not last:
                    buf, row0 = slot(1 - p, r)
                    nxt.append(chunk_scores(a, r * lc, buf, keys(c + 1), row0))
                buf, row0 = slot(p, r)
                chunk_update(a, r * lc, buf, *st[r], keys(c), row0)
            return nxt

        def body(t, st):
            c = c_lo + 2 * t
            return step(c + 1, 1, step(c, 0, st))

        @pl.when(c_hi > c_lo)
        def _():
            n = c_hi - c_lo
            trips = lax.div(n - 1, 2)  # n >= 1; floor division would lower through sign()
            st = []
            for r in range(per):
                buf, row0 = slot(0, r)
                st.append(chunk_scores(a, r * lc, buf, keys(c_lo), row0))
            st = lax.fori_loop(0, trips, body, st)
            c = c_lo + 2 * trips

            @pl.when(lax.rem(n, 2) == 0)
            def _():
                step(c + 1, 1, step(c, 0, st), last=True)

            @pl.when(lax.rem(n, 2) == 1)
            def _():
                step(c, 0, st, last=True)

    def masked_pair():
        if per * ck > g.block_kv:
            for a in range(units):
                _visible_chunks(prm, i, j, a, functools.partial(masked_range, a))
        elif unit % (32 // q_ref.dtype.itemsize):  # a traced row offset must be tile-aligned
            for a in range(units):
                unit_ranges(a)
        else:

            def unit_loop(a, carry):
                unit_ranges(a)
                return carry

            lax.fori_loop(0, units, unit_loop, 0)

    if diagonal_only:
        masked_pair = diagonal_pair
    elif diagonal:
        cut_pair = masked_pair

        def masked_pair():
            pl.when(on_diagonal)(diagonal_pair)
            if far_edge:
                pl.when(on_far_edge)(far_edge_pair)
            pl.when(jnp.logical_not(own_pipeline))(cut_pair)

    _unit_pairs(prm, i, j, flags, tile, full_pair, masked_pair if pipelined else None)

    # A diagonal pair is its q row's last visible pair (keys past the diagonal
    # are hidden: right = 0), so it normalises each unit inside its own
    # pipeline, as soon as the unit's last chunk is updated (chunk_pipeline's
    # finish): in one basic block with the later units' matmuls, the
    # scheduler hides the transposes and stores under them. Run as its own
    # block after the pipeline, the finalisation was a step's worth of XLU
    # and VALU work no MXU work overlapped (tpu7x 4k d=128: 629 bundles a q
    # block). The FINAL bit still decides: a pair that lacked it would only
    # have written its rows early, and the row's last step writes them again.
    final = _flag(flags, bsched.FINAL)
    if diagonal:
        final = jnp.logical_and(final, jnp.logical_not(diagonal_step))

    @pl.when(final)
    def _final():
        for a in range(units):
            finish(a)


def _sink_row(prm, sinks_ref, h, i, a):
    """(1, Gb * unit) sink logit of each query row of state unit a, in lane order."""
    g, grp, unit = prm.geom, prm.group, prm.unit
    if not g.seq_major:
        rows = [jnp.full((1, unit), sinks_ref[h * grp + hg], jnp.float32) for hg in range(grp)]
        return jnp.concatenate(rows, axis=1) if grp > 1 else rows[0]
    # Decode layout: global row r holds head r % G (float floor is exact here).
    lane = lax.broadcasted_iota(jnp.int32, (1, unit), 1)
    r = (i * g.rows + a * unit + lane).astype(jnp.float32)
    head = r - jnp.floor((r + 0.5) * (1.0 / grp)) * grp
    out = jnp.zeros((1, unit), jnp.float32)
    for hg in range(grp):
        out = jnp.where(head == float(hg), sinks_ref[h * grp + hg], out)
    return out


# ---------------------------------------------------------------------------
# pallas_call builders. Kernel-layout operands:
#   q5 [B, Hkv, Gb, Sr, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv],
#   lse/delta [B, Hkv, Gb, Sr] f32, qpos/qseg [Bm, 1, Sr], kseg [Bm, 1, Skv].


def _meta_specs(outer_is_q):
    def q_blk(word):
        return (
            (word >> bsched.OUTER_SHIFT)
            if outer_is_q
            else ((word >> bsched.INNER_SHIFT) & (bsched.MAX_INNER_BLOCKS - 1))
        )

    def kv_blk(word):
        return (
            ((word >> bsched.INNER_SHIFT) & (bsched.MAX_INNER_BLOCKS - 1))
            if outer_is_q
            else (word >> bsched.OUTER_SHIFT)
        )

    return q_blk, kv_blk


def _common_specs(prm, outer_is_q, batch_meta):
    """BlockSpecs of q-side and kv-side operands for a (b, h, p) grid. Their
    index maps read the schedule, the first scalar-prefetch array, and pass
    over any after it (the dK/dV kernel's O blocks, schedule.o_blocks)."""
    g = prm.geom
    gb, br, bkv = prm.heads_in_block, g.block_pos, g.block_kv
    q_blk, kv_blk = _meta_specs(outer_is_q)
    minor = functools.partial(_minor_dims, prm)
    q_spec = lambda d: pl.BlockSpec(  # noqa: E731
        (None, None, gb) + minor(br, d), lambda b, h, p, s, *_: (b, h, 0) + minor(q_blk(s[p]), 0)
    )
    kv_spec = lambda d: pl.BlockSpec(  # noqa: E731
        (None, None) + minor(bkv, d), lambda b, h, p, s, *_: (b, h) + minor(kv_blk(s[p]), 0)
    )
    row_spec = pl.BlockSpec((None, None, gb, br), lambda b, h, p, s, *_: (b, h, 0, q_blk(s[p])))
    mb = (lambda b: b) if batch_meta else (lambda b: 0)
    qmeta_spec = pl.BlockSpec((None, 1, br), lambda b, h, p, s, *_: (mb(b), 0, q_blk(s[p])))
    kmeta_spec = pl.BlockSpec((None, 1, bkv), lambda b, h, p, s, *_: (mb(b), 0, kv_blk(s[p])))
    return q_spec, kv_spec, row_spec, qmeta_spec, kmeta_spec


def _meta_inputs(prm, aux, qmeta_spec, kmeta_spec):
    args, specs = [], []
    if prm.has_qpos:
        args.append(aux["qpos"])
        specs.append(qmeta_spec)
    if prm.has_segments:
        args += [aux["qseg"], aux["kseg"]]
        specs += [qmeta_spec, kmeta_spec]
    return args, specs


def _compiler_params(prm, sequential=False):
    """sequential: the (batch, kv head) axes run in grid order on one core
    (steps carry DMAs from one kv head to the next)."""
    return pltpu.CompilerParams(
        dimension_semantics=("arbitrary",) * 3
        if sequential
        else ("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=prm.vmem_limit,
        # Every block index comes from our schedule, built within the block
        # counts (clamped where built from data: schedule.enumerate_pairs),
        # and the dQ copies' from it: the checks only cost scalar bundles
        # each step (tpu7x 4k d=128 dK/dV: 676.4 against 684.1 us).
        disable_bounds_checks=True,
    )


def fwd_call(prm, q5, k, v, sinks, aux, sched, interpret, batch_meta):
    b, hkv = k.shape[0], k.shape[1]
    g = prm.geom
    q_spec, kv_spec, row_spec, qmeta_spec, kmeta_spec = _common_specs(prm, True, batch_meta)
    args, specs = [], []
    if prm.has_sinks:
        args.append(sinks.astype(jnp.float32))
        specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    args += [q5, k, v]
    specs += [q_spec(prm.head_dim), kv_spec(prm.head_dim), kv_spec(prm.head_dim_v)]
    margs, mspecs = _meta_inputs(prm, aux, qmeta_spec, kmeta_spec)
    args += margs
    specs += mspecs
    rows = q5.shape[:3] + (g.q_rows_total,)
    o_dims = _minor_dims(prm, g.q_rows_total, prm.head_dim_v)
    out_shape = (
        jax.ShapeDtypeStruct(q5.shape[:3] + o_dims, q5.dtype),
        jax.ShapeDtypeStruct(rows, jnp.float32),
    )
    out_specs = (q_spec(prm.head_dim_v), row_spec)
    gb, unit = prm.heads_in_block, prm.unit
    units = g.block_pos // unit
    scratch = [
        pltpu.VMEM((units, 1, gb * unit), jnp.float32),
        pltpu.VMEM((units, prm.head_dim_v + ONES_ROWS, gb * unit), jnp.float32),
        pltpu.VMEM((prm.head_dim_v + ONES_ROWS, g.block_kv), v.dtype),
    ]
    scratch += [pltpu.VMEM((g.block_kv, prm.chunk_lanes), jnp.float32)] * 2
    if prm.swapped:
        scratch.append(pltpu.VMEM((gb, g.block_pos, prm.head_dim), q5.dtype))
    steps = sched.shape[0]
    itemsize = q5.dtype.itemsize
    cost = pl.CostEstimate(
        flops=int(b * hkv * steps * 2 * g.rows * g.block_kv * (prm.head_dim + prm.head_dim_v)),
        transcendentals=int(b * hkv * steps * g.rows * g.block_kv),
        bytes_accessed=int(
            itemsize * (q5.size + k.size + v.size + q5.size // prm.head_dim * prm.head_dim_v)
        ),
    )
    return pl.pallas_call(
        functools.partial(_fwd_kernel, prm=prm, interpret=bool(interpret)),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, steps),
            in_specs=specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        compiler_params=_compiler_params(prm),
        cost_estimate=cost,
        interpret=interpret,
        name="flash_attention_fwd",
    )(sched, *args)
