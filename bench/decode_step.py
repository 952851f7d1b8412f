"""Whole-model decode step on 8 chips, composed from per-layer parts.

`python -m bench.decode_step --models qwen3-30b-a3b,gemma-4-26b-a4b --batches 1,8,64,512
--kv 1024,8192 --parallel tp8,ep8 --generations v6e --out DIR`

One decode step of the whole model, per rank (every rank does the same work,
so the step time is one rank's time):

    layers x (attention over the KV cache + norms + router + MoE experts
              [+ Gemma 4's dense MLP] + collectives)  +  embedding + final norm + lm head

The MoE experts layer is the only part this library changes, and the only
part taken from the TPU compiler's schedule: `python -m bench` is run on the
per-rank MoE shape (cached under OUT/moe_cache, so a rerun only reads JSON)
for our op and each baseline. Everything else is an ideal bound, the same for
ours and the baselines: max(HBM bytes / bandwidth, flops / peak) plus a fixed
cost per op, and the collectives at the interconnect's bandwidth and latency.
Each constant below says where it comes from or that it is an assumption.

The collectives are a formula. Their bytes are checked against the
compiler's: for each model and plan, the experts block at `--sharded-batch`
is compiled with our kernel on every rank for the multi-chip topology
(`v6e:2x4`, bench/sharded.py), and results.md lists the collectives the
compiler emitted beside the formula's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

from torch_bindings import tpu_info

from . import model, moe

BF16 = 2


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The figures of a model's config.json that a decode step's cost needs."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int
    top_k: int
    moe_intermediate: int
    # A dense MLP beside the experts in every layer (Gemma 4); 0: none.
    dense_intermediate: int = 0
    norms_per_layer: int = 2
    # Sliding-window layers attend to at most `window` cached tokens.
    sliding_layers: int = 0
    window: int = 0
    # Full-attention layers whose KV heads / head size differ (Gemma 4).
    global_kv_heads: int | None = None
    global_head_dim: int | None = None
    source: str = ""
    unsure: str = ""

    @property
    def moe_shape(self) -> moe.MoeShape:
        return moe.MoeShape(self.name, self.experts, self.top_k, self.hidden, self.moe_intermediate)


# Frozen table. MoE dims are bench/moe.py's MODELS (checked in the tests);
# the rest from each model's config.json as transformers 5.22.2's config
# classes describe it, and published figures, as each `source` says.
MODELS = {
    "qwen3-30b-a3b": ModelConfig(
        "qwen3-30b-a3b",
        layers=48,
        hidden=2048,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        experts=128,
        top_k=8,
        moe_intermediate=768,
        source="Qwen/Qwen3-30B-A3B config.json (48 layers, 32/4 heads, head_dim 128, vocab "
        "151936; transformers' Qwen3MoeConfig defaults match all but its 24 layers)",
    ),
    "gemma-4-26b-a4b": ModelConfig(
        "gemma-4-26b-a4b",
        layers=30,
        hidden=2816,
        heads=16,
        kv_heads=8,
        head_dim=256,
        vocab=262144,
        experts=128,
        top_k=8,
        moe_intermediate=704,
        dense_intermediate=2112,
        norms_per_layer=7,
        sliding_layers=25,
        window=1024,
        global_kv_heads=2,
        global_head_dim=512,
        source="google/gemma-4-26B-A4B: 30 layers, 5 sliding : 1 full, window 1024, 16/8 "
        "heads of 256, vocab 262144, 128 experts top-8 of 704 (public model cards); full "
        "layers 2 KV heads of 512 (transformers 5.22.2 gemma4 config: global_head_dim "
        "default, EP-plan comment); 7 RMSNorms per MoE layer (Gemma4TextDecoderLayer)",
        unsure="dense MLP intermediate 2112 (one model card's 'hidden 2,112', not checked "
        "against config.json); global layers' K=V sharing ignored (K and V both counted)",
    ),
    "gpt-oss-20b": ModelConfig(
        "gpt-oss-20b",
        layers=24,
        hidden=2880,
        heads=64,
        kv_heads=8,
        head_dim=64,
        vocab=201088,
        experts=32,
        top_k=4,
        moe_intermediate=2880,
        sliding_layers=12,
        window=128,
        source="openai/gpt-oss-20b config.json: 24 layers, 64/8 heads of 64, vocab 201088, "
        "32 experts top-4 of 2880, alternate layers sliding window 128",
        unsure="attention sinks and biases ignored (negligible bytes)",
    ),
    "mixtral-8x7b": ModelConfig(
        "mixtral-8x7b",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=32000,
        experts=8,
        top_k=2,
        moe_intermediate=14336,
        source="mistralai/Mixtral-8x7B-v0.1 config.json (= transformers' MixtralConfig "
        "defaults): 32 layers, 32/8 heads of 128, vocab 32000, 8 experts top-2 of 14336",
    ),
}


# --- interconnect -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ici:
    name: str
    ring_bytes_per_s: float  # what one rank sends per second around a bidirectional ring
    hop_latency_s: float
    source: str


# Per-link latency: an ASSUMPTION (1 us per ring step, the order of magnitude
# public JAX scaling notes give for one ICI hop); results.md repeats the
# batch-64 verdict with 3x this latency and half the bandwidth.
HOP_LATENCY_S = 1e-6

ICI = {
    # cloud.google.com/tpu/docs/v6e: 800 GB/s bidirectional ICI per chip, 4 ports,
    # 2D torus (v6e-8 = 2x4). Per port 100 GB/s each way; a bidirectional ring
    # sends on 2 ports at once: 200 GB/s per rank.
    "v6e": Ici(
        "v6e", 200e9, HOP_LATENCY_S, "cloud.google.com/tpu/docs/v6e: 800 GB/s bidi, 4 ports"
    ),
    # cloud.google.com/tpu/docs/tpu7x: 1200 GB/s bidirectional ICI per chip, two
    # TensorCores (= JAX devices, = ranks here) per chip: the 8 ranks are 4 chips
    # and the two ranks of a chip share its ports (ASSUMPTION: no faster path
    # between the two dies is counted). 300 GB/s per chip ring, 150 per rank.
    "tpu7x": Ici(
        "tpu7x", 150e9, HOP_LATENCY_S, "cloud.google.com/tpu/docs/tpu7x: 1200 GB/s bidi per chip"
    ),
}


def ici(generation: str) -> Ici:
    if generation not in ICI:
        raise ValueError(
            f"generation: no interconnect figures for {generation!r}; known {list(ICI)}"
        )
    return ICI[generation]


def all_reduce_s(nbytes: float, ranks: int, link: Ici) -> float:
    """Ring all-reduce (reduce-scatter + all-gather): 2(n-1) steps, each rank
    sends 2(n-1)/n of the message."""
    if ranks == 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * link.hop_latency_s + steps / ranks * nbytes / link.ring_bytes_per_s


def all_gather_s(nbytes: float, ranks: int, link: Ici) -> float:
    """Ring all-gather of a message of `nbytes` in total."""
    if ranks == 1:
        return 0.0
    steps = ranks - 1
    return steps * link.hop_latency_s + steps / ranks * nbytes / link.ring_bytes_per_s


def all_to_all_s(rank_bytes: float, ranks: int, link: Ici) -> float:
    """Each rank sends `rank_bytes`, (n-1)/n of it to other ranks, in n-1 steps."""
    if ranks == 1:
        return 0.0
    steps = ranks - 1
    return steps * link.hop_latency_s + steps / ranks * rank_bytes / link.ring_bytes_per_s


# --- parallel plans -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    kind: str  # "tp" or "ep"
    ranks: int

    @property
    def name(self) -> str:
        return f"{self.kind}{self.ranks}"


def parse_plan(s: str) -> Plan:
    s = s.strip().lower()
    kind, num = s[:2], s[2:]
    if kind not in ("tp", "ep") or not num.isdigit() or int(num) < 1:
        raise ValueError(f"parallel plan: expected tpN or epN (e.g. tp8, ep8), got {s!r}")
    return Plan(kind, int(num))


@dataclasses.dataclass(frozen=True)
class RankShapes:
    """What one rank holds and computes in one decode step of one layer."""

    seqs: int  # sequences (= decode tokens) this rank runs attention and dense parts for
    heads: int
    kv_heads: int
    global_kv_heads: int
    moe: moe.MoeShape  # the per-rank experts layer
    moe_tokens: int  # tokens of that experts layer (rows = moe_tokens x moe.top_k)
    dense_intermediate: int
    vocab: int  # lm head columns on this rank (vocab-parallel in both plans)


def _kv_per_rank(kv: int, ranks: int, what: str) -> int:
    """KV heads per rank: split when they divide, replicated when fewer than ranks."""
    if kv % ranks == 0:
        return kv // ranks
    if ranks % kv == 0:
        return 1
    raise ValueError(
        f"tensor parallel: {what} {kv} neither divides nor is divided by {ranks} ranks"
    )


def rank_shapes(cfg: ModelConfig, plan: Plan, batch: int) -> RankShapes:
    """TP-n: attention heads, every expert's intermediate and the dense MLP are
    split n ways, every rank sees every token. EP-n: experts split n ways,
    attention data-parallel (ceil(batch/n) sequences per rank), and, routing
    uniform, each rank's experts get batch x top_k / n rows (stated assumption:
    expected load, no imbalance)."""
    if batch < 1:
        raise ValueError(f"batch: expected a positive integer, got {batch}")
    n = plan.ranks
    vocab = -(-cfg.vocab // n)
    if plan.kind == "tp":
        if cfg.heads % n:
            raise ValueError(
                f"tp{n}: {cfg.name}'s {cfg.heads} attention heads do not divide by {n}"
            )
        if cfg.moe_intermediate % n:
            raise ValueError(
                f"tp{n}: {cfg.name}'s expert intermediate {cfg.moe_intermediate} does not divide by {n}"
            )
        if cfg.dense_intermediate % n:
            raise ValueError(
                f"tp{n}: {cfg.name}'s dense intermediate {cfg.dense_intermediate} does not divide by {n}"
            )
        gkv = cfg.global_kv_heads or cfg.kv_heads
        s = cfg.moe_shape
        return RankShapes(
            seqs=batch,
            heads=cfg.heads // n,
            kv_heads=_kv_per_rank(cfg.kv_heads, n, "KV heads"),
            global_kv_heads=_kv_per_rank(gkv, n, "global KV heads"),
            moe=dataclasses.replace(s, intermediate=s.intermediate // n),
            moe_tokens=batch,
            dense_intermediate=cfg.dense_intermediate // n,
            vocab=vocab,
        )
    if cfg.experts % n:
        raise ValueError(f"ep{n}: {cfg.name}'s {cfg.experts} experts do not divide by {n}")
    s = cfg.moe_shape
    return RankShapes(
        seqs=-(-batch // n),
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        global_kv_heads=cfg.global_kv_heads or cfg.kv_heads,
        # top-1 over E/n experts with batch*k/n tokens: batch*k/n rows spread
        # uniformly over this rank's experts.
        moe=dataclasses.replace(s, experts=s.experts // n, top_k=1),
        moe_tokens=max(1, -(-batch * cfg.top_k // n)),
        dense_intermediate=cfg.dense_intermediate,
        vocab=vocab,
    )


# --- the non-MoE parts (ideal bounds) ----------------------------------------

# Fixed cost of one op (a fused XLA computation or a small launch) inside the
# compiled step: ASSUMPTION, 1 us. The attention core is a Pallas launch:
# 4 us, the fixed cost our own scheduled 1-token launches show (README,
# Performance: scalar prefetch, last DMA's latency, writeback).
OP_FIXED_S = 1e-6
ATTENTION_FIXED_S = 4e-6


def part_s(nbytes: float, flops: float, generation: str, fixed_s: float) -> float:
    c = model.chip(generation)
    return max(nbytes / c.hbm_bytes_per_s, flops / c.peak_flops) + fixed_s


@dataclasses.dataclass(frozen=True)
class Step:
    """Seconds per decode step on one rank, by part (all layers summed)."""

    attention: float
    norms: float
    router: float
    dense_mlp: float
    moe: float
    collectives: float
    head: float  # embedding + final norm + lm head + sampling collective

    @property
    def total(self) -> float:
        return sum(dataclasses.astuple(self))

    @property
    def other(self) -> float:
        return self.total - self.moe


def collective_bytes(cfg: ModelConfig, plan: Plan, batch: int) -> dict:
    """Per layer: TP all-reduces [batch, hidden] bf16 twice (after attention,
    after the MoE block); EP all-to-alls each rank's batch/n x top_k rows of
    hidden bf16 twice (dispatch, combine)."""
    if plan.kind == "tp":
        return {"all_reduce": [batch * cfg.hidden * BF16] * 2}
    seqs = -(-batch // plan.ranks)
    return {"all_to_all": [seqs * cfg.top_k * cfg.hidden * BF16] * 2}


def experts_collectives(cfg: ModelConfig, plan: Plan, batch: int) -> list[tuple[str, int]]:
    """(HLO op, bytes per rank) of the experts block's own collectives, in
    collective_bytes' figures: TP, the second all-reduce of a layer (the first
    is attention's); EP, both all-to-alls."""
    b = collective_bytes(cfg, plan, batch)
    if plan.kind == "tp":
        return [("all-reduce", x) for x in b["all_reduce"][1:]]
    return [("all-to-all", x) for x in b["all_to_all"]]


def layer_collectives_s(cfg: ModelConfig, plan: Plan, batch: int, link: Ici) -> float:
    b = collective_bytes(cfg, plan, batch)
    return sum(all_reduce_s(x, plan.ranks, link) for x in b.get("all_reduce", [])) + sum(
        all_to_all_s(x, plan.ranks, link) for x in b.get("all_to_all", [])
    )


def kv_bytes_per_rank(cfg: ModelConfig, plan: Plan, batch: int, kv: int) -> int:
    """KV cache bytes one rank reads per step (all layers), K and V bf16."""
    r = rank_shapes(cfg, plan, batch)
    full_layers = cfg.layers - cfg.sliding_layers
    slide = cfg.sliding_layers * min(kv, cfg.window) * r.kv_heads * cfg.head_dim
    gdim = cfg.global_head_dim or cfg.head_dim
    full = full_layers * kv * (r.global_kv_heads if cfg.global_kv_heads else r.kv_heads) * gdim
    return r.seqs * (slide + full) * 2 * BF16


def weight_bytes_per_rank(cfg: ModelConfig, plan: Plan) -> int:
    r = rank_shapes(cfg, plan, 1)
    attn = cfg.hidden * cfg.head_dim * (2 * r.heads + 2 * r.kv_heads) * BF16
    experts = r.moe.experts * 3 * r.moe.hidden * r.moe.intermediate * BF16
    dense = 3 * cfg.hidden * r.dense_intermediate * BF16
    router = cfg.hidden * cfg.experts * BF16
    # embedding replicated (a gather), lm head vocab-parallel
    head = cfg.vocab * cfg.hidden * BF16 + r.vocab * cfg.hidden * BF16
    return cfg.layers * (attn + experts + dense + router) + head


def step(
    cfg: ModelConfig,
    plan: Plan,
    generation: str,
    batch: int,
    kv: int,
    moe_layer_s: float,
    link: Ici | None = None,
) -> Step:
    """One decode step with the experts layer costing `moe_layer_s` per layer per
    rank; `link` overrides the generation's interconnect (sensitivity)."""
    link = link or ici(generation)
    if kv < 1:
        raise ValueError(f"kv: expected a positive KV length, got {kv}")
    if moe_layer_s < 0:
        raise ValueError(f"moe_layer_s: expected >= 0, got {moe_layer_s}")
    r = rank_shapes(cfg, plan, batch)
    h, d, L, t = cfg.hidden, cfg.head_dim, cfg.layers, r.seqs
    # q, k, v, o projections (weights) + the KV cache (per layer average)
    proj_w = h * d * (2 * r.heads + 2 * r.kv_heads) * BF16
    proj_flops = 2 * t * proj_w / BF16
    kv_b = kv_bytes_per_rank(cfg, plan, batch, kv)
    # QK^T and PV: 2 matmuls x 2 flops over every cached position of every q head
    attn_flops = 4 * t * r.heads * d * kv * L
    attention = (
        part_s(L * proj_w + kv_b, L * proj_flops + attn_flops, generation, 0.0)
        + L * (2 * OP_FIXED_S + ATTENTION_FIXED_S)  # qkv projection, o projection, core
    )
    norm_b = 2 * t * h * BF16 + h * BF16
    norms = L * cfg.norms_per_layer * part_s(norm_b, 4 * t * h, generation, OP_FIXED_S)
    # TP: every rank routes every token; EP: its own batch/n
    router = L * part_s(
        h * cfg.experts * BF16 + t * h * BF16, 2 * t * h * cfg.experts, generation, OP_FIXED_S
    )
    dense_mlp = 0.0
    if r.dense_intermediate:
        w = 3 * h * r.dense_intermediate * BF16
        dense_mlp = L * part_s(w, 2 * t * w / BF16, generation, OP_FIXED_S)
    collectives = L * layer_collectives_s(cfg, plan, batch, link)
    # embedding gather, final norm, lm head over this rank's vocab slice for
    # every token (EP first all-gathers the batch's hidden states), then the
    # greedy pick's all-gather of (value, index) per token and rank
    head_w = r.vocab * h * BF16
    head = (
        part_s(batch * h * BF16, 0, generation, OP_FIXED_S)
        + part_s(norm_b, 4 * t * h, generation, OP_FIXED_S)
        + part_s(head_w + batch * r.vocab * BF16, 2 * batch * head_w / BF16, generation, OP_FIXED_S)
        + all_gather_s(batch * 8 * plan.ranks, plan.ranks, link)
        + (all_gather_s(batch * h * BF16, plan.ranks, link) if plan.kind == "ep" else 0.0)
    )
    return Step(attention, norms, router, dense_mlp, L * moe_layer_s, collectives, head)


def tokens_per_s(batch: int, step_s: float) -> float:
    if step_s <= 0:
        raise ValueError(f"step time: expected > 0, got {step_s}")
    return batch / step_s


def required_moe_layer_s(speedup: float, ours: Step, layers: int) -> float:
    """Per-layer experts time a baseline needs for ours to be `speedup`x faster
    over the whole step (everything else equal)."""
    return (speedup * ours.total - ours.other) / layers


# --- the MoE layer from the scheduled model ----------------------------------

IMPLS = ("ours_moe_experts", "hf_grouped_mm", "tokamax_ragged_dot")
OURS = IMPLS[0]
BASELINES = IMPLS[1:]
LABELS = {
    "ours_moe_experts": "ours (experts_forward)",
    "hf_grouped_mm": "transformers grouped_mm",
    "tokamax_ragged_dot": "tokamax ragged_dot",
}


def _shape_dir(root: str, s: moe.MoeShape) -> str:
    return os.path.join(root, f"e{s.experts}-k{s.top_k}-h{s.hidden}-i{s.intermediate}")


def _have(path: str, tokens: set, generations: list) -> dict | None:
    """{(impl, tokens): record} from a previous sweep if it covers every point."""
    try:
        with open(path) as f:
            recs = json.load(f)["records"]
    except (OSError, ValueError, KeyError):
        return None
    got = {
        (r["impl"], r["tokens"]): r
        for r in recs
        if r.get("kernel") == "moe" and r.get("routing") == "uniform"
    }
    for i in IMPLS:
        for t in tokens:
            rec = got.get((i, t))
            if rec is None or any(g not in rec["per_generation"] for g in generations):
                return None
    return got


def moe_records(shape: moe.MoeShape, tokens: set, generations: list, root: str, jobs: int):
    """Sweep records of the per-rank MoE shape, from OUT/moe_cache when it has them."""
    d = _shape_dir(root, shape)
    path = os.path.join(d, "results.json")
    got = _have(path, tokens, generations)
    if got is not None:
        return got
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "--kernels",
        "moe",
        "--experts",
        str(shape.experts),
        "--top-k",
        str(shape.top_k),
        "--hidden",
        str(shape.hidden),
        "--intermediate",
        str(shape.intermediate),
        "--batches",
        ",".join(str(t) for t in sorted(tokens)),
        "--prefill",
        "",
        "--routing",
        "uniform",
        "--impls",
        ",".join(IMPLS),
        "--generations",
        ",".join(generations),
        "--jobs",
        str(jobs),
        "--no-progress",
        "--out",
        d,
    ]
    print(f"[decode_step] MoE sweep for {os.path.basename(d)}: {' '.join(cmd[2:])}", flush=True)
    os.makedirs(d, exist_ok=True)
    with open(d + ".log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    got = _have(path, tokens, generations)
    if got is None:
        raise RuntimeError(f"the MoE sweep in {d} did not produce every point")
    return got


def moe_layer_us(rec: dict, generation: str) -> tuple[float | None, str]:
    """(µs per layer, what it is): the scheduled time, else the ideal model's, else None."""
    from . import report

    g = rec["per_generation"].get(generation, {})
    if g.get("status") != "ok":
        return None, f"{g.get('status', 'missing')}: {(g.get('reason') or '')[:120]}"
    us = report.headline_us(g)
    kind = "scheduled" if g.get("scheduled_us") else "ideal (no schedule)"
    if any("not used" in n for n in g.get("notes", [])):
        kind = "roofline floor, a lower bound (XLA's estimate over 100x its roofline, not used)"
    if (g.get("xla_floored_us") or 0) > 0.01 * (us or 0):
        kind = (
            "scheduled, with XLA fusions whose loop bounds the run cannot see charged their "
            "HBM bytes at copy bandwidth (a lower bound)"
        )
    if g.get("compiles") is False:
        kind += ", does not compile"
    return us, kind


# --- driver -------------------------------------------------------------------


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _strs(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.decode_step", description=__doc__.split("\n")[0]
    )
    p.add_argument("--models", type=_strs, default=["qwen3-30b-a3b", "gemma-4-26b-a4b"])
    p.add_argument("--batches", type=_ints, default=[1, 8, 64, 512])
    p.add_argument("--kv", type=_ints, default=[1024, 8192])
    p.add_argument("--parallel", type=_strs, default=["tp8", "ep8"])
    p.add_argument("--generations", type=_strs, default=["v6e"])
    p.add_argument("--out", default="decode_out")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument(
        "--sharded-batch",
        type=int,
        default=64,
        help="compile each model and plan's experts block for v6e:2x4 at this batch (0: skip)",
    )
    a = p.parse_args(argv)
    bad = [m for m in a.models if m not in MODELS]
    if bad:
        p.error(f"--models: unknown {bad}; known: {list(MODELS)}")
    for b in a.batches + a.kv:
        if b < 1:
            p.error(f"--batches/--kv: expected positive integers, got {b}")
    try:
        a.plans = [parse_plan(s) for s in a.parallel]
    except ValueError as e:
        p.error(str(e))
    for g in a.generations:
        try:
            model.chip(g)
            ici(g)
        except ValueError as e:
            p.error(str(e))
    for m in a.models:
        for pl in a.plans:
            try:
                rank_shapes(MODELS[m], pl, 1)
            except ValueError as e:
                p.error(str(e))
    return a


def evaluate(args) -> list[dict]:
    rows = []
    cache = os.path.join(args.out, "moe_cache")
    for m in args.models:
        cfg = MODELS[m]
        for pl in args.plans:
            by_shape: dict = {}
            for b in args.batches:
                r = rank_shapes(cfg, pl, b)
                by_shape.setdefault(r.moe, set()).add(r.moe_tokens)
            recs = {
                s: moe_records(s, toks, args.generations, cache, args.jobs)
                for s, toks in by_shape.items()
            }
            for gen in args.generations:
                hbm = tpu_info.facts(gen).hbm_capacity_bytes
                for kv in args.kv:
                    for b in args.batches:
                        r = rank_shapes(cfg, pl, b)
                        row = dict(model=m, plan=pl.name, generation=gen, kv=kv, batch=b)
                        row["moe_shape"] = (
                            f"E={r.moe.experts} k={r.moe.top_k} H={r.moe.hidden} "
                            f"I={r.moe.intermediate}, {r.moe_tokens} tok"
                        )
                        mem = weight_bytes_per_rank(cfg, pl) + kv_bytes_per_rank(cfg, pl, b, kv)
                        row["hbm_gb"] = mem / 1e9
                        row["fits"] = mem <= hbm
                        ours_rec = recs[r.moe][(OURS, r.moe_tokens)]
                        row["moe_roofline_us"] = ours_rec["per_generation"][gen].get("roofline_us")
                        for impl in IMPLS:
                            us, kind = moe_layer_us(recs[r.moe][(impl, r.moe_tokens)], gen)
                            row[f"{impl}_moe_us"] = us
                            row[f"{impl}_kind"] = kind
                            if us is None:
                                row[f"{impl}_step"] = None
                                continue
                            st = step(cfg, pl, gen, b, kv, us * 1e-6)
                            row[f"{impl}_step"] = dataclasses.asdict(st) | {"total": st.total}
                        rows.append(row)
    return rows


def _ms(row, impl):
    s = row.get(f"{impl}_step")
    return s["total"] * 1e3 if s else None


def speedup(row, base) -> float | None:
    o, b = _ms(row, OURS), _ms(row, base)
    return b / o if o and b else None


def _sensitivity(row, at_roofline: bool = False) -> float | None:
    """Speedup over grouped_mm with a slower interconnect (half bandwidth, 3x
    latency), or with our experts layer at its roofline instead."""
    base = row["hf_grouped_mm_moe_us"]
    ours = row.get("moe_roofline_us") if at_roofline else row[f"{OURS}_moe_us"]
    if base is None or ours is None:
        return None
    cfg, plan, gen = MODELS[row["model"]], parse_plan(row["plan"]), row["generation"]
    link = ici(gen)
    slow = (
        link
        if at_roofline
        else dataclasses.replace(
            link, ring_bytes_per_s=link.ring_bytes_per_s / 2, hop_latency_s=3 * link.hop_latency_s
        )
    )
    args = (cfg, plan, gen, row["batch"], row["kv"])
    return step(*args, base * 1e-6, slow).total / step(*args, ours * 1e-6, slow).total


def sharded_compiles(args) -> list[dict]:
    """The experts block of each model and plan compiled for v6e:2x4 (bench.sharded),
    its collectives beside the formula's bytes for the experts block."""
    from . import sharded

    if not args.sharded_batch or "v6e" not in args.generations:
        return []
    out = []
    for m in args.models:
        for pl in args.plans:
            res = sharded.compile_moe_block(MODELS[m], pl, args.sharded_batch, "v6e")
            want = experts_collectives(MODELS[m], pl, args.sharded_batch)
            out.append(
                dict(
                    model=m,
                    plan=pl.name,
                    batch=args.sharded_batch,
                    topology=sharded.TOPOLOGIES["v6e"],
                    compiles=res.ok,
                    error=res.error,
                    collectives=[f"{c.kind} {c.bytes:,} B" for c in res.collectives],
                    formula=[f"{kind} {b:,} B" for kind, b in want],
                    bytes_match=res.ok and [(c.kind, c.bytes) for c in res.collectives] == want,
                )
            )
    return out


def write_markdown(
    path: str, rows: list[dict], argv: list[str], compiled: list[dict] | None = None
) -> None:
    f = lambda x, fmt: "n/a" if x is None else format(x, fmt)
    lines = [
        "# Modeled whole-model decode step, 8 ranks",
        "",
        f"`python -m bench.decode_step {' '.join(argv)}`",
        "",
        "Per rank and step: experts layer from the TPU compiler's schedule of the per-rank "
        "shape (`python -m bench`), everything else an ideal bound (bytes / HBM bandwidth, "
        "flops / peak, + fixed cost per op) and ring collectives at the ICI constants "
        "(bench/decode_step.py). ms per step; tok/s = batch / step; speedup = baseline "
        "step / our step. `fits`: weights + KV cache per rank within the chip's HBM.",
        "",
        "| model | plan | gen | KV | batch | ours ms | ours tok/s | grouped_mm ms | "
        "tokamax ms | × grouped_mm | × tokamax | MoE µs/layer ours · grouped_mm · tokamax "
        "| MoE share (ours) | fits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o = r.get(f"{OURS}_step")
        share = f"{o['moe'] / o['total']:.0%}" if o else "n/a"
        tps = r["batch"] / o["total"] if o else None
        moe_cells = " · ".join(f(r[f"{i}_moe_us"], ",.0f") for i in IMPLS)
        lines.append(
            f"| {r['model']} | {r['plan']} | {r['generation']} | {r['kv']} | {r['batch']} | "
            f"{f(_ms(r, OURS), ',.2f')} | {f(tps, ',.0f')} | {f(_ms(r, 'hf_grouped_mm'), ',.2f')} | "
            f"{f(_ms(r, 'tokamax_ragged_dot'), ',.2f')} | {f(speedup(r, 'hf_grouped_mm'), '.2f')} | "
            f"{f(speedup(r, 'tokamax_ragged_dot'), '.2f')} | {moe_cells} | {share} | "
            f"{'yes' if r['fits'] else 'no'} ({r['hbm_gb']:.0f} GB) |"
        )
    kinds = sorted(
        {(i, r[f"{i}_kind"]) for r in rows for i in IMPLS if "scheduled" != r[f"{i}_kind"]}
    )
    if kinds:
        lines += ["", "MoE figures that are not a plain schedule:", ""]
        lines += [f"* {i}: {k}" for i, k in kinds]
    lines += ["", "## Batch 64: what the announcement's speedups would need", ""]
    claims = {"qwen3-30b-a3b": 21.5, "gemma-4-26b-a4b": 12.8}
    for r in rows:
        if r["batch"] != 64 or r["model"] not in claims or not r.get(f"{OURS}_step"):
            continue
        cfg = MODELS[r["model"]]
        o = Step(**{k: v for k, v in r[f"{OURS}_step"].items() if k != "total"})
        need = required_moe_layer_s(claims[r["model"]], o, cfg.layers) * 1e6
        have = r["hf_grouped_mm_moe_us"]
        lines.append(
            f"* {r['model']} {r['plan']} {r['generation']} KV {r['kv']}: modeled "
            f"{f(speedup(r, 'hf_grouped_mm'), '.2f')}× over grouped_mm; "
            f"{claims[r['model']]}× needs grouped_mm's experts layer at {need:,.0f} µs per "
            f"layer per rank (modeled {f(have, ',.0f')} µs, {f(need / have if have else None, '.1f')}× "
            f"that); non-MoE part of our step {o.other * 1e3:.2f} ms of {o.total * 1e3:.2f}; "
            f"with the ICI at half bandwidth and 3× latency: "
            f"{f(_sensitivity(r), '.2f')}×; with our experts layer at its roofline "
            f"({f(r.get('moe_roofline_us'), ',.0f')} µs): {f(_sensitivity(r, at_roofline=True), '.2f')}×."
        )
    if compiled:
        lines += [
            "",
            "## The experts block compiled for the 8-chip topology",
            "",
            "bench/sharded.py: one layer's experts block under the plan, our kernel on every "
            "rank, compiled for libtpu's `v6e:2x4`; the collectives in the compiler's optimized "
            "HLO (bytes of one rank's operand) against the formula's bytes for that block.",
            "",
            "| model | plan | batch | topology | compiles | compiler's collectives | formula | match |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in compiled:
            lines.append(
                f"| {c['model']} | {c['plan']} | {c['batch']} | {c['topology']} | "
                f"{'yes' if c['compiles'] else 'no: ' + (c['error'] or '')[:80]} | "
                f"{'; '.join(c['collectives']) or '-'} | "
                f"{'; '.join(c['formula'])} | "
                f"{'yes' if c['bytes_match'] else 'no'} |"
            )
    lines += ["", "## Model configs", ""]
    for m in sorted({r["model"] for r in rows}):
        c = MODELS[m]
        lines.append(f"* {m}: {c.source}." + (f" Unsure: {c.unsure}." if c.unsure else ""))
    lines += [
        "",
        "## Assumptions",
        "",
        "* TP-n: heads, expert intermediate and dense MLP split n ways; KV heads split, or "
        "replicated when fewer than n; 2 ring all-reduces of [batch, hidden] bf16 per layer.",
        "* EP-n: experts split n ways, attention and dense parts data-parallel "
        "(ceil(batch/n) sequences per rank); uniform routing at its expected load: each rank's "
        "experts get batch·top_k/n rows (modeled as top-1 over E/n experts); 2 all-to-alls "
        "(dispatch, combine) of batch/n·top_k·hidden bf16 per rank per layer. transformers' own "
        "EP plan instead replicates attention and all-reduces the expert outputs.",
        "* lm head vocab-parallel in both plans, embedding replicated.",
        f"* ICI: {'; '.join(f'{k}: {v.ring_bytes_per_s / 1e9:.0f} GB/s per rank around a ring ({v.source})' for k, v in ICI.items())}; "
        f"{HOP_LATENCY_S * 1e6:.0f} µs per ring step (assumption).",
        f"* Fixed cost per op {OP_FIXED_S * 1e6:.0f} µs, attention core launch "
        f"{ATTENTION_FIXED_S * 1e6:.0f} µs (assumptions).",
        "* Attention over the KV cache is an ideal bound (no decode attention kernel of ours "
        "yet: issue 13); identical for ours and the baselines.",
    ]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def plot(path: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    plans = list(dict.fromkeys(r["plan"] for r in rows))
    gens = list(dict.fromkeys(r["generation"] for r in rows))
    kvs = sorted({r["kv"] for r in rows})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(
        len(models),
        len(plans) * len(gens),
        figsize=(5 * len(plans) * len(gens), 3.8 * len(models)),
        squeeze=False,
    )
    colors = {i: plt.cm.tab10(k) for k, i in enumerate(IMPLS)}
    for mi, m in enumerate(models):
        for pi, (pl, gen) in enumerate((p, g) for p in plans for g in gens):
            ax = axes[mi][pi]
            for impl in IMPLS:
                for kv, ls in zip(kvs, styles):
                    pts = [
                        (r["batch"], r["batch"] / r[f"{impl}_step"]["total"])
                        for r in rows
                        if (r["model"], r["plan"], r["generation"], r["kv"]) == (m, pl, gen, kv)
                        and r.get(f"{impl}_step")
                    ]
                    if pts:
                        ax.plot(
                            *zip(*sorted(pts)),
                            ls,
                            marker="o",
                            ms=3,
                            color=colors[impl],
                            label=f"{LABELS[impl]}, KV {kv}",
                        )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch (sequences decoding)")
            ax.set_ylabel("modeled decode tokens/s")
            ax.set_title(f"{m} — {gen}-8, {pl}")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=6, loc="upper left")
    floors = sorted(
        {LABELS[i] for r in rows for i in IMPLS if "lower bound" in r.get(f"{i}_kind", "")}
    )
    if floors:
        # the baseline's point is a floor there: the true gap is at least what is drawn
        fig.text(
            0.01,
            0.002,
            f"{', '.join(floors)}: some points are lower bounds (floored at bytes, see results.md)",
            fontsize=7,
        )
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = evaluate(args)
    compiled = sharded_compiles(args)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(dict(argv=argv, rows=rows, sharded=compiled), fh, indent=1)
    write_markdown(os.path.join(args.out, "results.md"), rows, argv, compiled)
    plot(os.path.join(args.out, "decode_tokens_per_s.png"), rows)
    for name in ("results.md", "results.json", "decode_tokens_per_s.png"):
        print(" ", os.path.join(args.out, name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
