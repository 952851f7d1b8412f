"""The model against published TPU figures: `python -m bench.calibration`.

Each figure is a public measurement of a Pallas grouped matmul; the model
walks the same launch (or, where the measured kernel is not available here,
JAX's megablox as a stand-in, said so in the table) and reports model /
measured. Figures:

* perf-model.md reference walk (JAX 0.10.2 megablox, Qwen3-30B-A3B): not a
  measurement, but an independent walk the project's dashboard uses.
* tpu-inference issue 3520 (TPU7x, one TensorCore, xprof device time,
  megablox `gmm_v2`): bf16 rows. `gmm_v2` lives in tpu-inference, not here:
  pass its file with `--gmm-v2 PATH` (or BENCH_GMM_V2) to walk the measured
  kernel itself; without it JAX's megablox with full-width blocks stands in.
* tokamax PR 1221 (v6e / v7x, median of 20): speedup of tile_m 256 over 128 for
  m=65536, 128 groups, k=3072, n=2048, balanced groups. tokamax's kernel is a
  megablox descendant; megablox with (tm, 512, 512) blocks stands in.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from . import grid_walk, model, moe, tracing

ISSUE_3520 = "https://github.com/vllm-project/tpu-inference/issues/3520"
TOKAMAX_1221 = "https://github.com/openxla/tokamax/pull/1221"

# (E, K, N, touched groups, rows each, measured us, copy-bandwidth fraction)
ISSUE_3520_ROWS = [
    (512, 4096, 256, 72, 1, 71.8, 0.66),
    (64, 4096, 2048, 30, 3, 159.8, 0.98),
]
# (generation, measured speedup of tile_m 256 over 128)
TOKAMAX_1221_ROWS = [("v6e", 1.30), ("tpu7x", 1.31)]


def _megablox():
    from jax.experimental.pallas.ops.tpu.megablox import ops

    return ops.gmm


def _walk_gmm(gmm_fn, m, k, n, e, sizes, dtype=jnp.bfloat16, generation=None):
    f = lambda x, w, gs: gmm_fn(x, w, gs)
    args = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((e, k, n), dtype),
        jnp.asarray(sizes, jnp.int32),
    )
    if generation:
        with tracing.pretend_tpu(generation):
            return grid_walk.analyze(f, *args)
    return grid_walk.analyze(f, *args)


def _time(costs, generation, dma_as_steps=False):
    t = sum(model.kernel_time_s(c.hbm_bytes, c.flops, c.steps, generation) for c in costs)
    if dma_as_steps:
        t += sum(c.dma_issues for c in costs) * model.chip(generation).step_overhead_s
    return t


def _scheduled_s(fn, args, generation) -> tuple[float, list]:
    """Scheduled seconds of every launch fn(*args) makes (bench.schedule)."""
    from . import schedule

    with tracing.pretend_tpu(generation):
        launches = tracing.trace_launches(fn, *args)
        scheds = [schedule.schedule_launch(l, generation) for l in launches]
    return sum(s.seconds for s in scheds), scheds


def _load_gmm_v2(path):
    spec = importlib.util.spec_from_file_location("_bench_gmm_v2", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def reference_walk() -> list[dict]:
    """perf-model.md's megablox ratios (model / roofline, gate_up)."""
    gmm = _megablox()
    shape = moe.MODELS["qwen3-30b-a3b"]
    rows = []
    for tokens, want in ((1, 18.6), (8, 19.0), (64, 19.6), (512, 23.3)):
        ids, _ = moe.route(tokens, shape.experts, shape.top_k, "uniform", 0)
        sizes = moe.group_sizes(ids, shape.experts)
        m, k, n = tokens * shape.top_k, shape.hidden, 2 * shape.intermediate
        tm = min(128, m)
        costs = _walk_gmm(
            lambda x, w, gs: gmm(
                x, w, gs, preferred_element_type=jnp.bfloat16, tiling=(tm, 128, 128)
            ),
            m,
            k,
            n,
            shape.experts,
            sizes,
        )
        roof = model.grouped_roofline_s([model.GroupedMatmul(tuple(sizes), k, n)], "v6e")
        rows.append(
            dict(
                figure="perf-model.md reference walk (megablox default, v6e)",
                point=f"Qwen3 gate_up, {tokens} tokens",
                reference=want,
                model=_time(costs, "v6e") / roof,
                unit="× roofline",
                note="ideal model vs the note's own walk",
            )
        )
    return rows


def issue_3520(gmm_v2_path: str | None) -> list[dict]:
    rows = []
    gen = "tpu7x"
    mod = _load_gmm_v2(gmm_v2_path) if gmm_v2_path else None
    for e, k, n, g, per, meas_us, frac in ISSUE_3520_ROWS:
        m = g * per
        mp = -(-m // 16) * 16
        sizes = np.zeros(e, np.int32)
        touched = np.arange(g) * (e // g)
        sizes[touched] = per
        sizes[touched[-1]] += mp - m  # padding rows go to the last touched group
        if mod is not None:
            tm = min(128, mp)
            tiles = mod.TileSizes(tile_m=tm, tile_k=k, tile_n=n, bucket_base=tm)
            fn = lambda x, w, gs: mod.gmm_v2(x, w, gs, tile_info=tiles, vmem_limit_bytes=64 << 20)
            kernel = "gmm_v2 (walked)"
        else:
            gmm = _megablox()
            fn = lambda x, w, gs: gmm(
                x, w, gs, preferred_element_type=jnp.bfloat16, tiling=(mp, k, n)
            )
            kernel = "megablox full-width (stand-in)"
        costs = _walk_gmm(fn, mp, k, n, e, sizes, generation=gen)
        t = _time(costs, gen)
        args = (
            jax.ShapeDtypeStruct((mp, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((e, k, n), jnp.bfloat16),
            jnp.asarray(sizes),
        )
        try:
            sched, _ = _scheduled_s(fn, args, gen)
        except Exception as err:  # noqa: BLE001 - e.g. the stand-in's VMEM
            sched, why = None, f"{type(err).__name__}: {err}"[:120]
        point = f"E={e} {k}x{n} bf16, {g}x{per} rows"
        rows.append(
            dict(
                figure=f"tpu-inference #3520 ({kernel}, tpu7x)",
                point=point,
                reference=meas_us,
                model=t * 1e6,
                unit="µs",
                scheduled=None if sched is None else sched * 1e6,
                note="calibrates DMA latency and copy bandwidth" if sched else why,
            )
        )
    return rows


# Splash attention forward, d=128, causal: tokamax's published Ironwood
# (tpu7x) figures put it at 20-34% of peak.
SPLASH_PUBLISHED = (0.20, 0.34)


def splash_fraction_of_peak(
    seq: int = 8192, heads: int = 32, kv_heads: int = 8, head_dim: int = 128
) -> list[dict]:
    from . import points, registry

    gen = "tpu7x"
    p = points.AttentionPoint(seq, q_heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    rows = []
    for impl in ("jax_splash_attention", "ours_flash_attention"):
        built = registry.REGISTRY[impl].build(p, gen, None)
        sched, _ = _scheduled_s(built.fn, p.walker_args(), gen)
        peak = model.chip(gen).peak_flops
        frac = p.useful_flops() / sched / peak
        rows.append(
            dict(
                figure=f"splash attention fwd on Ironwood, {impl} (tpu7x)",
                point=f"causal T={seq} d={head_dim} {heads}/{kv_heads} heads",
                reference=sum(SPLASH_PUBLISHED) / 2,
                model=None,
                unit="of peak",
                scheduled=frac,
                note=f"published band {SPLASH_PUBLISHED[0]:.0%}-{SPLASH_PUBLISHED[1]:.0%}; "
                f"scheduled {sched * 1e6:,.0f} µs",
            )
        )
    return rows


# tokamax ragged_dot forward on TPU7x prefill shapes: 619-809 TFLOP/s (its
# autotune cache).
TOKAMAX_PUBLISHED_TFLOPS = (619.0, 809.0)


def tokamax_prefill_tflops(tokens: int = 8192) -> list[dict]:
    from . import registry

    gen = "tpu7x"
    shape = moe.MODELS["qwen3-30b-a3b"]
    p = moe.MoePoint(shape, tokens, "uniform", 0)
    rows = []
    for impl in ("tokamax_ragged_dot", "ours_ragged_dot"):
        try:
            built = registry.REGISTRY[impl].build(p, gen, None)
        except registry.Skip as e:
            rows.append(
                dict(
                    figure=f"tokamax ragged_dot prefill, {impl}",
                    point="",
                    reference=None,
                    model=None,
                    unit="TFLOP/s",
                    scheduled=None,
                    note=f"skip: {e}",
                )
            )
            continue
        sched, _ = _scheduled_s(built.fn, p.walker_args(), gen)
        tflops = p.useful_flops() / sched / 1e12
        rows.append(
            dict(
                figure=f"tokamax ragged_dot fwd on TPU7x prefill, {impl} (kernels only)",
                point=f"Qwen3-30B-A3B experts, {tokens} tokens, uniform",
                reference=sum(TOKAMAX_PUBLISHED_TFLOPS) / 2,
                model=None,
                unit="TFLOP/s",
                scheduled=tflops,
                note=f"published band {TOKAMAX_PUBLISHED_TFLOPS[0]:.0f}-"
                f"{TOKAMAX_PUBLISHED_TFLOPS[1]:.0f}; Pallas launches only, "
                f"scheduled {sched * 1e6:,.0f} µs",
            )
        )
    return rows


def tokamax_1221(scheduled: bool = True) -> list[dict]:
    gmm = _megablox()
    m, g, k, n = 65536, 128, 3072, 2048
    sizes = np.full(g, m // g, np.int32)
    rows = []
    for gen, measured in TOKAMAX_1221_ROWS:
        t, sch = {}, {}
        for tm in (128, 256):
            fn = functools.partial(gmm, preferred_element_type=jnp.bfloat16, tiling=(tm, 512, 512))
            costs = _walk_gmm(lambda x, w, gs: fn(x, w, gs), m, k, n, g, sizes)
            t[tm] = _time(costs, gen)
            if scheduled:
                args = (
                    jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                    jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
                    jnp.asarray(sizes),
                )
                sch[tm], _ = _scheduled_s(lambda x, w, gs: fn(x, w, gs), args, gen)
        rows.append(
            dict(
                figure=f"tokamax PR 1221 (megablox stand-in, {gen})",
                point=f"m={m} g={g} k={k} n={n} balanced: tile_m 256 vs 128",
                reference=measured,
                model=t[128] / t[256],
                unit="speedup",
                scheduled=sch[128] / sch[256] if sch else None,
                note="" if sch else "scheduled skipped (--fast)",
            )
        )
    return rows


def _fmt(v, unit):
    if v is None:
        return "-"
    if unit == "of peak":
        return f"{v:.1%}"
    return f"{v:.3g} {unit}"


def table(rows: list[dict]) -> str:
    out = [
        "| figure | point | measured / reference | scheduled | scheduled / measured "
        "| ideal model | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref, sch, ideal = r.get("reference"), r.get("scheduled"), r.get("model")
        ratio = f"{sch / ref:.2f}" if (ref and sch) else "-"
        out.append(
            f"| {r['figure']} | {r['point']} | {_fmt(ref, r['unit'])} | "
            f"{_fmt(sch, r['unit'])} | {ratio} | {_fmt(ideal, r['unit'])} | "
            f"{r.get('note', '')} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.calibration")
    p.add_argument(
        "--gmm-v2",
        default=os.environ.get("BENCH_GMM_V2"),
        help="path to tpu-inference's tpu_inference/kernels/megablox/gmm_v2.py",
    )
    p.add_argument("--out", default=None, help="write the table to this file")
    p.add_argument(
        "--fast",
        action="store_true",
        help="skip the scheduled time of PR 1221's m=65536 stand-in (minutes)",
    )
    p.add_argument(
        "--tokamax-prefill",
        action="store_true",
        help="also schedule tokamax's ragged_dot at Qwen3 8k prefill on tpu7x "
        "(about 15 minutes: its heuristic 128x128x128 tiles make ~250k DMAs)",
    )
    args = p.parse_args(argv)
    rows = (
        reference_walk()
        + issue_3520(args.gmm_v2)
        + tokamax_1221(scheduled=not args.fast)
        + splash_fraction_of_peak()
    )
    if args.tokamax_prefill:
        rows += tokamax_prefill_tflops()
    text = table(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
