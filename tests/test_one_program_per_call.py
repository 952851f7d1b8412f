"""References and helpers that checks call with many shapes compile one XLA
program per call, not one per op.

JAX compiles every op called outside `jit` anew for each new shape (~35 ms on
the 2-core machine); op by op, the references, quantizers and bounds were
~9,000 programs of the suite and test_moe_decode.py's time halved once they
were jitted (2026-12-07). Each call below has shapes no other test uses, so
its program is compiled here: one backend compile, counted by JAX's own
compile event.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

from flash_attention_tpu import reference as fa_reference
from flash_attention_tpu.kvcache import flash_attention_kvcache
from ragged_dot_tpu import mxfp4
from ragged_dot_tpu import reference as rd_reference
from rmsnorm_tpu import reference as rms_reference

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def compiles():
    """The names of the backend compiles while a test runs (its list)."""
    seen: list[str] = []

    def listen(name, secs, **kw):
        if name == _BACKEND_COMPILE:
            seen.append(name)

    monitoring.register_event_duration_secs_listener(listen)
    yield seen
    monitoring.unregister_event_duration_listener(listen)


def _put(shape, dtype=np.float32, seed=0):
    """Device arrays made in numpy: putting them compiles nothing."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jax.device_put(x.astype(dtype))


def _moe_reference():
    t, k, e, h, i = 5, 2, 3, 24, 40
    idx = jax.device_put(np.array([[0, 2], [1, 1], [2, 0], [0, 1], [2, 2]], np.int32))
    arrays = (_put((t, h)), idx, _put((t, k)), _put((e, 2 * i, h)), _put((e, h, i)))
    statics = (None, None, e, True, False, True, "silu", 0, 1.702, 7.0)
    return rd_reference.moe_experts_reference, (*arrays, *statics), {}


def _kvcache(fn, **kw):
    q, kc, vc = _put((2, 1, 4, 16)), _put((2, 40, 2, 16)), _put((2, 40, 2, 16))
    lens = jax.device_put(np.array([9, 33], np.int32))
    return fn, (q, kc, vc, lens), dict(causal=True, **kw)


# name -> () -> (function, args, kwargs), the inputs made before the call.
CALLS = {
    "ragged_dot_reference": lambda: (
        rd_reference.ragged_dot_reference,
        (_put((11, 24)), _put((3, 24, 40)), jax.device_put(np.array([4, 0, 6], np.int32))),
        {},
    ),
    "moe_experts_reference": _moe_reference,
    "mxfp4.quantize": lambda: (mxfp4.quantize, (_put((2, 96, 24)),), {}),
    "mxfp4.dequantize": lambda: (
        mxfp4.dequantize,
        (
            jax.device_put(np.full((2, 48, 24), 0x35, np.uint8)),
            jax.device_put(np.full((2, 32, 24), 127, np.uint8)),
        ),
        {},
    ),
    "rms_norm_ref": lambda: (rms_reference.rms_norm_ref, (_put((6, 44)), _put((44,))), {}),
    "rms_norm_bwd_ref": lambda: (
        rms_reference.rms_norm_bwd_ref,
        (_put((6, 52)), None, _put((6, 52), seed=1), _put((52,))),
        {},
    ),
    "attention_kvcache_reference": lambda: _kvcache(fa_reference.attention_kvcache_reference),
    "flash_attention_kvcache": lambda: _kvcache(flash_attention_kvcache, interpret=True),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_one_program_per_call(name, compiles):
    fn, args, kwargs = CALLS[name]()
    compiles.clear()
    jax.block_until_ready(fn(*args, **kwargs))
    assert len(compiles) == 1, f"{name}: {len(compiles)} programs compiled, expected 1"
    compiles.clear()
    jax.block_until_ready(fn(*args, **kwargs))
    assert not compiles, f"{name}: compiled again for the same shapes"


def test_counter_sees_eager_ops(compiles):
    """The count is the one that matters: three eager ops are three programs."""
    x = _put((3, 29))
    compiles.clear()
    jax.block_until_ready(jnp.exp(jnp.abs(x) + 1.0))
    assert len(compiles) == 3
