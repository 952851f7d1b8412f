"""The published artifact: publish.py build output, loading through `kernels`, upload plan."""

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PUBLISH = [sys.executable, str(ROOT / "scripts" / "publish.py")]
REPO = "tpu-kernels/rmsnorm-tpu"


def _clean_env(source_tree=False, **extra):
    """The environment without scripts/env.sh's import paths, unless `source_tree`
    (publish.py imports torch_bindings; a loaded kernel must not see the tree)."""
    env = {k: v for k, v in os.environ.items() if source_tree or k != "PYTHONPATH"}
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [*PUBLISH, "build", "--out", str(out), "--kernel", "rmsnorm"], check=True, cwd=ROOT
    )
    return out


def test_kernels_folder_does_not_shadow_hf_kernels():
    # With the checkout both as the working directory and on scripts/env.sh's PYTHONPATH.
    assert str(ROOT) in os.environ.get("PYTHONPATH", "").split(os.pathsep)
    out = subprocess.run(
        [sys.executable, "-c", "import kernels; kernels.get_kernel; print(kernels.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert out.returncode == 0, out.stderr
    assert "site-packages" in out.stdout
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_build_layout_and_metadata(dist):
    repo = dist / "rmsnorm-tpu"
    assert (repo / "README.md").read_text().count(REPO) >= 2
    assert (repo / "benchmarks" / "benchmark.py").is_file()
    ids = set()
    for variant, backend in (("torch-tpu", "tpu"), ("torch-cpu", "cpu")):
        vdir = repo / "build" / variant
        meta = json.loads((vdir / "metadata.json").read_text())
        assert meta["name"] == "rmsnorm-tpu" and meta["version"] == 1
        assert meta["backend"] == {"type": backend}
        assert meta["python-depends"] == []
        assert meta["id"].startswith("_rmsnorm_tpu_")
        ids.add(meta["id"])
        # Digest covers every file but metadata.json, standard base64 of sha256.
        files = sorted(
            p.relative_to(vdir).as_posix()
            for p in vdir.rglob("*")
            if p.is_file() and p.name != "metadata.json" and "__pycache__" not in p.parts
        )
        assert sorted(meta["digest"]["files"]) == files
        for rel, digest in meta["digest"]["files"].items():
            want = base64.b64encode(hashlib.sha256((vdir / rel).read_bytes()).digest()).decode()
            assert digest == want, rel
        # Self-contained: the bindings are vendored, no symlinks.
        assert (vdir / "rmsnorm_tpu" / "_torch_bindings" / "op.py").is_file()
        assert not any(p.is_symlink() for p in vdir.rglob("*"))
    assert len(ids) == 1  # identical code in both variants


def test_build_is_byte_identical(dist, tmp_path):
    subprocess.run(
        [*PUBLISH, "build", "--out", str(tmp_path), "--kernel", "rmsnorm"], check=True, cwd=ROOT
    )
    a = {
        p.relative_to(dist).as_posix(): p.read_bytes()
        for p in (dist / "rmsnorm-tpu").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    b = {
        p.relative_to(tmp_path).as_posix(): p.read_bytes()
        for p in (tmp_path / "rmsnorm-tpu").rglob("*")
        if p.is_file()
    }
    assert a == b


LOAD_SCRIPT = r"""
import sys, json, torch
from pathlib import Path
from kernels import get_kernel, get_local_kernel
root = sys.argv[2]  # the checkout; its .venv (site-packages) may lie inside it
src = [p for p in sys.path if p.rstrip('/') == root or p.startswith(root + '/kernels') or 'kernels/rmsnorm' in p]
assert not src, sys.path
k = get_kernel("tpu-kernels/rmsnorm-tpu", version=1)
x = torch.randn(3, 5, 200)
w = torch.randn(200)
y = k.rms_norm(x, w, 1e-6)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
err = (y - ref).abs().max().item()
v = get_local_kernel(Path(sys.argv[1]) / "build" / "torch-tpu")
print(json.dumps({"name": k.__name__, "file": k.__file__, "err": err, "all": sorted(k.__all__),
                  "layers": sorted(dir(k.layers)), "local": v.__name__}))
"""


def test_get_kernel_loads_built_artifact_without_repo_code(dist, tmp_path):
    repo = dist / "rmsnorm-tpu"
    out = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(repo), str(ROOT)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_clean_env(LOCAL_KERNELS=f"{REPO}={repo}"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["file"].startswith(str(repo / "build"))
    assert info["err"] < 1e-4
    assert info["all"] == ["fused_add_rms_norm", "layers", "rms_norm"]
    assert "RMSNorm" in info["layers"]
    assert info["name"].startswith("_rmsnorm_tpu_") and info["local"] == info["name"]


TWO_BUILDS = r"""
import sys, torch
from pathlib import Path
from kernels import get_local_kernel
a = get_local_kernel(Path(sys.argv[1]) / "build" / "torch-cpu")
b = get_local_kernel(Path(sys.argv[2]) / "build" / "torch-cpu")
assert a.__name__ != b.__name__, (a.__name__, b.__name__)
assert a.LIB.namespace != b.LIB.namespace
x, w = torch.randn(2, 64), torch.randn(64)
torch.testing.assert_close(a.rms_norm(x, w), b.rms_norm(x, w))
assert b.MARKER == "second build"
print("ok")
"""


def test_two_builds_with_different_sources_load_side_by_side(dist, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "dist", "results", "__pycache__", "tests", "bench"
        ),
    )
    init = src / "kernels" / "rmsnorm" / "rmsnorm_tpu" / "__init__.py"
    init.write_text(init.read_text() + '\nMARKER = "second build"\n')
    out2 = tmp_path / "dist2"
    subprocess.run(
        [
            sys.executable,
            str(src / "scripts" / "publish.py"),
            "build",
            "--out",
            str(out2),
            "--kernel",
            "rmsnorm",
        ],
        check=True,
        cwd=src,
    )
    out = subprocess.run(
        [sys.executable, "-c", TWO_BUILDS, str(dist / "rmsnorm-tpu"), str(out2 / "rmsnorm-tpu")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_clean_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_upload_dry_run_prints_plan_without_network(tmp_path):
    out = subprocess.run(
        [
            *PUBLISH,
            "upload",
            "--org",
            "someone",
            "--kernel",
            "rmsnorm",
            "--dry-run",
            "--allow-dirty",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_clean_env(True, HF_HUB_OFFLINE="1", HF_TOKEN="hf_secret_do_not_print"),
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    kinds = [l.split()[1] for l in lines if l.startswith("[dry-run]")]
    assert kinds == [
        "create_repo",
        "upload_card",
        "create_branch",
        "upload_build",
        "delete_stale",
        "verify",
    ]
    assert all("someone/rmsnorm-tpu" in l for l in lines if l.startswith("[dry-run]"))
    assert "branch" not in kinds and "v1:" in out.stdout
    assert "hf_secret_do_not_print" not in out.stdout + out.stderr


def test_upload_refuses_dirty_tree(tmp_path):
    probe = ROOT / "kernels" / "rmsnorm" / "dirty_probe.tmp"
    probe.write_text("x")
    try:
        out = subprocess.run(
            [*PUBLISH, "upload", "--dry-run", "--out", str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=_clean_env(True),
        )
    finally:
        probe.unlink()
    assert out.returncode != 0
    assert "dirty git tree" in out.stderr
