"""Row-block sizes for RMSNorm, per TPU generation.

RMSNorm is memory-bound: each row is read once and written once, so the only
tiling decision is how many rows a grid step moves. Bigger blocks amortise the
~0.35 us per-step overhead; the ceiling is scoped VMEM, which must hold every
streamed block twice (double buffering) plus the kernel's f32 temporaries.
"""

from __future__ import annotations

import dataclasses

from ._torch_bindings import tpu_info

# Scoped-VMEM budget we plan blocks against, and the limit we ask Mosaic for:
# the project's one policy (torch_bindings/tpu_info.py: 3/4 of a TensorCore's
# VMEM, the same number for both).
VMEM_BUDGET = {g: tpu_info.vmem_budget_bytes(g) for g in tpu_info.GENERATIONS}
VMEM_LIMIT = {g: tpu_info.vmem_limit_bytes(g) for g in tpu_info.GENERATIONS}

# Past ~1 MiB per streamed block the step overhead is <3% of the transfer time
# on every generation; larger blocks only cost VMEM and pipeline warm-up.
TARGET_BLOCK_BYTES = 2 * 2**20
MAX_BLOCK_ROWS = 2048
F32_TEMPS = 4  # f32 copies of a block the kernel body keeps live (x, x*x/xhat, y, grad)


# The copy ring both directions stream through (kernel._copy_ring): slots per stream.
# Two blocks queued behind the one being normalised keep the HBM pipe busy
# through each copy's fixed latency; with the BlockSpec pipeline's two slots a
# step waited on its next block's latency whenever the vector work took as
# long as the copies (tpu7x: 46 of 128 us at 8,192 x 8,192, by the schedule).
RING_IN_SLOTS = 3
RING_OUT_SLOTS = 3
RING_MIN_BLOCKS = 4
# Rows the ring's body normalises at a time: a block's f32 temporaries would
# not fit the register file (see kernel.BWD_CHUNK_ROWS). 32 rows scheduled
# faster than 16 on tpu7x (fewer loop trips for the same work; bwd at
# 8,192 x 2,880, where whole rows are live: 71.6 -> 66.9 us) and the same on
# v6e, whose copies bind.
RING_CHUNK_ROWS = 32


@dataclasses.dataclass(frozen=True)
class RMSNormConfig:
    """block_rows: rows a step (BlockSpec pipeline) or a ring block moves.
    ring: the call streams through kernel._copy_ring's copy ring (rows a
    multiple of the sublane tile and at least RING_MIN_BLOCKS blocks)."""

    block_rows: int
    vmem_limit_bytes: int
    ring: bool = False


def sublane_multiple(itemsize: int) -> int:
    """Rows per packed vreg tile: 8 for 32-bit, 16 for 16-bit dtypes."""
    return 8 * (4 // itemsize)


def vmem_need(block_rows: int, hidden: int, stream_itemsizes: tuple[int, ...]) -> int:
    streamed = sum(2 * block_rows * hidden * s for s in stream_itemsizes)
    return streamed + F32_TEMPS * block_rows * hidden * 4 + 2 * hidden * 4


def ring_vmem_need(block_rows, hidden, in_itemsizes, out_itemsizes) -> int:
    slots = RING_IN_SLOTS * sum(in_itemsizes) + RING_OUT_SLOTS * sum(out_itemsizes)
    return slots * block_rows * hidden + F32_TEMPS * RING_CHUNK_ROWS * hidden * 4 + 2 * hidden * 4


def ring_config(rows, hidden, in_itemsizes, out_itemsizes, generation) -> RMSNormConfig | None:
    """The copy ring's blocks, or None where the BlockSpec pipeline is
    used: rows not a multiple of the sublane tile (a ring block is copied
    whole, and Mosaic copies whole tiles), or fewer than RING_MIN_BLOCKS
    blocks (nothing to overlap)."""
    sub = sublane_multiple(min(in_itemsizes + out_itemsizes))
    row_bytes = hidden * max(in_itemsizes + out_itemsizes)
    block = max(sub, min(MAX_BLOCK_ROWS, TARGET_BLOCK_BYTES // row_bytes) // sub * sub)
    if rows % sub or rows < RING_MIN_BLOCKS * block:
        return None
    if ring_vmem_need(block, hidden, in_itemsizes, out_itemsizes) > VMEM_BUDGET[generation]:
        return None
    return RMSNormConfig(block_rows=block, vmem_limit_bytes=VMEM_LIMIT[generation], ring=True)


def choose_config(
    rows: int, hidden: int, stream_itemsizes: tuple[int, ...], generation: str
) -> RMSNormConfig:
    """Largest sensible row block for `hidden` that fits the generation's VMEM.

    `stream_itemsizes` lists the item size of every [rows, hidden] array the
    kernel streams (inputs and outputs).
    """
    if generation not in VMEM_BUDGET:
        raise ValueError(f"generation: expected one of {sorted(VMEM_BUDGET)}, got {generation!r}")
    budget = VMEM_BUDGET[generation]
    sub = sublane_multiple(min(stream_itemsizes))
    row_bytes = hidden * max(stream_itemsizes)
    rows_cap = -(-rows // sub) * sub
    block = max(sub, min(MAX_BLOCK_ROWS, TARGET_BLOCK_BYTES // row_bytes, rows_cap))
    block = block // sub * sub
    while block > sub and vmem_need(block, hidden, stream_itemsizes) > budget:
        block = max(sub, block // 2 // sub * sub)
    need = vmem_need(block, hidden, stream_itemsizes)
    if need > budget:
        raise ValueError(
            f"hidden size {hidden} is too large for RMSNorm on {generation}: a block of "
            f"{block} rows needs {need} bytes of VMEM, budget is {budget} bytes"
        )
    return RMSNormConfig(block_rows=block, vmem_limit_bytes=VMEM_LIMIT[generation])
