"""The project's one source of TPU facts.

Everything the kernels' block-size tables, the compile gate (`aot.py`) and the
performance model (`bench/`) know about a TPU generation lives here: the
generation names we support and their libtpu AOT topologies, per-JAX-device
peaks, HBM bandwidth and VMEM, the scoped-VMEM policy every kernel plans and
compiles against, the clock we assume, and how an attached TPU's device kind
maps to a generation. No other file should carry a copy of these numbers.

Sources
-------
* Per-device hardware constants: JAX's own table,
  `jax.experimental.pallas.tpu.get_tpu_info_for_chip(ChipVersion, cores)`,
  jax 0.10.2 (`tests/test_tpu_info.py` asserts every number below against it,
  so an edit here that disagrees with JAX fails CI). JAX reports per
  TensorCore; a JAX device is one TensorCore on v5e, v6e and tpu7x, and a
  megacore (two TensorCores) on v5p (the `v5p:1x1x1` AOT device reports
  `num_cores == 2`), so v5p's per-device peaks and bandwidth are JAX's times 2.
  tpu7x: one JAX device is ONE TensorCore, 1155 TFLOP/s bf16 and 3.7 TB/s;
  the widely quoted 2307 TFLOP/s / 7.4 TB/s are per chip (two devices).
* Cross-check against the TPU compiler's own cost model (libtpu 0.0.52):
  AOT-compile an 8192^3 bf16 matmul and a large elementwise op for the
  generation; `compiled.cost_analysis()` exposes `optimal_seconds`, so the
  compiler's peak is flops / optimal_seconds and its bandwidth is
  bytes accessed / optimal_seconds (`compiler_cross_check` recomputes them;
  the recorded values are asserted by the tests). The compiler agrees with
  JAX on v5e and v6e (197 vs 197, 918 vs 920 TFLOP/s; 1638 vs 1640 GB/s on
  v6e) and is lower elsewhere: tpu7x 996 vs 1155 TFLOP/s (0.86x), v5p 394 vs
  459 TFLOP/s (0.86x); bandwidth v5e 738 vs 820 GB/s (0.90x), tpu7x 3686 vs
  3700, v5p 2350 vs 2460 (0.96x). Its int8/fp8 matmuls are charged no faster
  than bf16, so the compiler does not cross-check the int8/fp8 peaks.
  Roofline figures use JAX's (published) numbers; the compiler's are kept
  beside them.
* Clock (an ASSUMPTION: no clock appears in JAX, libtpu's dumps or the cost
  analysis): clock = compiler peak / (TensorCores x MXUs x width^2 x 2 flop
  x rows per cycle), with rows per cycle assumed 1 for the 128-wide MXUs
  (v5e, v5p) and 2 for the 256-wide ones (v6e, tpu7x). That gives v5e 1.50,
  v6e 1.75, tpu7x 1.90, v5p 1.50 GHz. The same formula on JAX's peaks gives
  1.50, 1.75, 2.20 and 1.75 GHz: the two disagree on tpu7x and v5p, and the
  compiler's is used because cycles read from the compiler's schedule are what
  the clock converts.

Scoped-VMEM policy (one rule, every kernel)
-------------------------------------------
Each Pallas kernel requests `vmem_limit_bytes = vmem_limit_bytes(gen)` and
every block-size table plans blocks whose VMEM estimate fits
`vmem_budget_bytes(gen)`, the same number: 3/4 of one TensorCore's physical
VMEM (v5e, v6e: 96 MiB of 128; tpu7x, v5p: 48 MiB of 64). Checked with
libtpu 0.0.52 AOT compiles:
* the limit is enforced at compile time for pipelined blocks
  (`CompileTimeScopedVmemOom` past it), so a kernel must request what it plans;
  the defaults without a request are 16 MiB (v5e, v5p) and 32 MiB (v6e,
  tpu7x), too small for the tables' weight slabs and attention blocks;
* the hard ceiling is the physical VMEM less 64 KiB the compiler keeps, and
  it is shared with whatever XLA keeps live in VMEM around the kernel in a
  larger program: the quarter not granted is left for that;
* the tables' VMEM estimates are upper bounds (flash attention's test compiles
  with limit == estimate; ragged_dot's tables compiled with limit == estimate
  for 4 MoE models x 3 batch sizes on tpu7x), so budget == limit needs no
  extra margin.
"""

from __future__ import annotations

import dataclasses
import functools
import os

MiB = 1 << 20

# Every generation a table, the compile gate or the model knows.
GENERATIONS = ("v5e", "v6e", "tpu7x", "v5p")
# Compile-gated in CI and swept by bench (v5p has tables but no gate).
DEFAULT_GENERATIONS = ("v5e", "v6e", "tpu7x")
# The tables used when no TPU is attached and TPU_KERNELS_GENERATION is unset.
DEFAULT_GENERATION = "v6e"

# Scoped-VMEM policy: the fraction of one TensorCore's VMEM a kernel requests
# and plans against (see the module docstring).
VMEM_FRACTION = (3, 4)

# Per Pallas grid step: the commonly quoted ~0.35 us pipeline cost (DMA issue,
# semaphore waits, scalar bookkeeping). NOT in today's JAX docs: an assumption
# the ideal model and ragged_dot's block search share (bench calibrates it).
GRID_STEP_OVERHEAD_S = 0.35e-6

# From a DMA's last byte to its semaphore: an assumption calibrated on
# tpu-inference #3520's measured copies (bench/calibration.py). Kernels that
# stream weights keep enough bytes in flight to hide it; bench's scheduled
# model charges it to every DMA.
DMA_LATENCY_S = 1.35e-6


@dataclasses.dataclass(frozen=True)
class TpuFacts:
    """One generation, per JAX device (see `tensor_cores_per_device`).

    Peaks and bandwidth are per JAX device; VMEM, MXU count and width are per
    TensorCore (what one kernel instance sees). None: no native support.
    """

    name: str
    topology: str  # libtpu AOT topology of one chip
    chip_version: str  # jax's ChipVersion value
    tensor_cores_per_device: int
    bf16_flops_per_s: float
    int8_ops_per_s: float | None
    fp8_flops_per_s: float | None
    hbm_bytes_per_s: float
    hbm_capacity_bytes: int
    vmem_capacity_bytes: int  # per TensorCore
    default_scoped_vmem_bytes: int  # what a kernel gets without asking (XLA default)
    num_mxus: int  # per TensorCore
    mxu_width: int
    mxu_rows_per_cycle: int  # ASSUMPTION, used only to state a clock
    compiler_bf16_flops_per_s: float  # TPU compiler's cost model (cross-check)
    compiler_hbm_bytes_per_s: float  # TPU compiler's cost model (cross-check)
    note: str = ""  # other published figures, and how they relate

    @property
    def vmem_budget_bytes(self) -> int:
        num, den = VMEM_FRACTION
        return self.vmem_capacity_bytes * num // den

    @property
    def vmem_limit_bytes(self) -> int:
        return self.vmem_budget_bytes

    @property
    def mxu_flops_per_cycle(self) -> int:
        """bf16 flops per clock of one device under the rows-per-cycle assumption."""
        return (
            self.tensor_cores_per_device
            * self.num_mxus
            * self.mxu_width**2
            * 2
            * self.mxu_rows_per_cycle
        )

    @property
    def clock_hz(self) -> float:
        """ASSUMED TensorCore clock: the compiler's peak / MXU flops per cycle."""
        return self.compiler_bf16_flops_per_s / self.mxu_flops_per_cycle

    @property
    def clock_hz_from_peak(self) -> float:
        """The same derivation on the published (JAX) peak, for comparison."""
        return self.bf16_flops_per_s / self.mxu_flops_per_cycle

    @property
    def source(self) -> str:
        return (
            f"jax get_tpu_info_for_chip(ChipVersion {self.chip_version!r}, "
            f"{self.tensor_cores_per_device}) per TensorCore x "
            f"{self.tensor_cores_per_device} TensorCore(s) per JAX device: "
            f"{self.bf16_flops_per_s / 1e12:g} TFLOP/s bf16, "
            f"{self.hbm_bytes_per_s / 1e9:g} GB/s HBM; TPU compiler cost model "
            f"(libtpu 0.0.52): {self.compiler_bf16_flops_per_s / 1e12:g} TFLOP/s, "
            f"{self.compiler_hbm_bytes_per_s / 1e9:g} GB/s; assumed clock "
            f"{self.clock_hz / 1e9:.2f} GHz (torch_bindings/tpu_info.py)"
            + (f". {self.note}" if self.note else "")
        )


TPUS = {
    "v5e": TpuFacts(
        name="v5e",
        topology="v5e:1x1",
        chip_version="v5e",
        tensor_cores_per_device=1,
        bf16_flops_per_s=197e12,
        int8_ops_per_s=394e12,
        fp8_flops_per_s=None,
        hbm_bytes_per_s=820e9,
        hbm_capacity_bytes=17_200_000_000,
        vmem_capacity_bytes=128 * MiB,
        default_scoped_vmem_bytes=16 * MiB,
        num_mxus=4,
        mxu_width=128,
        mxu_rows_per_cycle=1,
        compiler_bf16_flops_per_s=197e12,
        compiler_hbm_bytes_per_s=737.7e9,
        note="cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 819 GB/s per chip (one TensorCore)",
    ),
    "v6e": TpuFacts(
        name="v6e",
        topology="v6e:1x1",
        chip_version="v6e",
        tensor_cores_per_device=1,
        bf16_flops_per_s=920e12,
        int8_ops_per_s=1840e12,
        fp8_flops_per_s=920e12,
        hbm_bytes_per_s=1640e9,
        hbm_capacity_bytes=34_400_000_000,
        vmem_capacity_bytes=128 * MiB,
        default_scoped_vmem_bytes=32 * MiB,
        num_mxus=2,
        mxu_width=256,
        mxu_rows_per_cycle=2,
        compiler_bf16_flops_per_s=918e12,
        compiler_hbm_bytes_per_s=1638e9,
        note="cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 1640 GB/s per chip (one TensorCore)",
    ),
    "tpu7x": TpuFacts(
        name="tpu7x",
        topology="tpu7x:1x1x1",
        chip_version="7x",
        tensor_cores_per_device=1,
        bf16_flops_per_s=1155e12,
        int8_ops_per_s=None,
        fp8_flops_per_s=2300e12,
        hbm_bytes_per_s=3700e9,
        hbm_capacity_bytes=103_000_000_000,
        vmem_capacity_bytes=64 * MiB,
        default_scoped_vmem_bytes=32 * MiB,
        num_mxus=2,
        mxu_width=256,
        mxu_rows_per_cycle=2,
        compiler_bf16_flops_per_s=996e12,
        compiler_hbm_bytes_per_s=3686e9,
        note=(
            "cloud.google.com/tpu/docs/tpu7x (Ironwood): 2307 TFLOP/s bf16, 7.37 TB/s "
            "per chip = two TensorCores, each its own JAX device; measured copy "
            "bandwidth ~3.21 TB/s per device (tpu-inference #3520)"
        ),
    ),
    "v5p": TpuFacts(
        name="v5p",
        topology="v5p:1x1x1",
        chip_version="v5p",
        tensor_cores_per_device=2,
        bf16_flops_per_s=459e12,
        int8_ops_per_s=918e12,
        fp8_flops_per_s=None,
        hbm_bytes_per_s=2460e9,
        hbm_capacity_bytes=103_000_000_000,
        vmem_capacity_bytes=64 * MiB,
        default_scoped_vmem_bytes=16 * MiB,
        num_mxus=4,
        mxu_width=128,
        mxu_rows_per_cycle=1,
        compiler_bf16_flops_per_s=394e12,
        compiler_hbm_bytes_per_s=2350.4e9,
        note=(
            "cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 2765 GB/s per chip (one "
            "megacore device); JAX's table says 2460 GB/s"
        ),
    ),
}
assert tuple(TPUS) == GENERATIONS


def check_generation(generation: str) -> str:
    if generation not in TPUS:
        raise ValueError(f"generation: expected one of {list(GENERATIONS)}, got {generation!r}")
    return generation


def facts(generation: str) -> TpuFacts:
    return TPUS[check_generation(generation)]


def vmem_budget_bytes(generation: str) -> int:
    """VMEM a block-size table may plan one kernel into (the policy's one number)."""
    return facts(generation).vmem_budget_bytes


def vmem_limit_bytes(generation: str) -> int:
    """`vmem_limit_bytes` every Pallas kernel requests (== the budget)."""
    return facts(generation).vmem_limit_bytes


def topology(generation: str) -> str:
    return facts(generation).topology


# ---------------------------------------------------------------------------
# Generation detection: the one rule.


def generation_of_kind(device_kind: str) -> str:
    """Our generation name for a JAX TPU `device_kind` ("TPU v5 lite", "TPU v6 lite", "TPU7x", ...).

    An unknown TPU maps to tpu7x, whose VMEM (64 MiB) is the smallest any
    table plans for: the safe choice.
    """
    kind = device_kind.lower().replace(" ", "")
    if "v5lite" in kind or "v5e" in kind:
        return "v5e"
    if "v6" in kind:
        return "v6e"
    if "v5p" in kind or kind.endswith("v5"):
        return "v5p"
    return "tpu7x"


def attached_generation() -> str | None:
    """The generation of the first attached TPU, or None when there is none."""
    try:
        import jax

        devs = [d for d in jax.devices() if d.platform == "tpu"]
    except Exception:  # noqa: BLE001 - no TPU backend on this host
        devs = []
    return generation_of_kind(devs[0].device_kind) if devs else None


@functools.lru_cache(maxsize=1)
def detected_generation() -> str:
    """The TPU generation block-size tables are chosen for.

    `TPU_KERNELS_GENERATION` wins; then an attached TPU's device kind; else v6e
    (the tables for every generation are compile-checked in CI).
    """
    env = os.environ.get("TPU_KERNELS_GENERATION")
    if env:
        return env
    return attached_generation() or DEFAULT_GENERATION


# ---------------------------------------------------------------------------
# Cross-check against the TPU compiler's cost model (AOT, no TPU needed).


def compiler_cross_check(generation: str, n: int = 8192) -> dict:
    """The compiler's own peak and bandwidth for `generation`, from cost analysis.

    Compiles (ahead of time) an n^3 bf16 matmul and an elementwise op over
    n*n/4 bf16 elements; returns flops / optimal_seconds and bytes accessed /
    optimal_seconds. A few seconds per generation.
    """
    import jax
    import jax.numpy as jnp

    from .aot import tpu_compile

    def cost(fn, args):
        c = tpu_compile(fn, args, generation).cost_analysis()
        return c[0] if isinstance(c, (list, tuple)) else c

    mm = cost(lambda a, b: a @ b, [jax.ShapeDtypeStruct((n, n), jnp.bfloat16)] * 2)
    ew = cost(lambda a: a * 2 + 1, [jax.ShapeDtypeStruct((n // 4, n), jnp.bfloat16)])
    return {
        "bf16_flops_per_s": mm["flops"] / mm["optimal_seconds"],
        "hbm_bytes_per_s": ew["bytes accessed"] / ew["optimal_seconds"],
    }
