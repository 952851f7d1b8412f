"""Ahead-of-time compilation for TPUs that are not attached.

libtpu compiles for a named topology without the chip, so Mosaic's VMEM and
layout checks run on any host. This is the compile gate tests and bench use.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax

from . import tpu_info

# Generation name -> topology string understood by libtpu (from tpu_info).
TOPOLOGIES = {g: tpu_info.topology(g) for g in tpu_info.GENERATIONS}
DEFAULT_GENERATIONS = tpu_info.DEFAULT_GENERATIONS


@functools.lru_cache(maxsize=None)
def topology_device(generation: str):
    from jax.experimental import topologies

    if generation not in TOPOLOGIES:
        raise ValueError(f"generation: expected one of {sorted(TOPOLOGIES)}, got {generation!r}")
    return topologies.get_topology_desc(TOPOLOGIES[generation], platform="tpu").devices[0]


@dataclasses.dataclass(frozen=True)
class CompileResult:
    generation: str
    ok: bool
    error: str | None
    temp_bytes: int | None  # scoped/temp memory the compiler reserved, if readable
    flops: float | None
    bytes_accessed: float | None


# libtpu guards itself with a lock file: a compile that races another
# process's libtpu start-up fails with this message and succeeds on retry.
_TRANSIENT = "libtpu multi-process"
_RETRIES = 8


def tpu_compile(
    fn: Callable[..., Any],
    args: Sequence[jax.ShapeDtypeStruct],
    generation: str,
    static_kwargs: dict | None = None,
):
    """Compiles fn(*args, **static_kwargs) for `generation`; returns the executable.
    fn.donate_argnums, where set, are donated (as its caller's jit donates them)."""
    dev = topology_device(generation)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    f = functools.partial(fn, **(static_kwargs or {}))
    for attempt in range(_RETRIES):
        try:
            jitted = jax.jit(f, donate_argnums=getattr(fn, "donate_argnums", ()))
            return jitted.trace(*placed).lower(lowering_platforms=("tpu",)).compile()
        except Exception as e:  # noqa: BLE001 - the compiler raises many types
            if _TRANSIENT not in str(e) or attempt + 1 == _RETRIES:
                raise
            time.sleep(0.5 * (attempt + 1))


def executable_costs(compiled) -> tuple[int | None, float | None, float | None]:
    """(temp bytes, flops, bytes accessed) from the compiler's analyses, None if unreadable."""
    temp = flops = nbytes = None
    try:
        temp = int(getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0))
    except Exception:  # noqa: BLE001
        pass
    try:
        cost = compiled.cost_analysis()
        if isinstance(cost, (list, tuple)):
            cost = cost[0]
        flops = float(cost.get("flops", 0.0))
        nbytes = float(cost.get("bytes accessed", 0.0))
    except Exception:  # noqa: BLE001
        pass
    return temp, flops, nbytes


def try_tpu_compile(fn, args, generation, static_kwargs=None) -> CompileResult:
    """Like tpu_compile, but reports failure (e.g. VMEM OOM) instead of raising."""
    try:
        compiled = tpu_compile(fn, args, generation, static_kwargs)
    except Exception as e:  # noqa: BLE001 - the compiler raises many types
        return CompileResult(generation, False, f"{type(e).__name__}: {e}"[:2000], None, None, None)
    return CompileResult(generation, True, None, *executable_costs(compiled))
