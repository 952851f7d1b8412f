"""The walker on JAX's megablox gmm: exact bytes against an independent
count, and the project's reference ratios (perf-model.md)."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

from bench import grid_walk, model, moe


def _schedule(group_sizes, tm):
    """(m tile, group) visited by megablox, in order: every group with rows
    visits each row tile its rows touch (written from the gmm docstring's
    contract, not from its metadata code)."""
    visits, start = [], 0
    for g, size in enumerate(group_sizes):
        if size:
            for t in range(start // tm, (start + size - 1) // tm + 1):
                visits.append((t, g))
        start += size
    return visits


def _independent_bytes(group_sizes, m, k, n, tm, tk, tn, isz=2, osz=2):
    visits = _schedule(group_sizes, tm)
    prev = {"lhs": None, "rhs": None, "out": None}
    total = 0
    out_runs = 0
    for ni in range(-(-n // tn)):
        for t, g in visits:
            for ki in range(-(-k // tk)):
                lhs, rhs, out = (t, ki), (g, ki, ni), (t, ni)
                if lhs != prev["lhs"]:
                    total += tm * min(tk, k - ki * tk) * isz
                if rhs != prev["rhs"]:
                    total += min(tk, k - ki * tk) * min(tn, n - ni * tn) * isz
                if out != prev["out"]:
                    out_runs += 1
                    total += tm * min(tn, n - ni * tn) * osz
                prev = {"lhs": lhs, "rhs": rhs, "out": out}
    steps = -(-n // tn) * len(visits) * -(-k // tk)
    return total, steps


@pytest.mark.parametrize(
    "sizes,tiling",
    [
        ((10, 0, 30, 24), (32, 128, 128)),
        ((64, 0, 0, 0), (16, 128, 128)),
        ((1, 2, 3, 58), (8, 256, 128)),
    ],
)
def test_megablox_bytes_match_independent_count(sizes, tiling):
    m, k, n, e = 64, 256, 384, 4
    tm, tk, tn = tiling
    f = lambda x, w, gs: megablox.gmm(x, w, gs, preferred_element_type=jnp.bfloat16, tiling=tiling)
    [c] = grid_walk.analyze(
        f,
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((e, k, n), jnp.bfloat16),
        jnp.asarray(sizes, jnp.int32),
    )
    want_bytes, want_steps = _independent_bytes(sizes, m, k, n, tm, tk, tn)
    block_bytes = sum(o.bytes for o in c.operands if o.kind != "scalar_prefetch")
    assert c.steps == want_steps
    assert block_bytes == want_bytes
    assert c.flops == want_steps * 2 * tm * tk * tn


def _qwen_gate_up(tokens, tiling_fn, generation="v6e"):
    shape = moe.MODELS["qwen3-30b-a3b"]
    ids, _ = moe.route(tokens, shape.experts, shape.top_k, "uniform", seed=0)
    sizes = moe.group_sizes(ids, shape.experts)
    m = tokens * shape.top_k
    k, n = shape.hidden, 2 * shape.intermediate
    tiling = tiling_fn(m, k, n)
    f = lambda x, w, gs: megablox.gmm(x, w, gs, preferred_element_type=jnp.bfloat16, tiling=tiling)
    [c] = grid_walk.analyze(
        f,
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((shape.experts, k, n), jnp.bfloat16),
        jnp.asarray(sizes),
    )
    t = model.kernel_time_s(c.hbm_bytes, c.flops, c.steps, generation)
    roof = model.grouped_roofline_s([model.GroupedMatmul(tuple(sizes), k, n)], generation)
    return t / roof


@pytest.mark.parametrize("tokens,want", [(1, 18.6), (8, 19.0)])
def test_megablox_default_tiling_matches_reference_ratio(tokens, want):
    """perf-model.md: default tiling at batch 1 / 8 on v6e, model / roofline."""
    ratio = _qwen_gate_up(tokens, lambda m, k, n: (min(128, m), 128, 128))
    assert ratio == pytest.approx(want, rel=0.03)


def test_megablox_full_width_tiling_matches_reference_ratio():
    """perf-model.md: full K and N per block, batch 1: 1.09x (v6e), 1.20x (tpu7x)."""
    full = lambda m, k, n: (m, k, n)
    assert _qwen_gate_up(1, full, "v6e") == pytest.approx(1.09, rel=0.02)
    assert _qwen_gate_up(1, full, "tpu7x") == pytest.approx(1.20, rel=0.02)
