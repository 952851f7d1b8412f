"""Plain f32 softmax attention with the kernel's features, for tests.

The mask is built explicitly as a dense [Sq, Skv] boolean matrix; K/V heads
are repeated for GQA. Everything is computed in float32 from the (possibly
bf16-rounded) inputs, so differences to the kernel come from the kernel's
bf16 matmul inputs (p is cast to the value dtype) and summation order.

Tolerances (`TOLERANCES`, used by `assert_close`): the max abs error over
max(1, max |expected|). bf16 matches splash attention's ~1e-2 forward
accuracy class (p rounded to bf16 costs ~2^-8 relative per term); gradients
chain three bf16 matmuls, hence the looser bound. float16 is computed in
f32 by the kernel, so it is only limited by f16 output rounding. f32 is
limited by summation order (the CPU interpreter does exact f32 matmuls).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

TOLERANCES = {
    "float32": {"out": 2e-5, "lse": 2e-5, "grad": 1e-4},
    "float16": {"out": 2e-3, "lse": 1e-4, "grad": 5e-3},
    "bfloat16": {"out": 2e-2, "lse": 1e-2, "grad": 5e-2},
}


def assert_close(actual, expected, dtype, kind, what=""):
    tol = TOLERANCES[jnp.dtype(dtype).name][kind]
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.array_equal(np.isfinite(a), np.isfinite(e)), f"{what}: non-finite entries differ"
    fin = np.isfinite(e)
    if not fin.any():
        return
    assert np.array_equal(a[~fin], e[~fin]), f"{what}: infinite entries differ"
    scale = max(1.0, float(np.max(np.abs(e[fin]))))
    err = float(np.max(np.abs(a[fin] - e[fin]))) / scale
    assert err <= tol, f"{what}: error {err:.3g} > tol {tol:g} ({jnp.dtype(dtype).name} {kind})"


def visibility_mask(
    q_len, kv_len, *, causal=False, window_size=(-1, -1), q_segment_ids=None, kv_segment_ids=None
):
    """[B or 1, Sq, Skv] bool: query i (bottom-right aligned) may see key j."""
    left, right = window_size
    qi = np.arange(q_len)[:, None] + (kv_len - q_len)
    kj = np.arange(kv_len)[None, :]
    m = np.ones((q_len, kv_len), bool)
    if causal:
        m &= kj <= qi
    if left >= 0:
        m &= kj >= qi - left
    if right >= 0:
        m &= kj <= qi + right
    m = jnp.asarray(m[None])  # indexed in numpy: called eagerly, no XLA op
    if q_segment_ids is not None:
        m = m & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
    return m


def attention_reference(
    q,
    k,
    v,
    *,
    causal=False,
    window_size=(-1, -1),
    softcap=None,
    sinks=None,
    softmax_scale=None,
    q_segment_ids=None,
    kv_segment_ids=None,
):
    """q [B, Hq, Sq, D], k/v [B, Hkv, Skv, D|Dv] -> (out [B, Hq, Sq, Dv] f32, lse f32)."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    q = q.astype(jnp.float32)
    k = jnp.repeat(k.astype(jnp.float32), hq // hkv, axis=1)
    v = jnp.repeat(v.astype(jnp.float32), hq // hkv, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest") * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    mask = visibility_mask(
        sq,
        skv,
        causal=causal,
        window_size=window_size,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )[:, None]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks.astype(jnp.float32)[None, :, None, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sinks.astype(jnp.float32)[None, :, None, None] - m)
    empty = denom == 0.0
    safe = jnp.where(empty, 1.0, denom)
    out = jnp.einsum("bhqk,bhkd->bhqd", p / safe, v, precision="highest")
    lse = jnp.where(empty, jnp.inf, m + jnp.log(safe))[..., 0]
    return out, lse


def attention_reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """Packed q [Tq, Hq, D], k/v [Tk, Hkv, D]: one dense call per sequence.

    Returns (out [Tq, Hq, Dv] f32, lse [Hq, Tq] f32). cu_seqlens must be
    concrete (numpy) here.
    """
    cq = np.asarray(cu_seqlens_q)
    ck = np.asarray(cu_seqlens_k)
    hq, dv = q.shape[1], v.shape[2]
    outs, lses = [], []
    for s in range(len(cq) - 1):
        q0, q1, k0, k1 = int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])
        if q1 == q0:
            continue
        if k1 == k0:
            outs.append(jnp.zeros((q1 - q0, hq, dv), jnp.float32))
            sk = kw.get("sinks")
            lse = (
                jnp.full((hq, q1 - q0), jnp.inf, jnp.float32)
                if sk is None
                else jnp.broadcast_to(sk.astype(jnp.float32)[:, None], (hq, q1 - q0))
            )
            lses.append(lse)
            continue
        o, l = attention_reference(
            q[q0:q1].transpose(1, 0, 2)[None],
            k[k0:k1].transpose(1, 0, 2)[None],
            v[k0:k1].transpose(1, 0, 2)[None],
            **kw,
        )
        outs.append(o[0].transpose(1, 0, 2))
        lses.append(l[0])
    if not outs:
        return jnp.zeros((0, hq, dv), jnp.float32), jnp.zeros((hq, 0), jnp.float32)
    return jnp.concatenate(outs, axis=0), jnp.concatenate(lses, axis=1)


# jitted: one program per shape, not one per op (eager mode compiles every op).
@functools.partial(
    jax.jit,
    static_argnames=("causal", "window_size", "softcap", "softmax_scale", "cache_layout"),
)
def attention_kvcache_reference(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    *,
    block_table=None,
    cache_batch_idx=None,
    sinks=None,
    causal=False,
    window_size=(-1, -1),
    softcap=None,
    softmax_scale=None,
    cache_layout="bshd",
    kv_mask=None,
):
    """flash_attn_with_kvcache's attention (no cache update), f32: (out
    [B, Sq, Hq, Dv], lse [B, Hq, Sq]).

    Each sequence's keys are gathered (block_table pages, or cache_batch_idx
    rows) into [B, S, Hkv, D]; query i of sequence b sits at position
    cache_seqlens[b] - Sq + i. Keys past the length are masked and their
    values zeroed (whatever they hold). Empty rows: output 0, lse +inf.
    """
    b, sq, hq, d = q.shape
    lens = jnp.asarray(cache_seqlens, jnp.int32)
    if cache_layout == "bhsd":
        k_cache, v_cache = k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3)
    if block_table is not None:
        k = k_cache[block_table].reshape(b, -1, *k_cache.shape[2:])
        v = v_cache[block_table].reshape(b, -1, *v_cache.shape[2:])
    else:
        rows = jnp.arange(b) if cache_batch_idx is None else jnp.asarray(cache_batch_idx)
        k, v = k_cache[rows], v_cache[rows]
    s_len, hkv = k.shape[1], k.shape[2]
    grp = hq // hkv
    kj = jnp.arange(s_len)[None, None, :]
    qi = (lens[:, None] - sq + jnp.arange(sq)[None, :])[:, :, None]  # [B, Sq, 1]
    valid = kj < lens[:, None, None]
    mask = valid
    if kv_mask is not None:
        mask = mask & (jnp.asarray(kv_mask) != 0)[:, None, :]
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        mask &= kj <= qi + right
    if left >= 0:
        mask &= kj >= qi - left
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kf = jnp.repeat(k.astype(jnp.float32), grp, axis=2)
    vf = jnp.where(valid[:, 0, :, None, None], v.astype(jnp.float32), 0.0)
    vf = jnp.repeat(vf, grp, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf, precision="highest") * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    m4 = mask[:, None]
    s = jnp.where(m4, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks.astype(jnp.float32)[None, :, None, None])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(m4, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sinks.astype(jnp.float32)[None, :, None, None] - m)
    empty = denom == 0.0
    out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(empty, 1.0, denom), vf, precision="highest")
    lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, denom)))[..., 0]
    return out, lse
