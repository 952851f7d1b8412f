"""The TPU compile gate, shared by every kernel's tests.

`assert_compiles` AOT-compiles a JAX function with libtpu for a TPU that is not
attached (real Mosaic and XLA TPU compiler: VMEM overflow and layout errors
fail here); `meta_call` runs a torch op's TorchTPU `jax_op` on meta tensors,
which is `jax.export(..., platforms=["tpu"])`, the Pallas-to-Mosaic lowering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch

from torch_bindings.aot import DEFAULT_GENERATIONS, try_tpu_compile

GENERATIONS = DEFAULT_GENERATIONS


def spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def assert_compiles(fn, args, generation: str):
    result = try_tpu_compile(fn, args, generation)
    if not result.ok:
        pytest.fail(f"TPU compile failed for {generation}: {result.error}")
    return result


def meta_call(jax_op, *args):
    """Calls the TorchTPU jax_op behind `jax_op` (a torch_bindings.JaxOp) on meta tensors."""
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    return jax_op.tpu_op()(*meta)
