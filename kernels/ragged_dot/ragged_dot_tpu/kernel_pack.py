"""pairs.pack_rows as a Pallas TPU kernel: [T, H] bf16 -> uint32
[T * row_words(H), 128], what gmm's in-kernel row gather (``gather=``) reads
one DMA a row.

Why a kernel: XLA lowers pack_rows' reshapes and lane slices as relayouts,
three fusions that took 161 us for 8,192 Qwen3 tokens on tpu7x (by their
schedules), where the bytes take a few: here each 256-column group of a
block of rows is two 128-lane halves packed with whole-vreg bit operations
(pairs.pack_halves) and stored as every row_words-th row of the output
block, one strided store, as gmm's packed epilogue writes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import pairs


# A grid step's rows: its in and out blocks up to BLOCK_BYTES together (the
# BlockSpec pipeline keeps one block in flight, and each step waits on its
# copy's latency: 8,192 Qwen3 tokens on tpu7x, scheduled, 26.2 us in
# 512-row blocks, 22.3 in 2048-row ones, the bytes at copy bandwidth).
BLOCK_BYTES = 16 * 2**20
MAX_BLOCK_T = 2048


def pack_rows(x, *, block_t=None, interpret=False):
    """[T, H] (H pairs.packable: a multiple of 64) -> pairs.pack_rows(x), bit
    for bit."""
    t, h = x.shape
    if x.dtype != jnp.bfloat16 or not pairs.packable(h):
        raise ValueError(
            f"pack_rows: x: expected bfloat16 [T, H] with H a multiple of {pairs.PIECE},"
            f" got {x.dtype} {tuple(x.shape)}"
        )
    rw = pairs.row_words(h)
    half = pairs.GROUP // 2
    if block_t is None:
        block_t = max(16, min(MAX_BLOCK_T, BLOCK_BYTES // (2 * h + rw * half * 4)) // 16 * 16)
    bt = min(block_t, -(-t // 16) * 16)

    def kernel(x_ref, out_ref):
        if rw > pairs.groups(h):  # padding word rows are written as zeros
            out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)
        for g in range(pairs.groups(h)):
            out_ref[pl.ds(g, bt, stride=rw), :] = pairs.group_words(x_ref, g)

    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(t, bt),),
        in_specs=[pl.BlockSpec((bt, h), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((bt * rw, half), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((t * rw, half), jnp.uint32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            # double-buffered blocks plus the packed words of one group
            vmem_limit_bytes=2 * BLOCK_BYTES + 8 * 2**20,
        ),
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=t * h * 2 + t * rw * half * 4
        ),
        interpret=interpret,
        name="pack_rows",
    )(x)
