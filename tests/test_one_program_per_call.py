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

_COMPILES: list[str] = []
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: (
        _COMPILES.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
)


def _put(shape, dtype=np.float32, seed=0):
    """Device arrays made in numpy: putting them compiles nothing."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jax.device_put(x.astype(dtype))


def _moe_reference():
    t, k, e, h, i = 5, 2, 3, 24, 40
    idx = jax.device_put(np.array([[0, 2], [1, 1], [2, 0], [0, 1], [2, 2]], np.int32))
    return lambda: rd_reference.moe_experts_reference(
        _put((t, h)), idx, _put((t, k)), _put((e, 2 * i, h)), _put((e, h, i)),
        None, None, e, True, False, True, "silu", 0, 1.702, 7.0,
    )  # fmt: skip


def _kvcache(fn, **kw):
    q, kc, vc = _put((2, 1, 4, 16)), _put((2, 40, 2, 16)), _put((2, 40, 2, 16))
    lens = jax.device_put(np.array([9, 33], np.int32))
    return lambda: fn(q, kc, vc, lens, causal=True, **kw)


CALLS = {
    "ragged_dot_reference": lambda: (
        lambda: rd_reference.ragged_dot_reference(
            _put((11, 24)), _put((3, 24, 40)), jax.device_put(np.array([4, 0, 6], np.int32))
        )
    ),
    "moe_experts_reference": _moe_reference,
    "mxfp4.quantize": lambda: lambda: mxfp4.quantize(_put((2, 96, 24))),
    "mxfp4.dequantize": lambda: (
        lambda: mxfp4.dequantize(
            jax.device_put(np.full((2, 48, 24), 0x35, np.uint8)),
            jax.device_put(np.full((2, 32, 24), 127, np.uint8)),
        )
    ),
    "rms_norm_ref": lambda: lambda: rms_reference.rms_norm_ref(_put((6, 44)), _put((44,))),
    "rms_norm_bwd_ref": lambda: (
        lambda: rms_reference.rms_norm_bwd_ref(
            _put((6, 52)), None, _put((6, 52), seed=1), _put((52,))
        )
    ),
    "attention_kvcache_reference": lambda: _kvcache(fa_reference.attention_kvcache_reference),
    "flash_attention_kvcache": lambda: _kvcache(flash_attention_kvcache, interpret=True),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_one_program_per_call(name):
    call = CALLS[name]()  # inputs made first: their transfers compile nothing
    _COMPILES.clear()
    jax.block_until_ready(call())
    assert len(_COMPILES) == 1, f"{name}: {len(_COMPILES)} programs compiled, expected 1"
    _COMPILES.clear()
    jax.block_until_ready(call())
    assert not _COMPILES, f"{name}: compiled again for the same shapes"


def test_counter_sees_eager_ops():
    """The count is the one that matters: three eager ops are three programs."""
    x = _put((3, 29))
    _COMPILES.clear()
    jax.block_until_ready(jnp.exp(jnp.abs(x) + 1.0))
    assert len(_COMPILES) == 3
