"""Scheduled TPU time of a Pallas launch: the compiler's own VLIW schedule, run.

Each launch is compiled ahead of time for the target generation with libtpu's
low-level dump on (only the final bundle schedule is written), and that
schedule is executed by `bench.llo` with the launch's real scalar-prefetch
values: every loop runs its real trip count, every bundle costs a cycle, DMA
waits stall until a simple HBM model says the data is there, and a matmul op
waits while its MXU is still busy with earlier ones (`llo.MxuModel`).

    time = (bundles issued + cycles stalled on DMA waits and MXUs) / clock

The clock and the DMA latency are stated assumptions (`CLOCK_HZ`,
`DMA_LATENCY_S`); the bandwidth is the device's. A bundle count is a lower
bound on what the chip does (MXU result latency and bank conflicts beyond the
static schedule are invisible), so this is still optimistic, but far less
than max(bytes / bandwidth, flops / peak): it sees VPU-, store- or EUP-bound
loops, MXU weight pushes, serial scalar work and exposed DMA latency.

libtpu reads its flags once, when it loads: `enable_dumps()` must run before
anything loads libtpu (importing `bench` does it; `import torch_tpu` loads
libtpu, so import bench first).
"""

from __future__ import annotations

import atexit
import base64
import dataclasses
import glob
import gzip
import os
import re
import shutil
import tempfile
import threading

import numpy as np

from . import llo

_LLO_FLAGS = "--xla_jf_dump_llo_text=true --xla_jf_dump_llo_pass_label_regex=final_bundles"


def _libtpu_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libtpu" in f.read()
    except OSError:
        return False


_DIR_ENV = "BENCH_DUMP_DIR"
_TAG_PREFIX = "bench"
_PID_ENV = "BENCH_DUMP_PID"


def dump_dir() -> str | None:
    """The folder the compiler dumps into in this process, if enable_dumps set one."""
    return os.environ.get(_DIR_ENV) or None


def enable_dumps() -> str | None:
    """Points libtpu's schedule dump and XLA's HLO dump at this process's own
    folder (worker processes get their own: they clean up as they read).

    Returns the folder, or None when libtpu was loaded without the flags (then
    no schedule can be read in this process).
    """
    d = os.environ.get(_DIR_ENV)
    mine = os.environ.get(_PID_ENV) == str(os.getpid())
    if d and mine and f"--xla_jf_dump_to={d}/llo" in os.environ.get("LIBTPU_INIT_ARGS", ""):
        return d
    if _libtpu_loaded():
        return None
    d = tempfile.mkdtemp(prefix="bench-dumps-")
    atexit.register(shutil.rmtree, d, True)
    os.environ[_DIR_ENV] = d
    os.environ[_PID_ENV] = str(os.getpid())
    libtpu = re.sub(
        r"--xla_jf_dump_to=\S+|" + re.escape(_LLO_FLAGS), "", os.environ.get("LIBTPU_INIT_ARGS", "")
    )
    xla = re.sub(
        r"--xla_dump_to=\S+|--xla_dump_hlo_as_text|--xla_dump_hlo_module_re=\S+",
        "",
        os.environ.get("XLA_FLAGS", ""),
    )
    os.environ["LIBTPU_INIT_ARGS"] = (
        f"{libtpu.strip()} --xla_jf_dump_to={d}/llo {_LLO_FLAGS}".strip()
    )
    # only the programs bench names (new_tag): not every CPU jit of the process
    os.environ["XLA_FLAGS"] = (
        f"{xla.strip()} --xla_dump_to={d}/xla --xla_dump_hlo_as_text "
        f"--xla_dump_hlo_module_re=.*{_TAG_PREFIX}[0-9]+n[0-9]+.*"
    ).strip()
    return d


class Unavailable(Exception):
    """No schedule can be read in this process (the message says why)."""


_lock = threading.Lock()
_counter = [0]


def new_tag() -> str:
    """A program name no other compile of this process uses (dump files carry it)."""
    with _lock:
        _counter[0] += 1
        return f"{_TAG_PREFIX}{os.getpid()}n{_counter[0]}"


@dataclasses.dataclass
class Dumps:
    hlo: str | None  # XLA's optimized HLO (estimated cycles per fusion)
    bundles: str | None  # the Mosaic kernel's final bundles (one kernel programs)
    # {XLA fusion or Pallas kernel name: its final bundles}, when asked for
    fusions: dict = dataclasses.field(default_factory=dict)


def _read(pattern: str, exclude: str = "") -> str | None:
    files = [f for f in glob.glob(pattern) if not exclude or exclude not in f]
    if not files:
        return None
    with open(max(files, key=os.path.getsize)) as f:
        return f.read()


def collect(tag: str, fusions: bool = False) -> Dumps:
    """What the compiler dumped for program `tag`; the files are removed.

    fusions: also every fusion's (and Pallas kernel's) final bundles. Their
    files carry no program tag, so the folder must hold one program's files:
    compile with `compile_tagged(..., fusions=True)`, which empties it first.
    """
    d = os.environ.get(_DIR_ENV)
    if not d:
        return Dumps(None, None)
    out = Dumps(
        _read(os.path.join(d, "xla", f"*jit_{tag}.*after_optimizations.txt")),
        _read(os.path.join(d, "llo", f"*-{tag}.*final_bundles.txt"), exclude="schedule-analysis"),
        _fusion_texts(d, tag) if fusions else {},
    )
    discard(tag)
    return out


def _fusion_texts(d: str, tag: str) -> dict[str, str]:
    texts = {}
    for path in glob.glob(os.path.join(d, "llo", "*-01-final_bundles.txt")):
        name = os.path.basename(path).split("-", 1)[1].rsplit("-01-final_bundles", 1)[0]
        if not (name.startswith("<") or name == "TLP" or tag in name):  # prologue/epilogue
            with open(path) as f:
                texts[name] = f.read()
    return texts


def compile_tagged(compile_fn, fn, fusions: bool = False):
    """(compile_fn(program), its Dumps): `program` is fn under a fresh tag, so
    that its dump files can be told from other compiles'. A compile error is
    raised after the program's files are removed."""
    if fusions:
        discard("")  # fusion files carry no program tag: one program at a time
    tag = new_tag()

    def program(*a):
        return fn(*a)

    program.__name__ = tag
    # arguments the caller donates (a kernel that updates its input in place)
    program.donate_argnums = getattr(fn, "donate_argnums", ())
    try:
        result = compile_fn(program)
    except Exception:
        discard(tag)
        raise
    return result, collect(tag, fusions)


def discard(tag: str) -> None:
    d = os.environ.get(_DIR_ENV)
    if not d:
        return
    paths = glob.glob(os.path.join(d, "xla", f"*{tag}*")) + glob.glob(os.path.join(d, "llo", "*"))
    for f in paths:
        try:
            if os.path.isdir(f):
                shutil.rmtree(f, ignore_errors=True)
            else:
                os.remove(f)
        except OSError:
            pass


def pack(text: str) -> str:
    return base64.b64encode(gzip.compress(text.encode(), 6)).decode()


def unpack(packed: str) -> str:
    return gzip.decompress(base64.b64decode(packed)).decode()


# Stated assumption (see bench/README.md "Scheduled time"): the time from a
# DMA's last byte to its semaphore, calibrated on tpu-inference #3520
# (bench/calibration.py); kept in torch_bindings.tpu_info with the clock, so
# the kernels' tiling plans against the same figure.
from torch_bindings.tpu_info import DMA_LATENCY_S  # noqa: E402

# DMAs move data at this fraction of the device's HBM bandwidth: the copy
# bandwidth tpu-inference #3520 measured on tpu7x (3.21 TB/s of 3.7), applied
# to every generation (no other generation has a published copy figure).
DMA_BANDWIDTH_FRACTION = 3.21 / 3.7


def clock_hz(generation: str) -> float:
    from torch_bindings import tpu_info

    return tpu_info.facts(generation).clock_hz


@dataclasses.dataclass(frozen=True)
class LaunchSchedule:
    name: str
    generation: str
    seconds: float
    cycles: float
    bundles: int  # issued (executed) bundles
    static_bundles: int  # length of the schedule
    stall_cycles: float  # waiting on DMAs
    dmas: int
    dma_bytes: int
    hot_loops: list  # [{start, body_bundles, iterations, cycles, binding, floor_bundles, slots}]
    unknown_branches: int
    notes: list
    mxu_stall_cycles: float = 0.0  # matmul ops waiting for their MXU
    stopped: bool = False  # the executor's bundle limit cut the run: not a figure

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def final_bundles(fn, args, generation: str) -> str:
    """Compiles fn(*args) (one pallas_call) for `generation`; returns the
    kernel's final bundle schedule."""
    from . import xla_cost

    if enable_dumps() is None:
        raise Unavailable(
            "libtpu was loaded before bench could enable its schedule "
            "dump; import bench before torch_tpu, or run python -m bench"
        )
    res = xla_cost.compile_program(fn, args, generation, want_cycles=False, want_schedule=True)
    if not res.ok:
        raise Unavailable(f"does not compile for {generation}: {res.error}")
    if not res.schedule:
        raise Unavailable("libtpu wrote no schedule for this kernel")
    return unpack(res.schedule)


def operand_values(operands) -> dict:
    """Custom-call operand index -> array, for the concrete integer operands
    (what a kernel can copy into SMEM or read as a scalar)."""
    out = {}
    for i, o in enumerate(operands):
        if not (isinstance(o, (np.ndarray, np.generic)) or hasattr(o, "__array__")):
            continue
        try:
            a = np.asarray(o)
        except Exception:  # noqa: BLE001 - symbolic values have no data
            continue
        if a.dtype.kind in "iub" and a.size <= (1 << 22):
            out[i] = a
    return out


def copy_bytes_per_s(generation: str) -> float:
    from . import model

    return model.chip(generation).hbm_bytes_per_s * DMA_BANDWIDTH_FRACTION


def hbm_model(generation: str) -> llo.HbmModel:
    hz = clock_hz(generation)
    return llo.HbmModel(copy_bytes_per_s(generation) / hz, DMA_LATENCY_S * hz)


def run_schedule(
    text: str,
    operands: dict,
    generation: str,
    name: str = "kernel",
    max_bundles: int = llo.MAX_BUNDLES,
) -> LaunchSchedule:
    res = llo.simulate(text, operands, hbm_model(generation), generation, max_bundles)
    hz = clock_hz(generation)
    static = len(llo.parse(text))
    hot = [
        dict(
            start=l.start,
            body_bundles=l.body_bundles,
            iterations=l.iterations,
            cycles=l.cycles,
            binding=l.binding,
            floor_bundles=round(l.floor_bundles, 1),
            slots=l.slots,
        )
        for l in res.loops[:3]
    ]
    return LaunchSchedule(
        name,
        generation,
        res.cycles / hz,
        res.cycles,
        res.bundles,
        static,
        res.stall_cycles,
        res.dmas,
        res.dma_bytes,
        hot,
        res.unknown_branches,
        res.notes,
        res.mxu_stall_cycles,
        res.stopped,
    )


def schedule_launch(launch, generation: str) -> LaunchSchedule:
    """Scheduled time of one walker `Launch` on `generation`."""
    from . import tracing

    fn, args = tracing.launch_program(launch)
    text = final_bundles(fn, args, generation)
    return run_schedule(text, operand_values(launch.operands), generation, launch.name)
