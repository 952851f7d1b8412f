"""Flash attention's JAX API: `flash_attention` (dense, batched) and
`flash_attention_varlen` (packed sequences), differentiable through one
custom_vjp whose backward runs the dK/dV and dQ kernels on the forward's
output and logsumexp.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from . import checks, kernel_bwd, kernel_fwd, tiling
from . import schedule as bsched
from .kernel_fwd import KernelParams

# ---------------------------------------------------------------------------
# custom_vjp core on kernel-layout operands.


@dataclasses.dataclass(frozen=True)
class _Static:
    fwd: KernelParams
    dkdv: KernelParams
    dq: KernelParams
    interpret: bool
    batch_meta: bool  # segment/position arrays have a batch axis (else shared)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_core(st: _Static, q5, k, v, sinks, aux):
    return _forward(st, q5, k, v, sinks, aux)


def _forward(st, q5, k, v, sinks, aux):
    return kernel_fwd.fwd_call(
        st.fwd, q5, k, v, sinks, aux, aux["sched_fwd"], st.interpret, st.batch_meta
    )


def _core_fwd(st, q5, k, v, sinks, aux):
    o5, lse = _forward(st, q5, k, v, sinks, aux)
    # Residuals: inputs, output and the compact f32 logsumexp (one per row).
    return (o5, lse), (q5, k, v, sinks, aux, o5, lse)


def _core_bwd(st, res, cts):
    q5, k, v, sinks, aux, o5, lse = res
    do5, dlse = cts
    # d(lse)/d(logits) = p, so an lse cotangent folds into delta.
    delta = jnp.sum(do5.astype(jnp.float32) * o5.astype(jnp.float32), axis=-1)
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32)
    do5 = do5.astype(q5.dtype)
    dk, dv = kernel_bwd.dkdv_call(
        st.dkdv, q5, k, v, do5, lse, delta, aux, aux["sched_dkdv"], st.interpret, st.batch_meta
    )
    dq5 = kernel_bwd.dq_call(
        st.dq, q5, k, v, do5, lse, delta, aux, aux["sched_dq"], st.interpret, st.batch_meta
    )
    dsinks = None
    if sinks is not None:
        dsinks = _sink_grad(st.fwd, sinks, lse, delta).astype(sinks.dtype)
    aux_ct = jax.tree_util.tree_map(lambda _: None, aux)
    return dq5, dk, dv, dsinks, aux_ct


def _sink_grad(prm, sinks, lse, delta):
    """d sink_h = -sum over rows of head h of p_sink * delta (sink value is 0)."""
    b, hkv, gb, sr = lse.shape
    grp = prm.group
    if prm.geom.seq_major:
        lse = lse.reshape(b, hkv, sr // grp, grp).transpose(0, 1, 3, 2)
        delta = delta.reshape(b, hkv, sr // grp, grp).transpose(0, 1, 3, 2)
    sink = sinks.astype(jnp.float32).reshape(1, hkv, grp, 1)
    p_sink = jnp.exp(sink - lse)  # lse is finite whenever a sink exists
    return -jnp.sum(p_sink * delta, axis=(0, 3)).reshape(hkv * grp)


_attention_core.defvjp(_core_fwd, _core_bwd)


# ---------------------------------------------------------------------------
# Public entry points.


def _band(causal, left, right):
    left = bsched.UNBOUNDED if left < 0 else left
    right = bsched.UNBOUNDED if right < 0 else right
    if causal:
        right = min(right, 0)
    return left, right


def _params(
    geom,
    pb: checks.Problem,
    *,
    scale,
    softcap,
    causal,
    q_offset,
    has_qpos,
    has_segments,
    has_sinks,
    generation,
    sub_block,
):
    left, right = _band(causal, pb.left, pb.right)
    return KernelParams(
        geom=geom,
        group=pb.group,
        head_dim=pb.head_dim,
        head_dim_v=pb.head_dim_v,
        scale=float(scale),
        softcap=(float(softcap) if softcap else None),
        causal=causal,
        left=left,
        right=right,
        q_offset=q_offset,
        has_qpos=has_qpos,
        has_segments=has_segments,
        has_sinks=has_sinks,
        vmem_limit=tiling.VMEM_BUDGET_BYTES[generation],
        sub=bsched.sub_tiles(geom, sub_block, eligible=not (has_qpos or has_segments)),
    )


def _to_kernel_layout_q(x, hkv, seq_major):
    """[B, Hq, S, D] -> [B, Hkv, Gb, Sr, D]."""
    b, hq, s, d = x.shape
    grp = hq // hkv
    x = x.reshape(b, hkv, grp, s, d)
    if seq_major:
        x = x.transpose(0, 1, 3, 2, 4).reshape(b, hkv, 1, s * grp, d)
    return x


def _from_kernel_layout_q(x, hq, seq_major):
    b, hkv, gb, sr, d = x.shape
    grp = hq // hkv
    if seq_major:
        x = x.reshape(b, hkv, sr // grp, grp, d).transpose(0, 1, 3, 2, 4)
    return x.reshape(b, hq, -1, d)


def _from_kernel_layout_rows(x, hq, seq_major):
    b, hkv, gb, sr = x.shape
    grp = hq // hkv
    if seq_major:
        x = x.reshape(b, hkv, sr // grp, grp).transpose(0, 1, 3, 2)
    return x.reshape(b, hq, -1)


def _rows_meta(x, grp, seq_major):
    """Per-position int array [Bm, S] -> per-row kernel array [Bm, 1, Sr]."""
    if seq_major:
        x = jnp.repeat(x, grp, axis=1)
    return x[:, None, :].astype(jnp.int32)


def flash_attention(
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
    block_sizes: tiling.BlockSizes | None = None,
    generation=None,
    interpret=False,
    return_lse=False,
):
    """Flash attention, q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv].

    causal: bottom-right aligned when Sq != Skv (query i sees keys
      <= i + Skv - Sq). window_size=(left, right): flash-attn convention,
      -1 unbounded. softcap: logits -> softcap * tanh(logits / softcap).
    sinks: [Hq] learned logit per query head added to the softmax
      denominator (GPT-OSS). q/kv_segment_ids [B, Sq]/[B, Skv] int: no
      attention across segments.
    generation: 'v5e' | 'v6e' | 'tpu7x' (default: the attached TPU); picks
      block sizes and the VMEM limit.
    Returns out [B, Hq, Sq, Dv] (and logsumexp [B, Hq, Sq] f32 with
    return_lse; +inf for rows that see no key).
    """
    pb = checks.check_inputs(
        q,
        k,
        v,
        sinks=sinks,
        window_size=window_size,
        softcap=softcap,
        softmax_scale=softmax_scale,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    generation = tiling.check_generation(generation or tiling.detect_generation())
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(pb.head_dim)
    out_dtype = q.dtype
    if pb.q_len == 0 or pb.kv_len == 0:
        return _empty_result(q, v, pb, sinks, return_lse)
    q, k, v = _compute_dtype(q, k, v)
    plan = tiling.plan(
        generation=generation,
        q_len=pb.q_len,
        kv_len=pb.kv_len,
        group=pb.group,
        head_dim=pb.head_dim,
        head_dim_v=pb.head_dim_v,
        itemsize=q.dtype.itemsize,
        block_sizes=block_sizes,
    )
    has_seg = q_segment_ids is not None
    q_offset = pb.kv_len - pb.q_len
    grp = pb.group

    def prm(geom):
        return _params(
            geom,
            pb,
            scale=scale,
            softcap=softcap,
            causal=causal,
            q_offset=q_offset,
            has_qpos=geom.seq_major,
            has_segments=has_seg,
            has_sinks=sinks is not None,
            generation=generation,
            sub_block=plan.sub_block,
        )

    st = _Static(prm(plan.fwd), prm(plan.dkdv), prm(plan.dq), bool(interpret), has_seg)
    kw = dict(
        q_offset=q_offset, group=grp, causal=causal, left=pb.left, right=pb.right, segmented=has_seg
    )
    (sched_fwd,) = bsched.dense_schedules(plan.fwd, None, **kw)
    (sched_dq, sched_dkdv) = bsched.dense_schedules(plan.dq, plan.dkdv, **kw)
    aux = {
        "sched_fwd": jnp.asarray(sched_fwd),
        "sched_dkdv": jnp.asarray(sched_dkdv),
        "sched_dq": jnp.asarray(sched_dq),
    }
    seq_major = plan.fwd.seq_major
    if seq_major:
        rows = jnp.arange(pb.q_len * grp, dtype=jnp.int32)
        aux["qpos"] = (rows // grp + q_offset)[None, None, :]
    if has_seg:
        aux["qseg"] = _rows_meta(q_segment_ids, grp, seq_major)
        aux["kseg"] = kv_segment_ids[:, None, :].astype(jnp.int32)
        if seq_major:
            aux["qpos"] = jnp.broadcast_to(aux["qpos"], (pb.batch,) + aux["qpos"].shape[1:])
    q5 = _to_kernel_layout_q(q, pb.num_kv_heads, seq_major)
    o5, lse = _call_core(st, q5, k, v, sinks, aux)
    out = _from_kernel_layout_q(o5, pb.num_q_heads, seq_major).astype(out_dtype)
    if return_lse:
        return out, _from_kernel_layout_rows(lse, pb.num_q_heads, seq_major)
    return out


def _call_core(st, q5, k, v, sinks, aux):
    return _attention_core(st, q5, k, v, sinks, aux)


def _compute_dtype(q, k, v):
    # f16 is computed in f32 (Mosaic has no f16 VPU path on all generations);
    # outputs are cast back by the caller.
    if q.dtype == jnp.float16:
        return q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    return q, k, v


def _empty_result(q, v, pb, sinks, return_lse, varlen=False):
    if varlen:
        out = jnp.zeros((pb.q_len, pb.num_q_heads, pb.head_dim_v), q.dtype)
        lse_shape = (pb.num_q_heads, pb.q_len)
    else:
        out = jnp.zeros((pb.batch, pb.num_q_heads, pb.q_len, pb.head_dim_v), q.dtype)
        lse_shape = (pb.batch, pb.num_q_heads, pb.q_len)
    if not return_lse:
        return out
    if sinks is None:
        lse = jnp.full(lse_shape, jnp.inf, jnp.float32)
    else:
        s = sinks.astype(jnp.float32)
        lse = jnp.broadcast_to(s[:, None] if varlen else s[None, :, None], lse_shape)
    return out, lse


def flash_attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=False,
    window_size=(-1, -1),
    softcap=None,
    sinks=None,
    softmax_scale=None,
    block_sizes: tiling.BlockSizes | None = None,
    generation=None,
    interpret=False,
    return_lse=False,
):
    """Packed variable-length attention (flash-attn varlen convention).

    q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv];
    cu_seqlens_q/k int32 [num_seqs + 1] offsets. causal is bottom-right
    aligned per sequence. Sequences never attend across boundaries; queries
    of a sequence with no keys output 0. The block schedule is built on
    device from cu_seqlens with a static bound derived from max_seqlen_k.
    Returns out [total_q, Hq, Dv] (and logsumexp [Hq, total_q]).
    """
    pb = checks.check_inputs(
        q,
        k,
        v,
        varlen=True,
        sinks=sinks,
        window_size=window_size,
        softcap=softcap,
        softmax_scale=softmax_scale,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )
    generation = tiling.check_generation(generation or tiling.detect_generation())
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(pb.head_dim)
    out_dtype = q.dtype
    if pb.q_len == 0 or pb.kv_len == 0:
        return _empty_result(q, v, pb, sinks, return_lse, varlen=True)
    q, k, v = _compute_dtype(q, k, v)
    plan = tiling.plan(
        generation=generation,
        q_len=pb.q_len,
        kv_len=pb.kv_len,
        group=pb.group,
        head_dim=pb.head_dim,
        head_dim_v=pb.head_dim_v,
        itemsize=q.dtype.itemsize,
        block_sizes=block_sizes,
    )
    grp, hkv = pb.group, pb.num_kv_heads
    cu_q = cu_seqlens_q.astype(jnp.int32)
    cu_k = cu_seqlens_k.astype(jnp.int32)
    kw = dict(
        group=grp, causal=causal, left=pb.left, right=pb.right, max_seqlen_k=int(max_seqlen_k)
    )
    seg, pos, (sched_fwd, _) = bsched.varlen_schedules(
        cu_q, cu_k, pb.q_len, pb.kv_len, plan.fwd, plan.dkdv, **kw
    )
    _, _, (sched_dq, sched_dkdv) = bsched.varlen_schedules(
        cu_q, cu_k, pb.q_len, pb.kv_len, plan.dq, plan.dkdv, **kw
    )
    t_k = jnp.arange(pb.kv_len, dtype=jnp.int32)
    kseg = jnp.clip(jnp.searchsorted(cu_k, t_k, side="right") - 1, 0, cu_k.shape[0] - 2)
    seq_major = plan.fwd.seq_major
    aux = {
        "sched_fwd": sched_fwd,
        "sched_dkdv": sched_dkdv,
        "sched_dq": sched_dq,
        "qpos": _rows_meta(pos[None], grp, seq_major),
        "qseg": _rows_meta(seg[None], grp, seq_major),
        "kseg": kseg[None, None, :].astype(jnp.int32),
    }

    def prm(geom):
        return _params(
            geom,
            pb,
            scale=scale,
            softcap=softcap,
            causal=causal,
            q_offset=0,
            has_qpos=True,
            has_segments=True,
            has_sinks=sinks is not None,
            generation=generation,
            sub_block=plan.sub_block,
        )

    st = _Static(prm(plan.fwd), prm(plan.dkdv), prm(plan.dq), bool(interpret), False)
    # [T, H, D] -> [1, H, T, D] kernel layout.
    q4 = q.transpose(1, 0, 2)[None]
    k4 = k.transpose(1, 0, 2)[None]
    v4 = v.transpose(1, 0, 2)[None]
    q5 = _to_kernel_layout_q(q4, hkv, seq_major)
    o5, lse = _call_core(st, q5, k4, v4, sinks, aux)
    out = _from_kernel_layout_q(o5, pb.num_q_heads, seq_major)[0].transpose(1, 0, 2)
    out = out.astype(out_dtype)
    if return_lse:
        return out, _from_kernel_layout_rows(lse, pb.num_q_heads, seq_major)[0]
    return out
