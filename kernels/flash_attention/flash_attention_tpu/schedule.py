"""Compact lists of the (q block, kv block) pairs the kernels visit.

The kernels run on a grid (batch, kv head, step). Each step reads one int32
word of a scalar-prefetched schedule that names its blocks, so pairs that
the mask fully hides cost no grid step, no DMA and no MXU work. A word packs

    outer block << 18 | inner block << 4 | flags

where "outer" is the block whose accumulators live across consecutive steps
(the q block for the forward and dQ kernels, the kv block for dK/dV) and
"inner" the block streamed past it. Flags:

    INIT     first step of an outer block: reset accumulators
    FINAL    last step of an outer block: normalise and write the output
    COMPUTE  the pair holds at least one visible entry
    MASK     the pair is not fully visible (diagonal, window edge, sequence
             tail, segment ids): apply the elementwise mask
    FIRST    (kv-major order only) the first computed pair of its q block:
             where the dK/dV kernel derives the block's delta = rowsum(dO * O)

An outer block with nothing visible still gets one step (INIT | FINAL, no
COMPUTE) so its output (zeros) is written. Steps past the end of a
data-dependent (varlen) schedule repeat the last pair with no flags: same
block indices, so Pallas issues no DMA, and the kernel does nothing.

Visible inner blocks of each outer block form a range [lo, hi] whose ends
never decrease with the outer index (causal, windows and packed sequences
all have this property), which is what lets one function build the
row-major (forward, dQ) and column-major (dK/dV) orders from the same ranges.
"""

from __future__ import annotations

import numpy as np

INIT = 1
FINAL = 2
COMPUTE = 4
MASK = 8
FIRST = 16
FLAG_BITS = 31

OUTER_SHIFT = 18
INNER_SHIFT = 5
MAX_OUTER_BLOCKS = 1 << (31 - OUTER_SHIFT)
MAX_INNER_BLOCKS = 1 << (OUTER_SHIFT - INNER_SHIFT)

UNBOUNDED = np.iinfo(np.int32).max // 4

# Schedules live in SMEM (1 MiB per core on v5e..tpu7x); keep each under 512 KiB.
MAX_STEPS = 1 << 17


def decode_word(word):
    """(outer, inner, flags) of a schedule word (works on numpy, jax, scalars)."""
    return word >> OUTER_SHIFT, (word >> INNER_SHIFT) & (MAX_INNER_BLOCKS - 1), word & FLAG_BITS


def _check_steps(steps):
    if steps > MAX_STEPS:
        raise ValueError(
            f"sequence length: the block schedule needs {steps} steps, more than the "
            f"{MAX_STEPS} that fit in SMEM; use larger block_q/block_kv"
        )


def _check_counts(n_outer, n_inner):
    if n_outer > MAX_OUTER_BLOCKS or n_inner > MAX_INNER_BLOCKS:
        raise ValueError(
            f"sequence length: at most {MAX_OUTER_BLOCKS} x {MAX_INNER_BLOCKS} blocks are "
            f"supported by the schedule encoding, got {n_outer} x {n_inner}"
        )


def enumerate_pairs(lo, hi, n_inner, max_steps=None, xp=np):
    """Row-major schedule from per-outer-block inner ranges [lo, hi].

    Returns (outer, inner, flags) arrays of length max_steps (or the exact
    count when max_steps is None; numpy only). Flags have no MASK bit.
    """
    n_outer = lo.shape[0]
    count = xp.maximum(hi - lo + 1, 0)
    steps = xp.maximum(count, 1)
    ends = xp.cumsum(steps)
    starts = ends - steps
    total = ends[-1]
    if max_steps is None:
        max_steps = int(total)
    _check_steps(max_steps)
    p = xp.arange(max_steps, dtype=np.int32)
    live = p < total
    p_eff = xp.minimum(p, total - 1)
    outer = xp.searchsorted(ends, p_eff, side="right").astype(np.int32)
    outer = xp.minimum(outer, n_outer - 1)
    t = p_eff - starts[outer]
    inner = xp.clip(lo[outer] + t, 0, n_inner - 1).astype(np.int32)
    flags = (
        xp.where(t == 0, INIT, 0)
        | xp.where(t == steps[outer] - 1, FINAL, 0)
        | xp.where(t < count[outer], COMPUTE, 0)
    )
    flags = xp.where(live, flags, 0).astype(np.int32)
    return outer, inner, flags


def transpose_ranges(lo, hi, n_inner, xp=np):
    """Per-inner-block ranges of outer blocks, for the column-major order."""
    j = xp.arange(n_inner, dtype=np.int32)
    first = xp.searchsorted(hi, j, side="left").astype(np.int32)  # first i: hi_i >= j
    last = (xp.searchsorted(lo, j, side="right") - 1).astype(np.int32)  # last i: lo_i <= j
    return first, last


def first_visits(kv, q, flags, lo, xp=np):
    """FIRST bits of a kv-major schedule: q block q's computed pairs are kv
    blocks lo[q]..hi[q] (its row-major range), so its first is kv block lo[q]."""
    return xp.where(((flags & COMPUTE) != 0) & (kv == lo[q]), FIRST, 0).astype(np.int32)


def o_blocks(words, xp=np):
    """Per step of a kv-major schedule, the q block whose O block the dK/dV
    kernel holds (its second scalar-prefetch array, read by O's index map).

    O is read only at a q block's FIRST step, where the kernel derives its
    delta; the other steps read q, dO and lse. Pallas copies an input's
    block only when its index changes from the step before, so O's index
    is the q block of the next FIRST step (this one's when FIRST; the last
    FIRST's past it, 0 if none): each O block moves once, a FIRST step or
    more ahead of its use. It moved at every step, one q-side block in
    three (v6e 8k d=256: 448 of its 576 copies of 1 MiB were not read).
    """
    n = words.shape[0]
    _, q, flags = decode_word(words)
    step = xp.arange(n, dtype=np.int32)
    first = (flags & FIRST) != 0
    at = xp.where(first, step, n)
    if xp is np:
        nxt = np.minimum.accumulate(at[::-1])[::-1]
    else:
        from jax import lax

        nxt = lax.cummin(at, reverse=True)
    last = xp.max(xp.where(first, step, -1))
    o = q[xp.clip(xp.where(nxt < n, nxt, last), 0, n - 1)]
    return xp.where(last >= 0, o, 0).astype(np.int32)


def pack(outer, inner, flags, xp=np):
    return (
        (outer.astype(np.int32) << OUTER_SHIFT)
        | (inner.astype(np.int32) << INNER_SHIFT)
        | flags.astype(np.int32)
    )


# ---------------------------------------------------------------------------
# Dense (static) schedules.


def q_block_positions(geom, q_offset, group):
    """[first, last] query position of each q block (kernel row layout)."""
    i = np.arange(geom.num_q_blocks, dtype=np.int64)
    first_row = i * geom.block_pos
    last_row = np.minimum(first_row + geom.block_pos, geom.q_rows_total) - 1
    if geom.seq_major:
        return first_row // group + q_offset, last_row // group + q_offset
    return first_row + q_offset, last_row + q_offset


def _dense_band(left, right, causal):
    left = UNBOUNDED if left is None or left < 0 else left
    right = UNBOUNDED if right is None or right < 0 else right
    if causal:
        right = min(right, 0)
    return left, right


def dense_ranges(geom, *, q_offset, group, causal, left, right):
    """Visible kv block range [lo, hi] of each q block (numpy)."""
    left, right = _dense_band(left, right, causal)
    q_first, q_last = q_block_positions(geom, q_offset, group)
    bkv, nk = geom.block_kv, geom.num_kv_blocks
    if right < -left:  # empty band: nothing is visible anywhere
        lo = np.zeros_like(q_first)
        return lo, lo - 1
    k_lo = np.maximum(q_first - left, 0)
    k_hi = np.minimum(q_last + right, geom.kv_len - 1)
    lo = k_lo // bkv
    hi = np.where(k_hi < k_lo, -1, np.floor_divide(k_hi, bkv))
    hi = np.where(lo > nk - 1, -1, hi)
    return lo.astype(np.int64), hi.astype(np.int64)


def _dense_mask_flags(geom, q_idx, kv_idx, *, q_offset, group, causal, left, right, segmented):
    """MASK bit per pair: set unless every entry of the pair is visible."""
    if segmented:
        return np.full(q_idx.shape, MASK, np.int32)
    left, right = _dense_band(left, right, causal)
    q_first, q_last = q_block_positions(geom, q_offset, group)
    qf, ql = q_first[q_idx], q_last[q_idx]
    kf = kv_idx.astype(np.int64) * geom.block_kv
    kl = kf + geom.block_kv - 1
    full = (kl <= qf + right) & (kf >= ql - left)
    full &= kl < geom.kv_len
    q_rows_end = (q_idx.astype(np.int64) + 1) * geom.block_pos
    full &= q_rows_end <= geom.q_rows_total
    return np.where(full, 0, MASK).astype(np.int32)


def dense_schedules(geom_rows, geom_cols, *, q_offset, group, causal, left, right, segmented):
    """Static schedules (numpy int32) for a dense call.

    geom_rows: geometry of a row-major kernel (forward or dQ) -> q-major list.
    geom_cols: geometry of the dK/dV kernel -> kv-major list (None to skip).
    """
    out = []
    kw = dict(q_offset=q_offset, group=group, causal=causal, left=left, right=right)
    g = geom_rows
    _check_counts(g.num_q_blocks, g.num_kv_blocks)
    lo, hi = dense_ranges(g, **kw)
    qi, kj, fl = enumerate_pairs(lo, hi, g.num_kv_blocks)
    fl = fl | np.where(fl & COMPUTE, _dense_mask_flags(g, qi, kj, segmented=segmented, **kw), 0)
    out.append(pack(qi, kj, fl))
    if geom_cols is not None:
        g = geom_cols
        _check_counts(g.num_kv_blocks, g.num_q_blocks)
        lo, hi = dense_ranges(g, **kw)
        clo, chi = transpose_ranges(lo, hi, g.num_kv_blocks)
        kj, qi, fl = enumerate_pairs(clo, chi, g.num_q_blocks)
        fl = fl | np.where(fl & COMPUTE, _dense_mask_flags(g, qi, kj, segmented=segmented, **kw), 0)
        fl = fl | first_visits(kj, qi, fl, lo)
        out.append(pack(kj, qi, fl))
    return out


# ---------------------------------------------------------------------------
# Sub-tiles of masked pairs.


def sub_tiles(geom, sub_block, eligible, rows=None):
    """(rows, keys) sub-tile the kernels cut masked pairs into, or None.

    Only dense calls (positions from block indices, no segment arrays) are
    eligible: the visible part of each row chunk is then a key range known
    from scalars. The size must divide both block dims (else 128 does).
    `rows`: the forward's slab (positions), which its sub-tiles take when
    smaller: a 1024-row sub-tile of the diagonal scheduled 2.4x slower per
    entry than a 256-row slab (v6e).
    """
    if not eligible or geom.seq_major:
        return None
    br, bkv = geom.block_pos, geom.block_kv
    s = sub_block if (br % sub_block == 0 and bkv % sub_block == 0) else 128
    if s >= br and s >= bkv:
        return None
    rc, ck = min(s, br), min(s, bkv)
    if rows is not None and rows < rc:
        rc = rows
    return rc, ck


def chunk_bounds(i, j, a, *, geom, sub, q_offset, left, right, xp=np):
    """[lo, hi) key chunks of pair (i, j) that row chunk a can see.

    left/right are the kernel's band (UNBOUNDED when open, right <= 0 when
    causal). Works on numpy ints and on in-kernel jax scalars alike.
    """
    rc, ck = sub
    shift = ck.bit_length() - 1
    row0 = i * geom.block_pos + a * rc
    n_valid = xp.minimum(row0 + rc, geom.q_rows_total) - row0
    p_first = row0 + q_offset
    p_last = p_first + n_valid - 1
    kf = j * geom.block_kv
    c_lo = 0
    if left < UNBOUNDED:
        c_lo = xp.maximum(p_first - left - kf, 0) >> shift
    hi = geom.kv_len - 1
    if right < UNBOUNDED:
        hi = xp.minimum(p_last + right, hi)
    c_hi = xp.minimum(((hi - kf) >> shift) + 1, geom.block_kv // ck)
    c_hi = xp.where(n_valid > 0, c_hi, 0)
    return c_lo, c_hi


def mxu_work(
    schedule,
    geom,
    head_dim,
    head_dim_v,
    group,
    *,
    q_major,
    sub=None,
    q_offset=0,
    causal=False,
    left=-1,
    right=-1,
):
    """MXU flops the kernels issue for one (batch, kv head): 2 matmuls per tile.

    Follows the kernels exactly: whole blocks for fully visible pairs, and
    for masked pairs either the whole block or the visible sub-tiles.
    left/right: flash-attn window (-1 unbounded).
    """
    left, right = _dense_band(left, right, causal)
    outer, inner, flags = decode_word(np.asarray(schedule))
    gb = 1 if geom.seq_major else group
    per_entry = 2 * (head_dim + head_dim_v)
    whole = geom.rows * geom.block_kv * per_entry
    total = 0
    for o, n, f in zip(outer.tolist(), inner.tolist(), flags.tolist()):
        if not f & COMPUTE:
            continue
        if not (f & MASK) or sub is None:
            total += whole
            continue
        rc, ck = sub
        i, j = (o, n) if q_major else (n, o)
        for a in range(geom.block_pos // rc):
            lo, hi = chunk_bounds(
                i, j, a, geom=geom, sub=sub, q_offset=q_offset, left=left, right=right
            )
            total += max(int(hi) - int(lo), 0) * gb * rc * ck * per_entry
    return total


# ---------------------------------------------------------------------------
# Varlen (data-dependent) schedules, built with jax.numpy from cu_seqlens.


def varlen_token_bounds(cu_q, cu_k, total_q, *, causal, left, right):
    """Per query token: shifted position and [lo, hi] visible key (global index).

    The shifted position puts the bottom-right causal alignment of each
    sequence in global key coordinates: key t_k of the same sequence is
    visible iff pos - left <= t_k <= pos + right.
    """
    import jax.numpy as jnp

    left, right = _dense_band(left, right, causal)
    t = jnp.arange(total_q, dtype=jnp.int32)
    seg = (jnp.searchsorted(cu_q, t, side="right") - 1).astype(jnp.int32)
    seg = jnp.clip(seg, 0, cu_q.shape[0] - 2)
    q_end = cu_q[seg + 1]
    k_start, k_end = cu_k[seg], cu_k[seg + 1]
    pos = t + (k_end - q_end)
    lo = jnp.clip(pos - left, k_start, k_end)
    hi = jnp.clip(pos + right, k_start - 1, k_end - 1)
    if right < -left:
        hi = k_start - 1
    return seg, pos, lo, hi


def varlen_step_bound(nq, nk, bkv, max_seqlen_k):
    """Upper bound on the steps of a row-major varlen schedule.

    With nondecreasing ranges, hi_i - lo_{i+1} is at most the kv blocks of the
    one sequence straddling the q-block boundary (max_seqlen_k / bkv + 1), the
    lo_i climb at most nk in total, and every q block adds at most one step for
    its own width and one placeholder.
    """
    return int(min(nq * nk + nq, (nq - 1) * (max_seqlen_k // bkv + 3) + 2 * nk + nq + 2))


def varlen_schedules(
    cu_q, cu_k, total_q, total_k, geom_rows, geom_cols, *, group, causal, left, right, max_seqlen_k
):
    """Data-dependent schedules (jax int32) with static upper-bound lengths.

    Returns per-token (segment, shifted position) and the row-major and
    column-major schedules.
    """
    import jax.numpy as jnp

    seg, pos, tok_lo, tok_hi = varlen_token_bounds(
        cu_q, cu_k, total_q, causal=causal, left=left, right=right
    )

    def ranges(g):
        i = jnp.arange(g.num_q_blocks, dtype=jnp.int32)
        first = i * g.block_pos
        last = jnp.minimum(first + g.block_pos, g.q_rows_total) - 1
        if g.seq_major:
            first, last = first // group, last // group
        lo = tok_lo[first] // g.block_kv
        hi = jnp.floor_divide(tok_hi[last], g.block_kv)
        return lo.astype(jnp.int32), hi.astype(jnp.int32)

    scheds = []
    g = geom_rows
    _check_counts(g.num_q_blocks, g.num_kv_blocks)
    nq, nk = g.num_q_blocks, g.num_kv_blocks
    lo, hi = ranges(g)
    qi, kj, fl = enumerate_pairs(
        lo, hi, nk, varlen_step_bound(nq, nk, g.block_kv, max_seqlen_k), xp=jnp
    )
    fl = fl | jnp.where(fl & COMPUTE, MASK, 0)
    scheds.append(pack(qi, kj, fl, xp=jnp))
    g = geom_cols
    _check_counts(g.num_kv_blocks, g.num_q_blocks)
    nq, nk = g.num_q_blocks, g.num_kv_blocks
    lo, hi = ranges(g)
    clo, chi = transpose_ranges(lo, hi, nk, xp=jnp)
    bound = varlen_step_bound(nq, nk, g.block_kv, max_seqlen_k) + nk
    kj, qi, fl = enumerate_pairs(clo, chi, nq, bound, xp=jnp)
    fl = fl | jnp.where(fl & COMPUTE, MASK, 0)
    fl = fl | first_visits(kj, qi, fl, lo, xp=jnp)
    scheds.append(pack(kj, qi, fl, xp=jnp))
    return seg, pos, scheds
