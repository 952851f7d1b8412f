"""Block sizes for the flash attention kernels, per TPU generation and regime.

Units. `block_q` counts query *positions* per block. The kernel stacks the
G = Hq / Hkv query heads that share one K/V head into the matmul rows of a
block, so a forward block holds G * block_q rows (prefill layout) and reads
its K/V block once for all G heads. `block_kv` counts keys per block.

Why these numbers (project performance model: time = max(bytes/BW,
flops/peak) + 0.35 us per grid step, so fewer steps and no re-reads win):

* Prefill. Causal grids visit only block pairs that touch the lower
  triangle; the wasted part is the upper half of each diagonal pair, about
  T * block / 2 of T^2 / 2 useful entries. 512 x 512 keeps that at
  (nb + 1) / nb = 1.06 at T = 8k while each step does ~0.5 GFLOP (several
  times the 0.35 us step cost on v6e). tpu7x doubles block_kv to amortise
  the step cost (chosen when the project took tpu7x's per-chip 2307 TFLOP/s
  for one device; one device is one TensorCore, 1155 TFLOP/s, 1.26x v6e:
  torch_bindings/tpu_info.py); its 64 MiB VMEM is why block_q does not grow
  too. v5e has a quarter of v6e's MXU rate,
  smaller steps already cost far more than 0.35 us, so it keeps 512 x 512
  and 256-wide query blocks for head_dim 256.
* Stacked rows are capped (`max_rows`): past ~2k rows the f32 logits block
  (rows x block_kv) dominates VMEM without reducing HBM traffic further.
  The forward's cap (`max_rows_fwd`) is its own: its fully visible pairs
  hold one 512-row chunk of scores at a time (kernel_fwd.py), so it takes
  1024-position query blocks and 1024-key blocks on v6e and tpu7x
  (4096 stacked rows at 32/8 heads), which halves the steps and the
  pipeline's prologue and epilogue a step pays. Scheduled, T = 8k causal,
  32/8 heads, against 512-position blocks with the same kernel: v6e d=128
  2,036 -> 1,616 us, d=64 1,891 -> 1,467, d=256 2,326 -> 1,940; tpu7x d=128
  1,802 -> 1,432; at 2k v6e d=128 179 -> 159. 2048-position blocks and
  2048-key blocks were slower (v6e 8k d=128 1,723 and 1,761), 512-key ones
  too (1,787).
* Decode (q_len < 128). Rows are (position, head) pairs of one K/V head, the
  kernel is HBM-bound on K/V, and the MXU work is tiny, so K/V blocks are
  long (few steps, long DMAs).
* Masked pairs (the diagonal, window edges) are cut into sub_block-sized
  sub-tiles and only sub-tiles with a visible entry are computed, so a
  diagonal pair costs about half a block: 256 matches the v6e/tpu7x MXU
  (256 wide), 128 the v5e MXU.
* Forward slabs (`slab_rows`). The forward keeps its softmax state per
  unit of a q block's positions (kernel_fwd.py: a masked sub-tile's rows,
  else a slab, else the whole block) and unrolls the units of a fully
  visible pair, so the scheduler interleaves one unit's MXU pops with
  another's exps. Scheduled, T = 8k causal, 32/8 heads, with the
  transposed tiles: v6e d=128 at 256 / 512 / 1024 slab rows 3,129 / 2,410
  / 2,403 us (the row sums by the MXU later took 512 to 2,104); d=256
  3,041 -> 2,359 at 512; tpu7x d=128 512 / 1024 rows 2,037 / 2,126, d=256
  without a slab 2,881, 512 rows 2,942. Once the forward issued the next
  unit's QK matmul before this unit's softmax (kernel_fwd.py), more units
  with longer key blocks paid on tpu7x at d >= 192: d=256 8k 2,881 -> 1,765
  us, 2k 234.5 -> 171.7 (512-position q blocks, 1024-key blocks, 1024-row
  slabs; d=192 8k 1,961 -> 1,812), and 1024-row slabs on v6e at d=256 (8k
  2,132 -> 2,094, 2k 198.5 -> 193.0; d=192 stays at 512: 2,088 vs 2,136).
* Backward blocks are smaller: the dK/dV kernel keeps four chunk x block_kv
  f32 temporaries live (s, p, dp, ds; dkdv_tile_rows). At head_dim > 128,
  v6e takes the same 512-position, 1024-key backward blocks as at 128 at
  every length, since its VMEM estimate counts a chunk's temporaries, not
  the block's (dK/dV with dQ fused, T = 8k causal, 32/8 heads, against
  256 x 512: d=256 5,014 -> 3,790 us, d=192 4,876 -> 3,552; d=256 at 2k
  441 -> 360, 4k 1,420 -> 1,102, 16k 18,738 -> 13,987). At d > 192 it
  takes 1024-position blocks first, where the kv head's dQ stays in VMEM
  with them (V6E_RESIDENT_256, below). tpu7x's 48 MiB
  holds a 512-position d=256 block beside neither the head's dQ nor a dQ
  kernel's blocks, so it took 256 x 512 until dQ could stream through HBM
  (Plan.stream_dq): dK/dV launch, 8k causal, 256 x 512 with dQ in VMEM
  3,885 us, 512 x 512 streamed 3,634, 512 x 1024 streamed 3,312 (d=192
  3,726 -> 2,973); training steps at d=256, 4k 1,438 -> 1,255 (dQ in VMEM
  at 47.2 of 48 MiB), 8k 5,237 -> 4,874, 16k 22,806 -> 18,150.

VMEM budgets are the scoped limits the kernels request: the project's one
policy, torch_bindings/tpu_info.py (3/4 of a TensorCore's VMEM: v5e/v6e 96 of
128 MiB, tpu7x 48 of 64 MiB).
"""

from __future__ import annotations

import dataclasses
import math

from . import schedule as bsched
from ._torch_bindings import tpu_info

# Generations with a block table (v5p uses tpu7x's: same VMEM).
GENERATIONS = ("v5e", "v6e", "tpu7x")

MiB = tpu_info.MiB
# Planning budget == the vmem_limit_bytes each kernel requests (tpu_info's policy).
VMEM_BUDGET_BYTES = {g: tpu_info.vmem_budget_bytes(g) for g in GENERATIONS}

# Query lengths below this use the decode layout: rows are (position, head)
# pairs, so a handful of query positions still fill MXU rows.
DECODE_MAX_Q_LEN = 128
# From here on ("long"), v6e's forward takes 1024-key blocks: the diagonal's
# extra masked work is then a small part of the call (v6e d=128 causal, 32/8
# heads: 2k tokens 375 -> 422 us with 1024-key blocks, 8k 3,981 -> 3,692);
# at d=128 its backward does too, halving the steps whose fixed cost (~320
# bundles of scalar pipeline work) each pays (8k: dK/dV 2,821 -> 2,740 us,
# dQ 2,132 -> 1,997). tpu7x takes them at every length (its prefill entry)
# where the dK/dV kernel fuses dQ (up to 8k at 32/8 heads; beyond, the plan
# halves them): d=128 causal dK/dV with dQ, 2k 213.3 -> 205.0 us, 4k 728.9
# -> 684.1, 8k 2,705.4 -> 2,514.8.
LONG_MIN_KV_LEN = 4096

LANES = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Block sizes of one flash attention call.

    block_q / block_kv: forward kernel (query positions, keys).
    block_q_bwd / block_kv_bwd: dK/dV and dQ kernels.
    max_rows: cap on stacked matmul rows (G * block_q) per block.
    max_rows_fwd: the forward's cap (0: max_rows). Its fully visible pairs
      hold one lane chunk of scores at a time, not the block's.
    sub_block: sub-tile edge for pairs the mask cuts (diagonal, window
      edges): only sub-tiles holding a visible entry reach the MXU.
    slab_rows: forward only: matmul rows whose scores one loop step computes
      in a fully visible pair (0: the whole block at once). See slab().
    fuse_dq: let the dK/dV kernel compute dQ too (Plan.fuse_dq), in VMEM
      when the kv head's dQ fits beside it, else streamed through HBM where
      that fits; False: always the separate dQ kernel.
    bwd_resident: (block_q_bwd, max_rows) the dK/dV kernel takes first,
      where the kv head's dQ (and delta) stays in VMEM beside them; () or
      where it does not fit: block_q_bwd and max_rows. See plan().
    stream_dq: stream a fused dQ through HBM even where it would fit in VMEM
      (tests of the streamed path on small shapes).
    """

    block_q: int
    block_kv: int
    block_q_bwd: int
    block_kv_bwd: int
    max_rows: int = 2048
    sub_block: int = 256
    slab_rows: int = 0
    max_rows_fwd: int = 0
    fuse_dq: bool = True
    stream_dq: bool = False
    bwd_resident: tuple = ()

    def __post_init__(self):
        if self.bwd_resident != () and not (
            isinstance(self.bwd_resident, tuple)
            and len(self.bwd_resident) == 2
            and all(isinstance(x, int) and x > 0 for x in self.bwd_resident)
        ):
            raise ValueError(
                "bwd_resident: expected () or (block_q_bwd, max_rows), two positive ints, "
                f"got {self.bwd_resident!r}"
            )
        for name in ("fuse_dq", "stream_dq"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if not isinstance(self.slab_rows, int) or self.slab_rows < 0 or self.slab_rows % 8:
            raise ValueError(
                f"slab_rows: expected 0 or a positive multiple of 8, got {self.slab_rows!r}"
            )
        if not isinstance(self.max_rows_fwd, int) or self.max_rows_fwd < 0:
            raise ValueError(
                f"max_rows_fwd: expected 0 or a positive int, got {self.max_rows_fwd!r}"
            )
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd", "max_rows", "sub_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        for name in ("block_kv", "block_kv_bwd", "sub_block"):
            if getattr(self, name) % LANES:
                raise ValueError(
                    f"{name}: expected a multiple of {LANES}, got {getattr(self, name)}"
                )


def _b(q, kv, qb, kvb, rows=2048, sub=256, slab=0, fwd_rows=0, resident=()):
    return BlockSizes(q, kv, qb, kvb, rows, sub, slab, fwd_rows, bwd_resident=resident)


# v6e at d > 192: 1024-position dK/dV blocks (4096 stacked rows at 32/8
# heads) where the kv head's dQ stays in VMEM with them (to 8k at 32/8
# heads: 72 of 96 MiB), half the steps of 512-position ones, each of which
# pays ~400 bundles of scalar pipeline work and the DMA waits of its q-side
# copies. dK/dV launches, T causal, 32/8 heads, d=256: 2k 274.9 -> 262.2
# us, 4k 931.9 -> 892.5, 8k 3,442.6 -> 3,312.8 (kernel_bwd.py: its full
# pairs unrolled); 64/8 heads 4k 2,029.9 -> 1,760.7, 8/8 heads 8k 1,317.4
# -> 943.9.
V6E_RESIDENT_256 = (1024, 4096)


# (generation, regime, head-dim class) -> block sizes. Head-dim class is
# max(head_dim, head_dim_v) rounded up to 128, 192 or 256.
BLOCK_TABLE = {
    ("v5e", "prefill", 128): _b(1024, 512, 512, 512, sub=128, fwd_rows=4096),
    ("v5e", "prefill", 192): _b(1024, 512, 256, 512, sub=128, fwd_rows=4096),
    ("v5e", "prefill", 256): _b(1024, 512, 256, 512, sub=128, fwd_rows=4096),
    ("v5e", "decode", 128): _b(64, 2048, 64, 1024, 1024),
    ("v5e", "decode", 192): _b(64, 2048, 64, 1024, 1024),
    ("v5e", "decode", 256): _b(64, 1024, 64, 512, 1024),
    ("v6e", "prefill", 128): _b(1024, 1024, 512, 512, slab=1024, fwd_rows=4096),
    ("v6e", "prefill", 192): _b(1024, 1024, 512, 1024, slab=1024, fwd_rows=4096),
    ("v6e", "prefill", 256): _b(
        1024, 1024, 512, 1024, slab=1024, fwd_rows=4096, resident=V6E_RESIDENT_256
    ),
    ("v6e", "long", 128): _b(1024, 1024, 512, 1024, slab=1024, fwd_rows=4096),
    ("v6e", "long", 192): _b(1024, 1024, 512, 1024, slab=1024, fwd_rows=4096),
    ("v6e", "long", 256): _b(
        1024, 1024, 512, 1024, slab=1024, fwd_rows=4096, resident=V6E_RESIDENT_256
    ),
    ("v6e", "decode", 128): _b(64, 4096, 64, 1024, 1024),
    ("v6e", "decode", 192): _b(64, 4096, 64, 1024, 1024),
    ("v6e", "decode", 256): _b(64, 2048, 64, 512, 1024),
    ("tpu7x", "prefill", 128): _b(1024, 1024, 512, 1024, slab=1024, fwd_rows=4096),
    ("tpu7x", "prefill", 192): _b(1024, 1024, 512, 1024, slab=1024, fwd_rows=4096),
    ("tpu7x", "prefill", 256): _b(1024, 1024, 512, 1024, slab=1024, fwd_rows=4096),
    ("tpu7x", "decode", 128): _b(64, 4096, 64, 1024, 1024),
    ("tpu7x", "decode", 192): _b(64, 2048, 64, 1024, 1024),
    ("tpu7x", "decode", 256): _b(64, 2048, 64, 512, 1024),
}


def head_dim_class(head_dim: int, head_dim_v: int) -> int:
    d = max(head_dim, head_dim_v)
    return 128 if d <= 128 else (192 if d <= 192 else 256)


def regime(q_len: int, kv_len: int | None = None) -> str:
    if q_len < DECODE_MAX_Q_LEN:
        return "decode"
    return (
        "long" if (kv_len or q_len) >= LONG_MIN_KV_LEN and q_len >= LONG_MIN_KV_LEN else "prefill"
    )


def _entry(generation: str, q_len: int, kv_len: int, dclass: int) -> BlockSizes:
    """The table's block sizes; "long" falls back to "prefill" where a
    generation has no long-sequence entry."""
    key = (generation, regime(q_len, kv_len), dclass)
    if key not in BLOCK_TABLE:
        key = (generation, "prefill", dclass)
    return BLOCK_TABLE[key]


def detect_generation() -> str:
    """The generation whose table to use (torch_bindings' detection: env override, device kind).

    v5p maps to the tpu7x table, whose VMEM (64 MiB per TensorCore) it shares.
    """
    generation = tpu_info.detected_generation()
    return "tpu7x" if generation == "v5p" else generation


def grid_on_one_core() -> bool:
    """Whether a kernel's grid runs in order on one TensorCore: an attached
    TPU whose JAX devices are single cores (v5e, v6e, tpu7x), or none (interpret
    mode, ahead-of-time compiles for those). A megacore device (v5p) splits
    a grid's parallel axes between its two cores."""
    generation = tpu_info.attached_generation()
    return generation is None or tpu_info.facts(generation).tensor_cores_per_device == 1


def check_generation(generation: str) -> str:
    if generation not in GENERATIONS:
        raise ValueError(f"generation: expected one of {list(GENERATIONS)}, got {generation!r}")
    return generation


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ---------------------------------------------------------------------------
# Resolved per-call geometry.


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Block geometry of one kernel: rows of a q block and keys of a kv block.

    seq_major: rows are (position, head) pairs of one K/V head (decode
      layout); otherwise rows are (head, position) with block_pos positions
      per head (prefill layout, the reshape of a (G, block_pos, D) block).
    rows: matmul rows per q block. q_rows_total: rows along the kernel's
      query axis (Sq in prefill layout, Sq * G in decode layout).
    """

    seq_major: bool
    block_pos: int  # prefill: positions per q block; decode: rows per q block
    rows: int
    block_kv: int
    q_rows_total: int
    kv_len: int

    @property
    def num_q_blocks(self) -> int:
        return -(-self.q_rows_total // self.block_pos)

    @property
    def num_kv_blocks(self) -> int:
        return -(-self.kv_len // self.block_kv)


def geometry(
    block_q: int, block_kv: int, *, q_len: int, kv_len: int, group: int, max_rows: int
) -> Geometry:
    """Clamps configured block sizes to the problem and picks the row layout."""
    bkv = min(block_kv, round_up(max(kv_len, 1), LANES))
    if q_len < DECODE_MAX_Q_LEN:
        total = q_len * group
        cap = max(round_up(min(block_q * group, max_rows), LANES), LANES)
        rows = total if total <= cap else cap
        return Geometry(True, rows, rows, bkv, total, kv_len)
    bq = min(block_q, round_up(q_len, LANES))
    bq = max(LANES, (bq // LANES) * LANES)
    if group * bq > max_rows:
        bq = max(LANES, (max_rows // group) // LANES * LANES)
    return Geometry(False, bq, group * bq, bkv, q_len, kv_len)


# The forward's fully visible pairs run in lane chunks of this many query
# rows (kernel_fwd.py), each chunk's scores stored once in a (block_kv,
# lanes) f32 buffer. 512 is both 256-wide MXUs of v6e/tpu7x side by side: a
# 256-row chunk fed one MXU at a time (v6e T = 8k causal 1,838 vs 1,616 us),
# a 1024-row one spilled (1,864).
FWD_CHUNK_LANES = (512, 256)
FWD_CHUNK_KEYS = 512


def fwd_chunk_lanes(heads: int, unit: int) -> int:
    """Query rows per chunk of a forward state unit of `heads` x `unit` rows:
    a chunk holds whole heads' units or lies inside one head's."""
    lanes = heads * unit
    for lc in FWD_CHUNK_LANES:
        if lanes % lc == 0 and (unit % lc == 0 or lc % unit == 0):
            return lc
    return lanes


def fwd_chunk_keys(block_kv: int) -> int:
    """Keys per exp + PV step of a forward chunk."""
    return math.gcd(block_kv, FWD_CHUNK_KEYS)


# ---------------------------------------------------------------------------
# VMEM need (bytes) of each kernel; conservative, checked against the budget.


def _lanes(d: int) -> int:
    return round_up(d, LANES)


def fwd_vmem_bytes(rows, bkv, d, dv, itemsize, unit_rows=None):
    """unit_rows: stacked rows of a state unit (a slab's), at most; None: the block's."""
    d, dv = _lanes(d), _lanes(dv)
    io = 2 * (rows * d + bkv * d + bkv * dv + rows * dv) * itemsize
    io += 2 * 8 * round_up(rows, LANES) * 4  # lse block
    io += 2 * 3 * 8 * round_up(max(rows, bkv), LANES) * 4  # segment/position rows
    scratch = rows * dv * 4 + 2 * rows * LANES * 4  # acc, m, l
    scratch += 2 * bkv * FWD_CHUNK_LANES[0] * 4  # a full pair's two score buffers
    unit = min(rows, unit_rows or rows)
    temps = unit * bkv * (3 * 4 + itemsize)  # a masked unit's s, p, mask, p cast
    return io + scratch + temps


def dkdv_tile_rows(geom: Geometry, sub_block: int, segmented: bool) -> int:
    """Query rows of the (rows x keys) f32 temporaries one dK/dV step holds.

    Dense calls run both kinds of pair as a pipeline over lane chunks of the
    block (kernel_bwd.py: a full pair over all keys, a masked one over each
    sub-tile key range), so a step holds one chunk's; calls with segments or
    positions, and blocks too small to cut, compute masked pairs as one
    whole-block tile. Counting the whole block for the pipelines kept the
    fused dQ out of tpu7x's 48 MiB at 16k (24 MiB of temporaries at
    2048 x 512 where a chunk's are 6).
    """
    lanes = fwd_chunk_lanes(geom.rows // geom.block_pos, geom.block_pos)  # decode layout: 1 head
    sub = bsched.sub_tiles(geom, sub_block, eligible=not segmented)
    return lanes if sub is not None and geom.rows > lanes else geom.rows


def dkdv_vmem_bytes(rows, bkv, d, dv, itemsize, tile_rows=None):
    """tile_rows: rows of the step's temporaries (dkdv_tile_rows); None: all rows."""
    d, dv = _lanes(d), _lanes(dv)
    io = 2 * (rows * d + rows * dv + bkv * d + bkv * dv) * itemsize
    io += 2 * 2 * 8 * round_up(rows, LANES) * 4  # lse, delta
    io += 2 * (bkv * d + bkv * dv) * itemsize  # dk, dv out
    io += 2 * 3 * 8 * round_up(max(rows, bkv), LANES) * 4
    scratch = bkv * (d + dv) * 4
    scratch += 4 * bkv * FWD_CHUNK_LANES[0] * itemsize  # a full pair's P and dS buffers
    temps = (tile_rows or rows) * bkv * (5 * 4 + 2 * itemsize)  # s, p, dp, ds, mask + casts
    return io + scratch + temps


def fused_dq_vmem_bytes(geom, d, itemsize):
    """What dK/dV's fused dQ adds: the kv head's f32 dQ, K^T, two output slots."""
    d = _lanes(d)
    return geom.num_q_blocks * geom.rows * d * 4 + (geom.block_kv + 2 * geom.rows) * d * itemsize


def streamed_dq_vmem_bytes(geom, d, itemsize):
    """What dK/dV's dQ streamed through HBM adds: three f32 q block slots, K^T."""
    d = _lanes(d)
    return 3 * geom.rows * d * 4 + geom.block_kv * d * itemsize


def own_delta_vmem_bytes(geom, dv, itemsize):
    """What a fused dK/dV kernel deriving delta adds: O's blocks in place of
    delta's, and the kv head's f32 delta rows."""
    heads = geom.rows // geom.block_pos
    rows = geom.num_q_blocks * round_up(heads, 8) * round_up(geom.block_pos, LANES) * 4
    return 2 * geom.rows * _lanes(dv) * itemsize + rows


def dq_vmem_bytes(rows, bkv, d, dv, itemsize):
    d, dv = _lanes(d), _lanes(dv)
    io = 2 * (rows * d + rows * dv + bkv * d + bkv * dv + rows * d) * itemsize
    io += 2 * 2 * 8 * round_up(rows, LANES) * 4
    io += 2 * 3 * 8 * round_up(max(rows, bkv), LANES) * 4
    scratch = rows * d * 4 + 2 * rows * LANES * 4
    temps = rows * bkv * (5 * 4 + itemsize)
    return io + scratch + temps


def check_vmem(kernel: str, need: int, generation: str) -> None:
    budget = VMEM_BUDGET_BYTES[generation]
    if need > budget:
        raise ValueError(
            f"block sizes: the {kernel} kernel needs about {need / MiB:.1f} MiB of VMEM "
            f"but the {generation} budget is {budget / MiB:.1f} MiB; use smaller "
            f"block_q/block_kv (or max_rows, max_rows_fwd)"
        )


@dataclasses.dataclass(frozen=True)
class Plan:
    """Geometries of the three kernels for one call."""

    fwd: Geometry
    dkdv: Geometry
    dq: Geometry
    generation: str
    sub_block: int
    slab_rows: int = 0
    fuse_dq: bool = False  # the dK/dV kernel computes dQ too (no dQ kernel)
    stream_dq: bool = False  # and accumulates it in HBM (the head's does not fit in VMEM)
    own_delta: bool = False  # and derives delta = rowsum(dO * O) itself (no XLA pass)
    segmented: bool = False  # segment ids or positions: masked pairs run whole-block tiles

    def vmem_needs(self, group, head_dim, head_dim_v, itemsize):
        """((kernel, bytes), ...): the VMEM each kernel the plan launches needs
        (the dQ kernel only when dQ is not fused)."""
        fwd, dkdv, dq = self.fwd, self.dkdv, self.dq
        unit = _unit_rows(fwd, self.slab_rows, group)
        needs = (
            (
                "forward",
                fwd_vmem_bytes(fwd.rows, fwd.block_kv, head_dim, head_dim_v, itemsize, unit),
            ),
            (
                "dK/dV",
                dkdv_vmem_bytes(
                    dkdv.rows,
                    dkdv.block_kv,
                    head_dim,
                    head_dim_v,
                    itemsize,
                    dkdv_tile_rows(dkdv, self.sub_block, self.segmented),
                )
                + (self._dq_vmem_bytes(head_dim, itemsize) if self.fuse_dq else 0)
                + (own_delta_vmem_bytes(dkdv, head_dim_v, itemsize) if self.own_delta else 0),
            ),
            ("dQ", dq_vmem_bytes(dq.rows, dq.block_kv, head_dim, head_dim_v, itemsize)),
        )
        return needs[:2] if self.fuse_dq else needs

    def _dq_vmem_bytes(self, head_dim, itemsize):
        if self.stream_dq:
            return streamed_dq_vmem_bytes(self.dkdv, head_dim, itemsize)
        return fused_dq_vmem_bytes(self.dkdv, head_dim, itemsize)


def _unit_rows(geom: Geometry, slab_rows: int, group: int) -> int:
    """Stacked rows of the forward's state unit, at most (its slab's, else the block's)."""
    heads = 1 if geom.seq_major else group
    pos = slab(geom, slab_rows, heads)
    return pos * heads if pos else geom.rows


def plan(
    *,
    generation: str,
    q_len: int,
    kv_len: int,
    group: int,
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    block_sizes: BlockSizes | None = None,
    segmented: bool = False,
) -> Plan:
    """Resolves block sizes for one call and checks they fit in VMEM.

    segmented: the call has segment ids or per-row positions (varlen), whose
    masked pairs hold whole-block temporaries (dkdv_tile_rows).

    Table entries shrink block_kv (then block_q) until they fit; explicit
    `block_sizes` that do not fit raise ValueError with the need and budget.
    Blocks' `bwd_resident` dK/dV blocks are tried first, and taken only with
    dQ in VMEM.
    """
    check_generation(generation)
    explicit = block_sizes is not None
    if block_sizes is None:
        block_sizes = _entry(generation, q_len, kv_len, head_dim_class(head_dim, head_dim_v))
    bs = block_sizes
    shape = dict(group=group, head_dim=head_dim, head_dim_v=head_dim_v, itemsize=itemsize)
    if bs.bwd_resident and bs.fuse_dq and not bs.stream_dq:
        q_bwd, rows = bs.bwd_resident
        resident = _plan_once(
            dataclasses.replace(
                bs,
                block_q_bwd=q_bwd,
                max_rows=rows,
                max_rows_fwd=bs.max_rows_fwd or bs.max_rows,
                bwd_resident=(),
            ),
            generation,
            q_len,
            kv_len,
            segmented,
            shape,
            resident_only=True,
        )
        if resident is not None:
            return resident
    while True:
        candidates = _candidates(bs, generation, q_len, kv_len, segmented, shape["group"])
        for candidate in candidates:
            over = _over(candidate, generation, shape)
            if not over:
                return candidate
        # `over` is the unfused plan's, which launches all three kernels
        if explicit:
            check_vmem(*over[0], generation)
        # Shrink the table entry: keys first (no effect on HBM re-reads of K/V),
        # of the kernels that are over only, then stacked rows.
        fwd_over = any(k == "forward" for k, _ in over)
        bwd_over = any(k != "forward" for k, _ in over)
        kv, kv_bwd = bs.block_kv, bs.block_kv_bwd
        if (fwd_over and kv > 512) or (bwd_over and kv_bwd > 512):
            bs = dataclasses.replace(
                bs,
                block_kv=max(512, kv // 2) if fwd_over else kv,
                block_kv_bwd=max(512, kv_bwd // 2) if bwd_over else kv_bwd,
            )
        elif max(bs.max_rows, bs.max_rows_fwd) > 256:
            bs = dataclasses.replace(
                bs,
                max_rows=max(256, bs.max_rows // 2),
                max_rows_fwd=bs.max_rows_fwd and max(256, bs.max_rows_fwd // 2),
            )
        elif bs.block_kv > 128 or bs.block_kv_bwd > 128:
            bs = dataclasses.replace(
                bs, block_kv=max(128, bs.block_kv // 2), block_kv_bwd=max(128, bs.block_kv_bwd // 2)
            )
        else:
            check_vmem(*over[0], generation)


def _candidates(bs, generation, q_len, kv_len, segmented, group, resident_only=False):
    """Plans of block sizes `bs`, in the order taken where they fit: dQ in
    the dK/dV kernel when the kv head's dQ fits beside it, and delta too
    when O's blocks and the head's delta rows also fit; else dQ streamed
    through HBM, before smaller blocks; last the unfused plan (the
    planner's shrinking reads its needs). A fused plan launches no dQ
    kernel, so the dQ kernel's own blocks need not fit: tpu7x's 1024-key
    dK/dV blocks fuse up to 8k, where a dQ kernel with them would not fit.
    resident_only: the plans with dQ in VMEM only."""

    def geom(block_q, block_kv, rows):
        return geometry(block_q, block_kv, q_len=q_len, kv_len=kv_len, group=group, max_rows=rows)

    fwd = geom(bs.block_q, bs.block_kv, bs.max_rows_fwd or bs.max_rows)
    bwd = geom(bs.block_q_bwd, bs.block_kv_bwd, bs.max_rows)
    p = Plan(fwd, bwd, bwd, generation, bs.sub_block, bs.slab_rows, segmented=segmented)
    streams = (True,) if bs.stream_dq else (False,) if resident_only else (False, True)
    fused = tuple(
        dataclasses.replace(p, fuse_dq=True, stream_dq=stream, own_delta=own)
        for stream in streams
        for own in (True, False)
    )
    if not bs.fuse_dq:
        fused = ()
    return fused if resident_only else (*fused, p)


def _over(plan_, generation, shape):
    """(kernel, bytes) of each kernel the plan launches that exceeds the budget."""
    needs = plan_.vmem_needs(
        shape["group"], shape["head_dim"], shape["head_dim_v"], shape["itemsize"]
    )
    return [(k, n) for k, n in needs if n > VMEM_BUDGET_BYTES[generation]]


def _plan_once(bs, generation, q_len, kv_len, segmented, shape, resident_only=False):
    """The first of _candidates' plans that fits the budget, or None."""
    for candidate in _candidates(
        bs, generation, q_len, kv_len, segmented, shape["group"], resident_only
    ):
        if not _over(candidate, generation, shape):
            return candidate
    return None


def slab(geom: Geometry, slab_rows: int, heads_in_block: int) -> int | None:
    """Positions per forward loop step over a fully visible pair, or None (whole block).

    A slab holds every stacked head's rows of `slab_rows // heads_in_block`
    positions; it must be a multiple of 8 positions that divides the block.
    """
    if not slab_rows or geom.seq_major:
        return None
    pos = slab_rows // heads_in_block
    if pos < 8 or pos % 8 or pos >= geom.block_pos or geom.block_pos % pos:
        return None
    return pos


# ---------------------------------------------------------------------------
# Decode over a KV cache (kernel_decode.py).
#
# The kernel is HBM-bound on the cache, so a step should move enough bytes to
# hide its fixed costs (0.35 us is ~560 KB at v6e's 1.6 TB/s): K blocks of
# ~1 MiB, all kv heads of a step in one block up to 8; a paged cache's step
# takes several pages. Scheduled v6e, 32/8 heads d=128, x the KV-bytes
# roofline: 64 x 1k tokens 1.49 (512 KiB) -> 1.21 (1 MiB) -> 1.21 (2 MiB);
# 64 x 4k 1.24 -> 1.17 -> 1.16. The DMA model's own floor is 1.15 (copies
# at 87% of HBM bandwidth, bench/schedule.py). tpu7x moves bytes twice as
# fast, so its steps are twice as big: [B, Hkv, S, D] cache, 64 x 4k 1.35 ->
# 1.21 (2 MiB), 64 x 1k 1.94 -> 1.31; flash-attn's [B, S, Hkv, D] cache,
# VALU-bound there, 64 x 4k 1.56 -> 1.43.

DECODE_TARGET_BYTES = {"v5e": 1 * MiB, "v6e": 1 * MiB, "tpu7x": 2 * MiB}
# A paged step also pays per page (its table entry, a K and a V copy, the
# whole/tail branch): on tpu7x, where a step's compute nearly equals its
# copies, twice the pages per step amortize that in calls of 64 default steps
# or more (the cache's capacity; 32/8 heads, d=128: 64 x 4k 370 -> 354 us,
# 256 x 16k 5,658 -> 5,390, 8 x 16k 188 -> 181). Smaller calls wait longer for
# their first, bigger step (8 x 4k 55.0 -> 55.7, 1 x 4k 13.1 -> 13.8), and the
# contiguous layouts got no faster (64 x 4k 343 -> 344).
DECODE_PAGED_TARGET_BYTES = {**DECODE_TARGET_BYTES, "tpu7x": 4 * MiB}
# Items in the kernel's DMA ring: 3 in flight hide a 1.35 us DMA latency
# behind ~2 MiB steps (K and V; bench's model moves 1 MiB in ~0.7 us on v6e).
DECODE_SLOTS = 4
# Up to this size every sequence's queries and outputs stay in VMEM for the
# whole call: q is copied once, beside the first cache blocks, and the outputs
# are written back once at the end. Per-sequence q and output blocks expose a
# DMA latency at each sequence change: the pipeline's output writeback queues
# behind the cache copies in flight and the next sequence waits for it (v6e,
# 8 x 1k tokens, 32/8 heads: 1.6 us of every 3.0 us sequence, read from the
# executed schedule; the call went 38.2 -> 32.7 us, see the issue 13 note).
DECODE_RESIDENT_BYTES = 16 * MiB
DECODE_MAX_BLOCK_KV = 4096
DECODE_MIN_BLOCK_KV = 128
DECODE_MAX_PAGES_PER_STEP = 16
DECODE_MAX_ROWS = 1024  # heads x rows of one q block (f32 accumulator rows)


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Block sizes of one decode call; 0 = the default choice.

    block_kv: cache positions a step reads (paged: rounded to whole pages).
    heads_per_block: kv heads a step reads (a divisor of Hkv, a multiple of 8
      or Hkv itself). block_rows: matmul rows (query position x head) of a q
      block. splits: partial softmaxes the work list is cut into (one per
      TensorCore of the device; more only for tests of the combine step).
    """

    block_kv: int = 0
    heads_per_block: int = 0
    block_rows: int = 0
    splits: int = 0

    def __post_init__(self):
        for name in ("block_kv", "heads_per_block", "block_rows", "splits"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: expected an int >= 0 (0 = default), got {value!r}")
        if self.block_rows % 8:
            raise ValueError(f"block_rows: expected a multiple of 8, got {self.block_rows}")


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    heads_per_block: int
    block_rows: int
    page: int  # positions per cache block input
    pages_per_step: int
    splits: int
    slots: int
    resident: bool  # q and outputs of every sequence stay in VMEM
    direct: bool  # resident on one core, no sinks: no combine step, output in q's dtype
    with_lse: bool  # the kernel writes logsumexps (the combine step or the caller needs them)
    vmem_need: int


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def decode_plan(
    *,
    generation: str,
    batch: int,
    num_kv_heads: int,
    rows: int,
    head_dim: int,
    head_dim_v: int,
    itemsize: int,
    cache_len: int,
    page: int | None,
    max_pages: int,
    block_sizes: DecodeBlockSizes | None = None,
    out_itemsize: int = 4,
    sinks: bool = False,
    return_lse: bool = False,
) -> DecodePlan:
    """Blocks of one decode call. rows = q_len * group; page None: contiguous
    cache of cache_len positions; else pages of `page` positions, max_pages
    of them per sequence. out_itemsize: the output dtype's (4 when it must be
    computed in f32)."""
    bs = block_sizes or DecodeBlockSizes()
    hkv = num_kv_heads
    hb = bs.heads_per_block or (8 if hkv > 8 and hkv % 8 == 0 else hkv)
    if hkv % hb or not (hb == hkv or hb % 8 == 0):
        raise ValueError(
            f"heads_per_block: expected a divisor of the {hkv} kv heads that is a multiple "
            f"of 8 or {hkv} itself, got {hb}"
        )
    cap = max(8, (DECODE_MAX_ROWS // hb) // 8 * 8)
    br = min(bs.block_rows or cap, rows)  # rows itself, or a multiple of 8
    d_lanes = _lanes(head_dim)

    def positions(target: int) -> int:
        per = _pow2_floor(target // (hb * d_lanes * itemsize))
        return min(DECODE_MAX_BLOCK_KV, max(DECODE_MIN_BLOCK_KV, per))

    want = bs.block_kv or positions(DECODE_TARGET_BYTES[generation])
    if not bs.block_kv and page is not None and batch * max_pages * page >= 64 * want:
        want = positions(DECODE_PAGED_TARGET_BYTES[generation])
    if page is None:
        bkv = cache_len if want >= cache_len else want
        if hkv == 1 and bkv != cache_len and bkv % 16:
            raise ValueError(f"block_kv: expected a multiple of 16 for one kv head, got {bkv}")
        per, pages_per_step = bkv, 1
    else:
        per = page
        pages_per_step = max(1, min(want // page, DECODE_MAX_PAGES_PER_STEP, max_pages))
    splits = bs.splits or tpu_info.facts(generation).tensor_cores_per_device
    bkv = per * pages_per_step
    buffers = 2 * DECODE_SLOTS * bkv * hb * d_lanes * itemsize  # K and V ring
    q_io = 2 * hb * br * d_lanes * itemsize + 2 * hb * br * (_lanes(head_dim_v) + LANES) * 4
    scratch = hb * br * (_lanes(head_dim_v) + 2 * LANES) * 4
    temps = br * round_up(per, LANES) * 4 * 4 + 2 * per * d_lanes * 4  # s, p, mask; k, v
    need = buffers + q_io + scratch + temps
    # Resident blocks hold (head, row) pairs as one sublane axis: [B, hb * br, D],
    # sized as they would be kept: with one partial (one core, no sinks) there is
    # no combine step, so the output is in q's dtype and the lse only if asked.
    one_partial = splits == 1 and not sinks
    o_item = out_itemsize if one_partial else 4
    flat = hb * br
    resident_bytes = (
        batch * round_up(flat, 32 // itemsize) * d_lanes * itemsize
        + 2 * batch * round_up(flat, 32 // o_item) * _lanes(head_dim_v) * o_item
        + (2 * batch * round_up(flat, 8) * LANES * 4 if return_lse or not one_partial else 0)
    )
    resident = (
        br == rows
        and resident_bytes <= DECODE_RESIDENT_BYTES
        and need - q_io + resident_bytes <= VMEM_BUDGET_BYTES[generation]
    )
    if resident:
        need += resident_bytes - q_io
    direct = one_partial and resident
    with_lse = return_lse or not direct
    check_vmem("decode", need, generation)
    return DecodePlan(
        hb, br, per, pages_per_step, splits, DECODE_SLOTS, resident, direct, with_lse, need
    )
