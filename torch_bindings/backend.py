"""Which implementation a host (CPU) tensor runs, and which TPU generation we target.

The generation rule itself (`detected_generation`, `generation_of_kind`) is
defined in `tpu_info` and re-exported here.

CPU tensors run the same JAX function as the TPU: the Pallas kernel in
interpret mode (default: what is tested is what ships), or, for users who just
want speed on a CPU, the XLA reference. Select with the environment variable
`TPU_KERNELS_CPU_IMPL=interpret|reference` or, scoped, with
`torch_bindings.cpu_impl("reference")`.
"""

from __future__ import annotations

import contextlib
import os

# The one generation-detection rule lives with the other TPU facts.
from .tpu_info import detected_generation, generation_of_kind  # noqa: F401

CPU_IMPLS = ("interpret", "reference")
_ENV = "TPU_KERNELS_CPU_IMPL"


def current_cpu_impl() -> str:
    impl = os.environ.get(_ENV, "interpret")
    if impl not in CPU_IMPLS:
        raise ValueError(f"{_ENV}: expected one of {CPU_IMPLS}, got {impl!r}")
    return impl


@contextlib.contextmanager
def cpu_impl(impl: str):
    """Temporarily run host tensors through `impl` ("interpret" or "reference").

    The switch lives in the environment, not in this module: every built
    kernel vendors its own copy of torch_bindings, and all of them must see
    it. It is process-wide (not per thread).
    """
    if impl not in CPU_IMPLS:
        raise ValueError(f"impl: expected one of {CPU_IMPLS}, got {impl!r}")
    prev = os.environ.get(_ENV)
    os.environ[_ENV] = impl
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = prev
