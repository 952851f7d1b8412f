"""Test session setup: the source tree importable as the built kernels are, JAX on the CPU."""

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Interpret-mode tests are mostly XLA:CPU compiles of small programs, and
# LLVM's optimisation is most of a compile: at level 0 a flash attention case
# costs about half the CPU time, with the same HLO (the numerics under test).
# libtpu writes the same LLO with or without it (the TPU compiles are checked
# for what the chip would run). Set before any backend starts.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

ROOT = Path(__file__).resolve().parent.parent


def _check_import_path():
    """scripts/env.sh puts this checkout's root and kernel folders on PYTHONPATH; a
    session started without it, or with another checkout's, would test other files."""
    import importlib.util

    import pytest

    names = ["bench", "torch_bindings"] + [
        p.name for p in sorted((ROOT / "kernels").glob("*/*")) if (p / "__init__.py").is_file()
    ]
    for name in names:
        spec = importlib.util.find_spec(name)
        origin = os.path.realpath(getattr(spec, "origin", None) or "/nowhere")
        if not origin.startswith(str(ROOT) + os.sep):
            raise pytest.UsageError(
                f"`{name}` imports from {origin}, not from {ROOT}: source {ROOT}/scripts/env.sh"
            )


_check_import_path()
# tests/ holds shared test helpers (gate.py), appended so that none of its folders
# (tests/bench) shadows a package; test modules are imported by path
# (--import-mode=importlib), so same-named files in kernel folders coexist.
if str(ROOT / "tests") not in sys.path:
    sys.path.append(str(ROOT / "tests"))

# bench's scheduled-time tests read the TPU compiler's dumps, which libtpu
# only writes when the flags are set before it loads (any test importing
# torch_tpu loads it): switch them on first, whatever the collection order.
import bench  # noqa: E402,F401


def _start_cpu_backend_with(flags: str) -> None:
    """Starts XLA:CPU with `flags` added to XLA_FLAGS, then takes them out again.

    Each XLA in the process reads XLA_FLAGS once, when it starts: XLA:CPU here,
    libtpu when a test first loads it, and libtpu stops the process at a flag
    it does not know (an XLA:CPU one). So XLA:CPU starts now, with them, and
    libtpu later reads the flags as they were (bench's dump flags included).
    """
    before = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{before} {flags}".strip()
    try:
        import jax

        jax.jit(lambda x: x + 1)(0)
    finally:
        os.environ["XLA_FLAGS"] = before


# XLA:CPU's MLIR fusion emitters were most of an interpret-mode kernel's
# compile: with the older emitters a gmm edge case's program compiles in 0.3 s,
# not 1.5 s, and test_gmm.py took 94 CPU-seconds, not 153 (2026-12-06). Same
# HLO (the numerics under test), code emitted by another path.
_start_cpu_backend_with("--xla_cpu_use_fusion_emitters=false")

from hypothesis import Phase, settings  # noqa: E402

# Interpret mode is slow: few, deterministic examples, no deadline.
settings.register_profile("ci", deadline=None, derandomize=True, max_examples=12, print_blob=True)
# scripts/mutants.py: the same examples, but a failure ends the test at once
# (no shrinking, no example database): it only needs to know that one fails.
settings.register_profile(
    "mutants",
    parent=settings.get_profile("ci"),
    database=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs when the process nears its memory-map limit.

    Every XLA:CPU executable keeps about three memory maps of JIT code until it is
    freed, and interpret-mode tests compile thousands: one session reached
    Linux's per-process limit (vm.max_map_count, 65530) about a third of the way
    through the suite and LLVM segfaulted mapping the next program. Past
    CLEAR_AT of the limit, the caches are cleared after the module (not after
    every module: later modules reuse some programs). A module that takes the
    process past FAIL_AT fails here, before a bigger one can crash the session.
    """
    yield
    jax = sys.modules.get("jax")
    if jax is None:
        return
    held, limit = _memory_maps(), _max_map_count()
    if held is not None and limit and held <= CLEAR_AT * limit:
        return
    import gc

    jax.clear_caches()
    gc.collect()
    if held is not None and limit and held > FAIL_AT * limit:
        pytest.fail(
            f"the process held {held} memory maps after this module (the limit is {limit};"
            f" {_memory_maps()} after clearing JAX's caches): split the module or clear"
            " within it"
        )


CLEAR_AT, FAIL_AT = 0.3, 0.6


def _memory_maps() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


def _max_map_count() -> int | None:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="session")
def published(tmp_path_factory):
    """Every Hub kernel built once by publish.py: {hub name: repo dir}."""
    import subprocess
    import tomllib

    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "publish.py"), "build", "--out", str(out)],
        check=True,
        capture_output=True,
    )
    lib = tomllib.loads((ROOT / "build.toml").read_text())["library"]
    repos = {}
    for folder in lib["kernels"]:
        name = tomllib.loads((ROOT / "kernels" / folder / "build.toml").read_text())["general"][
            "name"
        ]
        repos[name] = out / name
    return repos


# -- TPU compile gate: whole matrices on the spare cores -------------------------------
# The gate modules' matrix points (tests/gate.py) compile in worker processes
# started right after collection, while the numeric tests run; the gate tests
# themselves run last and mostly just collect results.


def pytest_collection_modifyitems(session, config, items):
    import gate

    last = {id(i) for i in gate.gate_items(items)}
    modules = {i.module for i in items if id(i) in last}
    tail = [i for i in items if i.module in modules]
    items[:] = [i for i in items if i.module not in modules] + tail


def pytest_configure(config):
    """Under pytest-xdist the controller names a folder where the test
    processes share the gate's results (tests/gate.py: Share)."""
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        import tempfile

        config.gate_share = tempfile.mkdtemp(prefix="pytest-gate-")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["gate_share"] = node.config.gate_share


def pytest_unconfigure(config):
    folder = getattr(config, "gate_share", None)
    if folder:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_finish(session):
    import gate

    if session.config.option.collectonly:
        return
    share = None
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is not None:
        share = gate.Share(workerinput["gate_share"])
    gate.start_session_pool(session.items, share)


def pytest_sessionfinish(session):
    # Here, not in pytest_terminal_summary: xdist's test processes have no
    # terminal summary, so their pools' results never reached GATE_REPORT.
    import gate

    session.config.gate_summary = gate.close_session_pool()


def pytest_terminal_summary(terminalreporter):
    summary = getattr(terminalreporter.config, "gate_summary", None)
    if summary:
        terminalreporter.write_line(f"TPU compile gate: {summary}")
