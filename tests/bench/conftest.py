"""Paths and platform for the bench tests when run on their own (the repo's
tests/conftest.py, when present, does the same)."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
_KERNELS = os.path.join(_ROOT, "kernels")
for _d in sorted(os.listdir(_KERNELS)):
    if os.path.isdir(os.path.join(_KERNELS, _d)) and os.path.join(_KERNELS, _d) not in sys.path:
        sys.path.append(os.path.join(_KERNELS, _d))

# The scheduled-time tests read the TPU compiler's dumps, which must be
# switched on before libtpu loads (torch_tpu loads it on import).
import bench  # noqa: E402,F401
