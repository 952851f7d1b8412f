"""Flash attention's JAX API: `flash_attention` (dense, batched) and
`flash_attention_varlen` (packed sequences), each differentiable through one
autograd path (torch_bindings/vjp.py) that the torch ops share: the forward
rule runs the forward kernel and keeps its per-row logsumexp as the residual;
the backward rule runs the dK/dV and dQ kernels on the inputs, the output and
that logsumexp. The forward kernel never runs in the backward.

Every entry takes `config`: None (the attached TPU's generation), a generation
name ("v5e", "v6e", "tpu7x"), or a tiling.BlockSizes (for the attached
generation's VMEM limit).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from . import checks, kernel_bwd, kernel_fwd, tiling
from . import schedule as bsched
from ._torch_bindings.vjp import differentiable
from .kernel_fwd import KernelParams


@dataclasses.dataclass(frozen=True)
class _Static:
    fwd: KernelParams
    dkdv: KernelParams
    dq: KernelParams
    interpret: object  # False, True or a pltpu.InterpretParams (_interpret)
    batch_meta: bool  # segment/position arrays have a batch axis (else shared)
    fuse_dq: bool  # dK/dV's kernel computes dQ too (tiling.Plan.fuse_dq)
    own_delta: bool  # and delta, where nothing else needs it (tiling.Plan.own_delta)
    stream_dq: bool  # and accumulates dQ in HBM (tiling.Plan.stream_dq)


def _kernels_fwd(st, q5, k, v, sinks, aux):
    """(o5, lse): the output and compact f32 logsumexp (one per row), kernel layout."""
    return kernel_fwd.fwd_call(
        st.fwd, q5, k, v, sinks, aux, aux["sched_fwd"], st.interpret, st.batch_meta
    )


def _kernels_bwd(st, q5, k, v, sinks, aux, o5, lse, do5, dlse):
    """(dq5, dk, dv, dsinks) from the forward's output and logsumexp, kernel layout."""
    own_delta = st.own_delta and sinks is None  # the sinks' gradient needs delta
    delta = None
    if not own_delta:
        d_axis = -2 if st.dkdv.swapped else -1
        delta = jnp.sum(do5.astype(jnp.float32) * o5.astype(jnp.float32), axis=d_axis)
        if dlse is not None:  # d(lse)/d(logits) = p: an lse cotangent folds into delta
            delta = delta - dlse.astype(jnp.float32)
    do5 = do5.astype(q5.dtype)
    out = kernel_bwd.dkdv_call(
        st.dkdv,
        q5,
        k,
        v,
        do5,
        lse,
        delta,
        aux,
        aux["sched_dkdv"],
        st.interpret,
        st.batch_meta,
        st.fuse_dq,
        o5 if own_delta else None,
        dlse if own_delta else None,
        stream_dq=st.stream_dq,
    )
    if st.fuse_dq:
        dk, dv, dq5 = out
    else:
        dk, dv = out
        dq5 = kernel_bwd.dq_call(
            st.dq, q5, k, v, do5, lse, delta, aux, aux["sched_dq"], st.interpret, st.batch_meta
        )
    dsinks = None
    if sinks is not None:
        dsinks = _sink_grad(st.fwd, sinks, lse, delta).astype(sinks.dtype)
    return dq5, dk, dv, dsinks


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


def _interpret(interpret):
    """interpret as the kernels take it: a bool, or a pltpu.InterpretParams
    (tests: DMAs run at their wait, so a read that overtakes a write reads
    stale data, as on a TPU)."""
    return interpret if isinstance(interpret, pltpu.InterpretParams) else bool(interpret)


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
    slab_rows=0,
    swapped=False,
):
    left, right = _band(causal, pb.left, pb.right)
    slab = tiling.slab(geom, slab_rows, 1 if geom.seq_major else pb.group)
    sub = bsched.sub_tiles(geom, sub_block, eligible=not (has_qpos or has_segments), rows=slab)
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
        sub=sub,
        slab=slab,
        swapped=swapped,
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


def _to_kernel_layout_rows(x, hkv, seq_major):
    """[B, Hq, S] -> [B, Hkv, Gb, Sr] (the inverse of _from_kernel_layout_rows)."""
    b, hq, s = x.shape
    grp = hq // hkv
    x = x.reshape(b, hkv, grp, s)
    if seq_major:
        x = x.transpose(0, 1, 3, 2).reshape(b, hkv, 1, s * grp)
    return x


def _compute_dtype(q, k, v):
    # f16 is computed in f32 (Mosaic has no f16 VPU path on all generations);
    # outputs are cast back by the caller.
    if q.dtype == jnp.float16:
        return q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    return q, k, v


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call resolved: kernel parameters, schedules, and the layout maps
    between the caller's arrays and the kernels' (q-like [.., Hq, .., D] <->
    [B, Hkv, Gb, Sr, D]; k/v-like <-> [B, Hkv, S, D]; per-row <-> [B, Hkv, Gb, Sr])."""

    pb: checks.Problem
    st: _Static | None  # None: no query or no key (nothing to launch)
    aux: dict | None
    q_in: Callable
    q_out: Callable
    kv_in: Callable
    kv_out: Callable
    rows_in: Callable
    rows_out: Callable


def _generation(config):
    """(generation, explicit BlockSizes or None) from config=None | generation | BlockSizes."""
    if isinstance(config, tiling.BlockSizes):
        return tiling.detect_generation(), config
    if config is None:
        return tiling.detect_generation(), None
    if isinstance(config, str) and config in tiling.GENERATIONS:
        return config, None
    raise ValueError(
        f"config: expected None, a generation name ({', '.join(tiling.GENERATIONS)}) "
        f"or a tiling.BlockSizes, got {config!r}"
    )


def _plan(pb, dtype, config, segmented):
    generation, block_sizes = _generation(config)
    plan = tiling.plan(
        generation=generation,
        q_len=pb.q_len,
        kv_len=pb.kv_len,
        group=pb.group,
        head_dim=pb.head_dim,
        head_dim_v=pb.head_dim_v,
        itemsize=jnp.dtype(jnp.float32 if dtype == jnp.float16 else dtype).itemsize,
        block_sizes=block_sizes,
        segmented=segmented,
    )
    return generation, plan


def _dense_call(
    q, k, v, sinks, q_segment_ids, *, causal, window_size, softcap, softmax_scale, config, interpret
):
    pb = checks.problem(q, k, v, window_size=window_size)
    hq, hkv = pb.num_q_heads, pb.num_kv_heads
    if pb.q_len == 0 or pb.kv_len == 0:
        return _Call(pb, None, None, *(None,) * 6)
    has_seg = q_segment_ids is not None
    generation, plan = _plan(pb, q.dtype, config, segmented=has_seg)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(pb.head_dim)
    q_offset = pb.kv_len - pb.q_len
    grp = pb.group
    seq_major = plan.fwd.seq_major
    swapped = kernel_fwd.swapped_layout(pb.head_dim, pb.head_dim_v, seq_major)

    def prm(geom, slab_rows=0):
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
            slab_rows=slab_rows,
            swapped=swapped,
        )

    st = _Static(
        prm(plan.fwd, plan.slab_rows),
        prm(plan.dkdv),
        prm(plan.dq),
        _interpret(interpret),
        has_seg,
        plan.fuse_dq,
        plan.own_delta,
        plan.stream_dq,
    )
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
    if plan.own_delta:  # O's blocks, where the dK/dV kernel derives delta
        aux["o_blocks_dkdv"] = jnp.asarray(bsched.o_blocks(sched_dkdv))
    if seq_major:
        rows = jnp.arange(pb.q_len * grp, dtype=jnp.int32)
        aux["qpos"] = (rows // grp + q_offset)[None, None, :]
    # swapped: (..., D, positions), a bitcast of the TPU's own layout of these arrays
    swap = (lambda x: jnp.swapaxes(x, -1, -2)) if swapped else (lambda x: x)
    return _Call(
        pb,
        st,
        aux,
        q_in=lambda x: swap(_to_kernel_layout_q(x, hkv, seq_major)),
        q_out=lambda x: _from_kernel_layout_q(swap(x), hq, seq_major),
        kv_in=swap,
        kv_out=swap,
        rows_in=lambda x: _to_kernel_layout_rows(x, hkv, seq_major),
        rows_out=lambda x: _from_kernel_layout_rows(x, hq, seq_major),
    )


def _with_segments(c: _Call, q_segment_ids, kv_segment_ids) -> dict:
    """The call's kernel metadata with the segment ids (traced arrays) added."""
    aux = dict(c.aux)
    if q_segment_ids is not None:
        grp, seq_major = c.pb.group, c.st.fwd.geom.seq_major
        aux["qseg"] = _rows_meta(q_segment_ids, grp, seq_major)
        aux["kseg"] = kv_segment_ids[:, None, :].astype(jnp.int32)
        if seq_major:
            aux["qpos"] = jnp.broadcast_to(aux["qpos"], (c.pb.batch,) + aux["qpos"].shape[1:])
    return aux


def _varlen_call(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    sinks,
    *,
    max_seqlen_k,
    causal,
    window_size,
    softcap,
    softmax_scale,
    config,
    interpret,
):
    pb = checks.problem(q, k, v, varlen=True, window_size=window_size)
    hq, hkv = pb.num_q_heads, pb.num_kv_heads
    if pb.q_len == 0 or pb.kv_len == 0:
        return _Call(pb, None, None, *(None,) * 6)
    generation, plan = _plan(pb, q.dtype, config, segmented=True)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(pb.head_dim)
    grp = pb.group
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
    if plan.own_delta:
        aux["o_blocks_dkdv"] = bsched.o_blocks(sched_dkdv, xp=jnp)

    def prm(geom, slab_rows=0):
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
            slab_rows=slab_rows,
        )

    st = _Static(
        prm(plan.fwd, plan.slab_rows),
        prm(plan.dkdv),
        prm(plan.dq),
        _interpret(interpret),
        False,
        plan.fuse_dq,
        plan.own_delta,
        plan.stream_dq,
    )

    # [T, H, D] <-> [1, H, T, D] kernel layout; per-row [H, T] <-> [1, H, T].
    def kv_in(x):
        return x.transpose(1, 0, 2)[None]

    def kv_out(x):
        return x[0].transpose(1, 0, 2)

    return _Call(
        pb,
        st,
        aux,
        q_in=lambda x: _to_kernel_layout_q(kv_in(x), hkv, seq_major),
        q_out=lambda x: kv_out(_from_kernel_layout_q(x, hq, seq_major)),
        kv_in=kv_in,
        kv_out=kv_out,
        rows_in=lambda x: _to_kernel_layout_rows(x[None], hkv, seq_major),
        rows_out=lambda x: _from_kernel_layout_rows(x, hq, seq_major)[0],
    )


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


# ---------------------------------------------------------------------------
# Forward and backward rules (shared by the dense and varlen entries).


def _forward(c: _Call, q, k, v, sinks, aux, return_lse, varlen):
    if c.st is None:
        return _empty_result(q, v, c.pb, sinks, return_lse, varlen), ()
    qc, kc, vc = _compute_dtype(q, k, v)
    o5, lse5 = _kernels_fwd(c.st, c.q_in(qc), c.kv_in(kc), c.kv_in(vc), sinks, aux)
    out = c.q_out(o5).astype(q.dtype)
    outputs = (out, c.rows_out(lse5)) if return_lse else out
    # Residuals: the compact logsumexp; and the f32 output when it was rounded
    # to a narrower output dtype (f16), so the backward's delta stays exact.
    return outputs, (lse5,) if o5.dtype == q.dtype else (lse5, o5)


def _backward(c: _Call, q, k, v, sinks, aux, outputs, residuals, cotangents, return_lse, varlen):
    dout, dlse = cotangents if return_lse else (cotangents, None)
    if c.st is None:
        zeros = tuple(jnp.zeros_like(x) for x in (q, k, v))
        if sinks is None or not return_lse:
            return (*zeros, None if sinks is None else jnp.zeros_like(sinks))
        _, vjp = jax.vjp(lambda s: _empty_result(q, v, c.pb, s, True, varlen)[1], sinks)
        return (*zeros, vjp(dlse)[0])
    out = outputs[0] if return_lse else outputs
    qc, kc, vc = _compute_dtype(q, k, v)
    lse5, o5 = residuals if len(residuals) == 2 else (residuals[0], c.q_in(out))
    dq5, dk, dv, dsinks = _kernels_bwd(
        c.st,
        c.q_in(qc),
        c.kv_in(kc),
        c.kv_in(vc),
        sinks,
        aux,
        o5,
        lse5,
        c.q_in(dout.astype(qc.dtype)),
        None if dlse is None else c.rows_in(dlse),
    )
    dq = c.q_out(dq5).astype(q.dtype)
    return dq, c.kv_out(dk).astype(k.dtype), c.kv_out(dv).astype(v.dtype), dsinks


def flash_attention_fwd(
    q, k, v, sinks, q_segment_ids, kv_segment_ids, *, return_lse=False, interpret=False, **kw
):
    """Dense forward rule: (outputs, residuals); see flash_attention for the arguments."""
    c = _dense_call(q, k, v, sinks, q_segment_ids, interpret=interpret, **kw)
    aux = None if c.st is None else _with_segments(c, q_segment_ids, kv_segment_ids)
    return _forward(c, q, k, v, sinks, aux, return_lse, False)


def flash_attention_bwd(
    args, outputs, residuals, cotangents, *, return_lse=False, interpret=False, **kw
):
    """Dense backward rule: (dq, dk, dv, dsinks, None, None)."""
    q, k, v, sinks, q_segment_ids, kv_segment_ids = args
    c = _dense_call(q, k, v, sinks, q_segment_ids, interpret=interpret, **kw)
    aux = None if c.st is None else _with_segments(c, q_segment_ids, kv_segment_ids)
    grads = _backward(c, q, k, v, sinks, aux, outputs, residuals, cotangents, return_lse, False)
    return (*grads, None, None)


def flash_attention_varlen_fwd(
    q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, *, return_lse=False, max_seqlen_q=None, **kw
):
    """Varlen forward rule: (outputs, residuals); see flash_attention_varlen."""
    c = _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, **kw)
    return _forward(c, q, k, v, sinks, c.aux, return_lse, True)


def flash_attention_varlen_bwd(
    args, outputs, residuals, cotangents, *, return_lse=False, max_seqlen_q=None, **kw
):
    """Varlen backward rule: (dq, dk, dv, None, None, dsinks)."""
    q, k, v, cu_seqlens_q, cu_seqlens_k, sinks = args
    c = _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, **kw)
    dq, dk, dv, dsinks = _backward(
        c, q, k, v, sinks, c.aux, outputs, residuals, cotangents, return_lse, True
    )
    return dq, dk, dv, None, None, dsinks


_flash_attention = differentiable(flash_attention_fwd, flash_attention_bwd)
_flash_attention_varlen = differentiable(flash_attention_varlen_fwd, flash_attention_varlen_bwd)


# ---------------------------------------------------------------------------
# Public entry points.


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
    config=None,
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
    config: None, a generation name ('v5e' | 'v6e' | 'tpu7x'; default: the
      attached TPU), or a tiling.BlockSizes; picks block sizes and the VMEM limit.
    interpret: run the kernels in Pallas' interpreter (CPU): True, or a
      pltpu.InterpretParams.
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
    return _flash_attention(
        q,
        k,
        v,
        sinks,
        q_segment_ids,
        kv_segment_ids,
        causal=bool(causal),
        window_size=(pb.left, pb.right),
        softcap=softcap,
        softmax_scale=softmax_scale,
        config=config,
        interpret=interpret,
        return_lse=bool(return_lse),
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
    causal=False,
    window_size=(-1, -1),
    softcap=None,
    sinks=None,
    softmax_scale=None,
    config=None,
    interpret=False,
    return_lse=False,
):
    """Packed variable-length attention (flash-attn varlen convention).

    q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv];
    cu_seqlens_q/k int32 [num_seqs + 1] offsets. causal is bottom-right
    aligned per sequence. Sequences never attend across boundaries; queries
    of a sequence with no keys output 0. The block schedule is built on
    device from cu_seqlens with a static bound derived from max_seqlen_k.
    config as in flash_attention.
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
    return _flash_attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        sinks,
        max_seqlen_q=int(max_seqlen_q),
        max_seqlen_k=int(max_seqlen_k),
        causal=bool(causal),
        window_size=(pb.left, pb.right),
        softcap=softcap,
        softmax_scale=softmax_scale,
        config=config,
        interpret=interpret,
        return_lse=bool(return_lse),
    )
