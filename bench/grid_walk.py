"""Walking a Pallas launch's grid: the HBM bytes, grid steps and MXU flops
it issues.

`walk_launch` replays a `bench.tracing.Launch`'s grid in the order Mosaic runs
it (last grid axis fastest) and counts what the pipeline moves and issues:

* HBM bytes: an input block is fetched when its block index differs from
  the previous step's; an output block is written back when its index
  changes and once at the end. Blocks left in HBM (memory space ANY) are not
  moved by the pipeline; the bytes of the kernel's own `dma_start`s are
  counted instead, per step, from the kernel body.
* grid steps.
* MXU flops issued per step: `2*M*K*N` of every `dot_general` in the kernel
  body, whatever the share of real rows in the block.

Block indices and the kernel body's costs come from `bench.scalar_eval`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
from jax._src.pallas import core as pallas_core

from .scalar_eval import Cost, EvalError, eval_body, eval_index_map, is_hbm
from .tracing import Launch, Unknown, trace_launches


@dataclasses.dataclass
class OperandTraffic:
    origin: str
    kind: str  # "input" | "output" | "scalar_prefetch"
    array_shape: tuple
    block_shape: tuple  # per-dim extent of one block (squeezed dims as 1)
    dtype: str
    memory_space: str
    transfers: int  # block fetches (inputs) or write-backs (outputs)
    bytes: int
    counted: bool  # False: left in HBM, moved by the kernel's own DMAs


@dataclasses.dataclass
class LaunchCost:
    name: str
    grid: tuple
    steps: int
    operands: list
    pipeline_bytes: int  # what BlockSpec pipelining moves
    dma_bytes: int  # what the kernel's own dma_starts move (HBM side)
    flops: int  # MXU flops issued over all steps
    notes: list
    dma_issues: int  # HBM-side dma_starts the kernel body executes
    declared_flops: float | None  # the launch's own CostEstimate
    declared_bytes: float | None

    @property
    def hbm_bytes(self) -> int:
        return self.pipeline_bytes + self.dma_bytes

    @property
    def uncounted(self) -> list:
        return [o.origin for o in self.operands if not o.counted]


def _block_dims(bm) -> list:
    dims = []
    for bd in bm.block_shape:
        if isinstance(bd, pallas_core.Squeezed) or bd is None:
            dims.append(("squeezed", 1))
        elif isinstance(bd, pallas_core.Blocked):
            dims.append(("blocked", bd.block_size))
        elif isinstance(bd, pallas_core.Element):
            dims.append(("element", bd.block_size))
        elif isinstance(bd, pallas_core.BoundedSlice):
            dims.append(("bounded", bd.block_size))
        elif isinstance(bd, int):
            dims.append(("blocked", bd))
        else:
            raise EvalError(f"unsupported block dim {bd!r}")
    return dims


def _transfers(indices: list[np.ndarray]) -> np.ndarray:
    """Steps at which the block index differs from the previous step's."""
    n = len(indices[0]) if indices else 1
    changed = np.zeros(n, bool)
    changed[0] = True
    for ix in indices:
        changed[1:] |= ix[1:] != ix[:-1]
    return changed


def _moved_bytes(indices, dims, array_shape, itemsize, at: np.ndarray) -> int:
    """Bytes of the blocks moved at the steps `at`, clipped to the array."""
    extent = np.ones(int(at.sum()), np.int64)
    for ix, (kind, size), full in zip(indices, dims, array_shape):
        sel = ix[at]
        if kind == "squeezed":
            e = np.ones_like(sel)
        elif kind == "blocked":
            e = np.clip(full - sel * size, 0, size)
        else:  # element offsets / bounded slices: at most `size` from the offset
            e = np.clip(full - sel, 0, size)
        extent = extent * e
    return int(extent.sum()) * itemsize


def walk_launch(launch: Launch) -> LaunchCost:
    """Counts HBM traffic, grid steps and issued MXU flops of one launch."""
    p = launch.params
    gm = p["grid_mapping"]
    ops = launch.operands
    n_dyn = gm.num_dynamic_grid_bounds
    dyn = iter(ops[:n_dyn])
    grid = []
    for g in gm.grid:
        if isinstance(g, pallas_core.DynamicGridDim):
            v = next(dyn)
            if isinstance(v, Unknown):
                raise EvalError("dynamic grid size is not computable from the inputs")
            grid.append(int(np.asarray(v)))
        else:
            grid.append(int(g))
    grid = tuple(grid)
    rest = ops[n_dyn:]
    n_idx = gm.num_index_operands
    scalars = rest[:n_idx]
    for s in scalars:
        if isinstance(s, Unknown):
            raise EvalError("scalar-prefetch operand is not computable from the inputs")
    scalars = [np.asarray(s) for s in scalars]
    steps = math.prod(grid)
    notes: list[str] = []
    if steps == 0:
        program_ids = [np.zeros(0, np.int32) for _ in grid]
    elif not grid:
        program_ids = []  # a single step with no program ids
    else:
        program_ids = [a.reshape(-1).astype(np.int32) for a in np.indices(grid, dtype=np.int32)]

    operands: list[OperandTraffic] = []
    for k, s in enumerate(scalars):
        operands.append(
            OperandTraffic(
                origin=f"scalar_prefetch[{k}]",
                kind="scalar_prefetch",
                array_shape=tuple(s.shape),
                block_shape=tuple(s.shape),
                dtype=str(s.dtype),
                memory_space="smem",
                transfers=1,
                bytes=int(s.nbytes),
                counted=True,
            )
        )

    n_in = gm.num_inputs
    for i, bm in enumerate(gm.block_mappings):
        kind = "input" if i < n_in else "output"
        aval = bm.array_aval
        itemsize = np.dtype(aval.dtype).itemsize
        ms = getattr(bm.transformed_block_aval, "memory_space", None)
        dims = _block_dims(bm)
        block_shape = tuple(s for _, s in dims)
        if is_hbm(ms):
            operands.append(
                OperandTraffic(
                    origin=str(bm.origin),
                    kind=kind,
                    array_shape=tuple(aval.shape),
                    block_shape=tuple(aval.shape),
                    dtype=str(aval.dtype),
                    memory_space=str(ms),
                    transfers=0,
                    bytes=0,
                    counted=False,
                )
            )
            continue
        if steps == 0:
            operands.append(
                OperandTraffic(
                    str(bm.origin),
                    kind,
                    tuple(aval.shape),
                    block_shape,
                    str(aval.dtype),
                    str(ms),
                    0,
                    0,
                    True,
                )
            )
            continue
        indices = eval_index_map(bm, program_ids, grid, scalars)
        at = _transfers(indices)
        nbytes = _moved_bytes(indices, dims, aval.shape, itemsize, at)
        operands.append(
            OperandTraffic(
                origin=str(bm.origin),
                kind=kind,
                array_shape=tuple(aval.shape),
                block_shape=block_shape,
                dtype=str(aval.dtype),
                memory_space=str(ms),
                transfers=int(at.sum()),
                bytes=nbytes,
                counted=True,
            )
        )

    cost = Cost(np.zeros(max(steps, 0)), np.zeros(max(steps, 0)), set())
    if steps:
        eval_body(p["jaxpr"], gm, scalars, program_ids, grid, cost, notes)
    notes.extend(sorted(cost.notes))
    uncounted = [o.origin for o in operands if not o.counted]
    dma = int(cost.dma_bytes.sum())
    if uncounted:
        if dma:
            notes.append(
                f"{', '.join(uncounted)} left in HBM: counted from the kernel's dma_start sizes"
            )
        else:
            notes.append(f"{', '.join(uncounted)} left in HBM: manual DMA, uncounted")
    ce = p.get("cost_estimate")
    return LaunchCost(
        name=launch.name,
        grid=grid,
        steps=steps,
        operands=operands,
        pipeline_bytes=sum(o.bytes for o in operands if o.counted),
        dma_bytes=dma,
        flops=int(cost.flops.sum()),
        notes=notes,
        dma_issues=int(cost.dma_issues.sum()),
        declared_flops=float(ce.flops) if ce is not None else None,
        declared_bytes=float(ce.bytes_accessed) if ce is not None else None,
    )


def analyze(fn: Callable, *args, **kwargs) -> list[LaunchCost]:
    """`walk_launch` over every pallas_call `fn(*args, **kwargs)` makes."""
    return [walk_launch(l) for l in trace_launches(fn, *args, **kwargs)]
