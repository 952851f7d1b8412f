"""Which implementation a host (CPU) tensor runs, and which TPU generation we target.

CPU tensors run the same JAX function as the TPU: the Pallas kernel in
interpret mode (default: what is tested is what ships), or, for users who just
want speed on a CPU, the XLA reference. Select with the environment variable
`TPU_KERNELS_CPU_IMPL=interpret|reference` or, scoped, with
`torch_bindings.cpu_impl("reference")`.
"""

from __future__ import annotations

import contextlib
import functools
import os

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


def generation_of_kind(device_kind: str) -> str:
    """Our generation name for a JAX TPU `device_kind` ("TPU v5 lite", "TPU v6 lite", "TPU7x", ...).

    An unknown TPU maps to tpu7x, whose VMEM (64 MiB) is the smallest any
    table plans for: the safe choice.
    """
    kind = device_kind.lower().replace(" ", "")
    if "v5lite" in kind or "v5e" in kind:
        return "v5e"
    if "v6" in kind:
        return "v6e"
    if "v5p" in kind or kind.endswith("v5"):
        return "v5p"
    return "tpu7x"


@functools.lru_cache(maxsize=1)
def detected_generation() -> str:
    """The TPU generation block-size tables are chosen for.

    `TPU_KERNELS_GENERATION` wins; then an attached TPU's device kind; else v6e
    (the tables for every generation are compile-checked in CI).
    """
    env = os.environ.get("TPU_KERNELS_GENERATION")
    if env:
        return env
    try:
        import jax

        devs = [d for d in jax.devices() if d.platform == "tpu"]
    except Exception:  # noqa: BLE001 - no TPU backend on this host
        devs = []
    return generation_of_kind(devs[0].device_kind) if devs else "v6e"
