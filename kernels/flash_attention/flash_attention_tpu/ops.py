"""flash-attention-tpu as torch ops: dense (batched) and varlen (packed) attention.

Both ops are differentiable (q, k, v and the optional sinks): their backward
ops run jax.vjp of the same JAX function, i.e. the kernel's own custom_vjp
(the dK/dV and dQ Pallas kernels, and the sink gradient).

The dense op takes q, k, v in either layout, "bhsd" ([B, H, S, D], the
kernels' own, what transformers' attention interface hands over) or "bshd"
([B, S, H, D], flash-attn's): the transposes then happen inside the JAX
program (one TPU program per call), not as torch copies in front of it.

Argument checks: dtype/device/rank with torch_bindings.validate here, every
shape rule in checks.py (called on shape specs), values of cu_seqlens in eager
mode only (reading them is a device sync, and impossible while tracing).
Under torch.compile, Dynamo cannot trace checks.py (JAX dtype objects), so
the shape rules run when the kernel itself is traced (it calls checks.py
again on its JAX arguments): the same ValueErrors, raised from inside the op.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import torch

from . import checks, reference
from .api import flash_attention as _jax_flash_attention
from .api import flash_attention_varlen as _jax_flash_attention_varlen
from ._torch_bindings import OpLibrary, validate

LIB = OpLibrary("flash_attention_tpu", Path(__file__).parent)

LAYOUTS = ("bhsd", "bshd")
_INT_DTYPES = (torch.int32, torch.int64)
_JAX_DTYPES = {
    torch.float32: jnp.float32,
    torch.bfloat16: jnp.bfloat16,
    torch.float16: jnp.float16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int32,
}
# max_seqlen_k only bounds the length of the varlen block schedule, so it is
# rounded up to this multiple: calls whose longest sequence differs a little
# share one compiled program (a few more placeholder steps, no recompile).
MAX_SEQLEN_BUCKET = 512


def _to_bhsd(x, layout):
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def _softcap(softcap: float):
    return float(softcap) if softcap else None


# -- dense ---------------------------------------------------------------------


def _dense_kernel(
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
    *,
    interpret,
):
    out = _jax_flash_attention(
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
        interpret=interpret,
    )
    return _to_bhsd(out, layout)


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
    kernel=_dense_kernel,
    reference=_dense_reference,
    differentiable=("q", "k", "v", "sinks"),
)


# -- varlen --------------------------------------------------------------------


def _varlen_kernel(
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
    *,
    interpret,
):
    return _jax_flash_attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal=causal,
        window_size=(window_left, window_right),
        softcap=_softcap(softcap),
        sinks=sinks,
        softmax_scale=softmax_scale,
        interpret=interpret,
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
    kernel=_varlen_kernel,
    reference=_varlen_reference,
    differentiable=("q", "k", "v", "sinks"),
)


# -- argument checks -----------------------------------------------------------


class _Spec:
    """Shape and dtype of a torch tensor, as checks.py reads arrays.

    Converting it to numpy raises, which checks.py takes as "traced": value
    checks are skipped, shape checks run.
    """

    def __init__(self, t: torch.Tensor, perm=None):
        shape = tuple(t.shape)
        self.shape = shape if perm is None else tuple(shape[i] for i in perm)
        self.dtype = jnp.dtype(_JAX_DTYPES[t.dtype])

    def __array__(self, *args, **kwargs):
        raise TypeError("shape-only spec")


def _readable(t: torch.Tensor) -> bool:
    return t.device.type != "meta" and not torch.compiler.is_compiling()


def _check_common(q, k, v, sinks, rank, names):
    for name, t in zip(names, (q, k, v)):
        validate.check_tensor(name, t, ndim=rank, dtypes=validate.FLOAT_DTYPES)
    validate.check_supported_device(names[0], q)
    validate.check_same_dtype(**dict(zip(names, (q, k, v))))
    if sinks is not None:
        validate.check_tensor("s_aux", sinks, ndim=1, dtypes=validate.FLOAT_DTYPES)


def _scalar(x):
    """A one-element tensor (transformers passes some scalars as tensors) as a Python number."""
    return x.item() if isinstance(x, torch.Tensor) and x.numel() == 1 else x


def _scale(softmax_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


# -- public op wrappers ----------------------------------------------------------


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
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    names = ("q", "k", "v")
    _check_common(q, k, v, sinks, 4, names)
    for name, seg in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
        if seg is not None:
            validate.check_tensor(name, seg, ndim=2, dtypes=_INT_DTYPES)
    validate.check_same_device(
        q=q, k=k, v=v, s_aux=sinks, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids
    )
    perm = None if layout == "bhsd" else (0, 2, 1, 3)
    left, right = checks.window(window_size)
    softcap, softmax_scale = _scalar(softcap), _scalar(softmax_scale)
    if not torch.compiler.is_compiling():
        checks.check_inputs(
            _Spec(q, perm),
            _Spec(k, perm),
            _Spec(v, perm),
            window_size=(left, right),
            softcap=softcap,
            softmax_scale=softmax_scale,
            sinks=None if sinks is None else _Spec(sinks),
            q_segment_ids=None if q_segment_ids is None else _Spec(q_segment_ids),
            kv_segment_ids=None if kv_segment_ids is None else _Spec(kv_segment_ids),
        )
    seg_q = None if q_segment_ids is None else q_segment_ids.to(torch.int32)
    seg_k = None if kv_segment_ids is None else kv_segment_ids.to(torch.int32)
    return _flash_attention(
        q,
        k,
        v,
        sinks,
        seg_q,
        seg_k,
        layout,
        bool(causal),
        left,
        right,
        float(softcap or 0.0),
        _scale(softmax_scale, q.shape[-1]),
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
    names = ("q", "k", "v")
    _check_common(q, k, v, sinks, 3, names)
    validate.check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=_INT_DTYPES)
    validate.check_tensor("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=_INT_DTYPES)
    validate.check_same_device(
        q=q, k=k, v=v, s_aux=sinks, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k
    )
    max_q, max_k = _scalar(max_seqlen_q), _scalar(max_seqlen_k)
    left, right = checks.window(window_size)
    softcap, softmax_scale = _scalar(softcap), _scalar(softmax_scale)
    # Eager host/TPU tensors: checks.py also checks the offsets' values.
    readable = _readable(cu_seqlens_q) and _readable(cu_seqlens_k)
    cu_q, cu_k = (
        (cu_seqlens_q.detach().cpu().numpy(), cu_seqlens_k.detach().cpu().numpy())
        if readable
        else (_Spec(cu_seqlens_q), _Spec(cu_seqlens_k))
    )
    if not torch.compiler.is_compiling():
        checks.check_inputs(
            _Spec(q),
            _Spec(k),
            _Spec(v),
            varlen=True,
            window_size=(left, right),
            softcap=softcap,
            softmax_scale=softmax_scale,
            sinks=None if sinks is None else _Spec(sinks),
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
        )
    if readable:
        checks.check_max_seqlen_values(cu_q, cu_k, max_q, max_k)
    max_q, max_k = int(max_q), int(max_k)
    bucket_k = min(k.shape[0], -(-max_k // MAX_SEQLEN_BUCKET) * MAX_SEQLEN_BUCKET)
    return _flash_attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q.to(torch.int32),
        cu_seqlens_k.to(torch.int32),
        sinks,
        max_q,
        max(max_k, bucket_k),
        bool(causal),
        left,
        right,
        float(softcap or 0.0),
        _scale(softmax_scale, q.shape[-1]),
    )
