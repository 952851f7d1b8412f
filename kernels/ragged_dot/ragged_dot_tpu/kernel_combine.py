"""MoE combine as a Pallas TPU kernel: each token's top-k rows of the down
projection fetched by DMA where the gmm wrote them, weighted and summed in f32.

res[t] = sum_j weights[t, j] * rows[slots[t, j]], rounded once to out_dtype.

Why this design
---------------
At prefill the layer's rows are in expert order and each token needs its k
of them back. XLA gathers them into a [k, T, H] copy (offloaded to the
SparseCore: reading and writing every row, 537 MB at 8,192 Qwen3 tokens)
and then reads that copy again for the weighted sum. Here each row is read
once, by its own DMA, into VMEM, and summed there: the rows' bytes once and
the [T, H] result, nothing in between.

* Rows arrive packed (pairs.pack_rows, what gmm writes with packed=True):
  a bf16 row of a [S, H] array shares its 32-bit words with its neighbour
  row, so it cannot be copied alone; packed, a row's H/2 words are whole
  (8, 128) tiles of their own (padded to them), one contiguous DMA (a row of a 2-D
  uint32 [S, H/2] array is a sublane of H/256 tiles: a strided copy whose
  addressing took ~10.5 bundles to issue on v6e against ~4.1).
* Grid over token tiles of `block_t` tokens, sequential, through three row
  slots (one semaphore each, one wait for a tile's whole byte count): tile
  i is summed while the copies of tile i + 2 are issued, in the same loop
  body, 16 tokens at a time, so the scalar unit issues copies in the
  bundles the vector work leaves free. With two slots (copies of tile i + 1
  issued during tile i) each step waited on its last copies' latency: 310
  us at 8,192 Qwen3 tokens on v6e; issuing a whole tile's copies before
  the sum, 250; three slots in one scratch array, 235. The last steps
  fetch the last tile again rather than branch in the loop (a branch would
  split the body in two). The ids of the tile two ahead reach SMEM through
  the BlockSpec pipeline.
* Each slot is its own scratch array and the step is compiled once per
  slot (a `pl.when` on the slot), so every ref in the loop body is static.
  With one [SLOTS, ...] array indexed by the step's slot, the scheduler could
  not tell the rows being copied in from the rows being summed and issued
  the tile's copies ahead of the loads: a 753-bundle body on tpu7x against
  611 now, 216.7 -> 178.3 us at 8,192 Qwen3 tokens (v6e 235.0 -> 221.4).
* Each token's rows land slot-major in VMEM ([k, block_t] rows). The sum
  reads word group g of 16 tokens as one sublane-strided load (every
  row_words(H)-th row), unpacks each word with a shift and a mask (no lane
  shuffles) and adds whole tiles of tokens.
* Row ids are clamped to [0, S) before the kernel, so every copy is in
  bounds whatever `slots` holds, and the DMAs' own bounds checks are
  compiled out. What is left of a copy's issue is ~7 scalar ops (the id's
  load, two addresses), ~4 bundles on the two scalar slots.
* A tile is the most tokens whose rows copy within a DMA latency
  (tiling.combine_block_t): a step's last copies, issued for the tile two
  ahead, land only if the next step lasts about that long (Gemma 4's padded
  rows at 32-token steps on tpu7x: 299.7 us at 8,192 tokens, half of it
  waiting; 188.5 at 64), and larger tiles expose more of the first two
  tiles' copies.
* A tile's 16-token parts are unrolled (block_t / 16, at most 8): each
  copy's id slot and VMEM destination are then constants instead of a sum
  on the loop's counter (a copy every ~3.7 bundles). 8,192 Qwen3 tokens on
  tpu7x, scheduled: 178.3 -> 153.9 us (v6e, bound by its copies' bytes:
  221.4, unchanged).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import pairs, tiling

SLOTS = tiling.COMBINE_SLOTS
SUB = 16  # tokens a loop body (block_t is a multiple of it)


def combine_reference(rows, slots, weights, *, hidden, out_dtype=jnp.bfloat16):
    """The same sum by XLA: gather, widen, weight, sum over k in f32."""
    gathered = pairs.unpack_rows(rows, hidden, jnp.float32)[slots]  # [T, k, H]
    return (gathered * weights.astype(jnp.float32)[..., None]).sum(axis=1).astype(out_dtype)


def _check(rows, slots, weights, hidden, out_dtype):
    if not pairs.packable(hidden):
        raise ValueError(f"combine: hidden: expected a multiple of {pairs.PIECE}, got {hidden}")
    rw = pairs.row_words(hidden)
    if rows.ndim != 2 or rows.dtype != jnp.uint32 or rows.shape[1] != pairs.GROUP // 2:
        raise ValueError(
            f"combine: rows: expected uint32 [S * {rw}, 128] (pairs.pack_rows of [S, {hidden}]),"
            f" got {rows.dtype} {tuple(rows.shape)}"
        )
    if rows.shape[0] % rw:
        raise ValueError(
            f"combine: rows: expected a multiple of {rw} rows (pairs.row_words({hidden}) a"
            f" token), got {rows.shape[0]}"
        )
    if slots.ndim != 2 or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(
            f"combine: slots: expected integer [T, k] row ids, got {slots.dtype}"
            f" {tuple(slots.shape)}"
        )
    if weights.shape != slots.shape or not jnp.issubdtype(weights.dtype, jnp.floating):
        raise ValueError(
            f"combine: weights: expected floating {tuple(slots.shape)} (slots' shape), got"
            f" {weights.dtype} {tuple(weights.shape)}"
        )
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"combine: out_dtype: expected bfloat16 or float32, got {out_dtype}")


@functools.partial(
    jax.jit, static_argnames=("hidden", "out_dtype", "block_t", "generation", "interpret")
)
def combine(
    rows,
    slots,
    weights,
    *,
    hidden,
    out_dtype=jnp.bfloat16,
    block_t=None,
    generation=None,
    interpret=False,
):
    """Args:
      rows: uint32 [S * pairs.row_words(H), 128]: S rows of H bf16 values as
        pairs.pack_rows lays them out (gmm's packed output).
      slots: int [T, k]: the row (of the S) for each token's k slots (clamped
        to [0, S)).
      weights: float [T, k]: each slot's weight (0 for a slot that counts for
        nothing: its row is still read, and 0 x inf is NaN as in XLA's sum).
      out_dtype: bfloat16 or float32.
      hidden: H, a multiple of 64 (pairs.packable).
      block_t: tokens a grid step (default tiling.combine_block_t for
        `generation`, the attached chip's if None).

    Returns [T, H] in out_dtype.
    """
    _check(rows, slots, weights, hidden, out_dtype)
    ng = pairs.groups(hidden)
    rw = pairs.row_words(hidden)
    s = rows.shape[0] // rw
    t, k = slots.shape
    h = hidden
    if t == 0 or k == 0 or s == 0:
        return jnp.zeros((t, h), out_dtype)
    bt = block_t or tiling.combine_block_t(t, k, h, generation)
    if bt % SUB:
        raise ValueError(f"combine: block_t: expected a multiple of {SUB}, got {bt}")
    nt = pl.cdiv(t, bt)
    pad = nt * bt - t
    # Padded tokens read row 0 with weight 0; their rows of the result are
    # never written back.
    ids = jnp.clip(slots.astype(jnp.int32), 0, s - 1)
    ids = jnp.pad(ids, ((0, pad), (0, 0))).reshape(nt, 1, bt * k)
    w = jnp.pad(weights.astype(jnp.float32), ((0, pad), (0, 0)))

    half = pairs.GROUP // 2

    def kernel(first_ref, second_ref, ahead_ref, w_ref, rows_hbm, out_ref, *scratch):
        bufs, sem = scratch[:SLOTS], scratch[SLOTS]
        i = pl.program_id(0)
        slot = lax.rem(i, SLOTS)

        def fetch(ids_ref, into, r0, count):
            """Tokens [r0, r0 + count) of a tile: each slot's row, one DMA."""
            for r in range(count):
                for j in range(k):
                    pltpu.make_async_copy(
                        rows_hbm.at[
                            pl.ds(pl.multiple_of(ids_ref[0, (r0 + r) * k + j] * rw, 8), rw)
                        ],
                        bufs[into].at[pl.ds((j * bt + r0 + r) * rw, rw)],
                        sem.at[into],
                    ).start()

        def fetch_tile(ids_ref, into):
            lax.fori_loop(0, bt // SUB, lambda b, c: fetch(ids_ref, into, b * SUB, SUB) or c, 0)

        def wait(into):
            # One wait for a tile: the semaphore counts the bytes of all its rows.
            pltpu.make_async_copy(bufs[into], bufs[into], sem.at[into]).wait()

        @pl.when(i == 0)
        def _():
            fetch_tile(first_ref, 0)
            fetch_tile(second_ref, 1)

        def step(cur, into):
            wait(cur)
            buf = bufs[cur]

            def part(b, carry):
                r0 = pl.multiple_of(b * SUB, SUB)
                fetch(ahead_ref, into, r0, SUB)
                wv = w_ref[pl.ds(r0, SUB), :]
                for g in range(ng):
                    # A partial last group sums only the columns it holds.
                    sums = [jnp.zeros((SUB, w), jnp.float32) for w in pairs.widths(h, g) if w]
                    for j in range(k):
                        words = buf[pl.ds((j * bt + r0) * rw + g, SUB, stride=rw), :]
                        wj = wv[:, j : j + 1]
                        values = pairs.group_values(words, h, g)
                        sums = [s + v * wj for s, v in zip(sums, values)]
                    o = g * pairs.GROUP
                    for p, v in enumerate(sums):
                        out_ref[pl.ds(r0, SUB), pl.ds(o + p * half, v.shape[1])] = v.astype(
                            out_ref.dtype
                        )
                return carry

            lax.fori_loop(0, bt // SUB, part, 0, unroll=True)

            @pl.when(i + 1 == nt)
            def _():
                wait((cur + 1) % SLOTS)
                wait(into)

        # One copy of the step per slot (see "Why this design"): static refs.
        for cur in range(SLOTS):
            pl.when(slot == cur)(functools.partial(step, cur, (cur + 2) % SLOTS))

    out = pl.pallas_call(
        kernel,
        grid=(nt,),
        in_specs=[
            # [nt, 1, bt * k], a tile's ids a block: a 1-D block's lowering
            # asks the attached chip for its tiling (none when compiling ahead
            # of time), and a squeezed row of a 2-D array breaks the (8, 128) rule.
            pl.BlockSpec((None, 1, bt * k), lambda i: (0, 0, 0), memory_space=pltpu.SMEM),
            pl.BlockSpec(
                (None, 1, bt * k), lambda i: (min(1, nt - 1), 0, 0), memory_space=pltpu.SMEM
            ),
            pl.BlockSpec(
                (None, 1, bt * k),
                lambda i: (jnp.minimum(i + 2, nt - 1), 0, 0),
                memory_space=pltpu.SMEM,
            ),
            pl.BlockSpec((bt, k), lambda i: (i, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((bt, h), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((t, h), out_dtype),
        scratch_shapes=[
            *(pltpu.VMEM((k * bt * rw, half), jnp.uint32) for _ in range(SLOTS)),
            pltpu.SemaphoreType.DMA((SLOTS,)),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            disable_bounds_checks=True,
            vmem_limit_bytes=tiling.combine_vmem_bytes(bt, k, h, out_dtype),
        ),
        interpret=interpret,
        name="moe_combine",
    )(ids, ids, ids, w, rows if interpret else _in_hbm(rows))
    return out


def _in_hbm(rows):
    """rows pinned to HBM. Left to XLA (memory space ANY), rows that fit in
    VMEM were copied there whole before the kernel (16.8 MB at 512 Qwen3
    tokens, 5.9 us on tpu7x by its schedule, nothing overlapping it), where
    the kernel's row copies, bound by their issue (~4 bundles each), read
    them from HBM at no extra time. (Interpret mode has no memory spaces,
    and its HLO interpreter refuses the tagged operand.)"""
    return pltpu.with_memory_space_constraint(rows, pltpu.HBM)
