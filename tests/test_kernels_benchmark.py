"""`kernels benchmark` (kernels 0.17.2's CLI, the Hub's standard timing) on every built kernel repo.

The CLI runs each `benchmarks/benchmark*.py` workload, compares the kernel's
output with the workload's `verify_*` reference (atol 1e-2) and exits non-zero
when one does not match. On a TPU host the workloads must run on the TPU
(kernels detects no `tpu` backend and hands them "cpu") and wait for it.
"""

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

NAMES = ["rmsnorm-tpu", "ragged-dot-tpu", "flash-attention-tpu"]
KERNELS_CLI = Path(sys.executable).with_name("kernels")


def _workloads(script: Path) -> set[str]:
    """`Class.workload` for every benchmark_* method of every class in the script."""
    tree = ast.parse(script.read_text())
    return {
        f"{c.name}.{f.name.removeprefix('benchmark_')}"
        for c in tree.body
        if isinstance(c, ast.ClassDef)
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name.startswith("benchmark_")
    }


@pytest.mark.parametrize("name", NAMES)
def test_kernels_benchmark_runs_and_verifies(name, published, tmp_path):
    repo = published[name]
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_KERNELS", "PYTHONPATH")}
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run(
        [
            str(KERNELS_CLI),
            "benchmark",
            str(repo),
            "--iterations",
            "1",
            "--warmup",
            "0",
            "--output",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    want = _workloads(repo / "benchmarks" / "benchmark.py")
    assert len(want) >= 1
    assert {r["workload"] for r in results} == want
    # Every workload has a reference and matched it (None would mean "no verify_*").
    assert all(r.get("verified") is True for r in results), results
    assert (
        "Running" in proc.stderr and "on cpu" in proc.stderr
    )  # no TPU here: the CPU path is timed


def _load_script(repo: Path):
    path = repo / "benchmarks" / "benchmark.py"
    spec = importlib.util.spec_from_file_location(f"bench_{repo.name.replace('-', '_')}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _benchmark_class(mod):
    from kernels.benchmark import Benchmark

    classes = [
        v
        for v in vars(mod).values()
        if isinstance(v, type) and issubclass(v, Benchmark) and v.__module__ == mod.__name__
    ]
    assert len(classes) == 1, classes  # the mixin is not collected as a benchmark
    return classes[0]


class _EchoKernel:
    """Stands in for the kernel: returns one of its inputs, so only the workload's own code runs."""

    def __getattr__(self, name):
        def fn(*args, **kwargs):
            first = args[0]
            return (first, first) if name == "fused_add_rms_norm" else first

        return fn


@pytest.mark.parametrize("name", NAMES)
def test_benchmark_uses_the_tpu_when_attached_and_waits_for_it(name, published, monkeypatch):
    mod = _load_script(published[name])
    cls = _benchmark_class(mod)
    waits = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: waits.append(1))

    # What kernels' runner does: instance.device = <device of the detected backend> ("cpu" on TPU hosts).
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: None
    )
    inst = cls()
    inst.device = "cpu"
    assert inst.device == "cpu"
    monkeypatch.setattr(
        torch.accelerator,
        "current_accelerator",
        lambda check_available=False: SimpleNamespace(type="tpu"),
    )
    inst.device = "cpu"
    assert inst.device == "tpu"

    # Each timed call waits for the TPU (tensors stay on the host: there is no TPU here).
    workloads = sorted(
        w.split(".", 1)[1] for w in _workloads(published[name] / "benchmarks" / "benchmark.py")
    )
    for w in workloads:
        inst = cls()
        inst.device = "cpu"
        inst._device = "cpu"
        getattr(inst, f"setup_{w}")()
        inst._device = "tpu"
        inst.kernel = _EchoKernel()
        before = len(waits)
        getattr(inst, f"benchmark_{w}")()
        assert len(waits) == before + 1, w
    # On the host nothing is synchronised.
    mod.sync("cpu")
    assert len(waits) == len(workloads)


def test_rmsnorm_reference_accepts_only_correct_roundings(published):
    mod = _load_script(published["rmsnorm-tpu"])
    bf = torch.bfloat16
    up, down = torch.tensor(2.59375), torch.tensor(2.578125)  # neighbouring bf16 values
    mid = (up + down) / 2
    # f32 reference a hair from the midpoint: either neighbour is a correct rounding.
    ref32 = torch.tensor([mid + 1e-6, mid - 1e-6, 2.5850])
    for kernel_pick in (up, down):
        out = torch.stack([kernel_pick, kernel_pick, down]).to(bf)
        got = mod._round_like_kernel(ref32, out, 2.0**-18)
        assert torch.equal(got, out)
    # Far from a midpoint only the correct rounding is accepted: a one-step error is not.
    out = torch.stack([up, up, up]).to(bf)
    got = mod._round_like_kernel(ref32, out, 2.0**-18)
    assert got[2] == down.to(bf) and got[2] != out[2]
    # A reference that is itself off is not rescued: beyond rel_err from the midpoint, the
    # reference's own rounding is returned whatever the kernel says.
    ref32 = torch.tensor([mid + 1e-4])
    assert mod._round_like_kernel(ref32, down.reshape(1).to(bf), 2.0**-18) == up.to(bf)


def test_ragged_dot_reference_accepts_only_correct_roundings(published):
    mod = _load_script(published["ragged-dot-tpu"])
    bf = torch.bfloat16
    up, down = torch.tensor(2.59375), torch.tensor(2.578125)
    mid = (up + down) / 2
    ref32 = torch.tensor([mid + 1e-6, 2.5850])
    err = torch.full_like(ref32, 1e-5)
    assert torch.equal(
        mod._round_like_kernel(ref32, torch.stack([down, down]).to(bf), err),
        torch.stack([down, down]).to(bf),
    )
    got = mod._round_like_kernel(ref32, torch.stack([up, up]).to(bf), err)
    assert got[0] == up.to(bf) and got[1] == down.to(bf)
