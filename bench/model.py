"""The TPU time model: constants per generation, kernel time, roofline.

time = max(HBM bytes / bandwidth, MXU flops / bf16 peak) + grid steps x step
overhead, summed over the launches of a program (plus the XLA parts, from the
compiler's own cost analysis). The roofline of a grouped matmul is
max(minimum bytes / bandwidth, useful flops / peak), minimum bytes being the
weights of the experts that get at least one row, lhs read once and the output
written once.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from torch_bindings import tpu_info


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float  # bf16 MXU flop/s of one JAX device
    hbm_bytes_per_s: float  # HBM bandwidth of one JAX device
    step_overhead_s: float  # per Pallas grid step (assumption, see README)
    source: str


# Step overhead: 0.35 us per grid step is the figure commonly quoted for the
# Pallas TPU pipeline's per-iteration cost (DMA issue + semaphore waits +
# scalar bookkeeping). It is NOT in today's JAX docs: treat it as an
# assumption to calibrate (bench/calibration.py compares it with public
# measurements). Its one home is torch_bindings/tpu_info.py.
STEP_OVERHEAD_S = tpu_info.GRID_STEP_OVERHEAD_S


def _chip(generation: str) -> Chip:
    """Per JAX device, from the project's one source of TPU facts (tpu7x: one
    TensorCore, 1155 TFLOP/s bf16 and 3.7 TB/s, not the per-chip 2307)."""
    f = tpu_info.facts(generation)
    return Chip(generation, f.bf16_flops_per_s, f.hbm_bytes_per_s, STEP_OVERHEAD_S, f.source)


CHIPS = {g: _chip(g) for g in tpu_info.DEFAULT_GENERATIONS}
GENERATIONS = tuple(CHIPS)


def chip(generation: str) -> Chip:
    if generation not in CHIPS:
        raise ValueError(f"generation: expected one of {sorted(CHIPS)}, got {generation!r}")
    return CHIPS[generation]


def kernel_time_s(hbm_bytes: float, flops: float, steps: int, generation: str) -> float:
    """One Pallas launch: max(memory, compute) + per-step overhead."""
    c = chip(generation)
    return max(hbm_bytes / c.hbm_bytes_per_s, flops / c.peak_flops) + steps * c.step_overhead_s


def xla_time_s(hbm_bytes: float, flops: float, generation: str) -> float:
    """An XLA program (no grid steps): the roofline of its cost analysis."""
    c = chip(generation)
    return max(hbm_bytes / c.hbm_bytes_per_s, flops / c.peak_flops)


def roofline_s(min_bytes: float, useful_flops: float, generation: str) -> float:
    c = chip(generation)
    return max(min_bytes / c.hbm_bytes_per_s, useful_flops / c.peak_flops)


@dataclasses.dataclass(frozen=True)
class GroupedMatmul:
    """One grouped matmul lhs (M, K) x rhs (E, K, N) -> (M, N)."""

    group_sizes: tuple  # rows per expert
    k: int
    n: int
    lhs_itemsize: int = 2
    rhs_itemsize: int = 2
    out_itemsize: int = 2

    @property
    def rows(self) -> int:
        return int(sum(self.group_sizes))

    @property
    def active_experts(self) -> int:
        return sum(1 for g in self.group_sizes if g > 0)

    @property
    def min_bytes(self) -> int:
        return (
            self.active_experts * self.k * self.n * self.rhs_itemsize
            + self.rows * self.k * self.lhs_itemsize
            + self.rows * self.n * self.out_itemsize
        )

    @property
    def useful_flops(self) -> int:
        return 2 * self.rows * self.k * self.n


def grouped_roofline_s(gmms: Iterable[GroupedMatmul], generation: str) -> float:
    """Sum of each grouped matmul's own roofline."""
    return sum(roofline_s(g.min_bytes, g.useful_flops, generation) for g in gmms)
