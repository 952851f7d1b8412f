"""ragged-dot-tpu compiles for real TPU generations (libtpu AOT) at MoE layer shapes.

The whole matrix runs in CI: every model x projection x batch x kernel x
generation, the backward kernels at 8,192 tokens, v5e's forward at 1 and
8,192 tokens (4 x 2 x (4 x 2 + 2 x 1 + 2 x 2) = 112 points), each kernel with the blocks
tiling.py picks for it: fwd = gmm, d_lhs = gmm(transpose_rhs=True), d_rhs =
tgmm. Rows M = tokens x top_k.
Points whose kernel gets the same blocks share one compile, the one with the
most rows, and v5e and v6e share one where their blocks and VMEM limit agree
(see _covers; checked per point by tracing): 101 of the 111 points that tile
compile (117 of 127 with v5e's backward kernels at 8,192 tokens too, 173 of
214 with the backward from 512 tokens and every generation at
8 to 512 tokens too, 209 of 261 with the backward at 64 tokens, 260 of 355
with it at 1 and 8 too). The compiles run
in worker processes (tests/gate.py) started as soon as the session is
collected, one per core, while the numeric tests run; the
suite prints the gate's CPU time at its end. Measured alone on this project's
shared 2-core machine (`time pytest` of this module): 43.9 CPU-minutes before
the workers dropped the session's compiler dumps and points could be covered,
18.4 after (338 of 366 points compiled), 10.1 since unaligned gmm slabs are
consumed in 256-column pieces (285 of 366 compiled; a GPT-OSS d_lhs point had
taken 13 s, one unrolled transpose of a 2880-wide slab).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os

import jax
import jax.numpy as jnp
import pytest

from gate import GENERATIONS, GateProgram, assert_compiles, forward_and_grads, session_pool, spec
from ragged_dot_tpu import mxfp4, tiling
from ragged_dot_tpu.api import moe_experts, ragged_dot
from ragged_dot_tpu.kernel_gmm import gmm
from ragged_dot_tpu.kernel_combine import combine
from ragged_dot_tpu.kernel_tgmm import tgmm

# name: (experts, top_k, hidden, intermediate)
MODELS = {
    "qwen3_30b_a3b": (128, 8, 2048, 768),
    "gemma4_26b_a4b": (128, 8, 2816, 704),
    "mixtral_8x7b": (8, 2, 4096, 14336),
    "gpt_oss_20b": (32, 4, 2880, 2880),  # H = I = 2880: not a multiple of 128
}
TOKENS = [1, 64, 512, 8192]
KERNELS = ["fwd", "d_lhs", "d_rhs"]
PROJECTIONS = ["gate_up", "down"]

# The backward kernels at 8,192 tokens only: a training step over 1, 8 or 64
# tokens is not one anyone runs (the 96 points at 1 and 8 took 78 s of the
# gate's CPU; the 48 at 64, 101 s in the suite of 2026-12-04, which ran 2
# minutes over its 25), and at 512 they get smaller blocks of the same
# kernels (1.9 of the gate's 27 CPU-minutes on 2026-12-05, in a suite that
# took 37 minutes). Small-row backward blocks still compile here, in the
# whole layers' fwd+grad programs at 64 tokens (Qwen3 bf16, quantized,
# MXFP4), and the interpret-mode tests check their numerics. The forward
# skips 8 tokens: 1 and 64 bracket it.
BACKWARD_MIN_TOKENS = 8192
# v5e at the decode and prefill ends only, forward only: its blocks follow the
# same rules as v6e's (same VMEM limit; where they agree one compile covers
# both), and no performance goal is held on v5e; its 64- and 512-token
# forwards were 0.7 CPU-minutes, its 8,192-token backward kernels 1.0 (16
# compiles, 2026-12-05, in a suite 2 minutes over its 25).
V5E_TOKENS = (1, 8192)
POINTS = [
    p
    for p in itertools.product(MODELS, PROJECTIONS, TOKENS, KERNELS, GENERATIONS)
    if (p[3] == "fwd" or p[2] >= BACKWARD_MIN_TOKENS)
    and (p[4] != "v5e" or (p[2] in V5E_TOKENS and p[3] == "fwd"))
]
# COMPILE_GATE=subset (local runs only; CI runs the whole matrix): the former CI
# subset, every generation and kernel, decode and prefill, K = 704 and 14336, N = 2880.
SUBSET = [
    ("qwen3_30b_a3b", "gate_up", 1),
    ("qwen3_30b_a3b", "down", 512),
    ("gemma4_26b_a4b", "down", 8192),
    ("mixtral_8x7b", "down", 64),
    ("gpt_oss_20b", "down", 64),
    ("gpt_oss_20b", "down", 8192),
]
if os.environ.get("COMPILE_GATE") == "subset":
    POINTS = [p for p in POINTS if p[:3] in SUBSET]

# Found by running the whole matrix: GPT-OSS's gate_up d_lhs (grad [m, 5760] x
# weights [32, 2880, 5760] contracted on 5760) has N = 2880, not a multiple of
# 128, so gmm's only slab is all of N, and two double-buffered 5760 x 2880 bf16
# weight slabs (66 MB) exceed tpu7x's 48 MiB budget: tiling raises "no gmm
# block fits VMEM". GPT-OSS backward cannot run on tpu7x until gmm can split
# an unaligned N (or pad it). strict: the day it compiles, this marker must go.
KNOWN_FAILURES = {
    ("gpt_oss_20b", "gate_up", t, "d_lhs", "tpu7x"): "GPT-OSS gate_up d_lhs: no gmm block fits "
    "tpu7x VMEM (N = 2880 unaligned, whole-N slabs of K = 5760 need 66 MB)"
    for t in TOKENS
    if t >= BACKWARD_MIN_TOKENS
}


def _dims(model, projection):
    e, top_k, h, i = MODELS[model]
    k, n = (h, 2 * i) if projection == "gate_up" else (i, h)
    return e, top_k, k, n


def _blocks(point):
    """The blocks tiling picks for a point's kernel (None where it raises), and
    whether its rows are one tile (then lhs is single-buffered)."""
    model, projection, tokens, kernel, generation = point
    e, top_k, k, n = _dims(model, projection)
    m = tokens * top_k
    try:
        if kernel == "fwd":
            cfg = tiling.gmm_config(m, k, n, e, jnp.bfloat16, generation=generation)
        elif kernel == "d_lhs":
            cfg = tiling.gmm_config(m, n, k, e, jnp.bfloat16, generation=generation)
        else:
            try:
                cfg = tiling.tgmm_config(m, k, n, e, jnp.bfloat16, generation=generation)
            except ValueError:  # tgmm pads K and N to the lane tile and tries again
                kp, np_ = tiling.round_up(k, 128), tiling.round_up(n, 128)
                cfg = tiling.tgmm_config(m, kp, np_, e, jnp.bfloat16, generation=generation)
    except ValueError:
        return None
    return cfg, m <= cfg.block_m


def _covers():
    """point -> the point whose compile covers it (checked per point by tracing,
    tests/gate.py).

    Within a generation: the point with the most rows among those whose kernel
    gets the same blocks; M (tokens x top_k) then only sets the grid's row
    extent, lhs and out extents in HBM and scalar bounds, so that point's
    compile holds every VMEM buffer and vector shape of the others.

    Across generations: v5e and v6e share a VMEM limit, and where tiling gives
    both the same blocks the two Pallas launches are the same text (traced), so
    one generation compiles that configuration for both: along each kernel's
    shared configurations, the one that compiles fewer of that kernel so far,
    and a generation left with none compiles its largest itself, so every
    kernel still compiles on every generation
    (test_every_kernel_compiles_on_every_generation)."""
    groups = {}
    for pt in POINTS:
        blocks = _blocks(pt)
        if blocks is not None:
            groups.setdefault((pt[:2], pt[3], blocks, pt[4]), []).append(pt)
    reps = {key: max(members, key=lambda pt: pt[2]) for key, members in groups.items()}
    # (model, projection, kernel, blocks) -> {generation: rep}
    shared = {}
    for (mp, kernel, blocks, gen), rep in reps.items():
        shared.setdefault((mp, kernel, blocks), {})[gen] = rep
    compiled = dict(reps)  # group key -> the point that compiles for it
    by_kernel = {}
    for key, by_gen in shared.items():
        if len(by_gen) > 1:
            by_kernel.setdefault(key[:2], []).append(key)
    for (mp, kernel), keys in by_kernel.items():
        own = {
            g: sum(1 for k, by_gen in shared.items() if k[:2] == (mp, kernel) and g in by_gen)
            - sum(1 for k in keys if g in shared[k])
            for g in GENERATIONS
        }
        compiles = dict(own)  # of this kernel, per generation, as assigned so far
        for key in sorted(keys, key=lambda k: max(p[2] for p in shared[k].values())):
            gen = min(shared[key], key=lambda g: (compiles[g], GENERATIONS.index(g)))
            compiles[gen] += 1
            for g in shared[key]:
                compiled[(mp, kernel, key[2], g)] = shared[key][gen]
        # A generation whose every configuration of the kernel is shared, and
        # went to the other, compiles its largest one itself.
        for g in GENERATIONS:
            mine = [k for k in keys if g in shared[k]]
            if mine and not compiles[g]:
                key = max(mine, key=lambda k: shared[k][g][2])
                compiled[(mp, kernel, key[2], g)] = shared[key][g]
    covers = {}
    for key, members in groups.items():
        covers.update({pt: compiled[key] for pt in members if pt != compiled[key]})
    return covers


COVERS = _covers()


def gate_program(point) -> GateProgram:
    """The program a point compiles (called in the gate's worker processes)."""
    if point[0] == "moe_layer":
        return _moe_layer_program(point[1])
    if point[0] == "quantized":
        return _quantized_program(point[1:])
    if point[0] == "quantized_moe_layer":
        return _moe_layer_program(point[2], weight_dtype=point[1])
    if point[0] == "vmem_limit_at_estimate":
        return _vmem_estimate_program(point[1:])
    if point[0] == "mixed":
        return _mixed_program(point[1:])
    if point[0] == "moe_decode":
        return _moe_decode_program(point[1:])
    if point[0] == "mxfp4":
        return _mxfp4_program(point[1:])
    if point[0] == "mxfp4_moe_layer":
        return _mxfp4_layer_program(point[1:])
    if point[0] == "glu":
        return _glu_program(point[1:])
    if point[0] == "gpt_oss_layer":
        return _gpt_oss_layer_program(point[1:])
    if point[0] == "gpt_oss_decode":
        return _gpt_oss_decode_program(point[1:])
    if point[0] == "combine":
        return _combine_program(point[1:])
    if point[0] == "gather":
        return _gather_program(point[1:])
    model, projection, tokens, kernel, generation = point
    e, top_k, k, n = _dims(model, projection)
    m = tokens * top_k
    sizes = spec((e,), jnp.int32)
    if kernel == "fwd":
        fn = functools.partial(gmm, config=generation)
        args = [spec((m, k)), spec((e, k, n)), sizes]
    elif kernel == "d_lhs":
        fn = functools.partial(gmm, transpose_rhs=True, config=generation)
        args = [spec((m, n)), spec((e, k, n)), sizes]
    else:
        fn = functools.partial(tgmm, config=generation)
        args = [spec((m, k)), spec((m, n)), sizes]
    # A kernel that also compiles at tiling's VMEM estimate (ESTIMATE_POINTS)
    # is covered by that compile: the same launch under a smaller VMEM limit.
    cover = COVERS.get(point, point)
    cover = ("vmem_limit_at_estimate", *cover) if cover in ESTIMATE_POINTS else cover
    return GateProgram(
        fn, args, generation, covered_by=None if cover == point else cover, extents=(m,)
    )


# Weight-only quantized gmm (int8 / float8_e4m3fn slabs widened in VMEM, scale
# rows in the same ring): Qwen3 at decode and prefill, GPT-OSS's unaligned
# N = 2880, forward (scales on N) and d_lhs (scales on the contraction), in
# transformers' [E, out, in] layout. (kind, model, projection, tokens, kernel,
# weight dtype, generation)
# The generations each weight dtype is meant for: int8 where the MXU has it
# (v5e, v6e), e4m3 on tpu7x and on v6e (FP8 checkpoints served there).
QUANTIZED_TARGETS = [
    ("int8", "v5e"),
    ("int8", "v6e"),
    ("float8_e4m3fn", "v6e"),
    ("float8_e4m3fn", "tpu7x"),
]
# Decode on every target; prefill (other blocks, several row tiles) once per
# weight dtype, on the generation it is meant for. The backward (d_lhs) at
# 8,192 tokens, as BACKWARD_MIN_TOKENS has it (its 64-token blocks compile in
# the quantized layers' fwd+grad programs below; these points were 38 CPU-s
# of the gate, 2026-12-07).
QUANTIZED_POINTS = [
    ("quantized", "qwen3_30b_a3b", proj, tokens, kernel, wdt, gen)
    for proj, tokens, kernel, (wdt, gen) in itertools.product(
        PROJECTIONS, [64, 8192], ["fwd", "d_lhs"], QUANTIZED_TARGETS
    )
    if (tokens == 64 and kernel == "fwd")
    or (tokens == 8192 and (wdt, gen) in (("int8", "v6e"), ("float8_e4m3fn", "tpu7x")))
] + [("quantized", "gpt_oss_20b", "down", 64, kernel, "int8", "v6e") for kernel in ("fwd", "d_lhs")]
# 128 x 128 block scales (FP8 checkpoints), folded into the lhs rows per column block.
QUANTIZED_POINTS += [
    ("quantized", "qwen3_30b_a3b", proj, tokens, kernel, "float8_e4m3fn_blocks", gen)
    for proj, tokens, kernel, gen in itertools.product(
        PROJECTIONS, [64, 8192], ["fwd", "d_lhs"], ["v6e", "tpu7x"]
    )
    if (tokens == 64 and kernel == "fwd") or (tokens == 8192 and gen == "tpu7x")
]


def _quantized_program(point) -> GateProgram:
    model, projection, tokens, kernel, wdt, generation = point
    e, top_k, k, n = _dims(model, projection)
    m = tokens * top_k
    # Weights [E, N, K] (Linear layout): the forward (w8a8 too) reads them transposed.
    fwd = kernel in ("fwd", "w8a8")
    transpose, axis = (True, "n") if fwd else (False, "k")
    scale = spec((e, n), jnp.float32)
    if wdt.endswith("_blocks"):
        wdt, axis = wdt.removesuffix("_blocks"), "block"
        scale = spec((e, n * k // 128**2), jnp.float32)
    rows_k = k if fwd else n
    fn = functools.partial(
        gmm,
        transpose_rhs=transpose,
        scale_axis=axis,
        quantize_lhs=kernel == "w8a8",
        config=generation,
    )
    args = [spec((m, rows_k)), spec((e, n, k), jnp.dtype(wdt)), spec((e,), jnp.int32), scale]
    return GateProgram(lambda x, w, g, s: fn(x, w, g, rhs_scale=s), args, generation)


# MXFP4 gmm (mxfp4's kernel layout, decoded to bf16 per slab piece): Qwen3
# at decode and prefill and GPT-OSS's unaligned 2880 at decode, on every
# generation (v5e has no bf16 VPU: its decode runs in f32, slower, but
# compiles). (kind, model, projection, tokens, generation)
MXFP4_POINTS = [
    ("mxfp4", model, proj, tokens, gen)
    for model, proj, tokens, gen in itertools.product(
        ["qwen3_30b_a3b", "gpt_oss_20b"], PROJECTIONS, [64, 8192], ["v5e", "v6e", "tpu7x"]
    )
    if tokens == 64 or model == "qwen3_30b_a3b"
]


def _mxfp4_program(point) -> GateProgram:
    model, projection, tokens, generation = point
    e, top_k, k, n = _dims(model, projection)
    w, s = mxfp4.abstract((e, k, n))
    fn = functools.partial(gmm, scale_axis="mx", config=generation)
    args = [spec((tokens * top_k, k)), w, spec((e,), jnp.int32), s]
    return GateProgram(lambda x, w, g, s: fn(x, w, g, rhs_scale=s), args, generation)


def _mxfp4_layer_program(point) -> GateProgram:
    """A whole MXFP4 experts layer at 64 tokens, forward and the gradient
    w.r.t. hidden states and routing weights (d_lhs dequantizes in XLA):
    Qwen3 (silu; one launch on v6e, under its 67-token limit, two on tpu7x),
    GPT-OSS (biases, interleaved clamped GLU: two launches)."""
    model, generation = point
    e, top_k, h, i = MODELS[model]
    t = 64
    gpt = model == "gpt_oss_20b"
    kw = dict(num_experts=e, is_transposed=True, config=generation)
    kw.update(activation="gpt_oss", is_concatenated=False) if gpt else None
    gu, gu_s = mxfp4.abstract((e, h, 2 * i))
    dn, dn_s = mxfp4.abstract((e, i, h))

    def fn(hid, idx, w, gu, dn, gu_b, dn_b, gu_s, dn_s):
        layer = lambda hid, w: moe_experts(hid, idx, w, gu, dn, gu_b, dn_b, gu_s, dn_s, **kw)  # noqa: E731
        return forward_and_grads(layer, hid, w)

    args = [spec((t, h)), spec((t, top_k), jnp.int32), spec((t, top_k)), gu, dn]
    if gpt:
        bias = [spec((e, 2 * i), jnp.float32), spec((e, h), jnp.float32)]
        return GateProgram(fn, [*args, *bias, gu_s, dn_s], generation)
    return GateProgram(lambda *a: fn(*a[:5], None, None, *a[5:]), [*args, gu_s, dn_s], generation)


# w8a8 gmm (activations quantized per row in the kernel, int8 x int8 on v5e
# and v6e, fp8 x fp8 on tpu7x), the forward in transformers' [E, out, in]
# layout: Qwen3 at decode and prefill, GPT-OSS's unaligned 2880.
# (_quantized_program's points, kernel "w8a8")
W8A8_POINTS = [
    ("quantized", "qwen3_30b_a3b", proj, tokens, "w8a8", wdt, gen)
    for proj, tokens, (wdt, gen) in itertools.product(
        PROJECTIONS,
        [64, 8192],
        [("int8", "v5e"), ("int8", "v6e"), ("float8_e4m3fn", "tpu7x")],
    )
] + [
    ("quantized", "gpt_oss_20b", "gate_up", 64, "w8a8", wdt, gen)
    for wdt, gen in [("int8", "v6e"), ("float8_e4m3fn", "tpu7x")]
]


# gmm with the activation in its epilogue (inference's gate/up projection):
# Qwen3 (I = 768, one slab per expert), Gemma 4 (I = 704: a 192-column tail
# piece, the up half on a sublane tile of the [2I, H] weights), Mixtral
# (I = 14336: slabs of gate and up blocks), torch's [E, 2I, H] layout.
# v5e at 8,192 tokens only (its 512-token points were 14 CPU-s of the gate,
# 2026-12-07; no performance goal is held on v5e).
GLU_POINTS = [
    ("glu", model, tokens, gen)
    for model, tokens, gen in itertools.product(
        ["qwen3_30b_a3b", "gemma4_26b_a4b", "mixtral_8x7b"], [512, 8192], ["v5e", "v6e", "tpu7x"]
    )
    if gen != "v5e" or tokens == 8192
]


def _glu_program(point) -> GateProgram:
    model, tokens, generation = point
    e, top_k, h, i = MODELS[model]
    fn = functools.partial(
        gmm, transpose_rhs=True, glu=("gelu_pytorch_tanh", 1.702, 7.0), config=generation
    )
    args = [spec((tokens * top_k, h)), spec((e, 2 * i, h)), spec((e,), jnp.int32)]
    return GateProgram(fn, args, generation)


# Inference's down projection writing packed rows (gmm(packed=True)) and the
# combine kernel reading them, as one program: the layers that take them at
# prefill (Qwen3, H = 2048; Gemma 4, H = 2816, word rows padded to whole
# tiles), torch's [E, H, I] layout, v6e and tpu7x; and in the one-hot
# routing's range, a token count that is not a multiple of the combine's
# 16-token loop body.
# v5e's were 12 CPU-s of the gate (2026-12-08): the same kernels as v6e's
# with other token blocks (tiling.combine_block_t).
COMBINE_POINTS = [
    ("combine", model, 8192, gen)
    for model in ("qwen3_30b_a3b", "gemma4_26b_a4b")
    for gen in ("v6e", "tpu7x")
] + [("combine", "qwen3_30b_a3b", 300, "tpu7x"), ("combine", "gemma4_26b_a4b", 300, "v6e")]


def _combine_program(point) -> GateProgram:
    model, tokens, generation = point
    e, top_k, h, i = MODELS[model]

    def fn(x, w, sizes, slots, weights):
        rows = gmm(x, w, sizes, transpose_rhs=True, config=generation, packed=True)
        return combine(rows, slots, weights, hidden=h)

    args = [
        spec((tokens * top_k, i)),
        spec((e, h, i)),
        spec((e,), jnp.int32),
        spec((tokens, top_k), jnp.int32),
        spec((tokens, top_k), jnp.float32),
    ]
    return GateProgram(fn, args, generation)


# Prefill inference's gate/up gmm gathering its rows (gmm(gather=), the
# hidden states packed by kernel_pack first, or by the kernel where its
# staging copies fit, GmmConfig.stage_rows): Qwen3 (H = 2048), Gemma 4
# (H = 2816, word rows padded to whole tiles; the layer takes it on v5e and
# v6e only, as it does the combine), torch's [E, 2I, H] layout, every
# generation, with tiling's blocks and the VMEM limit set to tiling's own
# estimate (the packed row tiles and the junk chunk in place of the lhs
# blocks, and the hidden states' rows where they stay in VMEM,
# GmmConfig.resident_rows): an undercount fails the compile.
# v5e's once, Qwen3 at 8,192 tokens (its rows resident and staged); its three
# others were 29 CPU-s of the gate (2026-12-07).
GATHER_POINTS = [
    ("gather", model, tokens, gen)
    for model in ("qwen3_30b_a3b", "gemma4_26b_a4b")
    for tokens in (2048, 8192)
    for gen in ("v5e", "v6e", "tpu7x")
    if gen != "v5e" or (model, tokens) == ("qwen3_30b_a3b", 8192)
]


def _gather_program(point) -> GateProgram:
    model, tokens, generation = point
    e, top_k, h, i = MODELS[model]
    m = tokens * top_k
    bf16 = jnp.bfloat16
    cfg = tiling.gmm_config(
        m, h, i, e, bf16, generation=generation, glu=True, gather=True, gather_tokens=tokens
    )
    chunk = min(cfg.chunk_m, cfg.block_m)
    need = tiling.gmm_vmem_bytes(
        m,
        h,
        i,
        cfg.block_m,
        cfg.block_n,
        chunk,
        bf16,
        bf16,
        bf16,
        cfg.weight_buffers,
        glu=True,
        merged=cfg.merged_tails,
        gather=True,
        resident_tokens=tokens if cfg.resident_rows else 0,
        stage_rows=cfg.stage_rows,
    )
    cfg = dataclasses.replace(cfg, vmem_limit_bytes=need)
    fn = functools.partial(gmm, transpose_rhs=True, glu=("silu", 1.702, 7.0), config=cfg)
    args = [spec((tokens, h)), spec((e, 2 * i, h)), spec((e,), jnp.int32), spec((m,), jnp.int32)]
    return GateProgram(lambda x, w, s, ids: fn(x, w, s, gather=ids), args, generation)


# lhs and rhs of different dtypes (the MXU runs in rhs's: f32 rows cast to bf16
# in VMEM, or bf16 rows widened) with a per-group bias: forward and the three
# gradients as one program, Qwen3 gate_up at 64 tokens, torch weight layout.
MIXED_POINTS = [("mixed", "float32", "bfloat16", "v6e"), ("mixed", "bfloat16", "float32", "tpu7x")]


def _mixed_program(point) -> GateProgram:
    lhs_dtype, rhs_dtype, generation = point
    e, top_k, k, n = _dims("qwen3_30b_a3b", "gate_up")
    m = 64 * top_k

    def fn(x, w, sizes, b):
        def loss(x, w, b):
            out = ragged_dot(x, w, sizes, bias=b, transpose_rhs=True, config=generation)
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(x, w, b)

    args = [
        spec((m, k), jnp.dtype(lhs_dtype)),
        spec((e, n, k), jnp.dtype(rhs_dtype)),
        spec((e,), jnp.int32),
        spec((e, n), jnp.dtype(rhs_dtype)),
    ]
    return GateProgram(fn, args, generation)


def _moe_layer_program(generation, weight_dtype=None) -> GateProgram:
    """Qwen3-30B-A3B experts layer, 64 tokens, torch weight layout, one program;
    with weight_dtype, weight-only quantized weights and their scales (the
    gradient is taken w.r.t. hidden states and routing weights only)."""
    e, top_k, h, i = MODELS["qwen3_30b_a3b"]
    t = 64
    kw = dict(
        num_experts=e,
        has_gate=True,
        is_transposed=False,
        is_concatenated=True,
        activation="silu",
        config=generation,
    )

    def fn(hid, idx, w, gu, dn):
        layer = lambda hid, w, gu, dn: moe_experts(hid, idx, w, gu, dn, **kw)  # noqa: E731
        return forward_and_grads(layer, hid, w, gu, dn)

    args = [
        spec((t, h)),
        spec((t, top_k), jnp.int32),
        spec((t, top_k)),
        spec((e, 2 * i, h)),
        spec((e, h, i)),
    ]
    if weight_dtype is not None:

        def fn(hid, idx, w, gu, dn, gu_s, dn_s):
            layer = lambda hid, w: moe_experts(hid, idx, w, gu, dn, None, None, gu_s, dn_s, **kw)  # noqa: E731
            return forward_and_grads(layer, hid, w)

        wdt = jnp.dtype(weight_dtype)
        args[3:] = [spec((e, 2 * i, h), wdt), spec((e, h, i), wdt)]
        args += [spec((e, 2 * i), jnp.float32), spec((e, h), jnp.float32)]  # per channel
    return GateProgram(fn, args, generation)


# GPT-OSS's own experts layer at prefill, inference: gate and up columns
# interleaved, biases on both projections, its clamped GLU. The gate/up gmm
# deinterleaves and adds its bias in the epilogue where its whole-expert slabs
# fit VMEM (bf16 on v5e and v6e, where tpu7x keeps XLA's activation; MXFP4
# everywhere), the down gmm adds its bias on every generation.
# (kind, tokens, weights, generation)
GPT_OSS_LAYER_POINTS = [
    ("gpt_oss_layer", 8192, weights, g) for weights in ("bf16", "mxfp4") for g in ("v6e", "tpu7x")
]


def _gpt_oss_layer_program(point) -> GateProgram:
    tokens, weights, generation = point
    e, top_k, h, i = MODELS["gpt_oss_20b"]
    kw = dict(
        num_experts=e,
        is_transposed=True,
        is_concatenated=False,
        activation="gpt_oss",
        config=generation,
    )

    def fn(hid, idx, w, gu, dn, gu_b, dn_b, *scales):
        return moe_experts(hid, idx, w, gu, dn, gu_b, dn_b, *scales, **kw)

    args = [spec((tokens, h)), spec((tokens, top_k), jnp.int32), spec((tokens, top_k))]
    if weights == "mxfp4":
        (gu, gu_s), (dn, dn_s) = mxfp4.abstract((e, h, 2 * i)), mxfp4.abstract((e, i, h))
        args += [gu, dn, spec((e, 2 * i), jnp.float32), spec((e, h), jnp.float32), gu_s, dn_s]
    else:
        args += [spec((e, h, 2 * i)), spec((e, i, h)), spec((e, 2 * i)), spec((e, h))]
    return GateProgram(fn, args, generation)


def _gpt_oss_fused(tokens, weights, generation):
    e, top_k, h, i = MODELS["gpt_oss_20b"]
    w_dtype = jnp.uint8 if weights == "mxfp4" else jnp.bfloat16
    return tiling.fused_moe_config(
        tokens, h, i, jnp.bfloat16, w_dtype, has_gate=True, is_transposed=True,
        is_concatenated=False, has_bias=True, generation=generation,
    )  # fmt: skip


# GPT-OSS's layer at decode: one launch (kernel_moe_decode) with its biases
# and interleaved gate/up columns, bf16 in 192-column slices of I (no
# multiple of 128 divides 2880), MXFP4 whole experts; one token and the most
# tokens the rule gives the launch, where its VMEM is fullest.
# (kind, tokens, weights, generation)
GPT_OSS_DECODE_POINTS = [
    ("gpt_oss_decode", 1, "bf16", "v6e"),
    ("gpt_oss_decode", 1, "mxfp4", "tpu7x"),
    ("gpt_oss_decode", 8, "mxfp4", "v6e"),
    ("gpt_oss_decode", "most", "bf16", "tpu7x"),
]


def _gpt_oss_decode_program(point) -> GateProgram:
    tokens, weights, generation = point
    if tokens == "most":
        tokens = max(t for t in range(1, 512) if _gpt_oss_fused(t, weights, generation))
    assert _gpt_oss_fused(tokens, weights, generation), f"{point}: not the fused launch"
    return _gpt_oss_layer_program((tokens, weights, generation))


# The one-launch decode layer (kernel_moe_decode) at the shapes it takes:
# the smallest and largest token counts of a generation, the torch and
# transposed weight layouts, TP-8 slices (Qwen3 I/8 = 96, Mixtral I/8 = 1792)
# and Mixtral's whole I = 14336 in 128-column items.
# (model, tokens, layout, shard, generation)
MOE_DECODE_POINTS = [
    ("moe_decode", "qwen3_30b_a3b", 1, "torch", "full", g) for g in GENERATIONS
] + [
    ("moe_decode", "qwen3_30b_a3b", 256, "torch", "full", "v6e"),
    ("moe_decode", "qwen3_30b_a3b", 240, "transposed", "full", "tpu7x"),
    ("moe_decode", "qwen3_30b_a3b", 8, "torch", "tp8", "v6e"),
    ("moe_decode", "gemma4_26b_a4b", 8, "torch", "full", "tpu7x"),
    ("moe_decode", "mixtral_8x7b", 4, "transposed", "tp8", "v6e"),
    ("moe_decode", "mixtral_8x7b", 64, "torch", "full", "v5e"),
    # per-channel int8 / fp8 weights (model, tokens, layout, shard, generation, dtype)
    ("moe_decode", "qwen3_30b_a3b", 1, "torch", "full", "v6e", "int8"),
    ("moe_decode", "qwen3_30b_a3b", 8, "torch", "full", "v6e", "float8_e4m3fn"),
    ("moe_decode", "qwen3_30b_a3b", 120, "transposed", "full", "tpu7x", "float8_e4m3fn"),
    ("moe_decode", "mixtral_8x7b", 16, "transposed", "tp8", "v5e", "int8"),
]


def _moe_decode_program(point) -> GateProgram:
    model, t, layout, shard, generation, *dtype = point
    wdt = jnp.dtype(dtype[0] if dtype else jnp.bfloat16)
    e, top_k, h, i = MODELS[model]
    i = i // 8 if shard == "tp8" else i
    transposed = layout == "transposed"
    fused = tiling.fused_moe_config(
        t, h, i, jnp.bfloat16, wdt, has_gate=True, is_transposed=transposed,
        is_concatenated=True, has_bias=False, generation=generation,
    )  # fmt: skip
    assert fused is not None, f"{point}: the layer would not take the fused launch"
    kw = dict(num_experts=e, is_transposed=transposed, activation="silu", config=generation)
    args = [
        spec((t, h)),
        spec((t, top_k), jnp.int32),
        spec((t, top_k), jnp.float32),
        spec((e, h, 2 * i) if transposed else (e, 2 * i, h), wdt),
        spec((e, i, h) if transposed else (e, h, i), wdt),
    ]
    if dtype:
        args += [spec((e, 2 * i), jnp.float32), spec((e, h), jnp.float32)]
        return GateProgram(
            lambda hid, idx, w, gu, dn, gs, ds: moe_experts(
                hid, idx, w, gu, dn, None, None, gs, ds, **kw
            ),
            args,
            generation,
        )
    return GateProgram(lambda *a: moe_experts(*a, **kw), args, generation)


# Where tiling's VMEM estimate is closest to what Mosaic allocates: the widest
# contraction (Mixtral down, K = 14336) at prefill on v5e, and GPT-OSS's
# unaligned whole-N slabs. (model, projection, tokens, kernel, generation)
ESTIMATE_POINTS = [
    ("mixtral_8x7b", "down", 8192, "fwd", "v5e"),
    # bf16 lhs rows counted at 2 bytes (not f32): 256-row blocks on v6e,
    # 128-row on tpu7x, each within a few MiB of the budget.
    ("mixtral_8x7b", "down", 8192, "fwd", "v6e"),
    ("mixtral_8x7b", "down", 8192, "fwd", "tpu7x"),
    ("mixtral_8x7b", "down", 8192, "d_rhs", "v5e"),
    ("gpt_oss_20b", "gate_up", 8192, "d_lhs", "v6e"),
]


def _vmem_estimate_program(point) -> GateProgram:
    """The point's kernel with its blocks from tiling and vmem_limit_bytes set to
    tiling's own estimate: if the estimate undercounts what Mosaic allocates,
    the compile fails (tiling would then plan configs that do not fit)."""
    model, projection, tokens, kernel, generation = point
    e, top_k, k, n = _dims(model, projection)
    m = tokens * top_k
    bf16 = jnp.bfloat16
    sizes = spec((e,), jnp.int32)
    if kernel == "d_rhs":
        cfg = tiling.tgmm_config(m, k, n, e, bf16, generation=generation)
        chunk = min(cfg.chunk_m, cfg.block_m)
        need = tiling.tgmm_vmem_bytes(
            m, k, n, cfg.block_m, cfg.block_k, cfg.block_n, chunk, bf16, bf16
        )
        fn = functools.partial(tgmm, config=dataclasses.replace(cfg, vmem_limit_bytes=need))
        return GateProgram(fn, [spec((m, k)), spec((m, n)), sizes], generation, extents=(m,))
    transpose = kernel == "d_lhs"
    kk, nn = (n, k) if transpose else (k, n)
    cfg = tiling.gmm_config(m, kk, nn, e, bf16, generation=generation)
    chunk = min(cfg.chunk_m, cfg.block_m)
    need = tiling.gmm_vmem_bytes(
        m, kk, nn, cfg.block_m, cfg.block_n, chunk, bf16, bf16, bf16, cfg.weight_buffers
    )
    cfg = dataclasses.replace(cfg, vmem_limit_bytes=need)
    fn = functools.partial(gmm, transpose_rhs=transpose, config=cfg)
    return GateProgram(fn, [spec((m, kk)), spec((e, k, n)), sizes], generation, extents=(m,))


@pytest.fixture(scope="module")
def pool():
    return session_pool()  # conftest.py started it with this module's points


def _id(point):
    return "-".join(str(x) for x in point)


@pytest.mark.parametrize(
    "point",
    [
        pytest.param(pt, marks=pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[pt]))
        if pt in KNOWN_FAILURES
        else pt
        for pt in POINTS
    ],
    ids=_id,
)
def test_kernel_compiles(point, pool):
    pool.assert_ok(__file__, point)


def test_every_kernel_compiles_on_every_generation():
    # A cover across generations must leave each generation at least one
    # compile of every model's projection and kernel that tiling can place.
    placed = {pt[:2] + pt[3:] for pt in POINTS if _blocks(pt) is not None}
    compiled = {pt[:2] + pt[3:] for pt in POINTS if _blocks(pt) is not None and pt not in COVERS}
    assert placed - compiled == set()
    assert all(c not in COVERS for c in COVERS.values())  # a cover compiles itself


# v6e and tpu7x: v5e's forward kernels at these shapes compile in the matrix
# above, its backward ones take v6e's rules and VMEM limit (26 CPU-s saved).
@pytest.mark.parametrize("point", [("moe_layer", g) for g in ("v6e", "tpu7x")], ids=_id)
def test_whole_moe_layer_fwd_and_grad_compile(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize("point", QUANTIZED_POINTS, ids=_id)
def test_quantized_gmm_compiles(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize(
    "point",
    [("quantized_moe_layer", "int8", "v6e"), ("quantized_moe_layer", "float8_e4m3fn", "tpu7x")],
    ids=_id,
)
def test_quantized_moe_layer_fwd_and_grad_compile(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize("point", W8A8_POINTS, ids=_id)
def test_w8a8_gmm_compiles(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize("point", MXFP4_POINTS, ids=_id)
def test_mxfp4_gmm_compiles(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize(
    "point",
    [
        # v6e's layer is GPT-OSS's (its unaligned N, biases, clamped GLU)
        ("mxfp4_moe_layer", "qwen3_30b_a3b", "tpu7x"),
        ("mxfp4_moe_layer", "gpt_oss_20b", "v6e"),
    ],
    ids=_id,
)
def test_mxfp4_moe_layer_fwd_and_grad_compile(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize("point", GLU_POINTS, ids=_id)
def test_glu_gmm_compiles(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize("point", GPT_OSS_LAYER_POINTS, ids=_id)
def test_gpt_oss_layer_with_its_epilogues_compiles(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize("point", COMBINE_POINTS, ids=_id)
def test_packed_down_projection_and_combine_compile(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize("point", GATHER_POINTS, ids=_id)
def test_gate_up_gmm_gathering_its_rows_compiles_at_its_vmem_estimate(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize("point", MIXED_POINTS, ids=_id)
def test_mixed_dtypes_with_bias_fwd_and_grads_compile(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize(
    "point", [("vmem_limit_at_estimate", *pt) for pt in ESTIMATE_POINTS], ids=_id
)
def test_vmem_estimate_is_a_limit_mosaic_accepts(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows", [1, 7, 12, 37, 40])
def test_gmm_compiles_for_row_counts_off_the_tile(rows, dtype):
    # Row counts that are not whole 8-row tiles (top_k x tokens of a real
    # batch often is not): the one-tile path copies lhs by hand, which Mosaic
    # accepts only for whole tiles. Found by compiling these: 12 and 37 failed.
    args = [spec((rows, 256), dtype), spec((16, 256, 512), dtype), spec((16,), jnp.int32)]
    assert_compiles(functools.partial(gmm, config="v6e"), args, "v6e")


@pytest.mark.parametrize("point", MOE_DECODE_POINTS, ids=_id)
def test_one_launch_decode_layer_compiles(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize("point", GPT_OSS_DECODE_POINTS, ids=_id)
def test_gpt_oss_one_launch_decode_layer_compiles(point, pool):
    pool.assert_ok(__file__, point)


@pytest.mark.parametrize("hidden", [2880, 3008])
def test_partial_word_groups_pack_gather_and_combine_compile(hidden):
    # H not a multiple of 256 packs its last word group partially (pairs.py):
    # lane-prefix slices of 64 columns (GPT-OSS's 2880: the low half; 3008: a
    # whole low half and 64 columns of the high one), masked loads, stores and
    # concatenations Mosaic must accept, on v6e. At 2880 the gate/up gmm that
    # stages and packs its own rows (GPT-OSS's layer at 8,192 tokens, whose
    # gmm reads rows kernel_pack packed, its packed down gmm with a bias and
    # its combine compile in test_gpt_oss_layer_with_its_epilogues_compiles);
    # at 3008 kernel_pack, the packed down gmm with a bias, and the combine.
    from ragged_dot_tpu.kernel_pack import pack_rows

    t, k, e, i = 512, 4, 4, 256
    m = t * k
    if hidden == 2880:
        glu = ("silu", 1.702, 7.0)
        staged = tiling.GmmConfig(256, i, 64, resident_rows=True, stage_rows=128)

        def fn(x, w_up, sizes, ids):
            return gmm(x, w_up, sizes, transpose_rhs=True, glu=glu, gather=ids, config=staged)

        args = [spec((t, hidden)), spec((e, 2 * i, hidden)), spec((e,), jnp.int32)]
        assert_compiles(fn, [*args, spec((m,), jnp.int32)], "v6e")
        return

    def fn(x, a, w_down, bias, sizes, slots, weights):
        rows = gmm(a, w_down, sizes, bias=bias, packed=True, config="v6e")
        return pack_rows(x), combine(rows, slots, weights, hidden=hidden)

    args = [
        spec((t, hidden)),
        spec((m, i)),
        spec((e, i, hidden)),
        spec((e, hidden)),
        spec((e,), jnp.int32),
        spec((t, k), jnp.int32),
        spec((t, k), jnp.float32),
    ]
    assert_compiles(fn, args, "v6e")
