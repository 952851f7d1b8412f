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

from torch_bindings.aot import DEFAULT_GENERATIONS, tpu_compile, try_tpu_compile

GENERATIONS = DEFAULT_GENERATIONS


def spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def forward_and_grads(layer, *args):
    """layer(*args) and the gradient of its sum w.r.t. every arg, from one
    forward (jax.vjp), as a training step runs it. A forward next to
    jax.grad(loss) holds the forward's launches twice, and where XLA does not
    merge them libtpu compiles both: GPT-OSS's MXFP4 layer on v6e took 43.7
    CPU-s that way, 29.7 this way (2026-12-07), the same launches compiled."""
    out, vjp = jax.vjp(layer, *args)
    return out, vjp(jnp.ones_like(out))


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
# hands its whole matrix to a pool of worker processes (one per spare core) when its
# first test asks, and each test waits for its own point. Points are built
# inside the worker by the test module's `gate_program(point)`, which returns a
# GateProgram. One that names a `covered_by` point is first traced against that
# point's program: if every Pallas launch it makes is one the other compiles
# (same kernel body, blocks, buffering, VMEM and compiler parameters; only the
# sizes it declares as `extents` and the grid may differ), it passes when that
# program compiles; otherwise it is compiled itself. A VMEM buffer of rank 3
# or more may also have a smaller leading dim than the cover's (it is not one
# of the two tiled dims: the same layout in fewer bytes), with the scalar
# literals equal to it (a loop over it) playing the same role; e.g. the dK/dV
# kernel's fused dQ accumulator, one slot per q block of the sequence.

import dataclasses  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Hashable, Sequence  # noqa: E402

import gate_worker  # noqa: E402


@dataclasses.dataclass
class GateProgram:
    """One point's program. extents: the sizes (rows M, sequence length) that
    may differ between this program and its cover: they only set array
    extents in HBM, the grid, scalar constants and scalar-prefetch (SMEM)
    lengths, never a block, a vector shape or a VMEM buffer."""

    fn: Callable[..., Any]
    args: Sequence[jax.ShapeDtypeStruct]
    generation: str
    covered_by: Hashable | None = None  # a point of the same module
    extents: tuple[int, ...] = ()
    # run on the compiled program's optimized HLO text: an error message, or
    # None (a point with a check is compiled, never covered)
    check: Callable[[str], str | None] | None = None


@dataclasses.dataclass(frozen=True)
class PointResult:
    ok: bool
    error: str | None
    cpu_s: float
    wall_s: float
    compiled: bool  # False: covered by another point's program
    covered_by: Hashable | None = None
    note: str | None = None  # why a candidate cover did not cover it


# Scalar integer literals in a jaxpr ("4096:i32[]"), refs ("Ref<smem>{i32[136]}")
# and array types ("bf16[32768,2048]").
_LITERAL = re.compile(r"(?<![\w.\]])(-?\d+):([iu]\d+)\[\]")
_REF = re.compile(r"Ref<(\w+)>\{(\w+)\[([\d, ]*)\]\}")
_ARRAY = re.compile(r"(\w+)\[([\d, ]*)\]")
_LENGTH = re.compile(r"\blength=(\d+)")
_BLOCK_SIZE = re.compile(r"block_size=(\d+)")
_SLOT = "#"  # where a size that may differ stood in a Launch's template


@dataclasses.dataclass(frozen=True)
class Launch:
    """One pallas_call as text, with the sizes that may differ between a
    program and its cover taken out of it (`sizes`, in order).

    Kept in the template, so compared exactly: the kernel body and its vector
    shapes, every VMEM ref (blocks, scratch), block shapes, pipeline modes,
    compiler parameters, dtypes, operand order. Taken out: scalar literals,
    SMEM ref and scalar-prefetch lengths, the grid's extents (any of the
    program's roles may explain them), other HBM array dims (only its extents
    may) and the VMEM limit (the cover's may be smaller).
    """

    template: str
    # (value, kind): kind True: any role may explain it; False: an extent's
    # role only; "le": a VMEM buffer's leading dim, at most the cover's; "ge":
    # the VMEM limit, at least the cover's (what compiles under a smaller
    # limit compiles under a larger one)
    sizes: tuple[tuple[int, bool | str], ...]
    roles: tuple[tuple[str, int], ...]  # name -> value: E0, E0-1, ..., G0, G0-1, ..., V0, ...

    def names(self, value: int, any_role: bool) -> set[str]:
        return {
            n for n, v in self.roles if v == value and (any_role or not n.startswith(("G", "V")))
        }

    def same_kernel(self, other: "Launch") -> bool:
        """True when only sizes differ, each playing the same role in both:
        e.g. 4095 and 32767 where both are the sequence extent minus one."""
        if self.template != other.template:
            return False
        for (a, kind), (b, _) in zip(self.sizes, other.sizes):
            if kind == "le":
                if a > b:
                    return False
            elif kind == "ge":
                if a < b:
                    return False
            elif a != b and not self.names(a, kind) & other.names(b, kind):
                return False
        return True


_VMEM_LIMIT = re.compile(r"\bvmem_limit_bytes=(\d+)")


def _launch(eqn, extents: tuple[int, ...]) -> Launch:
    p = eqn.params
    gm = p["grid_mapping"]
    grid = tuple(int(g) for g in gm.grid)
    roles = []
    for j, e in enumerate(extents):
        roles += [(f"E{j}", e), (f"E{j}-1", e - 1)]
    for i, g in enumerate(grid):
        roles += [(f"G{i}", g), (f"G{i}-1", g - 1)]
    sizes = []

    def slots(dims: str, any_role: bool) -> str:
        out = []
        for d in dims.split(","):
            if d.strip():
                sizes.append((int(d), any_role))
                out.append(_SLOT)
        return ",".join(out)

    vmem_leads = []

    def ref(m):
        space, dtype, dims = m.groups()
        if space in ("smem", "any"):
            dims = slots(dims, space == "smem")
        elif space == "vmem" and dims.count(",") >= 2:  # rank >= 3: an untiled leading dim
            lead, rest = dims.split(",", 1)
            sizes.append((int(lead), "le"))
            vmem_leads.append(int(lead))
            dims = f"{_SLOT},{rest}"
        return f"Ref<{space}>{{{dtype}[{dims}]}}"

    def literal(m):
        sizes.append((int(m.group(1)), True))
        return f"{_SLOT}:{m.group(2)}[]"

    def length(m):  # a scan's trip count (a fori_loop over a static range): a literal
        sizes.append((int(m.group(1)), True))
        return f"length={_SLOT}"

    def vmem_limit(m):  # a cover may compile the launch under a smaller limit
        sizes.append((int(m.group(1)), "ge"))
        return f"vmem_limit_bytes={_SLOT}"

    def jaxpr_text(j) -> str:
        return _LENGTH.sub(length, _LITERAL.sub(literal, _REF.sub(ref, str(j))))

    def block_shape(bm) -> str:
        text = str(bm.block_shape)
        if "Ref<any>" not in str(bm.transformed_block_aval):
            return text
        # a whole array left in HBM (memory_space=ANY): its dims are the array's
        return _BLOCK_SIZE.sub(lambda m: f"block_size={slots(m.group(1), False)}", text)

    def hbm(aval, any_role=False) -> str:
        return _ARRAY.sub(lambda m: f"{m.group(1)}[{slots(m.group(2), any_role)}]", str(aval))

    # Scalar-prefetch operands are copied to SMEM: their lengths count as SMEM's.
    k = gm.num_index_operands
    parts = [
        f"name={p.get('name')}",
        f"kernel={jaxpr_text(p['jaxpr'])}",
        f"grid=({slots(','.join(map(str, grid)), True)})",
        f"compiler_params={_VMEM_LIMIT.sub(vmem_limit, str(p.get('compiler_params')))}",
        f"index_operands={k} in={gm.num_inputs} out={gm.num_outputs}",
        f"index_map_avals={_REF.sub(ref, str(gm.index_map_avals))}",
        f"scratch={_REF.sub(ref, str(gm.scratch_avals))}",
        "operands=" + ";".join(hbm(v.aval, i < k) for i, v in enumerate(eqn.invars)),
        "results=" + ";".join(hbm(a) for a in p["out_avals"]),
    ]
    for bm in gm.block_mappings:
        parts.append(
            "block "
            + " | ".join(
                [
                    block_shape(bm),
                    _REF.sub(ref, str(bm.transformed_block_aval)),
                    hbm(bm.array_aval),
                    f"pipeline_mode={bm.pipeline_mode}",
                    f"index_map={jaxpr_text(bm.index_map_jaxpr)}",
                ]
            )
        )
    roles += [(f"V{k}", v) for k, v in enumerate(vmem_leads)]
    return Launch("\n".join(parts), tuple(sizes), tuple(roles))


def pallas_launches(fn, args, extents: tuple[int, ...] = ()) -> list[Launch]:
    """Every pallas_call `fn(*args)` traces. extents: the program's sizes
    (rows, sequence length) that a cover may have at other values."""
    return [_launch(eqn, tuple(extents)) for eqn in pallas_eqns(fn, args)]


def pallas_eqns(fn, args) -> list:
    """The pallas_call equations `fn(*args)` traces, through nested jaxprs."""
    from jax._src import core as jax_core

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(eqn)
            for v in eqn.params.values():
                for j in v if isinstance(v, (list, tuple)) else (v,):
                    if isinstance(j, jax_core.ClosedJaxpr):
                        walk(j.jaxpr)
                    elif isinstance(j, jax_core.Jaxpr):
                        walk(j)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def uncovered_launches(prog: GateProgram, cover: GateProgram) -> tuple[int, int]:
    """(launches of prog that cover's program does not make, launches of prog)."""
    mine = pallas_launches(prog.fn, prog.args, prog.extents)
    theirs = pallas_launches(cover.fn, cover.args, cover.extents)
    return sum(1 for a in mine if not any(a.same_kernel(b) for b in theirs)), len(mine)


_MODULES: dict[str, Any] = {}


def _run_point(module_file: str, point) -> PointResult:
    import importlib.util

    mod = _MODULES.get(module_file)
    if mod is None:
        spec = importlib.util.spec_from_file_location(f"_gate_{len(_MODULES)}", module_file)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MODULES[module_file] = mod
    c0, t0 = time.process_time(), time.monotonic()

    def done(ok, error, compiled, covered_by=None, note=None):
        cpu, wall = time.process_time() - c0, time.monotonic() - t0
        return PointResult(ok, error, cpu, wall, compiled, covered_by, note)

    try:
        prog = mod.gate_program(point)
        note = None
        if prog.covered_by is not None:
            missing, total = uncovered_launches(prog, mod.gate_program(prog.covered_by))
            if total and not missing:
                return done(True, None, False, prog.covered_by)
            note = f"not covered by {prog.covered_by}: {missing} of {total} launches differ"
        if prog.check is not None:
            try:
                hlo = tpu_compile(prog.fn, prog.args, prog.generation).as_text()
            except Exception as e:  # noqa: BLE001 - the compiler raises many types
                return done(False, f"{type(e).__name__}: {e}"[:2000], True)
            problem = prog.check(hlo)
            return done(problem is None, problem, True)
        res = try_tpu_compile(prog.fn, prog.args, prog.generation)
        return done(res.ok, res.error, True, None, note)
    except Exception as e:  # noqa: BLE001 - tiling raises before any compile
        return done(False, f"{type(e).__name__}: {e}"[:2000], False)


def _run_claimed(claim_path: str, module_file: str, point) -> PointResult | None:
    """_run_point, in the pool that claims the point first; None in the others."""
    try:
        os.close(os.open(claim_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return None
    return _run_point(module_file, point)


class CompilePool:
    """Compiles (module_file, point) pairs in worker processes, in the given order.

    workers: GATE_WORKERS, else one per CPU core but one (at least one, at most
    4): the numeric tests in the main process are the suite's longest serial
    chain, and a third process on a 2-core machine starved it (34 min with two
    workers; the gate itself needs about 25 CPU-minutes).

    share: under pytest-xdist every test process collects the whole matrix,
    and a pool per process compiled all of it (each process's, twice the
    gate's CPU). With a `Share`, the test processes' pools work through one
    queue: each pool is handed the whole matrix in the collected order, and
    its worker claims a point (a file created once, in the share's folder)
    before compiling it, skipping points another pool claimed. Every result
    goes to that folder, where a gate test waits for its point. A fixed
    split (every other point to each process) had left one pool with 1.4
    CPU-minutes more than the other, a core idle at the end of the suite.
    """

    def __init__(
        self,
        keyed_points: Sequence[tuple[str, Any]],
        workers: int | None = None,
        share: "Share | None" = None,
    ):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        n = (
            workers
            or int(os.environ.get("GATE_WORKERS", 0))
            or max(1, min(4, (os.cpu_count() or 1) - 1))
        )
        self.started = time.monotonic()
        self.pool = ProcessPoolExecutor(
            n,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=gate_worker.init,
            initargs=(gate_worker.env_without_dumps(), list(sys.path)),
        )
        self.futures = {}
        self.workers = n
        self.share = share
        self.add(keyed_points)

    def add(self, keyed_points) -> None:
        for key in keyed_points:
            if key in self.futures:
                continue
            if self.share is None:
                fut = self.pool.submit(_run_point, *key)
            else:
                fut = self.pool.submit(_run_claimed, self.share.claim_path(key), *key)
                fut.add_done_callback(lambda f, key=key: self.share.put(key, f))
            self.futures[key] = fut

    def _done(self) -> dict[tuple[str, Any], PointResult]:
        """This pool's finished points (not those another pool claimed)."""
        return {
            key: f.result()
            for key, f in self.futures.items()
            if f.done() and not f.cancelled() and f.exception() is None and f.result()
        }

    def result(self, module_file: str, point) -> PointResult:
        key = (str(module_file), point)
        self.add([key])  # a point outside the collected matrix joins the queue
        if self.share is not None:
            return self.share.get(key)
        return self.futures[key].result()

    def assert_ok(self, module_file: str, point) -> PointResult:
        r = self.result(module_file, point)
        if not r.ok:
            pytest.fail(f"TPU compile gate failed for {point}: {r.error}")
        if r.covered_by is not None:
            c = self.result(module_file, r.covered_by)
            if not (c.ok and c.compiled):
                pytest.fail(
                    f"TPU compile gate: {point} is covered by {r.covered_by}, which did not "
                    f"compile: {c.error}"
                )
        return r

    def summary(self) -> str:
        done = list(self._done().values())
        compiled = [r for r in done if r.compiled]
        missed = sum(1 for r in compiled if r.note)
        return (
            f"{len(done)} points: {len(compiled)} programs compiled "
            f"({missed} of them after a candidate cover differed), "
            f"{sum(1 for r in done if r.covered_by is not None)} checked as covered; "
            f"{sum(r.cpu_s for r in done) / 60:.1f} min CPU in {self.workers} worker "
            f"processes, pool open {(time.monotonic() - self.started) / 60:.1f} min"
        )

    def report(self, path: str) -> None:
        """Appends every finished point's result as JSON lines (GATE_REPORT=path;
        remove the file before a run): under xdist each test process's pool
        adds the points it compiled, at the end of that process's session."""
        import json

        with open(path, "a") as f:
            for (module_file, point), r in self._done().items():
                row = dict(module=os.path.basename(module_file), point=list(point))
                f.write(json.dumps({**row, **dataclasses.asdict(r)}) + "\n")

    def close(self) -> None:
        # A shared part is finished even when this process needs no more of
        # it: another process's gate tests may be waiting for it.
        self.pool.shutdown(wait=True, cancel_futures=self.share is None)


class Share:
    """The folder where the test processes' pools claim gate points (first
    come, first compiled) and leave each result for all of them."""

    WAIT_S = 3600.0

    def __init__(self, folder: str):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)

    def _path(self, key) -> str:
        import hashlib

        return os.path.join(self.folder, hashlib.sha256(repr(key).encode()).hexdigest())

    def claim_path(self, key) -> str:
        return self._path(key) + ".claim"

    def put(self, key, fut) -> None:
        import pickle

        if fut.cancelled() or fut.exception() is not None:
            r = PointResult(False, f"gate worker: {fut.exception()!r}", 0.0, 0.0, False)
        else:
            r = fut.result()
            if r is None:  # another pool claimed it and writes its result
                return
        tmp = self._path(key) + f".{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(r, f)
        os.replace(tmp, self._path(key))

    def get(self, key) -> PointResult:
        import pickle

        path, t0 = self._path(key), time.monotonic()
        while not os.path.exists(path):
            if time.monotonic() - t0 > self.WAIT_S:
                return PointResult(
                    False, f"no result for {key} in {self.WAIT_S:.0f} s", 0.0, 0.0, False
                )
            time.sleep(0.5)
        with open(path, "rb") as f:
            return pickle.load(f)


# One pool per session, started by conftest.py as soon as collection ends, so
# the gate compiles on the spare cores while the numeric tests still run; the gate
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


def start_session_pool(items, share: Share | None = None) -> None:
    global _SESSION_POOL
    keyed = []
    for item in gate_items(items):
        key = (str(item.module.__file__), item.callspec.params["point"])
        if key not in keyed:
            keyed.append(key)
    if keyed and _SESSION_POOL is None:
        _SESSION_POOL = CompilePool(keyed, share=share)


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
    if os.environ.get("GATE_REPORT"):
        _SESSION_POOL.report(os.environ["GATE_REPORT"])
    _SESSION_POOL.close()
    _SESSION_POOL = None
    return summary
