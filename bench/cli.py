"""Command line: `python -m bench [--quick] [--out DIR] ...`."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _strs(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _known(flag: str, given: list[str] | None, known) -> list[str] | None:
    bad = [x for x in given or [] if x not in known]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad}; known: {', '.join(known)}")
    return given


# --quick models the two generations the kernels are tuned for; the full
# sweep adds v5e.
QUICK_GENERATIONS = ("v6e", "tpu7x")


def generations(args) -> tuple:
    from . import model

    return tuple(args.generations or (QUICK_GENERATIONS if args.quick else model.GENERATIONS))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Modeled TPU performance of this library's kernels against "
        "JAX/XLA alternatives (no TPU needed; timings only on a real TPU).",
    )
    p.add_argument("--out", default="bench_out", help="output folder")
    p.add_argument(
        "--quick",
        action="store_true",
        help="short run: qwen3-30b-a3b at 1, 64, 512 tokens, uniform routing, "
        "2 rmsnorm and 1 attention point, v6e and tpu7x, every implementation",
    )
    p.add_argument(
        "--kernels",
        type=_strs,
        default=["moe", "rmsnorm", "attention"],
        help="comma list of moe, rmsnorm, attention, decode_attention (decode over a KV "
        "cache: not in the default run)",
    )
    p.add_argument(
        "--models", type=_strs, default=None, help="comma list of MoE models (default: all four)"
    )
    p.add_argument("--experts", type=int, help="custom MoE shape: experts")
    p.add_argument("--top-k", type=int, help="custom MoE shape: experts per token")
    p.add_argument("--hidden", type=int, help="custom MoE shape: hidden size")
    p.add_argument("--intermediate", type=int, help="custom MoE shape: expert FFN size")
    p.add_argument(
        "--batches", type=_ints, default=None, help="decode token counts (default 1,2,4,...,512)"
    )
    p.add_argument(
        "--prefill",
        type=_ints,
        default=None,
        help="prefill token counts (default 2048,8192; '' for none)",
    )
    p.add_argument(
        "--routing", type=_strs, default=None, help="comma list of uniform, zipf (default both)"
    )
    p.add_argument(
        "--impls", type=_strs, default=None, help="only these implementations (registry names)"
    )
    p.add_argument(
        "--generations",
        type=_strs,
        default=None,
        help="comma list of v5e, v6e, tpu7x (default all)",
    )
    p.add_argument("--rmsnorm-hidden", type=_ints, default=None)
    p.add_argument("--rmsnorm-tokens", type=_ints, default=None)
    p.add_argument(
        "--rmsnorm-variants",
        type=_strs,
        default=None,
        help="comma list of plain, gemma, residual (fused add); default plain",
    )
    p.add_argument(
        "--rmsnorm-directions",
        type=_strs,
        default=None,
        help="comma list of fwd, bwd (the backward alone); default fwd for --quick, both otherwise",
    )
    p.add_argument("--attention-seqs", type=_ints, default=None)
    p.add_argument(
        "--attention-windows",
        type=_ints,
        default=None,
        help="causal sliding windows, keys a query sees (0: the whole causal prefix; default 0)",
    )
    p.add_argument(
        "--attention-head-dims",
        type=_ints,
        default=None,
        help="attention head dims (default 128)",
    )
    p.add_argument(
        "--attention-directions",
        type=_strs,
        default=None,
        help="comma list of fwd, train (forward + backward); default fwd for "
        "--quick, both otherwise",
    )
    p.add_argument(
        "--decode-batches", type=_ints, default=None, help="decode_attention batches (1,8,64,256)"
    )
    p.add_argument(
        "--decode-contexts",
        type=_ints,
        default=None,
        help="decode_attention cached tokens per sequence (1024,4096,16384)",
    )
    p.add_argument("--seed", type=int, default=0, help="routing seed")
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="skip the AOT TPU compile gate (model from the walk only)",
    )
    p.add_argument(
        "--cache", default=None, help="compile cache file (default OUT/compile_cache.jsonl)"
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="worker processes (default: 2 if the host has 2+ CPUs)",
    )
    p.add_argument(
        "--xla-v6e-only",
        action="store_true",
        help="compile the XLA part of every program for v6e only and reuse "
        "it for the other generations (faster; default: each generation)",
    )
    p.add_argument(
        "--no-schedule",
        action="store_true",
        help="skip the scheduled time (the compiler's VLIW schedule, run); ideal model only",
    )
    p.add_argument("--list", action="store_true", help="list implementations and exit")
    p.add_argument(
        "--summary",
        action="store_true",
        help="print scheduled and ideal µs per point (always on with --quick)",
    )
    args = p.parse_args(argv)
    custom = [args.experts, args.top_k, args.hidden, args.intermediate]
    if any(v is not None for v in custom) and not all(v is not None for v in custom):
        p.error("--experts, --top-k, --hidden and --intermediate go together")
    for name, v in zip(("--experts", "--top-k", "--hidden", "--intermediate"), custom):
        if v is not None and v <= 0:
            p.error(f"{name}: expected a positive integer, got {v}")
    if args.experts is not None and args.top_k > args.experts:
        p.error(f"--top-k: expected at most --experts ({args.experts}), got {args.top_k}")
    return args


def build_tasks(args):
    from . import moe, points, registry

    tasks = []
    if args.impls:
        unknown = [i for i in args.impls if i not in registry.REGISTRY]
        if unknown:
            raise SystemExit(f"--impls: unknown {unknown}; known: {sorted(registry.REGISTRY)}")

    def impls(kernel):
        return [i for i in registry.impls_for(kernel) if not args.impls or i.name in args.impls]

    if "moe" in args.kernels:
        if args.experts is not None:
            shapes = [
                moe.MoeShape(
                    f"custom-e{args.experts}-k{args.top_k}-h{args.hidden}-i{args.intermediate}",
                    args.experts,
                    args.top_k,
                    args.hidden,
                    args.intermediate,
                )
            ]
        else:
            names = args.models or (["qwen3-30b-a3b"] if args.quick else list(moe.MODELS))
            bad = [n for n in names if n not in moe.MODELS]
            if bad:
                raise SystemExit(f"--models: unknown {bad}; known: {list(moe.MODELS)}")
            shapes = [moe.MODELS[n] for n in names]
        batches = (
            args.batches
            if args.batches is not None
            else ([1, 64, 512] if args.quick else list(moe.DECODE_TOKENS))
        )
        prefill = (
            args.prefill
            if args.prefill is not None
            else ([] if args.quick else list(moe.PREFILL_TOKENS))
        )
        routings = args.routing or (["uniform"] if args.quick else list(moe.ROUTINGS))
        for s in shapes:
            for routing in routings:
                for t in list(batches) + list(prefill):
                    pt = moe.MoePoint(s, t, routing, args.seed)
                    tasks += [(i, pt) for i in impls("moe")]
    if "rmsnorm" in args.kernels:
        hs = args.rmsnorm_hidden or ([2048] if args.quick else list(points.RMSNORM_HIDDEN))
        ts = args.rmsnorm_tokens or ([8, 8192] if args.quick else list(points.RMSNORM_TOKENS))
        variants = _known("--rmsnorm-variants", args.rmsnorm_variants, points.RMSNORM_VARIANTS)
        dirs = _known("--rmsnorm-directions", args.rmsnorm_directions, points.RMSNORM_DIRECTIONS)
        for h in hs:
            for t in ts:
                for v in variants or ["plain"]:
                    for d in dirs or (["fwd"] if args.quick else ["fwd", "bwd"]):
                        pt = points.RmsNormPoint(h, t, variant=v, direction=d)
                        tasks += [(i, pt) for i in impls("rmsnorm")]
    if "attention" in args.kernels:
        seqs = args.attention_seqs or ([2048] if args.quick else list(points.ATTENTION_SEQS))
        dirs = _known(
            "--attention-directions", args.attention_directions, points.ATTENTION_DIRECTIONS
        )
        dirs = dirs or (["fwd"] if args.quick else ["fwd", "train"])
        for n in seqs:
            for hd in args.attention_head_dims or [128]:
                for d in dirs:
                    for w in args.attention_windows or [0]:
                        pt = points.AttentionPoint(n, head_dim=hd, direction=d, window=w)
                        tasks += [(i, pt) for i in impls("attention")]
    if "decode_attention" in args.kernels:
        batches = args.decode_batches or list(points.DECODE_BATCHES)
        contexts = args.decode_contexts or list(points.DECODE_CONTEXTS)
        for b in batches:
            for n in contexts:
                pt = points.DecodeAttentionPoint(b, n)
                tasks += [(i, pt) for i in impls("decode_attention")]
    return tasks


def _context(args, gens, cache, read_also):
    from . import sweep, xla_cost

    return sweep.Context(
        generations=gens,
        compiles=xla_cost.CompileCache(cache, read_also),
        do_compile=not args.no_compile,
        measure=sweep.on_tpu(),
        xla_all_generations=not args.xla_v6e_only,
        scheduled=not (args.no_schedule or args.no_compile),
    )


def _shards(tasks, jobs):
    """Task indices per worker: points sharing a compile key stay together (they
    share compiles), heavier points (more tokens) spread first."""
    groups: dict = {}
    for i, (impl, pt) in enumerate(tasks):
        groups.setdefault(pt.compile_key, []).append(i)
    weight = lambda idx: sum(1 + getattr(tasks[i][1], "tokens", 1) / 256 for i in idx)
    shards = [[] for _ in range(jobs)]
    load = [0.0] * jobs
    for idx in sorted(groups.values(), key=weight, reverse=True):
        j = load.index(min(load))
        shards[j] += idx
        load[j] += weight(idx)
    return [sorted(s) for s in shards]


def _worker(argv, indices, cache, read_also, queue):
    args = parse_args(argv)
    from . import sweep

    gens = generations(args)
    tasks = build_tasks(args)
    ctx = _context(args, gens, cache, read_also)
    out = []
    for i in indices:
        impl, pt = tasks[i]
        out.append((i, sweep.evaluate(impl, pt, ctx)))
        queue.put(1)
    return out, dict(ctx.timings)


def _run_parallel(args, argv, tasks, jobs, cache):
    import multiprocessing as mp

    from . import xla_cost

    argv = list(sys.argv[1:] if argv is None else argv)
    shards = _shards(tasks, jobs)
    paths = [f"{cache}.worker{j}" for j in range(jobs)]
    ctx = mp.get_context("spawn")
    bar = None
    if not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(tasks), desc=f"bench x{jobs}", unit="pt", dynamic_ncols=True)
        except ImportError:
            pass
    with ctx.Manager() as manager, ctx.Pool(jobs) as pool:
        queue = manager.Queue()
        pending = [
            pool.apply_async(_worker, (argv, shards[j], paths[j], [cache], queue))
            for j in range(jobs)
        ]
        done = 0
        while done < len(tasks):
            if all(p.ready() for p in pending):
                break
            try:
                queue.get(timeout=0.5)
                done += 1
                if bar is not None:
                    bar.update(1)
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
        results = [p.get() for p in pending]
        # A pool left by `with` is terminated, and libtpu's handler in each worker
        # prints a SIGTERM stack trace: let the workers exit on their own.
        pool.close()
        pool.join()
    if bar is not None:
        bar.close()
    xla_cost.CompileCache(cache).merge_from(paths)
    records = [None] * len(tasks)
    timings = {"walk": 0.0, "compile": 0.0, "schedule": 0.0}
    for out, t in results:
        for i, rec in out:
            records[i] = rec
        for k in timings:
            timings[k] += t.get(k, 0.0)
    return records, timings


def _default_platform() -> None:
    """Without a TPU attached, keep JAX off libtpu's device probe (it only
    serves the AOT compiler here); on a TPU host JAX picks the chip and the
    sweep measures."""
    if "JAX_PLATFORMS" in os.environ:
        return
    import glob

    if not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
        os.environ["JAX_PLATFORMS"] = "cpu"


def main(argv=None) -> int:
    _default_platform()
    args = parse_args(argv)
    from . import model, registry, report, sweep

    if args.list:
        for i in registry.REGISTRY.values():
            print(f"{i.kernel:10s} {i.name:28s} {i.description}")
        return 0
    gens = generations(args)
    for g in gens:
        model.chip(g)
    os.makedirs(args.out, exist_ok=True)
    cache = args.cache or os.path.join(args.out, "compile_cache.jsonl")
    tasks = build_tasks(args)
    jobs = args.jobs if args.jobs is not None else min(2, os.cpu_count() or 1)
    jobs = max(1, min(jobs, len(tasks)))
    t0 = time.perf_counter()
    if jobs == 1:
        ctx = _context(args, gens, cache, ())
        records = sweep.run(tasks, ctx, progress=not args.no_progress)
        timings = dict(ctx.timings)
        ncomp = len(ctx.compiles)
    else:
        records, timings = _run_parallel(args, argv, tasks, jobs, cache)
        ncomp = None
    elapsed = time.perf_counter() - t0
    meta = dict(
        argv=sys.argv[1:] if argv is None else list(argv),
        generations=list(gens),
        elapsed_s=elapsed,
        walk_s=timings["walk"],
        compile_s=timings["compile"],
        points=len(tasks),
        jobs=jobs,
        compiles_cached=ncomp,
        reference_generation="v6e" if args.xla_v6e_only else "all",
        schedule_s=timings.get("schedule", 0.0),
    )
    files = report.write_all(args.out, records, sweep.environment(), meta)
    if args.quick or args.summary:
        print(report.summary(records, list(gens)))
    print(
        f"{len(records)} records in {elapsed:.1f} s with {jobs} job(s) "
        f"(walk {timings['walk']:.1f} s, compile {timings['compile']:.1f} s, schedule "
        f"{timings.get('schedule', 0.0):.1f} s, summed over jobs)"
    )
    for f in files:
        print(" ", f)
    return 0
