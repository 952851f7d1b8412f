# Sourced by the scripts: project venv on PATH, and JAX kept off a TPU that is not there.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
export PATH="$VENV/bin:$PATH"
# This checkout's root (bench, torch_bindings) and kernel folders (one package each) come
# first on the import path. Computed here rather than written into the venv (a .pth) so that
# worktrees sharing one .venv, and scripts/mutants.py's copies, each import their own files,
# and a subprocess that must not see the source tree (tests/test_hub.py) drops one variable.
# ROOT/kernels has no __init__.py: as a namespace folder it cannot shadow HF's `kernels`.
_paths="$ROOT"
for _d in "$ROOT"/kernels/*/; do _paths="$_paths:${_d%/}"; done
export PYTHONPATH="$_paths${PYTHONPATH:+:$PYTHONPATH}"
unset _paths _d
# libtpu is installed; without a TPU, JAX would try (and fail) to open one.
if ! ls /dev/accel* /dev/vfio/[0-9]* >/dev/null 2>&1; then
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
  # Nor is there a TPU VM metadata server to ask for the topology: without this,
  # torch_tpu's first backward was seen retrying that query for over 10 minutes.
  export TPU_SKIP_MDS_QUERY="${TPU_SKIP_MDS_QUERY:-1}"
fi
# Tests and helpers start several processes that load libtpu (compile gate, subprocess loads).
export ALLOW_MULTIPLE_LIBTPU_LOAD="${ALLOW_MULTIPLE_LIBTPU_LOAD:-1}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore:<TorchTpu/Performance/TcMalloc/}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
