"""tpu-inference's ragged paged attention (v3): the kernel vLLM's TPU backend
decodes with, as a decode-attention peer.

The `tpu-inference` wheel is installed without its dependencies
(requirements-nodeps.txt): its package `__init__` brings up vLLM, torchax and
its serving stack, which a kernel user does not need. So the kernel's three
files (`v3/util.py`, `v3/tuned_block_sizes.py`, `v3/kernel.py`) are loaded
alone, as modules of stand-in parent packages, with the two helpers they import
from the rest of the package stood in for: a logger, and `get_device_name`.

The kernel asks the attached device for its generation (`get_tpu_version`,
from `jax.devices()`), to pick its default block sizes. Here it is told the
bench's generation instead; everything else is its own: its default decode
blocks (the ones vLLM uses unless its RPA_V3_* knobs are set), its merged
cache layout [pages, page, 2 Hkv / packing, packing, D] (K and V of a head
interleaved), one query token per sequence, `update_kv_cache=False` (the new
token already in the cache, as for our kernel in the same run).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp

PACKAGE = "tpu_inference"
_V3 = "kernels/ragged_paged_attention/v3"
_GENERATION_VERSION = {"v5e": 5, "v6e": 6, "tpu7x": 7}


def _package_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)  # finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{PACKAGE} is not installed (scripts/setup.sh installs it)")
    return Path(list(spec.submodule_search_locations)[0])


def load():
    """The v3 kernel module, loaded from the installed wheel without its package."""
    name = f"{PACKAGE}.{_V3.replace('/', '.')}.kernel"
    if name in sys.modules:
        return sys.modules[name]
    root = _package_dir()
    parts = [PACKAGE, *_V3.split("/")]
    for i in range(1, len(parts) + 1):
        pkg = ".".join(parts[:i])
        if pkg not in sys.modules:
            mod = types.ModuleType(pkg)
            mod.__path__ = [str(root.joinpath(*parts[1:i]))]
            sys.modules[pkg] = mod
    logger = types.ModuleType(f"{PACKAGE}.logger")
    logger.init_logger = logging.getLogger
    utils = types.ModuleType(f"{PACKAGE}.utils")
    utils.get_device_name = lambda *a, **k: "TPU (bench)"
    sys.modules.setdefault(logger.__name__, logger)
    sys.modules.setdefault(utils.__name__, utils)
    base = ".".join(parts)
    for file in ("util", "tuned_block_sizes", "kernel"):
        spec = importlib.util.spec_from_file_location(f"{base}.{file}", root / _V3 / f"{file}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def new_token(q, k):
    """The new token's K (or V) [B, Hkv, D] of each sequence: the kernel takes
    it (to write into the cache); with update_kv_cache=False it is not written."""
    shape = (q.shape[0], k.shape[2], k.shape[3])
    if isinstance(q, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, q.dtype)
    return jnp.zeros(shape, q.dtype)


def call_args(q, k_new, v_new, kv_cache, lengths, table, *, scale: float):
    """(args, kwargs) of one decode token per sequence, for the kernel and for
    its own reference (`ref_ragged_paged_attention`, which takes the same)."""
    b = q.shape[0]
    args = (
        q,
        k_new,
        v_new,
        kv_cache,
        lengths,
        table.reshape(-1),
        jnp.arange(b + 1, dtype=jnp.int32),  # cu_q_lens: one query token per sequence
        jnp.full((3,), b, jnp.int32),  # distribution: every sequence decode-only
    )
    return args, dict(sm_scale=scale)


def decode(kernel, q, k_new, v_new, kv_cache, lengths, table, *, generation: str, scale: float):
    """One decode token per sequence: q [B, Hq, D], k_new / v_new [B, Hkv, D],
    kv_cache in the kernel's merged layout, lengths [B], table [B, pages] ->
    ([B, Hq, D], the cache: the kernel's output aliases it, as vLLM's step
    returns it)."""
    version = _GENERATION_VERSION.get(generation)
    if version is None:
        raise ValueError(f"generation: expected one of {sorted(_GENERATION_VERSION)}")
    kernel.get_tpu_version = lambda: version
    args, kwargs = call_args(q, k_new, v_new, kv_cache, lengths, table, scale=scale)
    from bench import tracing

    # its VMEM limit defaults to the attached chip's capacity: the generation's
    with tracing.pretend_tpu(generation):
        return kernel.ragged_paged_attention(*args, **kwargs, update_kv_cache=False)


def cache_shape(kernel, pages: int, page: int, kv_heads: int, head_dim: int, dtype):
    return tuple(kernel.get_kv_cache_shape(pages, page, kv_heads, head_dim, jnp.dtype(dtype)))


def merge(kernel, k, v):
    """Our paged K and V [pages, page, Hkv, D] in the kernel's merged layout
    (its own merge_kv, position by position)."""
    pages, page = k.shape[:2]
    shape = cache_shape(kernel, pages, page, k.shape[2], k.shape[3], k.dtype)
    if isinstance(k, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, k.dtype)
    flat = lambda x: x.reshape(pages * page, *x.shape[2:])  # noqa: E731
    return kernel.merge_kv(flat(k), flat(v)).reshape(shape)
