"""Scheduled TPU time of a Pallas launch: the compiler's own VLIW schedule, run.

Each launch is compiled ahead of time for the target generation with libtpu's
low-level dump on (only the final bundle schedule is written), and that
schedule is executed by `bench.llo` with the launch's real scalar-prefetch
values: every loop runs its real trip count, every bundle costs a cycle, and
DMA waits stall until a simple HBM model says the data is there.

    time = (bundles issued + cycles stalled on DMA waits) / clock

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

import dataclasses
import glob
import os
import re
import tempfile
import threading

import numpy as np

from . import llo

_FLAG_DIR = "--xla_jf_dump_to="
_FLAGS = ("--xla_jf_dump_llo_text=true "
          "--xla_jf_dump_llo_pass_label_regex=final_bundles")


def _libtpu_loaded() -> bool:
  try:
    with open("/proc/self/maps") as f:
      return "libtpu" in f.read()
  except OSError:
    return False


def enable_dumps() -> str | None:
  """Points libtpu's schedule dump at a private folder; returns it.

  Returns None when libtpu is already loaded without the dump flags (then no
  schedule can be read in this process).
  """
  args = os.environ.get("LIBTPU_INIT_ARGS", "")
  m = re.search(re.escape(_FLAG_DIR) + r"(\S+)", args)
  if m:
    return m.group(1)
  if _libtpu_loaded():
    return None
  d = tempfile.mkdtemp(prefix="bench-llo-")
  os.environ["LIBTPU_INIT_ARGS"] = f"{args} {_FLAG_DIR}{d} {_FLAGS}".strip()
  return d


class Unavailable(Exception):
  """No schedule can be read in this process (the message says why)."""


# Stated assumptions (see bench/README.md "Scheduled time"): the TensorCore
# clock is not published; these are the compiler's own peak (cost-analysis
# flops / optimal seconds of a large matmul) divided by the MXU flops per
# cycle. DMA latency: the time from a DMA's last byte to its semaphore,
# calibrated on tpu-inference #3520 (bench/calibration.py).
CLOCK_HZ = {"v5e": 1.5e9, "v6e": 1.75e9, "tpu7x": 1.9e9, "v5p": 1.75e9}
DMA_LATENCY_S = 0.5e-6


def clock_hz(generation: str) -> float:
  return CLOCK_HZ[generation]


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

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


_lock = threading.Lock()
_counter = [0]


def final_bundles(fn, args, generation: str) -> str:
  """Compiles fn(*args) (one pallas_call) for `generation`; returns the
  kernel's final bundle schedule."""
  from torch_bindings.aot import tpu_compile

  d = enable_dumps()
  if d is None:
    raise Unavailable("libtpu was loaded before bench could enable its schedule "
                      "dump; import bench before torch_tpu, or run python -m bench")
  with _lock:
    _counter[0] += 1
    tag = f"llo{os.getpid()}x{_counter[0]}"

  def kernel(*a):
    return fn(*a)

  kernel.__name__ = tag
  tpu_compile(kernel, args, generation)
  files = glob.glob(os.path.join(d, f"*-{tag}.*final_bundles.txt"))
  try:
    main = [f for f in files if "schedule-analysis" not in f]
    if not main:
      raise Unavailable(f"libtpu wrote no schedule for {tag} in {d}")
    with open(max(main, key=os.path.getsize)) as f:
      return f.read()
  finally:
    for f in glob.glob(os.path.join(d, f"*-{tag}*")) + glob.glob(os.path.join(d, "*TLP*")) \
        + glob.glob(os.path.join(d, "*<late-*")):
      try:
        os.remove(f)
      except OSError:
        pass


def operand_values(operands) -> dict:
  """Custom-call operand index -> flat ints, for the concrete integer operands
  (what a kernel can read into SMEM)."""
  out = {}
  for i, o in enumerate(operands):
    if isinstance(o, (np.ndarray, np.generic)) or hasattr(o, "__array__"):
      try:
        a = np.asarray(o)
      except Exception:  # noqa: BLE001 - symbolic values have no data
        continue
      if a.dtype.kind in "iub" and a.size <= (1 << 20):
        out[i] = [int(v) for v in a.reshape(-1)]
  return out


def hbm_model(generation: str) -> llo.HbmModel:
  from . import model

  c = model.chip(generation)
  hz = clock_hz(generation)
  return llo.HbmModel(c.hbm_bytes_per_s / hz, DMA_LATENCY_S * hz)


def run_schedule(text: str, operands: dict, generation: str, name: str = "kernel",
                 max_bundles: int = 50_000_000) -> LaunchSchedule:
  res = llo.simulate(text, operands, hbm_model(generation), max_bundles)
  hz = clock_hz(generation)
  static = len(llo.parse(text))
  hot = [dict(start=l.start, body_bundles=l.body_bundles, iterations=l.iterations,
              cycles=l.cycles, binding=l.binding, floor_bundles=round(l.floor_bundles, 1),
              slots=l.slots)
         for l in res.loops[:3]]
  return LaunchSchedule(name, generation, res.cycles / hz, res.cycles, res.bundles, static,
                        res.stall_cycles, res.dmas, res.dma_bytes, hot,
                        res.unknown_branches, res.notes)


def schedule_launch(launch, generation: str) -> LaunchSchedule:
  """Scheduled time of one walker `Launch` on `generation`."""
  from . import walker

  fn, args = walker.launch_program(launch)
  text = final_bundles(fn, args, generation)
  return run_schedule(text, operand_values(launch.operands), generation, launch.name)
