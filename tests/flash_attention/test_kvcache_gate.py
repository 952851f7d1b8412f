"""The decode kernel over a KV cache compiles for every TPU generation (libtpu
AOT, no chip), at decode shapes: batch 64 against a 32k-position cache
(16k where v5e's HBM would not hold it).

Layouts: "gqa" a contiguous cache with 32 query / 8 kv heads; "paged" the
same heads over 256-position pages (flash-attn's page multiple); "mqa" one kv
head (the cache viewed as [.., S, D]); "static" transformers' StaticCache
layout [B, Hkv, S, D] with a padding mask, 32/8 heads; "spec" 4 new queries per sequence,
causal with a 1k window, sinks and a softcap (GPT-OSS-style, 64/8 heads). The
grid's step count is data (a dynamic grid dimension), so one program per
point covers every length. Compiled in the session's gate workers.
"""

from __future__ import annotations

import functools
import itertools

import jax.numpy as jnp
import pytest

from flash_attention_tpu import kvcache
from gate import GENERATIONS, GateProgram, session_pool, spec

BATCH, CACHE, PAGE = 64, 32768, 256
# v5e's 16 GB of HBM does not hold 64 x 32k positions of 8 d=256 heads (K and V).
MAX_CACHE_BYTES = 8 << 30
LAYOUTS = ("gqa", "paged", "mqa", "static")
# Every layout on every generation at d = 128; the other head dims (other
# lane tilings of q, k, v and the accumulator) on the two layouts whose DMAs
# differ (contiguous and paged): 27 compiles, not 39 (80 CPU-s of the suite).
POINTS = [
    *itertools.product(GENERATIONS, (128,), LAYOUTS),
    *itertools.product(GENERATIONS, (64, 256), ("gqa", "paged")),
    *((g, 64, "spec") for g in GENERATIONS),
]


def gate_program(point) -> GateProgram:
    generation, d, layout = point
    hq, hkv, sq = {
        "gqa": (32, 8, 1),
        "paged": (32, 8, 1),
        "mqa": (8, 1, 1),
        "static": (32, 8, 1),
        "spec": (64, 8, 4),
    }[layout]
    q = spec((BATCH, sq, hq, d))
    cache_len = min(CACHE, MAX_CACHE_BYTES // (BATCH * hkv * d * 2 * 2))
    lens = spec((BATCH,), jnp.int32)
    if layout == "paged":
        cache = spec((BATCH * cache_len // PAGE, PAGE, hkv, d))
        table = spec((BATCH, cache_len // PAGE), jnp.int32)

        def fn(q, k, v, lens, table):
            return kvcache.flash_attention_kvcache(
                q, k, v, lens, block_table=table, causal=True, config=generation
            )

        return GateProgram(fn, [q, cache, cache, lens, table], generation)
    if layout == "static":
        cache = spec((BATCH, hkv, cache_len, d))

        def fn(q, k, v, lens, mask):
            return kvcache.flash_attention_kvcache(
                q, k, v, lens, cache_layout="bhsd", kv_mask=mask, causal=True, config=generation
            )

        return GateProgram(
            fn, [q, cache, cache, lens, spec((BATCH, cache_len), jnp.int32)], generation
        )
    cache = spec((BATCH, cache_len, hkv, d))
    kw = dict(causal=True, config=generation)
    args = [q, cache, cache, lens]
    if layout == "spec":
        kw.update(window_size=(1023, 0), softcap=30.0)
        args.append(spec((hq,), jnp.float32))

        def fn(q, k, v, lens, sinks):
            return kvcache.flash_attention_kvcache(q, k, v, lens, sinks=sinks, **kw)

        return GateProgram(fn, args, generation)
    return GateProgram(functools.partial(kvcache.flash_attention_kvcache, **kw), args, generation)


@pytest.fixture(scope="module")
def pool():
    return session_pool()


@pytest.mark.parametrize("point", POINTS, ids=lambda pt: "-".join(str(x) for x in pt))
def test_compiles(point, pool):
    pool.assert_ok(__file__, point)
