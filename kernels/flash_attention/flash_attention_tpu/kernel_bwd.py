"""Flash attention's backward Pallas kernels: dK/dV (kv-major walk) and dQ
(q-major walk), from the forward's output and per-row logsumexp (no forward
recomputation). Layout, schedule and masks as in kernel_fwd.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import schedule as bsched
from .kernel_fwd import (
    NN_DIMS,
    NT_DIMS,
    KernelParams,
    _common_specs,
    _compiler_params,
    _decode,
    _dot_f32,
    _flag,
    _flat_rows,
    _unit_pairs,
    _k_side,
    _key_valid_row,
    _keys,
    _logits,
    _meta_inputs,
    _q_side,
    _rows,
    _run_pair,
    _set_rows,
    _visible,
    _zero_tail_rows,
)

# ---------------------------------------------------------------------------
# dK/dV kernel: kv-major schedule, logits transposed (keys on sublanes) so
# the per-query logsumexp and delta are lane-major rows, as stored. The
# outputs are accumulated transposed too, dV^T = dO^T P^T and dK^T = Q^T dS^T
# [D, keys]: row-major, dV = P dO at Dv = 128 half-fills the 256-wide result
# of v6e/tpu7x and pops both halves of every 256-row partial, as the
# forward's PV did (kernel_fwd.py); [D, keys] fills it. dK/dV are transposed
# once per kv block, at the end.


def _dkdv_kernel(sched_ref, *refs, prm: KernelParams, interpret: bool):
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    refs = refs[6:]
    qpos_ref = refs.pop(0) if prm.has_qpos else None
    qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if prm.has_segments else (None, None)
    dk_ref, dv_ref, dk_acc, dv_acc = refs  # dk_acc: (D, bkv); dv_acc: (Dv, bkv)

    g = prm.geom
    gb, br = prm.heads_in_block, g.block_pos
    q_tail = g.q_rows_total % br != 0
    j, i, flags = _decode(sched_ref, pl.program_id(2))

    @pl.when(_flag(flags, bsched.INIT))
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    def tile(masked, r0, rc, k0, ck):
        n = gb * rc
        q3 = _rows(q_ref, r0, rc)
        do3 = _rows(do_ref, r0, rc)
        lse = _flat_rows(_rows(lse_ref, r0, rc))
        delta = _flat_rows(_rows(delta_ref, r0, rc))
        if masked:
            qpos, qvalid, qseg = _q_side(prm, i, qpos_ref, qseg_ref, r0, rc)
            if q_tail:
                row = i * br + r0 + lax.broadcasted_iota(jnp.int32, (gb, rc, 1), 1)
                valid3 = row < g.q_rows_total
                q3 = _zero_tail_rows(q3, valid3)
                do3 = _zero_tail_rows(do3, valid3)
                lse = jnp.where(qvalid, lse, 0.0)
                delta = jnp.where(qvalid, delta, 0.0)
        q = q3.reshape(n, prm.head_dim)
        do = do3.reshape(n, prm.head_dim_v)
        k = _keys(k_ref, k0, ck)
        v = _keys(v_ref, k0, ck)
        s, t = _logits(prm, lax.dot_general(k, q, NT_DIMS, preferred_element_type=jnp.float32))
        p = jnp.exp(s - lse)
        if masked:
            kidx, kvalid, kseg = _k_side(prm, j, kseg_ref, k0, ck)
            mask = _visible(prm, qpos, qvalid, qseg, kidx, kvalid, kseg)
            p = jnp.where(mask, p, 0.0)
        dvt = _dot_f32(jnp.transpose(do), p.astype(do.dtype), NT_DIMS, interpret)
        dp = lax.dot_general(v, do, NT_DIMS, preferred_element_type=jnp.float32)
        ds = p * (dp - delta)
        if t is not None:
            ds = ds * (1.0 - t * t)
        dkt = _dot_f32(jnp.transpose(q), ds.astype(q.dtype), NT_DIMS, interpret)
        if ck == g.block_kv:
            dv_acc[...] += dvt
            dk_acc[...] += dkt
        else:
            dv_acc[:, pl.ds(k0, ck)] += dvt
            dk_acc[:, pl.ds(k0, ck)] += dkt

    _run_pair(prm, i, j, flags, tile)

    @pl.when(_flag(flags, bsched.FINAL))
    def _final():
        dk_ref[...] = jnp.transpose(dk_acc[...] * prm.scale).astype(dk_ref.dtype)
        dv_ref[...] = jnp.transpose(dv_acc[...]).astype(dv_ref.dtype)


# ---------------------------------------------------------------------------
# dQ kernel: q-major schedule like the forward, and transposed like it
# (kernel_fwd.py): dS^T [keys, rows] from K q^T and V dO^T, dQ^T = K^T dS^T
# [D, rows], with lse and delta as the lane rows they are stored as; K^T is
# stored once per step, dQ transposed once per q block.


def _dq_kernel(sched_ref, *refs, prm: KernelParams, interpret: bool):
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    refs = refs[6:]
    qpos_ref = refs.pop(0) if prm.has_qpos else None
    qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if prm.has_segments else (None, None)
    dq_ref, dq_acc, kt_ref = refs  # dq_acc: (units, D, Gb * unit); kt: (D, bkv)

    g = prm.geom
    gb, unit = prm.heads_in_block, prm.unit
    units = g.block_pos // unit
    kv_tail = g.kv_len % g.block_kv != 0
    i, j, flags = _decode(sched_ref, pl.program_id(2))

    @pl.when(_flag(flags, bsched.INIT))
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    @pl.when(_flag(flags, bsched.COMPUTE))
    def _transpose_k():
        kt_ref[...] = jnp.transpose(k_ref[...])

    def tile(masked, a, k0, ck):
        n, r0 = gb * unit, a * unit
        q = _rows(q_ref, r0, unit).reshape(n, prm.head_dim)
        do = _rows(do_ref, r0, unit).reshape(n, prm.head_dim_v)
        lse = _flat_rows(_rows(lse_ref, r0, unit))
        delta = _flat_rows(_rows(delta_ref, r0, unit))
        k = _keys(k_ref, k0, ck)
        v = _keys(v_ref, k0, ck)
        kt = kt_ref[...] if ck == kt_ref.shape[1] else kt_ref[:, pl.ds(k0, ck)]
        if masked:
            kidx, kvalid, kseg = _k_side(prm, j, kseg_ref, k0, ck)
            if kv_tail:  # keep dS finite (0) past the end (softcap's tanh, dP), and K^T dS
                k = _zero_tail_rows(k, kvalid)
                v = _zero_tail_rows(v, kvalid)
                kt = jnp.where(_key_valid_row(prm, j, k0, ck), kt, jnp.zeros_like(kt))
        s, t = _logits(prm, lax.dot_general(k, q, NT_DIMS, preferred_element_type=jnp.float32))
        p = jnp.exp(s - lse)
        if masked:
            qpos, qvalid, qseg = _q_side(prm, i, qpos_ref, qseg_ref, r0, unit)
            mask = _visible(prm, qpos, qvalid, qseg, kidx, kvalid, kseg)
            p = jnp.where(mask, p, 0.0)
        dp = lax.dot_general(v, do, NT_DIMS, preferred_element_type=jnp.float32)
        ds = p * (dp - delta)
        if t is not None:
            ds = ds * (1.0 - t * t)
        dq_acc[a] += _dot_f32(kt, ds.astype(kt.dtype), NN_DIMS, interpret)

    _unit_pairs(prm, i, j, flags, tile)

    @pl.when(_flag(flags, bsched.FINAL))
    def _final():
        for a in range(units):
            out = jnp.transpose(dq_acc[a] * prm.scale).reshape(gb, unit, prm.head_dim)
            _set_rows(dq_ref, a * unit, unit, out.astype(dq_ref.dtype))


def _bwd_operands(prm, q5, k, v, do5, lse, delta, aux, outer_is_q, batch_meta):
    """Operands and BlockSpecs shared by the dK/dV and dQ kernels (they differ in walk order)."""
    q_spec, kv_spec, row_spec, qmeta_spec, kmeta_spec = _common_specs(prm, outer_is_q, batch_meta)
    args = [q5, k, v, do5, lse, delta]
    specs = [
        q_spec(prm.head_dim),
        kv_spec(prm.head_dim),
        kv_spec(prm.head_dim_v),
        q_spec(prm.head_dim_v),
        row_spec,
        row_spec,
    ]
    margs, mspecs = _meta_inputs(prm, aux, qmeta_spec, kmeta_spec)
    return args + margs, specs + mspecs, q_spec, kv_spec


def dkdv_call(prm, q5, k, v, do5, lse, delta, aux, sched, interpret, batch_meta):
    b, hkv = k.shape[0], k.shape[1]
    g = prm.geom
    args, specs, _, kv_spec = _bwd_operands(prm, q5, k, v, do5, lse, delta, aux, False, batch_meta)
    out_shape = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    out_specs = (kv_spec(prm.head_dim), kv_spec(prm.head_dim_v))
    scratch = [
        pltpu.VMEM((prm.head_dim, g.block_kv), jnp.float32),
        pltpu.VMEM((prm.head_dim_v, g.block_kv), jnp.float32),
    ]
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, prm=prm, interpret=bool(interpret)),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, sched.shape[0]),
            in_specs=specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        compiler_params=_compiler_params(prm),
        interpret=interpret,
        name="flash_attention_dkdv",
    )(sched, *args)


def dq_call(prm, q5, k, v, do5, lse, delta, aux, sched, interpret, batch_meta):
    b, hkv = k.shape[0], k.shape[1]
    g = prm.geom
    args, specs, q_spec, _ = _bwd_operands(prm, q5, k, v, do5, lse, delta, aux, True, batch_meta)
    unit = prm.unit
    return pl.pallas_call(
        functools.partial(_dq_kernel, prm=prm, interpret=bool(interpret)),
        out_shape=jax.ShapeDtypeStruct(q5.shape, q5.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, sched.shape[0]),
            in_specs=specs,
            out_specs=q_spec(prm.head_dim),
            scratch_shapes=[
                pltpu.VMEM(
                    (g.block_pos // unit, prm.head_dim, prm.heads_in_block * unit), jnp.float32
                ),
                pltpu.VMEM((prm.head_dim, g.block_kv), k.dtype),
            ],
        ),
        compiler_params=_compiler_params(prm),
        interpret=interpret,
        name="flash_attention_dq",
    )(sched, *args)
