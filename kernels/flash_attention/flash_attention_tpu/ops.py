"""flash-attention-tpu as torch ops: dense (batched) and varlen (packed) attention.

Both ops are differentiable (q, k, v and the optional sinks) through
torch_bindings' one autograd path with api.py's rules: the forward op returns
the per-row logsumexp as a residual, and the backward op runs the dK/dV and dQ
kernels on it and the saved output; the forward kernel does not run again.

The dense op takes q, k, v in either layout, "bhsd" ([B, H, S, D], the
kernels' own, what transformers' attention interface hands over) or "bshd"
([B, S, H, D], flash-attn's): the transposes then happen inside the JAX
program (one TPU program per call), not as torch copies in front of it.

Argument checks: checks.py's, run by the ops on tensor specs before they
dispatch (shapes and dtypes), and here on Python scalars and, in eager mode,
on the values of cu_seqlens (reading them is a device sync, and impossible
while tracing). The kernels' JAX functions do not check again.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import torch

from . import api, checks, kvcache, reference
from ._torch_bindings import OpLibrary, validate
from ._torch_bindings.convert import TensorSpec

LIB = OpLibrary("flash_attention_tpu", Path(__file__).parent)

LAYOUTS = ("bhsd", "bshd")
# max_seqlen_k only bounds the length of the varlen block schedule, so it is
# rounded up to this multiple: calls whose longest sequence differs a little
# share one compiled program (a few more placeholder steps, no recompile).
MAX_SEQLEN_BUCKET = 512


def _to_bhsd(x, layout):
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def _softcap(softcap: float):
    return float(softcap) if softcap else None


# -- dense ---------------------------------------------------------------------


def _dense_statics(args, interpret):
    _, causal, left, right, softcap, softmax_scale = args[6:]
    return dict(
        causal=causal,
        window_size=(left, right),
        softcap=_softcap(softcap),
        softmax_scale=softmax_scale,
        config=None,
        interpret=interpret,
    )


def _dense_forward(*args, interpret):
    q, k, v, sinks, q_segment_ids, kv_segment_ids, layout = args[:7]
    out, residuals = api.flash_attention_fwd(
        _to_bhsd(q, layout),
        _to_bhsd(k, layout),
        _to_bhsd(v, layout),
        sinks,
        q_segment_ids,
        kv_segment_ids,
        **_dense_statics(args, interpret),
    )
    return _to_bhsd(out, layout), residuals


def _dense_backward(args, out, residuals, dout, *, interpret):
    q, k, v, sinks, q_segment_ids, kv_segment_ids, layout = args[:7]
    t = lambda x: _to_bhsd(x, layout)  # noqa: E731 - its own inverse
    dq, dk, dv, dsinks, _, _ = api.flash_attention_bwd(
        (t(q), t(k), t(v), sinks, q_segment_ids, kv_segment_ids),
        t(out),
        residuals,
        t(dout),
        **_dense_statics(args, interpret),
    )
    return t(dq), t(dk), t(dv), dsinks


def _bhsd_spec(x, layout):
    if layout == "bhsd" or len(x.shape) != 4:
        return x
    b, s, h, d = x.shape
    return TensorSpec((b, h, s, d), x.dtype)


def _dense_check(q, k, v, sinks, q_segment_ids, kv_segment_ids, layout, *_):
    # The scalars (window, softcap, scale) were checked as the wrapper normalised them.
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    checks.check_inputs(
        _bhsd_spec(q, layout),
        _bhsd_spec(k, layout),
        _bhsd_spec(v, layout),
        sinks=sinks,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )


def _dense_reference(
    q,
    k,
    v,
    sinks,
    q_segment_ids,
    kv_segment_ids,
    layout,
    causal,
    window_left,
    window_right,
    softcap,
    softmax_scale,
):
    out, _ = reference.attention_reference(
        _to_bhsd(q, layout),
        _to_bhsd(k, layout),
        _to_bhsd(v, layout),
        causal=causal,
        window_size=(window_left, window_right),
        softcap=_softcap(softcap),
        sinks=sinks,
        softmax_scale=softmax_scale,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    return _to_bhsd(out, layout).astype(q.dtype)


_flash_attention = LIB.define_differentiable(
    "flash_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor? q_segment_ids, Tensor? kv_segment_ids, "
    "str layout, bool causal, int window_left, int window_right, float softcap, float softmax_scale) -> Tensor",
    forward=_dense_forward,
    backward=_dense_backward,
    reference=_dense_reference,
    differentiable=("q", "k", "v", "sinks"),
    check=_dense_check,
)


# -- varlen --------------------------------------------------------------------


def _varlen_statics(args, interpret):
    max_seqlen_q, max_seqlen_k, causal, left, right, softcap, softmax_scale = args[6:]
    return dict(
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        causal=causal,
        window_size=(left, right),
        softcap=_softcap(softcap),
        softmax_scale=softmax_scale,
        config=None,
        interpret=interpret,
    )


def _varlen_forward(*args, interpret):
    return api.flash_attention_varlen_fwd(*args[:6], **_varlen_statics(args, interpret))


def _varlen_backward(args, out, residuals, dout, *, interpret):
    dq, dk, dv, _, _, dsinks = api.flash_attention_varlen_bwd(
        tuple(args[:6]), out, residuals, dout, **_varlen_statics(args, interpret)
    )
    return dq, dk, dv, dsinks


def _varlen_check(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, max_q, max_k, *_):
    checks.check_inputs(
        q,
        k,
        v,
        varlen=True,
        sinks=sinks,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
    )


def _varlen_reference(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    sinks,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    window_left,
    window_right,
    softcap,
    softmax_scale,
):
    """Traceable packed reference (cu_seqlens may be traced, unlike
    reference.attention_reference_varlen): one dense f32 softmax over all
    tokens with an explicit [Tq, Tk] mask, each sequence's queries aligned
    to the bottom right of its keys."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    cu_q, cu_k = cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32)
    n = cu_q.shape[0] - 1

    def token_meta(cu, total):
        t = jnp.arange(total, dtype=jnp.int32)
        seg = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, n - 1)
        return seg, t - cu[seg]

    seg_q, pos_q = token_meta(cu_q, tq)
    seg_k, pos_k = token_meta(cu_k, k.shape[0])
    len_q, len_k = jnp.diff(cu_q), jnp.diff(cu_k)
    qpos = (pos_q + len_k[seg_q] - len_q[seg_q])[:, None]
    kpos = pos_k[None, :]
    mask = seg_q[:, None] == seg_k[None, :]
    right = 0 if causal else window_right
    if right >= 0:
        mask &= kpos <= qpos + right
    if window_left >= 0:
        mask &= kpos >= qpos - window_left

    scale = softmax_scale
    qf = q.astype(jnp.float32)
    kf = jnp.repeat(k.astype(jnp.float32), hq // hkv, axis=1)
    vf = jnp.repeat(v.astype(jnp.float32), hq // hkv, axis=1)
    s = jnp.einsum("qhd,khd->hqk", qf, kf, precision="highest") * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask[None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks.astype(jnp.float32)[:, None, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(mask[None], jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sinks.astype(jnp.float32)[:, None, None] - m)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    return jnp.einsum("hqk,khd->qhd", p, vf, precision="highest").astype(q.dtype)


_flash_attention_varlen = LIB.define_differentiable(
    "flash_attention_varlen",
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? sinks, "
    "int max_seqlen_q, int max_seqlen_k, bool causal, int window_left, int window_right, "
    "float softcap, float softmax_scale) -> Tensor",
    forward=_varlen_forward,
    backward=_varlen_backward,
    reference=_varlen_reference,
    differentiable=("q", "k", "v", "sinks"),
    check=_varlen_check,
)


# -- decode over a KV cache -------------------------------------------------------


def _kvcache_statics(cache_layout, causal, left, right, softcap, softmax_scale):
    return dict(
        cache_layout=cache_layout,
        causal=causal,
        window_size=(left, right),
        softcap=_softcap(softcap),
        softmax_scale=softmax_scale,
        return_lse=True,
    )


def _kvcache_kernel(
    q, k_cache, v_cache, lengths, block_table, cache_batch_idx, kv_mask, sinks, *st, interpret
):
    return kvcache.flash_attention_kvcache(
        q,
        k_cache,
        v_cache,
        lengths,
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        kv_mask=kv_mask,
        sinks=sinks,
        config=None,
        interpret=interpret,
        **_kvcache_statics(*st),
    )


def _kvcache_reference(
    q, k_cache, v_cache, lengths, block_table, cache_batch_idx, kv_mask, sinks, *st
):
    statics = _kvcache_statics(*st)
    del statics["return_lse"]
    out, lse = reference.attention_kvcache_reference(
        q,
        k_cache,
        v_cache,
        lengths,
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        kv_mask=kv_mask,
        sinks=sinks,
        **statics,
    )
    return out.astype(q.dtype), lse


def _kvcache_check(
    q, k_cache, v_cache, lengths, block_table, cache_batch_idx, kv_mask, sinks, cache_layout, *_
):
    checks.check_kvcache_inputs(
        q,
        k_cache,
        v_cache,
        lengths,
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        sinks=sinks,
        cache_layout=cache_layout,
        kv_mask=kv_mask,
    )


_flash_attention_kvcache = LIB.define(
    "flash_attention_kvcache",
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table, "
    "Tensor? cache_batch_idx, Tensor? kv_mask, Tensor? sinks, str cache_layout, bool causal, "
    "int window_left, int window_right, float softcap, float softmax_scale) -> (Tensor, Tensor)",
    kernel=_kvcache_kernel,
    reference=_kvcache_reference,
    check=_kvcache_check,
)


# -- public op wrappers ----------------------------------------------------------


def _readable(t: torch.Tensor) -> bool:
    return t.device.type != "meta" and not torch.compiler.is_compiling()


def _scalar(x):
    """A one-element tensor (transformers passes some scalars as tensors) as a Python number."""
    return x.item() if isinstance(x, torch.Tensor) and x.numel() == 1 else x


def _index_tensor(t):
    # JAX runs without 64-bit integers: int64 indices travel as int32 (they fit).
    return t.to(torch.int32) if t is not None and t.dtype == torch.int64 else t


def _scalars(softcap, softmax_scale, head_dim: int) -> tuple[float, float]:
    """softcap (0.0 = off) and softmax_scale (1/sqrt(head_dim) when None) as the ops take them."""
    softcap, softmax_scale = checks.scalars(_scalar(softcap), _scalar(softmax_scale))
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    return float(softcap or 0.0), scale


def flash_attention(
    q,
    k,
    v,
    *,
    sinks=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    layout="bhsd",
    causal=False,
    window_size=(-1, -1),
    softcap=None,
    softmax_scale=None,
):
    """Dense attention. layout "bhsd": q [B, Hq, Sq, D], k [B, Hkv, Skv, D],
    v [B, Hkv, Skv, Dv] -> [B, Hq, Sq, Dv]; "bshd": sequence before heads.

    sinks [Hq] (any float dtype); q/kv_segment_ids int [B, Sq] / [B, Skv]:
    a query sees only keys of its own segment id. Differentiable in q, k, v
    and sinks.
    """
    validate.check_tensors(
        ("s_aux", "q_segment_ids", "kv_segment_ids"),
        q=q,
        k=k,
        v=v,
        s_aux=sinks,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    left, right = checks.window(window_size)
    softcap, scale = _scalars(softcap, softmax_scale, q.shape[-1] if q.dim() else 1)
    return _flash_attention(
        q,
        k,
        v,
        sinks,
        _index_tensor(q_segment_ids),
        _index_tensor(kv_segment_ids),
        layout,
        bool(causal),
        left,
        right,
        softcap,
        scale,
    )


def flash_attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    sinks=None,
    causal=False,
    window_size=(-1, -1),
    softcap=None,
    softmax_scale=None,
):
    """Packed attention: q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv],
    cu_seqlens int32/int64 [num_seqs + 1] -> [Tq, Hq, Dv]. Differentiable in
    q, k, v and sinks."""
    validate.check_tensors(
        ("s_aux",),
        q=q,
        k=k,
        v=v,
        s_aux=sinks,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
    )
    max_q = checks.static_len("max_seqlen_q", _scalar(max_seqlen_q))
    max_k = checks.static_len("max_seqlen_k", _scalar(max_seqlen_k))
    left, right = checks.window(window_size)
    softcap, scale = _scalars(softcap, softmax_scale, q.shape[-1] if q.dim() else 1)
    cu_q, cu_k = _index_tensor(cu_seqlens_q), _index_tensor(cu_seqlens_k)
    total_k = k.shape[0] if k.dim() else 0
    bucket_k = min(total_k, -(-max_k // MAX_SEQLEN_BUCKET) * MAX_SEQLEN_BUCKET)
    args = (q, k, v, cu_q, cu_k, sinks, max_q, max(max_k, bucket_k), bool(causal), left, right)
    args += (softcap, scale)
    if _readable(cu_q) and _readable(cu_k):
        # Shapes first (the op would check them next; this is the same check,
        # remembered), then the offsets' values, which the op cannot read.
        _flash_attention_varlen.check_args(args)
        checks.check_varlen_values(
            cu_q.detach().cpu().numpy(),
            cu_k.detach().cpu().numpy(),
            q.shape[0],
            k.shape[0],
            max_q,
            max_k,
        )
    return _flash_attention_varlen(*args)


def flash_attention_kvcache(
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
    """Attention of q [B, Sq, Hq, D] over each sequence's first
    cache_seqlens[b] cached keys -> (out [B, Sq, Hq, Dv], lse [B, Hq, Sq] f32).

    Caches contiguous [B_cache, S, Hkv, D] (cache_batch_idx picks each
    sequence's row) or paged [num_pages, page, Hkv, D] with block_table
    [B, max_pages]; cache_layout "bhsd": contiguous [B_cache, Hkv, S, D]
    caches (transformers'), optionally with kv_mask [B, S] (nonzero: the key
    may be seen). Forward only. In eager mode the lengths, table entries and
    cache rows are read once and checked against the cache.
    """
    validate.check_tensors(
        ("block_table", "cache_batch_idx", "kv_mask", "s_aux"),
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        kv_mask=kv_mask,
        s_aux=sinks,
    )
    left, right = checks.window(window_size)
    softcap, scale = _scalars(softcap, softmax_scale, q.shape[-1] if q.dim() else 1)
    lengths = _index_tensor(cache_seqlens)
    table, rows = _index_tensor(block_table), _index_tensor(cache_batch_idx)
    if kv_mask is not None and kv_mask.dtype == torch.bool:
        kv_mask = kv_mask.to(torch.int32)
    args = (q, k_cache, v_cache, lengths, table, rows, kv_mask, sinks, cache_layout, bool(causal))
    args += (left, right, softcap, scale)
    if all(t is None or _readable(t) for t in (lengths, table, rows)):
        _flash_attention_kvcache.check_args(args)
        sp = lambda t: None if t is None else validate.spec(t)  # noqa: E731
        pb = checks.check_kvcache_inputs(
            *map(sp, (q, k_cache, v_cache, lengths)),
            block_table=sp(table),
            cache_batch_idx=sp(rows),
            sinks=sp(sinks),
            cache_layout=cache_layout,
            kv_mask=sp(kv_mask),
        )
        values = lambda t: None if t is None else t.detach().cpu().numpy()  # noqa: E731
        checks.check_kvcache_values(
            pb, values(lengths), values(table), values(rows), num_cache_rows=k_cache.shape[0]
        )
    return _flash_attention_kvcache(*args)
