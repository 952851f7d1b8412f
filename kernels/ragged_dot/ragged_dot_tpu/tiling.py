"""Block sizes for the grouped matmul kernels, per TPU generation and shape.

Why the blocks look the way they do
-----------------------------------
``gmm`` streams the *weights* of one active group at a time through VMEM
with their full contraction depth (no K loop, so no accumulator and no K grid
axis) and walks the rows in tiles of ``block_m``. The grid is
``(N blocks, row tiles)``, so its length does not depend on the number of
groups: the model charges 0.35 us per grid step, which at decode would cost
more than the weight DMA of a small expert on tpu7x (3 MiB / 3.7 TB/s is
0.85 us). Inside a step the kernel loops over the groups that touch the tile.

Two regimes fall out of the row count M:

* decode (``round_up(M, sublane) <= decode_max_rows``): one row tile holding
  all of lhs/out, single-buffered. Steps = number of N blocks (usually 1-2).
  Rows per group are few; MXU passes are sized to them (``chunk_m`` then
  a power of two sublane tiles for the remainder), not to a tile.
* prefill: ``block_m`` rows per tile from the table below. Each group spans
  many tiles; its weights stay resident across them and are fetched once.

``block_n`` is the widest slab of N (all of N, or a multiple of 128 dividing
N) for which the double-buffered weights, lhs/out tiles and the chunk
temporaries fit the generation's VMEM budget. Among the fitting candidates
we pick the one with the lowest modelled time (bytes / HBM bandwidth + 0.35 us
per step), because for huge K (Mixtral down, K=14336) "widest N" and "tallest
M" pull in opposite directions: a narrow N slab re-reads lhs once per slab.

Table (block sizes per generation). VMEM capacity, the budget and the MXU
width come from torch_bindings/tpu_info.py, the project's one source of TPU
facts; the budget is its scoped-VMEM policy (3/4 of a TensorCore's VMEM), and
every table config requests exactly that as ``vmem_limit_bytes``:

=========  ==========  ======  ==============  =============  =======
generation VMEM        budget  decode_max_rows prefill block_m chunk_m
=========  ==========  ======  ==============  =============  =======
v5e        128 MiB     96 MiB  4096            512             128
v6e        128 MiB     96 MiB  4096            1024            256
tpu7x      64 MiB      48 MiB  4096            512             256
v5p        64 MiB      48 MiB  4096            512             128
=========  ==========  ======  ==============  =============  =======

``chunk_m`` is the MXU pass height (the systolic array is 128 deep on v5e/v5p,
256 on v6e/tpu7x). A group's rows are issued as ``chunk_m``-row passes while
at least that many remain, then its tail as one pass (two past half a chunk)
of a power of two sublane tiles (8 rows f32, 16 bf16; kernel_gmm.row_passes),
or, where the MXUs bind (``mxu_bound_block_m``) or the gathered rows stay in
VMEM (``RESIDENT_BLOCK_M``), inside its last whole pass
(``GmmConfig.merged_tails``, ``merged_tail_tiles``).

tgmm (d_rhs) tiles (K, N) of the output with an f32 accumulator and walks the
rows the same way; its blocks are searched with the same budget and model.
Its row passes are ``TGMM_CHUNK_M`` = 512 rows on every generation: rows are
its contraction, and each pass re-reads and re-writes the accumulator.

A hand-written config that leaves ``vmem_limit_bytes`` unset (its generation
unknown) gets one derived from its need (``vmem_limit_for``).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from . import mxfp4, pairs
from ._torch_bindings import tpu_info

MiB = tpu_info.MiB
STEP_OVERHEAD_S = tpu_info.GRID_STEP_OVERHEAD_S
TGMM_CHUNK_M = 512

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Weight-only quantized expert weights: the kernel DMAs these bytes and widens
# each slab piece to the activations' dtype in VMEM, with their scales. uint8
# is packed FP4 (mxfp4.py): two values a byte.
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), mxfp4.WEIGHT_DTYPE)


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in QUANTIZED_DTYPES


# The MoE layer routes tokens to experts and back by one-hot matmuls (moe.py)
# from 8 to 512 tokens, in bf16, instead of XLA's row gathers (scalar-driven
# copy loops). The matmuls' flops grow as tokens^2 (4 products of 2 k T^2 H
# flops: 34 GFLOP at 512 Qwen3 tokens, 37 us on v6e, 175 on v5e), so the
# upper bound stays where the scheduled XLA part still gains (moe.py's notes).
# Below 8 tokens the gathers are tiny and the matmul path's extra fusions are
# not: scheduled Qwen3 layer, 2026-12-01, matmuls vs gathers: +0.3 to +0.6 us
# at 1 token, within 0.5 us either way at 2 and 4, -1.6 us at 8 (v6e and tpu7x).
ROUTE_BY_MATMUL_MIN_TOKENS = 8
ROUTE_BY_MATMUL_MAX_TOKENS = 512
# Inference hands the hidden states to the gate/up gmm, which fetches each
# row itself (api._gather_fusable), from this many tokens: below, XLA's
# gather of a few rows costs less than the packing launch. In the one-hot
# range it replaces the dispatch matmul, whose [T * k, H] product was written
# and read again: scheduled Qwen3 layer at 512 tokens, v6e 942.5 -> 932.3 us,
# tpu7x 464.4 -> 455.6; at 320, 918.3 -> 912.3 and 442.5 -> 437.8 (below
# ~250 tokens the one-launch kernel takes the layer).
GATHER_MIN_TOKENS = ROUTE_BY_MATMUL_MIN_TOKENS


def route_by_matmul(tokens: int, hidden_dtype, dtype) -> bool:
    """Whether the MoE layer dispatches and combines tokens by one-hot matmuls:
    hidden states and expert rows (`dtype`) in bf16, where each product is one
    exact MXU pass (f32 hidden states keep the gathers: their dispatch would
    take six passes, and its gradient would round to bf16 where the gather's
    does not)."""
    bf16 = jnp.dtype(jnp.bfloat16)
    return (
        jnp.dtype(hidden_dtype) == bf16
        and jnp.dtype(dtype) == bf16
        and ROUTE_BY_MATMUL_MIN_TOKENS <= tokens <= ROUTE_BY_MATMUL_MAX_TOKENS
    )


def default_out_dtype(lhs_dtype, rhs_dtype) -> jnp.dtype:
    """ragged_dot's output dtype when none is asked for: the activations' for
    quantized weights, else the wider of the two (bf16 x f32 gives f32)."""
    if is_quantized(rhs_dtype):
        return jnp.dtype(lhs_dtype)
    return jnp.promote_types(lhs_dtype, rhs_dtype)


@dataclasses.dataclass(frozen=True)
class Generation:
    name: str
    vmem_capacity: int
    vmem_budget: int
    default_scoped_vmem: int
    decode_max_rows: int
    prefill_block_m: int
    chunk_m: int
    hbm_bytes_per_s: float
    peak_flops: float
    # gmm's largest row tile where the groups average a full MXU pass
    # (chunk_m rows) or more, i.e. where the MXUs bind rather than the
    # weight stream (0: prefill_block_m throughout).
    mxu_bound_block_m: int = 0


def _generation(
    name: str, decode_max_rows: int, prefill_block_m: int, mxu_bound_block_m: int = 0
) -> Generation:
    """Table entry: hardware facts from tpu_info, block choices from here.

    chunk_m (the MXU pass height) is the MXU width.
    """
    f = tpu_info.facts(name)
    return Generation(
        name,
        f.vmem_capacity_bytes,
        tpu_info.vmem_budget_bytes(name),
        f.default_scoped_vmem_bytes,
        decode_max_rows,
        prefill_block_m,
        f.mxu_width,
        f.hbm_bytes_per_s,
        f.bf16_flops_per_s,
        mxu_bound_block_m,
    )


GENERATIONS = {
    "v5e": _generation("v5e", 4096, 512),
    "v6e": _generation("v6e", 4096, 1024),
    # tpu7x 1024 (was 512) since the bench holds the MXUs to their rate: a
    # tile boundary splits an expert's rows into tail passes that push its
    # weights for few rows; Qwen3 at 8,192 tokens, uniform routing: gate/up
    # 611 -> 566 us, down 349 -> 318 (2048 rows: 549 for gate/up).
    # 2048 where the groups average 256 rows or more (mxu_bound_block_m):
    # Qwen3 with its [E, out, in] weights, gate/up 659.4 -> 628.2 us at
    # 8,192 tokens and 391.7 -> 375.8 at 4,096, down 365.4 -> 346.8 and
    # 218.0 -> 213.0. Below that the weight stream binds and a larger lhs
    # block delays the weight copies queued behind it: 2,048 tokens
    # (128 rows an expert), gate/up 299.6 -> 308.0. v6e, bound by its
    # weight copies, gains nothing (8,192 tokens: 834.9 -> 837.5).
    "tpu7x": _generation("tpu7x", 4096, 1024, mxu_bound_block_m=2048),
    "v5p": _generation("v5p", 4096, 512),
}
DEFAULT_GENERATION = tpu_info.DEFAULT_GENERATION


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """Blocks of the grouped matmul ``gmm``.

    block_m: rows of lhs/out per grid step (multiple of the sublane count).
    block_n: output columns per weight slab; equals N or is a multiple of 128
      that divides N.
    chunk_m: rows per MXU pass inside a group (multiple of the sublane count).
    vmem_limit_bytes: scoped VMEM limit to request, or None for the default.
    weight_buffers: VMEM slots of the weight stream (>= 2); all but one hold
      DMAs in flight while the MXU works on the other.
    merged_tails: tail sizes in sublane tiles, ascending, each under
      chunk_m's, that a group's last whole pass takes in (kernel_gmm.row_passes);
      () keeps every tail a pass of its own. block_m must hold chunk_m plus
      the largest.
    resident_rows: with gmm's gather, the hidden states' packed rows are
      copied into VMEM once and each gathered row is a vector load and store
      from there, not a DMA from HBM (RESIDENT_BLOCK_M).
    stage_rows: with resident_rows, the hidden states arrive as they are and
      the kernel packs them itself, through RESIDENT_STAGE_SLOTS copies of
      this many rows (a multiple of 16); 0: kernel_pack.pack_rows packs them
      in HBM first (RESIDENT_STAGE_ROWS).
    """

    block_m: int
    block_n: int
    chunk_m: int
    vmem_limit_bytes: int | None = None
    weight_buffers: int = 3
    merged_tails: tuple = ()
    resident_rows: bool = False
    stage_rows: int = 0

    def __post_init__(self):
        if not isinstance(self.resident_rows, bool):
            raise ValueError(f"resident_rows: expected a bool, got {self.resident_rows!r}")
        st = self.stage_rows
        if not isinstance(st, int) or st < 0 or st % 16 or (st and not self.resident_rows):
            raise ValueError(
                "stage_rows: expected a non-negative multiple of 16, and 0 without"
                f" resident_rows; got {st!r} (resident_rows={self.resident_rows})"
            )
        # A config is a jit static argument: it must hash, so a list is refused here.
        m = self.merged_tails
        if not (isinstance(m, tuple) and all(isinstance(t, int) for t in m)):
            raise ValueError(f"merged_tails: expected a tuple of ints, got {m!r}")


@dataclasses.dataclass(frozen=True)
class TgmmConfig:
    """Blocks of the transposed grouped matmul ``tgmm`` (output [G, K, N])."""

    block_m: int
    block_k: int
    block_n: int
    chunk_m: int
    vmem_limit_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class RaggedDotConfig:
    """Configs of the three kernels behind ``ragged_dot`` and its gradient."""

    fwd: GmmConfig | None = None
    bwd_lhs: GmmConfig | None = None
    bwd_rhs: TgmmConfig | None = None


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Configs of the fused MoE layer's two projections (None: chosen per call)."""

    gate_up: RaggedDotConfig | None = None
    down: RaggedDotConfig | None = None


def generation_of(device=None) -> str:
    """Generation name of `device` (default: the one torch_bindings detects)."""
    if device is None:
        return tpu_info.detected_generation()  # the one rule: env override, device kind
    if getattr(device, "platform", "") != "tpu":
        return DEFAULT_GENERATION
    return tpu_info.generation_of_kind(device.device_kind)


def get_generation(generation: str | None) -> Generation:
    if generation is None:
        generation = generation_of()
    if generation not in GENERATIONS:
        raise ValueError(f"generation: expected one of {sorted(GENERATIONS)}, got {generation!r}")
    return GENERATIONS[generation]


def sublane(*dtypes) -> int:
    """Rows per packed sublane tile: 8 for 32-bit, 16 if any operand is 16-bit.

    Quantized weights do not count: the rows a pass covers are those of lhs and
    out, and the weight's own tile (32 rows of int8) only pads its VMEM slot."""
    return max(8 * (4 // jnp.dtype(d).itemsize) for d in dtypes if not is_quantized(d))


def weight_rows(k: int, w_dtype) -> int:
    """Rows a weight slab of contraction depth k takes in VMEM (packed tiles)."""
    return round_up(k, max(16, 8 * (4 // jnp.dtype(w_dtype).itemsize)))


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _lane(x: int) -> int:
    return round_up(max(x, 1), 128)


def _slab_candidates(n: int) -> list[int]:
    """All of n, then multiples of 128 dividing n, widest first."""
    cands = [n]
    cands += [d for d in range(round_up(n, 128) - 128, 0, -128) if n % d == 0]
    return cands


def _m_candidates(m: int, sub: int, gen: Generation, top: int = 0) -> list[int]:
    """Row tiles to try: all rows in one tile at decode sizes, then
    powers of two down from `top` (default: the generation's prefill tile)."""
    m_pad = round_up(max(m, 1), sub)
    cands = []
    if m_pad <= gen.decode_max_rows:
        cands.append(m_pad)
    bm = top or gen.prefill_block_m
    while bm >= sub:
        if bm < m_pad:
            cands.append(bm)
        bm //= 2
    return cands or [m_pad]


def _chunk(bm: int, gen: Generation, sub: int) -> int:
    return max(sub, min(gen.chunk_m, round_up(bm, sub)))


def _limit(need: int, gen: Generation) -> int:
    """The scoped VMEM limit a table config requests: tpu_info's policy."""
    del need  # the table keeps need <= budget, and the limit is the budget
    return tpu_info.vmem_limit_bytes(gen.name)


def weight_minor_swapped(shape) -> bool:
    """Whether XLA's TPU layout for a weight [G, a, b] keeps a, not b, in lanes.

    XLA stores an array so that its (8, 128) tiles pad it least: a weight whose
    last dim is not a multiple of 128 but whose middle dim is (tensor-parallel
    shards: Qwen3-30B-A3B's [E, H, I/8] = [128, 2048, 96]) lives as
    [G][b][a], i.e. with layout {1, 2, 0}. A kernel that asks for it row-major
    makes XLA copy every expert's weights in HBM on every call (at TP-8 that
    copy was 8x the kernel's own time at one token). Handing the kernel the
    swapped view instead ([G, b, a], a bitcast of the same bytes) and
    contracting on the other axis reads it in place. Ties keep the logical order.
    """
    _, a, b = shape
    as_given = round_up(a, 8) * _lane(b)
    swapped = round_up(b, 8) * _lane(a)
    return swapped < as_given


def gmm_pieces(block_n: int, widest: int = 512, packed: bool = False) -> tuple[int, int, int]:
    """(piece width, full pieces, tail width) of a gmm weight slab.

    An aligned slab is consumed in `piece` columns (`widest` pieces and a
    tail where `widest` does not divide it). An unaligned one (GPT-OSS:
    N = 2880) goes in 256-column pieces and one narrower tail: as a single
    2880-wide piece, a transposed slab ([N, K], d_lhs) made Mosaic emit one
    unrolled transpose of the whole slab (17 s to compile one kernel).
    FP4 slabs take `widest` = MXFP4_PIECE: each piece is decoded into
    temporaries of its full depth first. A packed output (gmm(packed=True))
    is stored a 256-column word group at a time, so its pieces start on
    group boundaries (pairs.GROUP)."""
    if block_n % 128 and block_n > min(256, widest):
        w = min(256, widest)
        return w, block_n // w, block_n % w
    p = piece(block_n, widest)
    if packed and p % pairs.GROUP and block_n > p:
        return pairs.GROUP, block_n // pairs.GROUP, block_n % pairs.GROUP
    if p < widest < block_n:
        # An aligned slab that `widest` does not divide (Gemma 4's 1408 = 11 x
        # 128): widest pieces and an aligned tail, not 11 passes of 128 columns,
        # which half-fill a 256-wide MXU and, on tpu7x, pop the product of each
        # 256-deep slice of K (Gemma 4's gate/up at 8,192 tokens: tpu7x 1,376
        # -> 496 us, v6e 1,492 -> 1,110, by their schedules).
        return widest, block_n // widest, block_n % widest
    return p, block_n // p, 0


def piece_unroll(n_pieces: int, widened: bool = False) -> int:
    """Pieces of a slab per loop body of gmm's piece loop.

    The scheduler overlaps a piece's epilogue (pops, activation, stores) and
    the next piece's first weight push with MXU work only inside one body;
    across bodies the MXU idles ~300 bundles a piece on v6e. Mixtral's gate/up
    at 8,192 tokens (8 GLU pieces a slab), v6e, scheduled: 1 a body 5,127 us,
    2: 4,853, 4: 4,728, all 8: 4,588 (its flops take 4,183).

    The unrolled body costs compile time, paid in a user's first call at each
    new shape and in the compile gate, about in proportion to the pieces a
    body: that 8-piece slab compiled in 2.0 s of CPU at one a body, 3.7 at 2,
    7.5 at 4, 17.0 at 8 (v5e). Slabs of up to 4 pieces are unrolled whole,
    wider ones 2 a body; `widened` (weights with scales: int8 / fp8 widened
    or FP4 decoded piece by piece on the VPU, w8a8's scaled products) one a
    body past 4 (GPT-OSS's 22-piece FP4 slab, 64 tokens, v5e: 29.5 s at 4 a
    body, 8.6 at one)."""
    if n_pieces <= 4:
        return n_pieces
    return 1 if widened else 2


def piece(block_n: int, widest: int = 512) -> int:
    """Columns per MXU pass over a slab: 512 (or 256/128) when that divides it."""
    for p in (512, 256, 128):
        if p <= widest and block_n % p == 0:
            return p
    return block_n


# FP4 pieces: a [K/2, piece] slab piece is decoded through temporaries of
# ~16 bytes per weight (the bytes as int32 and two products of them, the bf16
# values, the spread scales and the scaled weights).
MXFP4_PIECE = 256
MXFP4_TEMP_BYTES = 16
# Rows of a group (in one row tile) past which gmm decodes each FP4 piece
# once into VMEM for all the group's row passes (kernel_gmm.process).
MXFP4_DECODE_ONCE_ROWS = 128


# Output columns per gmm piece with ``glu``: each MXU pass covers a piece's
# gate and up columns, 512 in all.
GLU_PIECE = 256


def widest_piece(w_dtype, glu=False) -> int:
    """Output columns of gmm's widest piece. With glu a piece's product has
    twice its columns: FP4's then decodes MXFP4_PIECE columns, as without."""
    if mxfp4.is_mxfp4(w_dtype):
        return MXFP4_PIECE // 2 if glu else MXFP4_PIECE
    return GLU_PIECE if glu else 512


# Weight slabs in flight behind the one on the MXU: enough bytes to keep HBM
# busy for a DMA's latency plus the MXU time of a slab (~1 us more), so the
# next slab's transfer is already queued when one arrives.
IN_FLIGHT_S = tpu_info.DMA_LATENCY_S + 1e-6
MAX_WEIGHT_BUFFERS = 6


def weight_buffers(k: int, bn: int, w_dtype, gen: Generation) -> int:
    """Slots for the weight stream: one on the MXU plus enough in flight to
    cover IN_FLIGHT_S at HBM speed (at least two)."""
    slab = weight_rows(k, w_dtype) * _lane(bn) * jnp.dtype(w_dtype).itemsize
    if mxfp4.is_mxfp4(w_dtype):
        slab //= 2
    in_flight = int(IN_FLIGHT_S * gen.hbm_bytes_per_s)
    return min(MAX_WEIGHT_BUFFERS, 1 + max(2, -(-in_flight // slab)))


def merged_tail_tiles(chunk: int, sub: int) -> tuple:
    """GmmConfig.merged_tails where the MXUs bind: tails of up to an eighth
    and up to half a chunk (32 and 128 rows of a 256-row chunk) go into the
    group's last whole pass."""
    per = chunk // sub
    return tuple(sorted({max(per // 8, 1), per // 2})) if per >= 2 else ()


def pass_rows(chunk: int, sub: int, merged=()) -> int:
    """Rows of every row-pass shape gmm emits (gmm.row_passes): `chunk`, then
    one site per tail size, sub << b rows below it (128 and 16: 128 + 64 +
    32 + 16), and the merged tails' (below).
    Mosaic gives each shape its own temporaries: counting only the chunk left
    Mixtral's down projection (K = 14336, 8192 tokens) on v5e needing 96.6 MiB
    against a 93.6 MiB estimate and the 96 MiB limit. (tgmm's estimate, which
    counts its operands' rows at f32, holds at Mixtral's largest blocks.)"""
    rows = chunk + sum(sub << b for b in range(max(chunk // sub - 1, 0).bit_length()))
    # Merged passes (GmmConfig.merged_tails) do not add a shape's worth each:
    # Qwen3's gate/up gmm on tpu7x (2,048-row tiles, three weight slots) needs
    # between 41 and 42 MiB with and without its two, by compiling it at
    # each limit. Their rows past the chunk are charged once.
    return rows + (merged[-1] * sub if merged else 0)


def glu_fusable(inter: int, transposed: bool, w_dtype, sub: int, interleaved: bool = False) -> bool:
    """Whether gmm can apply act(gate) * up in its epilogue (``glu``) for
    `inter` gate and `inter` up columns: unquantized weights (or, interleaved,
    MXFP4's, decoded a piece at a time as without glu), and
    * halves ([gate | up]): the up half starting on a tile boundary of the
      slab ([K, 2I]: a lane tile of 128; transposed [2I, K]: a sublane tile).
      Gemma 4's I = 704 qualifies only transposed (its torch layout);
    * interleaved (GPT-OSS: gate, up, gate, up, ...): I a multiple of 64, so
      every piece's product is whole 128-lane tiles (its tail included: I =
      2880 ends in 64 output columns, 128 product lanes), which the epilogue
      deinterleaves a tile at a time (kernel_gmm.deinterleave)."""
    fp4 = interleaved and mxfp4.is_mxfp4(w_dtype)  # GPT-OSS's checkpoints
    if not fp4 and (is_quantized(w_dtype) or jnp.dtype(w_dtype) not in SUPPORTED_DTYPES):
        return False
    if interleaved:
        return inter % GLU_INTERLEAVED_MULTIPLE == 0
    return inter % (sub if transposed else 128) == 0


GLU_INTERLEAVED_MULTIPLE = 64

# Rows per local expert (on average) from which the layer fuses an
# interleaved GLU (api._glu_fusable). GPT-OSS's 2,880 columns admit only
# whole-expert slabs, two in VMEM where the unfused product keeps three in
# flight, and below this each expert's exposed DMA latency outweighs the XLA
# pass the fusion saves. GPT-OSS-20B on v6e, its layer summed (launches and
# XLA part, us), unfused -> fused: bf16 at 8 tokens 774.4 -> 798.4, 64:
# 1,171.7 -> 1,200.3, 128: 1,191.3 -> 1,205.3, 256 (32 rows an expert):
# 1,226.5 -> 1,224.2, 512: 1,320.7 -> 1,261.3; MXFP4 at 8: 592.7 -> 603.7,
# 64: 894.7 -> 901.4, 256: 985.0 -> 981.3, 512: 1,136.2 -> 1,081.6.
GLU_INTERLEAVED_MIN_GROUP_ROWS = 32


def gmm_vmem_bytes(
    m,
    k,
    n,
    bm,
    bn,
    chunk,
    in_dtype,
    w_dtype,
    out_dtype,
    buffers=3,
    glu=False,
    packed=False,
    merged=(),
    gather=False,
    interleaved=False,
    bias=False,
    resident_tokens=0,
    stage_rows=0,
) -> int:
    """VMEM the gmm kernel needs with blocks (bm, bn) (padded to vreg tiles).

    Quantized weights add each piece widened to in_dtype and the scale slots
    (a [1, S] f32 row pads to 8 sublanes; S is at most max(k, bn)). With
    `glu`, n and bn count output columns: each slab holds a gate and an up
    block, and each piece has two f32 products. `packed`: the output block
    holds pairs.pack_rows' rows, whole (8, 128) word tiles a row (Gemma 4's
    2816 columns: 16 word rows for 11, 45% over bf16's bytes). `gather`: lhs
    rows gathered in the kernel (gmm's gather=): two tiles of packed rows and
    a chunk of junk rows in place of the lhs blocks. (Each pass unpacks its
    rows a 128-lane group at a time into the bf16 rows counted below; Qwen3's
    tpu7x gate/up in 2,048-row tiles compiles at 44 MiB and not at 42 with
    the gather, 42 and not 41 without: by compiling it at each limit.)
    With glu, `interleaved`: each piece's gate and up deinterleaved, two more
    f32 temporaries of a piece. `bias` (with or without glu): an f32 bias row
    of the slab's columns (2bn with glu) a weight slot, padded to 8 sublanes.
    `resident_tokens`: the hidden states' rows kept in VMEM (resident_rows),
    arriving through the staging copies of `stage_rows` (GmmConfig.stage_rows)."""
    ib, wb, ob = (jnp.dtype(d).itemsize for d in (in_dtype, w_dtype, out_dtype))
    halves = 2 if glu else 1
    tiles = -(-m // bm)
    n_blocks = -(-n // bn)
    lhs_bufs = 1 if tiles == 1 else 2
    out_bufs = 1 if tiles * n_blocks == 1 else 2
    kp, np_ = _lane(k), _lane(bn)
    if gather:
        need = (2 * bm + chunk + resident_tokens) * _row_bytes(k)
        need += stage_bytes(stage_rows, resident_tokens, k, jnp.dtype(in_dtype))
    else:
        need = lhs_bufs * bm * kp * ib
    out_row = _row_bytes(bn) if packed else np_ * ob
    need += out_bufs * bm * out_row
    mx = mxfp4.is_mxfp4(w_dtype)
    if mx:  # [K/2, bn] byte slots and [S, bn] scale slots
        need += buffers * (round_up(k // 2, 32) + mxfp4.scale_rows(k)) * np_
    else:
        # the weight stream's slots
        need += buffers * weight_rows(k, w_dtype) * _lane(halves * bn) * wb
        if is_quantized(w_dtype):
            need += buffers * 8 * _lane(max(k, bn)) * 4
    if bias:
        need += buffers * 8 * _lane(halves * bn) * 4
    # Row passes: the lhs rows (cast), the f32 product(s), the merge, for each
    # pass shape (Mosaic gives each its own stack temporaries).
    rows = pass_rows(chunk, sublane(in_dtype, w_dtype, out_dtype), merged)
    # The lhs rows are an f32 temporary only where they are scaled or
    # quantized (quantized weights); else they are the rows as read, which
    # for Mixtral's down projection (K = 14,336) is what sets its blocks.
    need += rows * kp * (4 if is_quantized(w_dtype) else ib)
    p, _, tail = gmm_pieces(bn, widest_piece(w_dtype, glu), packed)
    for pp in (_lane(p), _lane(tail) if tail else 0):
        need += (2 * halves + 1 + 2 * interleaved) * rows * pp * 4 + rows * pp * ob
        if mx:  # the decode's temporaries and the decoded piece kept in VMEM
            need += (MXFP4_TEMP_BYTES + ib) * round_up(k, 32) * pp * halves
        elif is_quantized(w_dtype):
            need += round_up(k, 16) * pp * ib
    return need


def _gmm_time(m, k, n, g, bm, bn, ib, wb, ob, gen, bufs, halves=1) -> float:
    tiles = -(-m // bm)
    n_blocks = -(-n // bn)
    lhs_reads = 1 if tiles == 1 else n_blocks
    # wb: bytes a weight (0.5 + the scales' share for FP4)
    nbytes = g * k * halves * n * wb + lhs_reads * m * k * ib + m * n * ob
    t = nbytes / gen.hbm_bytes_per_s + tiles * n_blocks * STEP_OVERHEAD_S
    if bufs < 3:  # nothing queued behind the arriving slab: each pays its latency
        t += min(g, m) * n_blocks * tpu_info.DMA_LATENCY_S
    return t


def _best_gmm_blocks(
    m,
    k,
    n,
    g,
    dtype,
    w_dtype,
    out_dtype,
    sub,
    gen,
    top,
    glu,
    packed,
    gather,
    interleaved,
    bias,
    resident_tokens,
):
    """((time, bm, bn, chunk, need, bufs, merged) of the fastest blocks that
    fit VMEM, or None; (need, bm, bn) of the smallest need) over row tiles
    from `top` down (gmm_config)."""
    best = smallest_need = None
    for bm in _m_candidates(m, sub, gen, top):
        chunk = _chunk(bm, gen, sub)
        # Where the MXUs bind, a group's tail rides in its last whole pass.
        merged = merged_tail_tiles(chunk, sub) if top else ()
        if merged and bm < chunk + merged[-1] * sub:
            merged = ()
        if gather and bm % chunk:  # the rows are fetched a chunk at a time
            continue
        for bn in [n] if gather else _slab_candidates(n):
            # Fewer slots before smaller blocks: two still stream, one behind another.
            slab_n = 2 * bn if glu else bn
            for bufs in range(weight_buffers(k, slab_n, w_dtype, gen), 1, -1):
                need = gmm_vmem_bytes(
                    m,
                    k,
                    n,
                    bm,
                    bn,
                    chunk,
                    dtype,
                    w_dtype,
                    out_dtype,
                    bufs,
                    glu,
                    packed,
                    merged,
                    gather,
                    interleaved,
                    bias,
                    resident_tokens,
                )
                if need <= gen.vmem_budget:
                    break
            if smallest_need is None or need < smallest_need[0]:
                smallest_need = (need, bm, bn)
            if need > gen.vmem_budget:
                continue
            wb = 0.5 + 1 / mxfp4.BLOCK if mxfp4.is_mxfp4(w_dtype) else w_dtype.itemsize
            t = _gmm_time(
                m, k, n, g, bm, bn, dtype.itemsize, wb, out_dtype.itemsize, gen, bufs, 1 + glu
            )
            if best is None or t < best[0]:
                best = (t, bm, bn, chunk, need, bufs, merged)
    return best, smallest_need


# Row tiles of gmm where it gathers its rows from VMEM-resident hidden states
# (GmmConfig.resident_rows) and the groups average a full MXU pass: its HBM
# traffic is then the weights and the output, so it is bound by its bundles
# wherever it runs, and a tail rides in its group's last whole pass
# (merged_tails), as where the MXUs bind. Qwen3 at 8,192 tokens on v6e, the
# layer scheduled: resident rows alone 1,699.1 -> 1,654.5 us; with 2048-row
# tiles and merged tails 1,530.8 (the tiles and tails without resident rows,
# 1,696.9: the row copies from HBM then bind).
RESIDENT_BLOCK_M = 2048

# Resident hidden states arrive as they are ([T, H] bf16) where VMEM has
# room for RESIDENT_STAGE_SLOTS copies of one of these row counts beside the
# launch's blocks (GmmConfig.stage_rows), the largest first, and gmm packs
# them into VMEM itself (pairs.pack_rows' layout): no pack_rows launch, which
# read and wrote every hidden state in HBM once more before the kernel read
# them (48.5 us of a 1,527.9 us Qwen3 layer at 8,192 tokens on v6e). Three
# copies in flight cover a copy's latency where they hold ~2 MB or more
# (v6e): Qwen3's gate/up at 8,192 tokens on v6e scheduled 675.6 us through
# 4 x 256 rows, 679.5 through 4 x 128, 685.7 through 2 x 256; smaller
# copies would be bound by their latency, so under 128 rows they stay packed
# by pack_rows (Gemma 4 at 512 tokens on tpu7x: 1.8 MiB to spare, four
# 128-row copies of its 2,816 columns take 2.75).
RESIDENT_STAGE_ROWS = (256, 128)
RESIDENT_STAGE_SLOTS = 4


def stage_copy_rows(stage_rows: int, tokens: int) -> int:
    """Rows of each staging copy of `tokens` hidden states: stage_rows, or
    fewer where the tokens' whole 8-row tiles (what a DMA of bf16 rows moves)
    are fewer, a multiple of 16 (bf16 tiles); 0 when they are under 16, and
    pack_rows in XLA brings every row."""
    return min(stage_rows, tokens // 8 * 8 // 16 * 16)


def stage_bytes(stage_rows: int, tokens: int, k: int, dtype) -> int:
    """VMEM of the RESIDENT_STAGE_SLOTS staging copies of `tokens` [T, k]
    hidden states (GmmConfig.stage_rows; 0 for none)."""
    return RESIDENT_STAGE_SLOTS * stage_copy_rows(stage_rows, tokens) * _lane(k) * dtype.itemsize


def gmm_config(
    m: int,
    k: int,
    n: int,
    g: int,
    dtype,
    *,
    out_dtype=None,
    generation: str | None = None,
    w_dtype=None,
    glu: bool = False,
    packed: bool = False,
    gather: bool = False,
    interleaved: bool = False,
    bias: bool = False,
    gather_tokens: int = 0,
) -> GmmConfig:
    """Picks gmm blocks for lhs [m, k] @ rhs[g] [k, n] on `generation`.
    With `glu`, n is the output's columns (rhs has 2n: gate and up halves)
    and block_n a block of them: every slab carries gate and up blocks.
    `packed`: the output is written as packed rows (gmm's packed=True).
    `gather`: lhs rows gathered in the kernel (gmm's gather=), which needs
    the whole of n in one block (each row tile is then fetched once);
    `gather_tokens` (the hidden states' rows): their packed rows stay in
    VMEM (resident_rows) where they fit beside row tiles as large as, and
    as many weight slots as, the launch takes without them; each row is
    then read from HBM once instead of once for each of its top_k experts.
    `interleaved`: glu's gate/up columns alternate; `bias`: gmm's bias= (both
    for gmm_vmem_bytes)."""
    gen = get_generation(generation)
    dtype = jnp.dtype(dtype)
    w_dtype = jnp.dtype(w_dtype or dtype)
    out_dtype = jnp.dtype(out_dtype or dtype)
    sub = sublane(dtype, w_dtype, out_dtype)  # quantized weights do not count
    many = m >= gen.chunk_m * max(g, 1)  # the groups average a whole pass
    shape = (m, k, n, g, dtype, w_dtype, out_dtype, sub, gen)
    flags = (glu, packed, gather, interleaved, bias)
    found, smallest_need = {}, None
    for resident in (False, True) if gather and gather_tokens > 0 else (False,):
        top = (gen.mxu_bound_block_m or (RESIDENT_BLOCK_M if resident else 0)) if many else 0
        best, smallest = _best_gmm_blocks(*shape, top, *flags, gather_tokens if resident else 0)
        found[resident] = best and (*best, resident)
        if smallest is not None and (smallest_need is None or smallest[0] < smallest_need[0]):
            smallest_need = smallest
    # Resident rows where they fit beside blocks as large as the others' (and
    # as many weight slots): smaller row tiles to make room for them cost more
    # passes than the row copies they save.
    best, res = found[False], found.get(True)
    if res is not None and (best is None or (res[1], res[5]) >= (best[1], best[5])):
        best = res
    if best is None:
        need, bm, bn = smallest_need
        raise ValueError(
            f"ragged_dot: no gmm block fits VMEM on {gen.name} for lhs [{m}, {k}],"
            f" rhs [*, {k}, {n}] ({dtype.name}): the smallest blocks (block_m={bm},"
            f" block_n={bn}, full K={k}) need {need / MiB:.1f} MiB, budget is"
            f" {gen.vmem_budget / MiB:.1f} MiB"
        )
    _, bm, bn, chunk, need, bufs, merged, resident = best
    stage = 0
    if resident:  # the hidden states packed in the kernel, where its copies fit
        for rows in RESIDENT_STAGE_ROWS:
            more = stage_bytes(rows, gather_tokens, k, dtype)
            if more and need + more <= gen.vmem_budget:
                stage, need = rows, need + more
                break
    return GmmConfig(bm, bn, chunk, _limit(need, gen), bufs, merged, resident, stage)


def tgmm_vmem_bytes(m, k, n, bm, bk, bn, chunk, in_dtype, out_dtype) -> int:
    ib, ob = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
    kp, np_ = _lane(bk), _lane(bn)
    tiles = -(-m // bm)
    lhs_bufs = 1 if tiles == 1 and k == bk else 2
    grad_bufs = 1 if tiles == 1 and n == bn else 2
    need = lhs_bufs * bm * kp * ib + grad_bufs * bm * np_ * ib
    need += round_up(bk, 8) * np_ * 4  # f32 accumulator
    need += 3 * round_up(bk, 16) * np_ * ob  # 2 staging slots + zero block
    # One chunk in flight: masked rows of both operands and the product.
    pp = _lane(piece(bn))
    need += chunk * (kp + pp) * 4 + round_up(bk, 8) * pp * 4
    return need


def tgmm_config(
    m: int, k: int, n: int, g: int, dtype, *, out_dtype=None, generation: str | None = None
) -> TgmmConfig:
    """Picks tgmm blocks for lhs [m, k]^T @ grad [m, n] per group on `generation`."""
    gen = get_generation(generation)
    dtype = jnp.dtype(dtype)
    out_dtype = jnp.dtype(out_dtype or dtype)
    sub = sublane(dtype, out_dtype)
    best = None
    smallest_need = None
    ib, ob = dtype.itemsize, out_dtype.itemsize
    # The f32 accumulator and staging grow as bk * bn; cap the slabs so the
    # search stays small and each output DMA is a few MiB at most.
    k_cands = [c for c in _slab_candidates(k) if c <= 2048 or c == k][:8]
    n_cands = [c for c in _slab_candidates(n) if c <= 2048 or c == n][:8]
    for bm in _m_candidates(m, sub, gen):
        # Rows are tgmm's contraction: taller passes amortise the f32
        # accumulator's read-modify-write over more MXU work.
        chunk = max(sub, min(TGMM_CHUNK_M, bm))
        tiles = -(-m // bm)
        for bk in k_cands:
            for bn in n_cands:
                need = tgmm_vmem_bytes(m, k, n, bm, bk, bn, chunk, dtype, out_dtype)
                if smallest_need is None or need < smallest_need[0]:
                    smallest_need = (need, bm, bk, bn)
                if need > gen.vmem_budget:
                    continue
                kb, nb = -(-k // bk), -(-n // bn)
                lhs_reads = 1 if tiles == 1 else nb
                grad_reads = 1 if tiles == 1 and nb == 1 else kb
                nbytes = g * k * n * ob + lhs_reads * m * k * ib + grad_reads * m * n * ib
                t = nbytes / gen.hbm_bytes_per_s + kb * nb * tiles * STEP_OVERHEAD_S
                if best is None or t < best[0]:
                    best = (t, bm, bk, bn, chunk, need)
    if best is None:
        need, bm, bk, bn = smallest_need
        raise ValueError(
            f"ragged_dot: no tgmm block fits VMEM on {gen.name} for lhs [{m}, {k}],"
            f" grad [{m}, {n}] ({dtype.name}): the smallest blocks (block_m={bm},"
            f" block_k={bk}, block_n={bn}) need {need / MiB:.1f} MiB, budget is"
            f" {gen.vmem_budget / MiB:.1f} MiB"
        )
    _, bm, bk, bn, chunk, need = best
    return TgmmConfig(bm, bk, bn, chunk, _limit(need, gen))


def vmem_limit_for(cfg_limit: int | None, need: int) -> int | None:
    """The limit to request: the config's (tables set tpu_info's policy), or,
    for a hand-written config that left it unset (generation unknown), none
    while the need fits 3/4 of the smallest default scoped limit of any
    generation (16 MiB on v5e/v5p), else the need plus headroom."""
    if cfg_limit is not None:
        return cfg_limit
    smallest_default = min(f.default_scoped_vmem_bytes for f in tpu_info.TPUS.values())
    if need <= smallest_default * 3 // 4:
        return None
    return int(need * 5 // 4 + 4 * MiB)


def check_gmm_config(cfg: GmmConfig, n: int, sub: int) -> None:
    if cfg.block_m <= 0 or cfg.block_m % sub:
        raise ValueError(
            f"config.block_m: expected a positive multiple of {sub}, got {cfg.block_m}"
        )
    if cfg.chunk_m <= 0 or cfg.chunk_m % sub:
        raise ValueError(
            f"config.chunk_m: expected a positive multiple of {sub}, got {cfg.chunk_m}"
        )
    if cfg.block_n != n and (cfg.block_n % 128 or n % cfg.block_n):
        raise ValueError(
            f"config.block_n: expected N={n} or a multiple of 128 dividing it, got {cfg.block_n}"
        )
    if cfg.weight_buffers < 2:
        raise ValueError(f"config.weight_buffers: expected 2 or more, got {cfg.weight_buffers}")
    merged, per = cfg.merged_tails, cfg.chunk_m // sub
    # (A tuple of ints: GmmConfig checks that on construction.)
    if merged != () and not (
        all(0 < t < per for t in merged)
        and list(merged) == sorted(set(merged))
        and cfg.block_m >= cfg.chunk_m + merged[-1] * sub
    ):
        raise ValueError(
            "config.merged_tails: expected () or ascending sublane-tile counts under"
            f" chunk_m / {sub} = {per}, with block_m >= chunk_m + the largest x {sub};"
            f" got {merged!r} (block_m={cfg.block_m}, chunk_m={cfg.chunk_m})"
        )


def check_tgmm_config(cfg: TgmmConfig, k: int, n: int, sub: int) -> None:
    if cfg.block_m <= 0 or cfg.block_m % sub:
        raise ValueError(
            f"config.block_m: expected a positive multiple of {sub}, got {cfg.block_m}"
        )
    if cfg.chunk_m <= 0 or cfg.chunk_m % sub:
        raise ValueError(
            f"config.chunk_m: expected a positive multiple of {sub}, got {cfg.chunk_m}"
        )
    for name, blk, dim in (("block_k", cfg.block_k, k), ("block_n", cfg.block_n, n)):
        if blk != dim and (blk % 128 or dim % blk):
            raise ValueError(
                f"config.{name}: expected {dim} or a multiple of 128 dividing it, got {blk}"
            )


def num_steps(m: int, n: int, cfg: GmmConfig) -> int:
    return math.ceil(m / cfg.block_m) * math.ceil(n / cfg.block_n)


# -- the one-launch decode layer (kernel_moe_decode) -----------------------------
#
# At decode sizes the whole experts layer is one Pallas launch: the layer's
# cost is its active experts' weights plus fixed costs, and the two-gmm
# program pays ~20 small XLA fusions (sort, histogram, gathers, combine: 14 us
# on v6e, 21 on tpu7x at one Qwen3 token, each waiting on its own DMAs) and a
# second launch. The fused kernel computes every token against each active
# expert and masks the sum, so it needs no sort and no gather; that MXU work
# grows with tokens x the expert's weights padded to the MXU width (a 96- or
# 128-wide slice fills half of a 256-wide MXU), and the launch pays while it
# stays under the expert's weight DMA. Its cost per row and padded weight
# element, from the kernel's own schedules (2026-12-02): v6e 4.5e-15 s (Qwen3
# TP-8, I = 96: 3.6 us per expert at 512 tokens; Mixtral TP-8, I = 1792 in
# 128-wide slices: 58 us), about 2.2x the peak rate; tpu7x 2.2e-15 (Qwen3,
# 5.3 us per expert at 512 tokens). Other generations: v6e's, scaled by
# peak flops. That puts the limit at ~270 tokens for Qwen3 on v6e and ~245 on
# tpu7x, ~100 for its TP-8 shard on v6e. Scheduled layer, fused vs two
# launches: Qwen3 v6e 58 / 77 us at 1 token, 885 / 896 at 128 (959 / 990 at
# 512, where the rule, which cannot see the two launches' XLA part, already
# picks two launches); tpu7x 28 / 53 at 1, 676 / 489 at 512; Qwen3 TP-8 v6e
# 132 / 139 at 64, 462 / 214 at 512; Mixtral TP-8 v6e 464 / 335 at 512.
# Per-channel int8 / fp8 weights: half the bytes, so about half the tokens;
# int8 at one token 32.1 / 51.3 us on v6e, fp8 17.0 / 42.4 on tpu7x.
# Each stream item is one active expert's gate/up and down weights for a
# block_i-wide slice of the intermediate dimension: as wide as the MXU where
# I allows, else about FUSED_MOE_ITEM_BYTES (small enough that the last
# item's compute, which no DMA hides, stays short).
FUSED_MOE_ITEM_BYTES = 4 * MiB
FUSED_MOE_ROW_S_PER_ELEM = {"v6e": 4.5e-15, "tpu7x": 2.2e-15}

# float8 weights on generations whose vector unit has no float8 conversion
# (v5e, v5p, v6e): widening a slice costs more VALU bundles than its DMA
# (v6e: 1968 bundles per 512-column piece against 479 for int8), and the
# fused layer's extra rows add MXU work on top. Scheduled Qwen3 layer, e4m3
# per channel on v6e, fused vs two launches: 49.7 / 68.9 us at 1 token,
# 274.5 / 291.7 at 8, 746.6 / 704.3 at 64; so these take it to 8 tokens.
FP8_VPU_GENERATIONS = ("tpu7x",)
FUSED_MOE_SLOW_FP8_MAX_TOKENS = 8


def _row_s_per_elem(gen: Generation) -> float:
    if gen.name in FUSED_MOE_ROW_S_PER_ELEM:
        return FUSED_MOE_ROW_S_PER_ELEM[gen.name]
    v6e = GENERATIONS["v6e"]
    return FUSED_MOE_ROW_S_PER_ELEM["v6e"] * v6e.peak_flops / gen.peak_flops


def fused_moe_max_tokens(
    hidden: int,
    inter: int,
    block_i: int,
    *,
    has_gate: bool = True,
    w_dtype=jnp.bfloat16,
    generation: str | None = None,
) -> int:
    """Most tokens the one-launch layer takes (see above): its MXU work per
    expert, all tokens against the weights padded to the MXU width, stays
    under the expert's weight DMA."""
    gen = get_generation(generation)
    mats = 3 if has_gate else 2
    padded = (
        mats * round_up(block_i, gen.chunk_m) * round_up(hidden, gen.chunk_m) * (inter // block_i)
    )
    dma_s = mats * inter * hidden * _bytes_per_weight(w_dtype) / gen.hbm_bytes_per_s
    most = int(dma_s / (padded * _row_s_per_elem(gen)))
    if jnp.dtype(w_dtype) == jnp.dtype(jnp.float8_e4m3fn) and gen.name not in FP8_VPU_GENERATIONS:
        return min(most, FUSED_MOE_SLOW_FP8_MAX_TOKENS)
    return most


@dataclasses.dataclass(frozen=True)
class FusedMoeConfig:
    """Blocks of the one-launch decode layer.

    block_i: columns of the intermediate dimension per stream item (I, or a
      multiple of 128 dividing I).
    buffers: VMEM slots of the stream (>= 2).
    vmem_limit_bytes: scoped VMEM limit to request.
    """

    block_i: int
    buffers: int
    vmem_limit_bytes: int | None = None


def check_fused_moe_config(cfg: FusedMoeConfig, inter: int, multiple: int = 128) -> None:
    """multiple: what a slice of I must be a multiple of (fused_moe_block_multiple)."""
    whole = cfg.block_i == inter
    if not (
        whole
        or (cfg.block_i % multiple == 0 and 0 < cfg.block_i < inter and inter % cfg.block_i == 0)
    ):
        raise ValueError(
            f"config.block_i: expected I = {inter} or a multiple of {multiple} dividing it,"
            f" got {cfg.block_i}"
        )
    if cfg.buffers < 2:
        raise ValueError(f"config.buffers: expected 2 or more, got {cfg.buffers}")


def _bytes_per_weight(w_dtype) -> float:
    return 0.5 if mxfp4.is_mxfp4(w_dtype) else jnp.dtype(w_dtype).itemsize


def fused_moe_item_bytes(hidden: int, block_i: int, has_gate: bool, w_dtype) -> int:
    n_proj = 2 if has_gate else 1
    weights = int((n_proj + 1) * hidden * block_i * _bytes_per_weight(w_dtype))
    if mxfp4.is_mxfp4(w_dtype):  # e8m0 scale rows beside each weight
        return (
            weights
            + n_proj * mxfp4.scale_rows(hidden) * block_i
            + (mxfp4.scale_rows(block_i) * hidden)
        )
    return weights


def fused_moe_vmem_bytes(
    tokens, hidden, block_i, buffers, item, quantized=False, mx=False, interleaved=False
) -> int:
    """The weight ring plus the f32 accumulators, the hidden states and the
    f32 temporaries of one item (projections, the down product; interleaved,
    the gate/up product before its halves are gathered); int8 / fp8 weights
    add their slices widened to bf16, MXFP4 ones a piece's decode (f32 and
    bf16) at a time."""
    rows = round_up(tokens, 16)
    if mx:
        widened = max(hidden, block_i) * MXFP4_PIECE * (4 + 2)
    else:
        widened = 3 * block_i * hidden * 2 if quantized else 0
    temps = (5 if interleaved else 3) * rows * block_i * 4
    return buffers * item + rows * hidden * (4 * 4 + 2) + temps + widened


def fused_moe_block_multiple(interleaved: bool, dn_transposed: bool) -> int:
    """What a slice of I (FusedMoeConfig.block_i, short of the whole) is a
    multiple of: 128, each slice's lanes starting on a lane tile; interleaved
    gate/up columns with down's I on its rows ([E, I, H]) take
    GLU_INTERLEAVED_MULTIPLE (a slice's 2 x block_i gate/up columns start on a
    lane tile, its down rows on a sublane tile; GPT-OSS's I = 2880 has no
    multiple of 128 below it that divides it, 576 of 64)."""
    return GLU_INTERLEAVED_MULTIPLE if interleaved and dn_transposed else 128


def fused_moe_config(
    tokens: int,
    hidden: int,
    inter: int,
    hidden_dtype,
    w_dtype,
    *,
    has_gate: bool,
    is_transposed: bool,
    is_concatenated: bool,
    has_bias: bool,
    block_scales: bool = False,
    generation: str | None = None,
) -> FusedMoeConfig | None:
    """The one-launch layer's blocks, or None where the layer runs as two gmm
    launches (more tokens than fused_moe_max_tokens; f32 weights, or quantized
    ones with 128 x 128 block scales; an I whose gate/up halves, slices,
    scale or bias slices would not start on a memory tile; no fit in VMEM).
    int8 / fp8 weights with per-channel scales are carried, and MXFP4 ones in
    their kernel layout, whole experts per stream item; biases and GPT-OSS's
    interleaved gate/up columns too."""
    bf16 = jnp.dtype(jnp.bfloat16)
    gen = get_generation(generation)
    mx = mxfp4.is_mxfp4(w_dtype)
    quantized = is_quantized(w_dtype) or mx
    interleaved = has_gate and not is_concatenated
    if tokens < 1 or block_scales:
        return None
    if jnp.dtype(hidden_dtype) != bf16 or not (jnp.dtype(w_dtype) == bf16 or quantized):
        return None
    # Halves: the up half (its scales, its bias) starts I columns into the
    # expert, on a lane tile. Interleaved: a slice's 2 x block_i columns.
    if interleaved and inter % GLU_INTERLEAVED_MULTIPLE:
        return None
    halves_on_lanes = has_gate and not interleaved and (quantized or has_bias)
    if halves_on_lanes and inter % 128:
        return None
    if mx:
        # Kernel layout ([E, H/2, 2I], [E, I/2, H]), whole experts: a slice of
        # down's rows would split its scale rows off their 32-row tiles.
        if not is_transposed or (not interleaved and inter % 128):
            return None
        return _fused_config_of(tokens, hidden, inter, [inter], has_gate, w_dtype, gen, interleaved)
    if quantized and not interleaved and inter % 128:  # scale slices start on lane tiles
        return None
    # gate_up and down as the kernel reads them, as XLA stores them
    # (api._hbm_view): True for [E, H, 2I] and [E, I, H].
    n = 2 * inter if has_gate else inter
    gu_transposed = is_transposed != weight_minor_swapped(
        (1, *((hidden, n) if is_transposed else (n, hidden)))
    )
    dn_transposed = is_transposed != weight_minor_swapped(
        (1, *((inter, hidden) if is_transposed else (hidden, inter)))
    )
    if (
        has_gate
        and not interleaved
        and inter % (128 if gu_transposed or quantized else sublane(w_dtype))
    ):
        return None
    item_of = lambda b: fused_moe_item_bytes(hidden, b, has_gate, w_dtype)  # noqa: E731
    step = fused_moe_block_multiple(interleaved, dn_transposed)
    blocks = [inter] + [b for b in range(inter - step, 0, -step) if inter % b == 0]
    # MXU-wide slices where I allows (a narrower one half-fills the MXU): the
    # widest within the item size, else the narrowest MXU-wide one.
    # Interleaved columns where I has no MXU-wide slice but itself (GPT-OSS's
    # 2880 in 64-column steps): the widest slice within the item size.
    wide = [b for b in blocks if b == inter or b % gen.chunk_m == 0]
    fitting = [b for b in wide if item_of(b) <= FUSED_MOE_ITEM_BYTES]
    if not fitting and interleaved and wide == [inter]:
        fitting = [b for b in blocks if item_of(b) <= FUSED_MOE_ITEM_BYTES]
    order = list(dict.fromkeys(fitting[:1] + wide[::-1] + blocks[::-1]))
    return _fused_config_of(tokens, hidden, inter, order, has_gate, w_dtype, gen, interleaved)


def _fused_config_of(tokens, hidden, inter, order, has_gate, w_dtype, gen, interleaved=False):
    """The first block_i of `order` that takes `tokens`, with as many buffers as
    cover the DMA latency and fit VMEM; None if none does."""
    mx = mxfp4.is_mxfp4(w_dtype)
    quantized = is_quantized(w_dtype) or mx
    in_flight = int(IN_FLIGHT_S * gen.hbm_bytes_per_s)
    for block_i in order:
        most = fused_moe_max_tokens(
            hidden, inter, block_i, has_gate=has_gate, w_dtype=w_dtype, generation=gen.name
        )
        if tokens > most:
            continue
        item = fused_moe_item_bytes(hidden, block_i, has_gate, w_dtype)
        for buffers in range(min(MAX_WEIGHT_BUFFERS, 1 + max(2, -(-in_flight // item))), 1, -1):
            need = fused_moe_vmem_bytes(
                tokens, hidden, block_i, buffers, item, quantized, mx, interleaved
            )
            if need <= gen.vmem_budget:
                return FusedMoeConfig(block_i, buffers, gen.vmem_budget)
    return None


# -- the combine kernel (kernel_combine) ---------------------------------------

COMBINE_BLOCK_T = 128
COMBINE_SLOTS = 3  # row slots: one summed, two tiles' copies in flight
# Its row slots: the bytes of COMBINE_SLOTS x k x block_t packed rows, the
# most it asks for (with the output's blocks and 4 MiB of temporaries beside
# them, at most ~21 MiB: within the smallest scoped budget, tpu7x's 48 MiB).
COMBINE_ROWS_BYTES = 16 * MiB


# Rows whose words are padded to whole tiles (H not a multiple of 2048: Gemma
# 4's 2816 takes 16 word rows a token for its 11) cost the down gmm and the
# combine those bytes too. Until 2026-12-06 tpu7x, whose HBM is fast, kept
# XLA's gather and sum for them (Gemma 4 at 8,192 tokens, 2026-12-04: 2,042.2
# us against 2,068.9 with the kernel). Since the gate/up gmm fetches its own
# rows and the combine issues its copies from constant addresses, the kernels
# win there too: Gemma 4 on tpu7x, the layer by its schedule, 614.5 -> 566.5
# us at 512 tokens, 821.6 -> 749.1 at 2,048, 1,876.7 -> 1,873.6 at 8,192.
#
# A partial last word group (GPT-OSS's H = 2880, since 2026-12-07) packs too,
# except on tpu7x: GPT-OSS's down gmm there is bound by its bundles (whole-expert
# slabs on the MXU), and the packing's strided stores, at 16 word rows a token
# two sublanes an op, add 17% to each of its passes (1,393 -> 1,629 bundles),
# more than XLA's gather and sum cost on tpu7x's HBM: its bf16 layer at 8,192
# tokens 3,519.4 -> 3,583.2 us with the kernel (v6e 3,599.9 -> 3,446.7).
def combine_in_kernel(hidden: int, generation: str | None = None) -> bool:
    """Whether the MoE layer's combine runs as kernel_combine on packed rows
    (else XLA gathers and sums): H packable (pairs.packable), whether or not
    a token's words are padded to whole tiles; with a partial last group, not
    on tpu7x (the attached chip's generation if None)."""
    if not pairs.packable(hidden):
        return False
    return hidden % pairs.GROUP == 0 or get_generation(generation).name != "tpu7x"


def combine_block_t(tokens: int, k: int, hidden: int, generation: str | None = None) -> int:
    """Tokens a combine step: the most (a multiple of 16, the bf16 output's
    sublane tile) whose rows copy within a DMA latency at the generation's
    HBM bandwidth, at most COMBINE_BLOCK_T, within COMBINE_ROWS_BYTES for the
    slots, and at most an eighth of the tokens.

    A step issues the copies of the tile two ahead while it sums its own, so
    its last copies land only if the next step lasts about a DMA latency:
    Gemma 4 (padded 8 KiB rows) had 32-token steps for the 8 MiB its slots
    were given, ~0.6 us on tpu7x, and its combine at 8,192 tokens scheduled
    299.7 us, half of it waiting (64 tokens: 188.5). Larger tiles expose more
    of the first two tiles' copies, which nothing overlaps: v6e Gemma 4 417.0
    us at 32 tokens, 419.2 at 48; Qwen3 at 512 tokens on tpu7x 24.3 us at 64,
    27.4 at 128 (hence at least 8 steps)."""
    gen = get_generation(generation)
    per_token = k * _row_bytes(hidden)
    cover = int(tpu_info.DMA_LATENCY_S * gen.hbm_bytes_per_s / per_token) // 16 * 16
    fit = COMBINE_ROWS_BYTES // (COMBINE_SLOTS * per_token) // 16 * 16
    eighth = tokens // 8 // 16 * 16
    return max(16, min(COMBINE_BLOCK_T, fit, cover, eighth))


def combine_vmem_bytes(block_t: int, k: int, hidden: int, out_dtype) -> int:
    """The combine's scoped VMEM limit: its row slots, its double-buffered
    output and weight blocks, and 4 MiB for the compiler's temporaries."""
    rows = COMBINE_SLOTS * k * block_t * _row_bytes(hidden)
    out = 2 * block_t * hidden * jnp.dtype(out_dtype).itemsize
    weights = 2 * round_up(block_t, 8) * 128 * 4
    return rows + out + weights + 4 * MiB


def _row_bytes(hidden: int) -> int:
    """A packed row's bytes (pairs.row_words rows of 128 words)."""
    return pairs.row_words(hidden) * 128 * 4
