"""AOT TPU compile of a program, cached: compile gate + the compiler's costs.

`torch_bindings.aot.tpu_compile` runs the real Mosaic + XLA TPU compiler for
a generation without the chip. From the executable we keep what the model
needs: whether it compiles (VMEM overflow, layout errors), the temp memory
the compiler reserved, the cost analysis (flops, bytes accessed: for a Pallas
custom call XLA reports the kernel's declared CostEstimate, which the sweep
replaces by the walker's counts) and, as a bonus, the per-fusion
`estimated_cycles` XLA's TPU cost model writes into each fusion's
backend_config (in cycles; converting to time needs the TensorCore clock,
which Google does not publish for these chips, so they are reported raw).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from typing import Any, Callable, Sequence

from torch_bindings.aot import _TRANSIENT  # a failure that is not the program's

from . import schedule


@dataclasses.dataclass(frozen=True)
class Compiled:
    generation: str
    ok: bool
    error: str | None
    temp_bytes: int | None
    flops: float | None
    bytes_accessed: float | None
    estimated_cycles: int | None  # sum over the entry computation's fusions
    seconds: float  # compile wall time on this host
    schedule: str | None = None  # the Mosaic kernel's final bundles, packed
    copy_bytes: int | None = None  # moved by copies/transposes with no estimate
    # The XLA fusions' own final bundles, run (bench.xla_fusions), plus XLA's
    # async copies at copy bandwidth; None where the dumps are off or a
    # fusion's run was cut off.
    fusions_us: float | None = None
    fusions_tried: bool = False  # False in records older than the field
    # Of fusions_us, what fusions whose run could not know a value (and may
    # have skipped a loop) were charged as their HBM bytes at copy bandwidth.
    fusions_floored_us: float | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
# XLA writes INT64_MAX where it has no estimate (e.g. a custom call).
_NO_ESTIMATE = (1 << 63) - 1


def _entry_cycles(hlo_text: str) -> int | None:
    """Sum of the estimated_cycles XLA's TPU cost model wrote into the
    optimized module, over every instruction that carries one.

    They sit on fusions, often inside the computations the entry calls (async
    wrappers, scatter offloads), so the whole module is read, not just ENTRY.
    Sorts, gathers and copies usually carry none: the sweep never charges an
    XLA part less than its roofline.
    """
    found = [int(m) for m in _CYCLES.findall(hlo_text) if int(m) != _NO_ESTIMATE]
    return sum(found) if found else None


_ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_COPY = re.compile(r"^\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]\S* (copy|transpose)\(", re.M)


def array_bytes(dtype: str, dims: str) -> int:
    """Bytes of an HLO array from its text: dtype name and "d0,d1,..." dims."""
    n = 1
    for d in dims.split(","):
        if d:
            n *= int(d)
    return n * _ITEMSIZE.get(dtype, 4)


def _unestimated_copy_bytes(hlo_text: str) -> int:
    """Bytes read + written by the copies and transposes XLA left without an
    estimate (e.g. relayouts of weights it is given in another layout): time
    the estimated cycles do not include."""
    total = 0
    for m in _COPY.finditer(hlo_text):
        line_end = hlo_text.find("\n", m.end())
        if '"estimated_cycles"' in hlo_text[m.start() : line_end]:
            continue
        total += 2 * array_bytes(m.group(1), m.group(2))
    return total


def compile_program(
    fn: Callable,
    args: Sequence[Any],
    generation: str,
    want_cycles: bool = True,
    want_schedule: bool = False,
) -> Compiled:
    """Compiles fn(*args) (args: ShapeDtypeStructs) for `generation`.

    With the compiler's dumps on (bench.schedule.enable_dumps), also reads the
    XLA program's estimated cycles and its fusions' scheduled time
    (`want_cycles`) and, with `want_schedule`, the final VLIW schedule of its
    Mosaic kernel (gzip + base64, for bench.schedule).
    """
    import time

    from torch_bindings.aot import executable_costs, tpu_compile

    from . import xla_fusions

    t0 = time.perf_counter()
    with_fusions = want_cycles and schedule.dump_dir() is not None
    try:
        exe, dumps = schedule.compile_tagged(
            lambda program: tpu_compile(program, list(args), generation), fn, with_fusions
        )
    except Exception as e:  # noqa: BLE001 - the compiler raises many types
        return Compiled(
            generation,
            False,
            _short_error(f"{type(e).__name__}: {e}"),
            None,
            None,
            None,
            None,
            time.perf_counter() - t0,
        )
    temp, flops, nbytes = executable_costs(exe)
    cycles = _entry_cycles(dumps.hlo) if (want_cycles and dumps.hlo) else None
    copies = _unestimated_copy_bytes(dumps.hlo) if (want_cycles and dumps.hlo) else None
    sched = schedule.pack(dumps.bundles) if (want_schedule and dumps.bundles) else None
    fusions_us = floored_us = None
    if with_fusions and dumps.hlo:
        xs = xla_fusions.schedule_fusions(dumps.fusions, dumps.hlo, generation)
        if not xs.incomplete:
            fusions_us = xs.total_us
            floored_us = sum(f.us for f in xs.fusions if f.floored)
    return Compiled(
        generation,
        True,
        None,
        temp,
        flops,
        nbytes,
        cycles,
        time.perf_counter() - t0,
        sched,
        copies,
        fusions_us,
        bool(with_fusions and dumps.hlo),
        floored_us,
    )


def _short_error(msg: str) -> str:
    # Keep the compiler's one-line reason (e.g. CompileTimeScopedVmemOom).
    for pat in ("CompileTimeScopedVmemOom", "RESOURCE_EXHAUSTED", "ResourceExhausted"):
        i = msg.find(pat)
        if i >= 0:
            return msg[max(0, i - 40) : i + 300].replace("\n", " ")
    return msg[:400].replace("\n", " ")


def _lacks(hit: Compiled, want_cycles: bool, want_schedule: bool) -> bool:
    """A cached record older than what is asked now (it is compiled again)."""
    return bool(
        (want_schedule and not hit.schedule)
        or (want_cycles and not hit.fusions_tried and schedule.dump_dir() is not None)
    )


# Bumped whenever what a cached record holds is computed differently (how the
# XLA part is charged): records of an older instrument are then misses, not
# stale figures. 2: a Pallas kernel with several outputs is no longer also
# charged as an XLA fusion (xla_fusions._CUSTOM_CALL). 3: gathers and scatters
# offloaded to the SparseCore are charged their bytes (xla_fusions.offloaded_bytes).
# 4: each MXU held to its rate (llo.MxuModel), XLA fusions' matmuls included.
INSTRUMENT_VERSION = 4


def source_fingerprint() -> str:
    """Digest of the code that builds what the cache holds: the kernel
    packages, torch_bindings and bench. Cache keys name programs by role
    (an experts layer's XLA routing by its row count), not by their text, so
    the main job's results/ cache served the routing program of an older
    commit after the code changed (2026-12-03: a 512-token layer read 985.5
    instead of 963.9 us). With the digest in every key, any change is a miss."""
    global _FINGERPRINT
    if _FINGERPRINT is None:
        from pathlib import Path

        _FINGERPRINT = code_digest(Path(__file__).resolve().parent.parent)
    return _FINGERPRINT


def code_digest(root) -> str:
    """sha1 (16 hex digits) of the paths and bytes of the kernel packages'
    modules, torch_bindings/ and bench/ under the checkout `root`."""
    import hashlib

    files = [*root.glob("kernels/*/*/*.py"), *root.glob("torch_bindings/*.py")]
    files += root.glob("bench/**/*.py")
    h = hashlib.sha1()
    for f in sorted(set(files)):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


_FINGERPRINT: str | None = None


class CompileCache:
    """(key, generation) -> Compiled, optionally persisted as JSON lines; a
    record is found only by the code (source_fingerprint) and instrument
    (INSTRUMENT_VERSION) that made it."""

    def __init__(self, path: str | None = None, read_also: Sequence[str] = ()):
        """Results are appended to `path`; `read_also` are more files to load
        (other workers' shards)."""
        self.path = path
        self._mem: dict[str, Compiled] = {}
        self._lock = threading.Lock()
        for p in ([path] if path else []) + list(read_also):
            if p and os.path.exists(p):
                self._load(p)

    def _load(self, path: str) -> None:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    self._mem[rec["key"]] = Compiled(**rec["value"])
                except Exception:  # noqa: BLE001 - a torn line is just a miss
                    continue

    def merge_from(self, paths: Sequence[str]) -> None:
        """Folds other cache files into this one (and its file), then removes them."""
        for p in paths:
            if not os.path.exists(p):
                continue
            before = set(self._mem)
            self._load(p)
            if self.path:
                with open(self.path, "a") as f:
                    for k in set(self._mem) - before:
                        f.write(json.dumps({"key": k, "value": self._mem[k].to_json()}) + "\n")
            os.remove(p)

    @staticmethod
    def _k(key, generation) -> str:
        return json.dumps(
            [key, generation, INSTRUMENT_VERSION, source_fingerprint()], sort_keys=True, default=str
        )

    def get(
        self,
        key,
        generation,
        fn: Callable,
        args: Sequence[Any],
        want_cycles: bool = True,
        want_schedule: bool = False,
    ) -> Compiled:
        k = self._k(key, generation)
        with self._lock:
            hit = self._mem.get(k)
        if hit is not None and (hit.ok is False or not _lacks(hit, want_cycles, want_schedule)):
            return hit
        res = compile_program(fn, args, generation, want_cycles, want_schedule)
        if not res.ok and _TRANSIENT in (res.error or ""):
            return res  # not a property of the program: do not remember it
        with self._lock:
            self._mem[k] = res
            if self.path:
                with open(self.path, "a") as f:
                    f.write(json.dumps({"key": k, "value": res.to_json()}) + "\n")
        return res

    def __len__(self):
        return len(self._mem)
