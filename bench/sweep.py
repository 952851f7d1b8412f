"""One record per (implementation, point): modeled time per generation,
traffic and flops against the minimum, the AOT compile gate, and a measured
time when (and only when) the process runs on a real TPU."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
import traceback
from typing import Any, Callable, Iterable

import jax
import numpy as np
from torch_bindings import tpu_info

from . import model
from . import registry
from . import schedule
from . import grid_walk, tracing
from . import xla_cost


@dataclasses.dataclass
class Context:
    generations: tuple
    compiles: xla_cost.CompileCache
    do_compile: bool = True
    measure: bool = False
    # The XLA part of each program (and XLA-only programs) is compiled for this
    # generation only, unless xla_all_generations: XLA's flop count does not
    # depend on the generation and its byte count moves by well under 1%
    # between them (layout padding), while a prefill-size sort alone takes
    # several seconds to compile.
    reference_generation: str = "v6e"
    xla_all_generations: bool = True
    # Scheduled time (bench.schedule): each Pallas launch's compiled VLIW
    # schedule, executed with the launch's scalar-prefetch values.
    scheduled: bool = True
    schedules: dict = dataclasses.field(default_factory=dict)
    walks: dict = dataclasses.field(default_factory=dict)
    rests: dict = dataclasses.field(default_factory=dict)
    timings: dict = dataclasses.field(default_factory=lambda: {"walk": 0.0, "compile": 0.0})

    def compile(
        self, key, generation, fn, args, want_cycles: bool = False, want_schedule: bool = False
    ) -> xla_cost.Compiled:
        t = time.perf_counter()
        try:
            # Lowering may ask Pallas for the chip (tokamax's quantized gmm
            # does): it answers for the generation compiled for, not the host.
            with tracing.pretend_tpu(generation):
                return self.compiles.get(key, generation, fn, args, want_cycles, want_schedule)
        finally:
            self.timings["compile"] += time.perf_counter() - t

    def gate_and_schedule(self, launch, generation):
        """(compile result, LaunchSchedule or None, why not) of one launch: the
        compile gate and the schedule come from the same compile."""
        kfn, kargs = tracing.launch_program(launch)
        sig = tracing.launch_signature(launch)
        comp = self.compile(("kernel", sig), generation, kfn, kargs, want_schedule=self.scheduled)
        if not self.scheduled:
            return comp, None, "scheduled time disabled"
        if not comp.ok:
            return comp, None, "does not compile"
        if not comp.schedule:
            return (
                comp,
                None,
                (
                    "no schedule: the compiler dump is off in this process "
                    "(libtpu loaded before bench)"
                ),
            )
        values = schedule.operand_values(launch.operands)
        key = (sig, generation, hash(tuple((k, v.tobytes()) for k, v in sorted(values.items()))))
        if key not in self.schedules:
            t = time.perf_counter()
            self.schedules[key] = schedule.run_schedule(
                schedule.unpack(comp.schedule), values, generation, launch.name
            )
            self.timings["schedule"] = self.timings.get("schedule", 0.0) + time.perf_counter() - t
        sch = self.schedules[key]
        if sch.stopped:  # a lower bound reported as a time would flatter the launch
            return comp, None, f"schedule cut off after {sch.bundles:,} bundles"
        return comp, sch, None

    def compile_kernels(self, fn, args, generation) -> xla_cost.Compiled:
        """Compile gate of every pallas_call fn(*args) makes, each on its own
        (cached by what Mosaic compiles, shared with the sweep's own gates)."""
        launches = tracing.trace_launches(fn, *args)
        results = []
        for l in launches:
            kfn, kargs = tracing.launch_program(l)
            results.append(
                self.compile(("kernel", tracing.launch_signature(l)), generation, kfn, kargs)
            )
        bad = [r for r in results if not r.ok]
        if bad:
            return bad[0]
        if results:
            return results[0]
        return xla_cost.Compiled(generation, True, None, None, None, None, None, 0.0)

    def walk(self, key, fn, args):
        """(launches, costs) of the program, traced once per key."""
        if key not in self.walks:
            t = time.perf_counter()
            try:
                launches = tracing.trace_launches(fn, *args)
                self.walks[key] = (launches, [grid_walk.walk_launch(l) for l in launches])
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                self.walks[key] = e
            finally:
                self.timings["walk"] += time.perf_counter() - t
        res = self.walks[key]
        if isinstance(res, Exception):
            raise res
        return res


# An XLA estimate more than this many times its part's roofline is taken for
# a cost-model artefact, and the roofline is charged instead (noted).
XLA_ESTIMATE_LIMIT = 100


def on_tpu() -> bool:
    try:
        return jax.default_backend() == "tpu"
    except Exception:  # noqa: BLE001
        return False


def measure_us(fn: Callable, args, warmup: int = 3, iters: int = 20) -> float:
    """Median wall time of the jitted fn on the attached device, in us."""
    f = jax.jit(fn)
    out = None
    for _ in range(warmup):
        out = f(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _launch_json(c: grid_walk.LaunchCost) -> dict:
    return dict(
        name=c.name,
        grid=list(c.grid),
        steps=c.steps,
        dma_issues=c.dma_issues,
        hbm_bytes=c.hbm_bytes,
        pipeline_bytes=c.pipeline_bytes,
        dma_bytes=c.dma_bytes,
        flops=c.flops,
        notes=list(c.notes),
        uncounted=c.uncounted,
        declared_flops=c.declared_flops,
        declared_bytes=c.declared_bytes,
        operands=[
            dict(
                origin=o.origin,
                kind=o.kind,
                block=list(o.block_shape),
                transfers=o.transfers,
                bytes=o.bytes,
                counted=o.counted,
            )
            for o in c.operands
        ],
    )


def _input_output_bytes(args, fn) -> int:
    """Bytes of the program's inputs plus outputs: what a program that touches
    every element at least once must move."""
    n = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in args)
    try:
        out = jax.eval_shape(fn, *args)
        n += sum(
            int(np.prod(o.shape)) * np.dtype(o.dtype).itemsize
            for o in jax.tree_util.tree_leaves(out)
        )
    except Exception:  # noqa: BLE001
        pass
    return n


def evaluate(impl: registry.Impl, point, ctx: Context) -> dict:
    rec: dict[str, Any] = dict(
        kernel=point.kernel,
        impl=impl.name,
        ours=impl.ours,
        baseline=impl.baseline,
        **point.labels(),
    )
    rec["min_bytes"] = int(point.min_bytes())
    rec["useful_flops"] = int(point.useful_flops())
    per_gen: dict[str, dict] = {}
    rec["per_generation"] = per_gen
    for gen in ctx.generations:
        g: dict[str, Any] = dict(status="ok", reason=None)
        per_gen[gen] = g
        roof = point.roofline_s(gen)
        g["roofline_us"] = roof * 1e6
        try:
            built = impl.build(point, gen, ctx)
            if hasattr(point, "program"):
                built = dataclasses.replace(
                    built, fn=point.program(built.fn), key=built.key + (point.walk_key[-1],)
                )
        except registry.Skip as e:
            g.update(status="skipped", reason=str(e))
            continue
        except Exception as e:  # noqa: BLE001
            g.update(status="error", reason=f"build: {type(e).__name__}: {e}"[:500])
            continue
        g["notes"] = list(built.notes)
        try:
            raw, launches = ctx.walk(
                (built.key, point.walk_key),
                built.fn,
                registry.program_args(built, point.walker_args()),
            )
        except Exception as e:  # noqa: BLE001
            g.update(status="error", reason=f"walk: {type(e).__name__}: {e}"[:500])
            g["traceback"] = traceback.format_exc(limit=3)[-1500:]
            continue
        g["launches"] = [_launch_json(c) for c in launches]
        pallas_s = sum(model.kernel_time_s(c.hbm_bytes, c.flops, c.steps, gen) for c in launches)
        pallas_bytes = sum(c.hbm_bytes for c in launches)
        pallas_flops = sum(c.flops for c in launches)
        g["pallas_steps"] = sum(c.steps for c in launches)
        g["dma_issues"] = sum(c.dma_issues for c in launches)
        g["pallas_us"] = pallas_s * 1e6

        # Compile gate of each Pallas kernel on this generation (Mosaic compiles
        # every pallas_call on its own, so compiling it alone is the same check),
        # and from the same compile, its final schedule, executed.
        g["compiles"] = None
        sched_s = 0.0
        sched_missing = None
        if ctx.do_compile and raw:
            gates = []
            for l, lj in zip(raw, g["launches"]):
                comp, sch, why = ctx.gate_and_schedule(l, gen)
                gates.append(comp)
                if sch is None:
                    sched_missing = sched_missing or why
                else:
                    sched_s += sch.seconds
                    lj["schedule"] = sch.to_json()
            g["kernel_compile_s"] = sum(r.seconds for r in gates)
            g["compiles"] = all(r.ok for r in gates)
            g["compile_error"] = next((r.error for r in gates if not r.ok), None)
            temps = [r.temp_bytes for r in gates if r.temp_bytes is not None]
            g["temp_bytes"] = max(temps) if temps else None
        elif raw:
            sched_missing = "compile disabled"

        # The XLA part: the compiler's analysis of the whole program minus what it
        # attributes to the Pallas custom calls (their declared CostEstimate).
        rest_bytes = rest_flops = 0.0
        have_rest = False
        if ctx.do_compile:
            xgen = gen if ctx.xla_all_generations else ctx.reference_generation
            g["xla_compiled_for"] = xgen
            share = (
                (built.glue_key, point.compile_key, xgen) if built.glue_key and launches else None
            )
            if share is not None and share in ctx.rests:
                rest_flops, rest_bytes, xla = ctx.rests[share]
                have_rest = True
                g.update(xla)
            else:
                comp = ctx.compile(
                    ("program", built.key, point.compile_key),
                    xgen,
                    built.fn,
                    registry.program_args(built, point.compile_args()),
                    want_cycles=True,
                )
                # What the XLA part is charged from; shared with the impls of the same glue.
                xla = dict(
                    xla_estimated_cycles=comp.estimated_cycles,
                    xla_unestimated_copy_bytes=comp.copy_bytes,
                    xla_fusions_us=comp.fusions_us,
                    xla_floored_us=comp.fusions_floored_us,
                )
                g.update(xla)
                g["compiler_flops"] = comp.flops
                g["compiler_bytes"] = comp.bytes_accessed
                if not launches:
                    g["compiles"] = comp.ok if xgen == gen else None
                    g["compile_error"] = comp.error
                    g["temp_bytes"] = comp.temp_bytes
                elif not comp.ok:
                    g["notes"].append(
                        f"whole program did not compile on {xgen}: {comp.error}"[:300]
                    )
                if comp.ok and comp.flops is not None:
                    declared_f = sum(c.declared_flops or 0.0 for c in launches)
                    declared_b = sum(c.declared_bytes or 0.0 for c in launches)
                    rest_flops = max(0.0, comp.flops - declared_f)
                    rest_bytes = max(0.0, (comp.bytes_accessed or 0.0) - declared_b)
                    have_rest = True
                    if not launches:
                        floor = _input_output_bytes(
                            registry.program_args(built, point.compile_args()), built.fn
                        )
                        if rest_bytes < floor:
                            g["notes"].append(
                                f"compiler reported {rest_bytes:.3g} bytes < inputs+outputs "
                                f"{floor:.3g}; using inputs+outputs"
                            )
                            rest_bytes = float(floor)
                    if share is not None:
                        ctx.rests[share] = (
                            rest_flops,
                            rest_bytes,
                            dict(xla, xla_part_from=impl.name),
                        )
        if not launches and not have_rest:
            g.update(
                status="error",
                reason="XLA program: no compiler cost ("
                + ("did not compile" if ctx.do_compile else "compile disabled")
                + ")",
            )
            continue
        xla_s = model.xla_time_s(rest_bytes, rest_flops, gen)
        total = pallas_s + xla_s
        g["xla_us"] = xla_s * 1e6
        # Scheduled: the XLA part is charged its fusions' own final bundles, run
        # (bench.xla_fusions: what XLA keeps in VMEM, how it loops a gather),
        # plus its async copies at copy bandwidth. Where those are missing (dumps
        # off, a fusion too long to run), the compiler's estimated cycles plus the
        # copies it left without one, never less than the cost analysis's
        # roofline (sorts, gathers and scatters carry no estimate).
        same_gen = g.get("xla_compiled_for") == gen
        fus = g.get("xla_fusions_us") if same_gen else None
        est = g.get("xla_estimated_cycles") if same_gen else None
        copies = g.get("xla_unestimated_copy_bytes") if same_gen else None
        charged = (est or 0) / schedule.clock_hz(gen) + (copies or 0) / schedule.copy_bytes_per_s(
            gen
        )
        if charged > XLA_ESTIMATE_LIMIT * max(xla_s, 1e-9):
            # Seen on lax.ragged_dot's masked convolution at 512+ tokens: one
            # fusion estimated at 17e9 cycles (5,600x its dense flops / peak).
            if fus is None:
                g["notes"].append(
                    f"XLA's estimated cycles ({charged * 1e6:,.0f} µs) exceed "
                    f"{XLA_ESTIMATE_LIMIT}x the XLA part's roofline: not used"
                )
            charged = 0.0
        g["xla_estimated_us"] = max(xla_s, charged) * 1e6
        if fus is not None:
            xla_sched_s = fus * 1e-6
            g["xla_charged_by"] = "fusion schedules"
        else:
            xla_sched_s = max(xla_s, charged)
            g["xla_charged_by"] = "estimated cycles / cost analysis"
        g["xla_scheduled_us"] = xla_sched_s * 1e6
        if raw and sched_missing:
            g["scheduled_us"] = None
            g["scheduled_missing"] = sched_missing
        else:
            g["scheduled_us"] = (sched_s + xla_sched_s) * 1e6
            g["pallas_scheduled_us"] = sched_s * 1e6
        g["xla_bytes"] = rest_bytes
        g["xla_flops"] = rest_flops
        g["hbm_bytes"] = pallas_bytes + rest_bytes
        g["issued_flops"] = pallas_flops + rest_flops
        g["modeled_us"] = total * 1e6
        # Variant: every manual HBM DMA the kernel issues costs a step as well
        # (kernels that loop over experts inside one grid step pay per-expert
        # issue/wait/scalar work that the grid-step term does not see).
        g["modeled_us_dma_as_steps"] = (
            total + g["dma_issues"] * model.chip(gen).step_overhead_s
        ) * 1e6
        g["bytes_over_min"] = g["hbm_bytes"] / max(rec["min_bytes"], 1)
        g["flops_over_useful"] = g["issued_flops"] / max(rec["useful_flops"], 1)
        g["roofline_fraction"] = roof / total if total > 0 else None
        g["tokens_per_s"] = point.tokens / total if total > 0 else None
        sch = g["scheduled_us"]
        g["scheduled_over_roofline"] = sch / (roof * 1e6) if sch and roof > 0 else None
        g["scheduled_tokens_per_s"] = point.tokens / (sch * 1e-6) if sch else None
        g["measured_us"] = None
        if ctx.measure and gen == tpu_info.attached_generation():
            try:
                g["measured_us"] = measure_us(
                    built.fn, registry.program_args(built, point.real_args())
                )
            except Exception as e:  # noqa: BLE001
                g["measure_error"] = f"{type(e).__name__}: {e}"[:300]
    return rec


def environment() -> dict:
    import importlib.metadata as md

    def ver(p):
        try:
            return md.version(p)
        except Exception:  # noqa: BLE001
            return None

    return dict(
        jax=ver("jax"),
        jaxlib=ver("jaxlib"),
        libtpu=ver("libtpu"),
        backend=jax.default_backend(),
        python=platform.python_version(),
        host=platform.machine(),
        cpus=os.cpu_count(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        chips={k: dataclasses.asdict(v) for k, v in model.CHIPS.items()},
        measured=on_tpu(),
    )


def run(tasks: Iterable[tuple], ctx: Context, progress: bool = True) -> list[dict]:
    tasks = list(tasks)
    it = tasks
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(tasks), desc="bench", unit="pt", dynamic_ncols=True)
        except ImportError:
            bar = None
    out = []
    for impl, point in it:
        if bar is not None:
            bar.set_postfix_str(
                f"{impl.name} {point.walk_key[0]} {getattr(point, 'tokens', '')}", refresh=False
            )
        out.append(evaluate(impl, point, ctx))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return out
