"""bench.xla_fusions: an XLA program's fusions, each run from its own final bundles."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import bench  # noqa: F401  (switches the compiler dumps on before libtpu loads)
from bench import schedule, xla_fusions

ROWS, COLS = 8192, 2048  # 32 MiB per bf16 operand: DMA time, not latency, dominates


def _spec():
    return jax.ShapeDtypeStruct((ROWS, COLS), jnp.bfloat16)


def test_elementwise_add_streams_at_copy_bandwidth():
    s = xla_fusions.schedule_xla_parts(lambda a, b: a + b, [_spec(), _spec()], "v6e")
    assert len(s.fusions) == 1, [f.name for f in s.fusions]
    moved = 3 * ROWS * COLS * 2
    assert s.fusions[0].dma_bytes == moved
    floor = moved / schedule.copy_bytes_per_s("v6e") * 1e6
    assert floor <= s.total_us <= 1.10 * floor, (s.total_us, floor)


def test_vector_work_shows_in_the_schedule():
    # Same bytes, a transcendental per element: the fusion is VPU/EUP-bound,
    # which a bytes model cannot see.
    plain = xla_fusions.schedule_xla_parts(lambda a, b: a + b, [_spec(), _spec()], "v6e")
    heavy = xla_fusions.schedule_xla_parts(
        lambda a, b: jnp.sin(a) * b + 1, [_spec(), _spec()], "v6e"
    )
    assert heavy.fusions[0].dma_bytes == plain.fusions[0].dma_bytes
    assert heavy.total_us > 1.5 * plain.total_us, (heavy.total_us, plain.total_us)
