"""TPU benchmark and performance model for this library's kernels.

`python -m bench --help`. Nothing here needs a TPU: kernel time is modeled
from what each Pallas launch does (bench.tracing finds the launches,
bench.grid_walk walks their grids) and from the TPU compiler's own analysis
of the AOT-compiled program (bench.xla_cost); real timings are taken only
when the process runs on a TPU.
"""

import os

# The AOT compile gate loads libtpu without opening a chip; several processes
# (tests, other benches) may do so at once, which libtpu's single-process
# lockfile would otherwise refuse.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# The compiler's schedule and HLO dumps (bench.schedule) must be switched on
# before libtpu loads, so before anything imports torch_tpu.
from . import schedule as _schedule  # noqa: E402

_schedule.enable_dumps()
