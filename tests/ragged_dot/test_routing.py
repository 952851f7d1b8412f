"""The MoE layer's routing by one-hot matmuls (moe.py, tiling.route_by_matmul).

At decode the layer moves token rows to their experts and back with matmuls
instead of row gathers. Checked here:

- the combine (`moe.combine_by_matmul`) per element against an f64 numpy sum,
  forward and its custom backward, with non-finite rows;
- the whole layer against its own gather path (`routing="gather"`, the
  reference's), same matmul on both sides, bf16, over drawn shapes, top-k,
  expert-parallel shards and biases: the dispatched rows bit for bit, the
  output and the gradients per element;
- non-finite inputs stay with their token: the set of non-finite output
  elements is the gather path's, every other element agrees;
- the rule: which calls take which path, in the program the API builds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from ragged_dot_tpu import moe, tiling
from ragged_dot_tpu.api import moe_experts
from tolerances import assert_close

BF16 = jnp.bfloat16


# ---------------------------------------------------------------------------
# The combine alone
# ---------------------------------------------------------------------------


def _combine_case(t, k, h, seed, invalid_frac=0.25):
    rng = np.random.default_rng(seed)
    s = t * k
    tok_sorted = rng.permutation(s) // k  # any order of the slots, k per token
    valid = rng.random(s) >= invalid_frac
    w = np.where(valid, rng.random(s).astype(np.float32), 0.0).astype(np.float32)
    out = jnp.asarray(rng.standard_normal((s, h)), BF16)
    return out, jnp.asarray(tok_sorted, jnp.int32), jnp.asarray(w), jnp.asarray(valid)


def _combine_f64(out, tok, w, valid, t):
    o = np.asarray(out.astype(jnp.float32), np.float64)
    o = np.where(np.asarray(valid)[:, None], o, 0.0)
    terms = o * np.asarray(w, np.float64)[:, None]
    res, mag = np.zeros((t, o.shape[1])), np.zeros((t, o.shape[1]))
    np.add.at(res, np.asarray(tok), terms)
    np.add.at(mag, np.asarray(tok), np.abs(terms))
    return res, mag


@settings(max_examples=3, deadline=None, derandomize=True)
@given(
    t=st.integers(1, 40),
    k=st.integers(1, 4),
    h=st.sampled_from([128, 384]),
    seed=st.integers(0, 2**16),
)
@example(t=1, k=1, h=128, seed=0)
def test_combine_matches_f64_forward_and_backward(t, k, h, seed):
    out, tok, w, valid = _combine_case(t, k, h, seed)
    got = moe.combine_by_matmul(out, tok, w, valid, t)
    want, mag = _combine_f64(out, tok, w, valid, t)
    # The f32 weights enter as two bf16 terms (relative error <= 2^-17) and the
    # products are summed in f32: within F32_SLACK of the terms' magnitude.
    assert_close(got, want, dtype=jnp.float32, magnitude=mag, what="combine")

    g = jax.random.normal(jax.random.PRNGKey(seed), (t, h), jnp.float32)
    _, vjp = jax.vjp(lambda o, ww: moe.combine_by_matmul(o, tok, ww, valid, t), out, w)
    d_out, d_w = vjp(g)
    g_rows = np.asarray(g, np.float64)[np.asarray(tok)]
    want_d_out = g_rows * np.asarray(w, np.float64)[:, None]
    assert d_out.dtype == BF16
    assert_close(d_out, want_d_out, dtype=jnp.float32, what="d_out")  # one rounding to bf16
    o = np.where(np.asarray(valid)[:, None], np.asarray(out.astype(jnp.float32), np.float64), 0)
    assert_close(
        d_w, (o * g_rows).sum(1), dtype=jnp.float32, magnitude=np.abs(o * g_rows).sum(1), what="d_w"
    )


def test_combine_keeps_non_finite_rows_to_their_token():
    t, k, h = 6, 2, 128
    out, tok, w, valid = _combine_case(t, k, h, seed=3, invalid_frac=0.0)
    valid = valid.at[5].set(False)
    w = w.at[5].set(0.0)
    out = out.at[2, 7].set(jnp.inf).at[5, 9].set(jnp.nan)  # slot 5 is not local
    got = np.asarray(moe.combine_by_matmul(out, tok, w, valid, t))
    want, mag = _combine_f64(jnp.where(jnp.isfinite(out), out, 0), tok, w, valid, t)
    bad = np.zeros((t, h), bool)
    bad[int(tok[2]), 7] = True  # only the local slot's token, only that column
    assert np.array_equal(~np.isfinite(got), bad)
    assert_close(np.where(bad, 0, got), np.where(bad, 0, want), magnitude=mag, what="finite")


# ---------------------------------------------------------------------------
# The whole layer: matmul routing against the gather path
# ---------------------------------------------------------------------------


def _layer_case(t, k, e, h, i, with_bias, seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), 7)
    hidden = jax.random.normal(keys[0], (t, h)).astype(BF16)
    idx = jnp.stack([jax.random.permutation(kk, e)[:k] for kk in jax.random.split(keys[1], t)])
    w = jax.nn.softmax(jax.random.normal(keys[2], (t, k)), -1)
    gu = (jax.random.normal(keys[3], (e, h, 2 * i)) * h**-0.5).astype(BF16)
    dn = (jax.random.normal(keys[4], (e, i, h)) * i**-0.5).astype(BF16)
    b1 = (jax.random.normal(keys[5], (e, 2 * i)) * 0.1).astype(BF16) if with_bias else None
    b2 = (jax.random.normal(keys[6], (e, h)) * 0.1).astype(BF16) if with_bias else None
    return hidden, idx.astype(jnp.int32), w, gu, dn, b1, b2


def _program(routing, num_experts, offset, activation, idx):
    """The layer with jax.lax.ragged_dot as its matmul, jitted (one compile per
    shape, not one per op); returns the output and what each matmul saw:
    {which: (rows in, rows out)}."""

    def run(hidden, w, gu, dn, b1, b2):
        seen = {}

        def matmul(x, wt, gs, which):
            y = jax.lax.ragged_dot(x, wt, gs, preferred_element_type=x.dtype)
            seen[which] = (x, y)
            return y

        out = moe.experts_program(
            hidden,
            idx,
            w,
            gu[offset : offset + num_experts],
            dn[offset : offset + num_experts],
            None if b1 is None else b1[offset : offset + num_experts],
            None if b2 is None else b2[offset : offset + num_experts],
            matmul=matmul,
            num_experts=num_experts,
            has_gate=True,
            is_concatenated=activation != "gpt_oss",
            activation=activation,
            group_offset=offset,
            alpha=1.702,
            limit=7.0,
            routing=routing,
        )
        return out, seen

    return jax.jit(run)


@settings(max_examples=3, deadline=None, derandomize=True)
@given(
    t=st.integers(tiling.ROUTE_BY_MATMUL_MIN_TOKENS, 24),
    k=st.integers(1, 3),
    shard=st.sampled_from([None, 0, 4]),
    gpt_oss=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(t=9, k=2, shard=4, gpt_oss=True, seed=1)
def test_layer_matches_its_gather_path(t, k, shard, gpt_oss, seed):
    e, h, i = 8, 128, 64
    num, off = (e, 0) if shard is None else (4, shard)
    activation = "gpt_oss" if gpt_oss else "silu"
    hidden, idx, w, gu, dn, b1, b2 = _layer_case(t, k, e, h, i, gpt_oss, seed)
    args = (hidden, w, gu, dn, b1, b2)
    fast = _program("auto", num, off, activation, idx)
    slow = _program("gather", num, off, activation, idx)
    assert tiling.route_by_matmul(t, BF16, BF16)
    (a, seen_a), (b, seen_b) = fast(*args), slow(*args)
    # The dispatch is exact: the experts see the same rows, bit for bit.
    for which in ("up", "down"):
        np.testing.assert_array_equal(
            np.asarray(seen_a[which][0].astype(jnp.float32)),
            np.asarray(seen_b[which][0].astype(jnp.float32)),
        )
    # Both round one f32 sum to bf16; the sums differ by the weights' two-term
    # split (<= F32_SLACK of the terms), so the outputs differ by <= 1 bf16 ulp.
    rows = np.abs(np.asarray(seen_b["down"][1].astype(jnp.float32)))
    mag = np.abs(np.asarray(w)).sum(1, keepdims=True) * (
        rows.max() + (0 if b2 is None else float(jnp.abs(b2).max()))
    )
    assert_close(a, b.astype(jnp.float32), dtype=BF16, magnitude=mag, roundings=1, what="out")

    def grads(fn):
        def loss(*xs):
            return jnp.sum(jnp.sin(fn(*xs)[0].astype(jnp.float32)))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) + ((4, 5) if gpt_oss else ())))

    ga, gb = grads(fast)(*args), grads(slow)(*args)
    for name, x, y in zip(("hidden", "w", "gate_up", "down", "b1", "b2"), ga, gb):
        assert x.dtype == y.dtype, name
        scale = max(1.0, float(jnp.abs(y.astype(jnp.float32)).max()))
        np.testing.assert_allclose(
            np.asarray(x.astype(jnp.float32)),
            np.asarray(y.astype(jnp.float32)),
            atol=2e-2 * scale,
            rtol=2e-2,
            err_msg=name,
        )


def test_non_finite_inputs_stay_with_their_token():
    """An inf in one token's hidden state and a NaN expert: the tokens and
    elements the gather path leaves finite are finite and agree."""
    e, h, i, t, k = 8, 128, 64, 9, 2
    assert tiling.route_by_matmul(t, BF16, BF16)
    hidden, idx, w, gu, dn, b1, b2 = _layer_case(t, k, e, h, i, False, seed=5)
    hidden = hidden.at[3, 11].set(jnp.inf)
    hot = int(idx[0, 0])
    dn = dn.at[hot, :, 17].set(jnp.nan)  # column 17 of every row routed to `hot`
    a, _ = _program("auto", e, 0, "silu", idx)(hidden, w, gu, dn, b1, b2)
    b, _ = _program("gather", e, 0, "silu", idx)(hidden, w, gu, dn, b1, b2)
    a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    assert not np.isfinite(b[3]).any() and not np.isfinite(b[0, 17])  # the case bites
    assert np.isfinite(b).sum() > b.size // 2
    assert np.array_equal(np.isfinite(a), np.isfinite(b))
    fin = np.isfinite(b)
    np.testing.assert_allclose(a[fin], b[fin], rtol=2**-7, atol=2**-7 * np.abs(b[fin]).max())


# ---------------------------------------------------------------------------
# The rule and its wiring
# ---------------------------------------------------------------------------


def test_rule():
    low, limit = tiling.ROUTE_BY_MATMUL_MIN_TOKENS, tiling.ROUTE_BY_MATMUL_MAX_TOKENS
    assert not tiling.route_by_matmul(low - 1, BF16, BF16)
    assert tiling.route_by_matmul(low, BF16, BF16)
    assert tiling.route_by_matmul(limit, BF16, BF16)
    assert not tiling.route_by_matmul(limit + 1, BF16, BF16)
    assert not tiling.route_by_matmul(8, jnp.float32, BF16)  # f32 hidden: gathers
    assert not tiling.route_by_matmul(8, BF16, jnp.float32)  # f32 weights: gathers


def _row_gathers(t, dtype):
    """How many row gathers of [t * k, H] the API's layer program holds. H
    = 96 does not pack (pairs.packable), so the combine stays XLA's gather
    and the count shows the routing alone."""
    e, k, h, i = 8, 2, 96, 64
    spec = jax.ShapeDtypeStruct
    jaxpr = jax.make_jaxpr(
        lambda *a: moe_experts(*a, num_experts=e, is_transposed=True, config="v6e")
    )(
        spec((t, h), dtype),
        spec((t, k), jnp.int32),
        spec((t, k), jnp.float32),
        spec((e, h, 2 * i), dtype),
        spec((e, i, h), dtype),
    )
    return str(jaxpr).count(f"[{t * k},{h}] = gather")


@pytest.mark.parametrize(
    "t, dtype, gathers",
    [(512, BF16, 0), (8, BF16, 0), (513, BF16, 2), (7, BF16, 2), (16, jnp.float32, 2)],
)
def test_api_takes_the_path_the_rule_names(t, dtype, gathers):
    assert _row_gathers(t, dtype) == gathers
