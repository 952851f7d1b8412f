"""The TPU compile gate, shared by every kernel's tests.

`assert_compiles` AOT-compiles a JAX function with libtpu for a TPU that is not
attached (real Mosaic and XLA TPU compiler: VMEM overflow and layout errors
fail here); `meta_call` runs a torch op's TorchTPU `jax_op` on meta tensors,
which is `jax.export(..., platforms=["tpu"])`, the Pallas-to-Mosaic lowering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch

from torch_bindings.aot import DEFAULT_GENERATIONS, try_tpu_compile

GENERATIONS = DEFAULT_GENERATIONS


def spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def assert_compiles(fn, args, generation: str):
    result = try_tpu_compile(fn, args, generation)
    if not result.ok:
        pytest.fail(f"TPU compile failed for {generation}: {result.error}")
    return result


def meta_call(jax_op, *args):
    """Calls the TorchTPU jax_op behind `jax_op` (a torch_bindings.JaxOp) on meta tensors."""
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    return jax_op.tpu_op()(*meta)


# -- whole matrices in CI: every point compiled, two at a time ---------------------
#
# Compiling for a TPU is one libtpu compile per program, single-threaded and
# seconds long (Mosaic lowers and allocates every kernel), so a gate module
# hands its whole matrix to a pool of worker processes (one per core) when its
# first test asks, and each test waits for its own point. Points are built
# inside the worker by the test module's `gate_program(point)`, which returns a
# GateProgram; one whose `covered_by` program already contains every Pallas
# launch it makes (the same kernels, bit for bit) is checked for that instead
# of being compiled again.

import dataclasses  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402


@dataclasses.dataclass
class GateProgram:
    fn: Callable[..., Any]
    args: Sequence[jax.ShapeDtypeStruct]
    generation: str
    covered_by: "GateProgram | None" = None


@dataclasses.dataclass(frozen=True)
class PointResult:
    ok: bool
    error: str | None
    cpu_s: float
    wall_s: float
    compiled: bool  # False: covered by another point's program


def pallas_launches(fn, args) -> list[str]:
    """A digest of every pallas_call `fn(*args)` traces (kernel jaxpr, grid, operands)."""
    import hashlib

    from jax._src import core as jax_core

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                p = eqn.params
                text = "|".join(
                    [
                        str(p["jaxpr"]),
                        str(p["grid_mapping"]),
                        str(p.get("compiler_params")),
                        ";".join(str(v.aval) for v in eqn.invars),
                    ]
                )
                found.append(hashlib.sha1(text.encode()).hexdigest())
            for v in eqn.params.values():
                for j in v if isinstance(v, (list, tuple)) else (v,):
                    if isinstance(j, jax_core.ClosedJaxpr):
                        walk(j.jaxpr)
                    elif isinstance(j, jax_core.Jaxpr):
                        walk(j)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


_MODULES: dict[str, Any] = {}


def _init_worker(path: list[str]) -> None:
    for p in path:
        if p not in sys.path:
            sys.path.append(p)


def _run_point(module_file: str, point) -> PointResult:
    import importlib.util

    mod = _MODULES.get(module_file)
    if mod is None:
        spec = importlib.util.spec_from_file_location(f"_gate_{len(_MODULES)}", module_file)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MODULES[module_file] = mod
    c0, t0 = time.process_time(), time.monotonic()
    try:
        prog = mod.gate_program(point)
        if prog.covered_by is not None:
            mine = pallas_launches(prog.fn, prog.args)
            theirs = set(pallas_launches(prog.covered_by.fn, prog.covered_by.args))
            missing = [s for s in mine if s not in theirs]
            ok = bool(mine) and not missing
            err = (
                None
                if ok
                else f"{len(missing)} of {len(mine)} launches not in the covering program"
            )
            return PointResult(ok, err, time.process_time() - c0, time.monotonic() - t0, False)
        res = try_tpu_compile(prog.fn, prog.args, prog.generation)
        return PointResult(res.ok, res.error, time.process_time() - c0, time.monotonic() - t0, True)
    except Exception as e:  # noqa: BLE001 - tiling raises before any compile
        return PointResult(
            False,
            f"{type(e).__name__}: {e}"[:2000],
            time.process_time() - c0,
            time.monotonic() - t0,
            False,
        )


class CompilePool:
    """Compiles (module_file, point) pairs in worker processes, in the given order.

    workers: GATE_WORKERS, else one per CPU core (at most 4).
    """

    def __init__(self, keyed_points: Sequence[tuple[str, Any]], workers: int | None = None):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        n = workers or int(os.environ.get("GATE_WORKERS", 0)) or min(4, os.cpu_count() or 1)
        self.started = time.monotonic()
        self.pool = ProcessPoolExecutor(
            n,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(list(sys.path),),
        )
        self.futures = {}
        self.workers = n
        self.add(keyed_points)

    def add(self, keyed_points) -> None:
        for key in keyed_points:
            if key not in self.futures:
                self.futures[key] = self.pool.submit(_run_point, *key)

    def result(self, module_file: str, point) -> PointResult:
        self.add([(str(module_file), point)])
        return self.futures[(str(module_file), point)].result()

    def assert_ok(self, module_file: str, point) -> PointResult:
        r = self.result(module_file, point)
        if not r.ok:
            pytest.fail(f"TPU compile gate failed for {point}: {r.error}")
        return r

    def summary(self) -> str:
        done = [
            f.result()
            for f in self.futures.values()
            if f.done() and not f.cancelled() and f.exception() is None
        ]
        compiled = [r for r in done if r.compiled]
        return (
            f"{len(done)} points: {len(compiled)} programs compiled, "
            f"{len(done) - len(compiled)} checked as covered; "
            f"{sum(r.cpu_s for r in done) / 60:.1f} min CPU in {self.workers} worker "
            f"processes, pool open {(time.monotonic() - self.started) / 60:.1f} min"
        )

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


# One pool per session, started by conftest.py as soon as collection ends, so
# the gate compiles on every core while the numeric tests still run; the gate
# modules themselves are ordered last.
_SESSION_POOL: CompilePool | None = None


def gate_items(items) -> list:
    return [
        i
        for i in items
        if getattr(i, "callspec", None) is not None
        and "point" in i.callspec.params
        and hasattr(i.module, "gate_program")
    ]


def start_session_pool(items) -> None:
    global _SESSION_POOL
    keyed = []
    for item in gate_items(items):
        key = (str(item.module.__file__), item.callspec.params["point"])
        if key not in keyed:
            keyed.append(key)
    if keyed and _SESSION_POOL is None:
        _SESSION_POOL = CompilePool(keyed)


def session_pool() -> CompilePool:
    global _SESSION_POOL
    if _SESSION_POOL is None:
        _SESSION_POOL = CompilePool([])
    return _SESSION_POOL


def close_session_pool() -> str | None:
    global _SESSION_POOL
    if _SESSION_POOL is None:
        return None
    summary = _SESSION_POOL.summary()
    _SESSION_POOL.close()
    _SESSION_POOL = None
    return summary
