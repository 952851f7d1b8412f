"""Decode attention's JAX API: `flash_attention_kvcache`, attention of a few
new query positions over each sequence's cached keys (what flash-attn's
`flash_attn_with_kvcache` computes once the new keys are in the cache).

Forward only, like flash-attn's: decoding does not differentiate through the
cache. The kernel is kernel_decode.py; block sizes come from
tiling.decode_plan, argument rules from checks.check_kvcache_inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from . import checks, kernel_decode, tiling
from .kernel_decode import UNBOUNDED, DecodeParams


def _generation(config):
    """(generation, DecodeBlockSizes or None) from None | generation | DecodeBlockSizes."""
    if isinstance(config, tiling.DecodeBlockSizes):
        return tiling.detect_generation(), config
    if config is None:
        return tiling.detect_generation(), None
    if isinstance(config, str) and config in tiling.GENERATIONS:
        return config, None
    raise ValueError(
        f"config: expected None, a generation name ({', '.join(tiling.GENERATIONS)}) "
        f"or a tiling.DecodeBlockSizes, got {config!r}"
    )


def _band(causal, window_size):
    left, right = checks.window(window_size)
    left = UNBOUNDED if left < 0 else left
    right = UNBOUNDED if right < 0 else right
    if causal:
        right = min(right, 0)
    return left, right


def decode_params(
    pb: checks.KvCacheProblem,
    dtype,
    *,
    causal=False,
    window_size=(-1, -1),
    softcap=None,
    softmax_scale=None,
    config=None,
    sinks=False,
    return_lse=False,
) -> DecodeParams:
    """The kernel's static parameters for a checked problem."""
    generation, block_sizes = _generation(config)
    # No f16 vector path on every generation: f16 is computed and written in f32.
    kdtype = jnp.dtype(jnp.float32 if dtype == jnp.float16 else dtype)
    itemsize = kdtype.itemsize
    plan = tiling.decode_plan(
        generation=generation,
        batch=pb.batch,
        num_kv_heads=pb.num_kv_heads,
        rows=pb.q_len * pb.group,
        head_dim=pb.head_dim,
        head_dim_v=pb.head_dim_v,
        itemsize=itemsize,
        cache_len=pb.cache_len,
        page=pb.page,
        max_pages=pb.max_pages,
        block_sizes=block_sizes,
        out_itemsize=itemsize,
        sinks=sinks,
        return_lse=return_lse,
    )
    left, right = _band(causal, window_size)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(pb.head_dim)
    return DecodeParams(
        q_len=pb.q_len,
        group=pb.group,
        block_rows=plan.block_rows,
        heads_per_block=plan.heads_per_block,
        page=plan.page,
        pages_per_step=plan.pages_per_step,
        head_dim=pb.head_dim,
        head_dim_v=pb.head_dim_v,
        scale=float(scale),
        softcap=float(softcap) if softcap else None,
        causal=bool(causal),
        left=left,
        right=right,
        paged=pb.page is not None,
        squeezed=pb.num_kv_heads == 1,
        cores=plan.splits,
        slots=plan.slots,
        resident=plan.resident,
        direct=plan.direct,
        o_dtype=kdtype.name if plan.direct else "float32",
        with_lse=plan.with_lse,
        cache_len=pb.cache_len if pb.page is None else 0,
        vmem_limit=tiling.VMEM_BUDGET_BYTES[generation],
    )


# One program per call signature: called eagerly, the schedule, table and
# combine around the kernel were some thirty small programs, each compiled
# for every new shape.
@functools.partial(
    jax.jit,
    static_argnames=(
        "causal",
        "window_size",
        "softcap",
        "softmax_scale",
        "return_lse",
        "cache_layout",
        "config",
        "interpret",
    ),
)
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
    return_lse=False,
    cache_layout="bshd",
    kv_mask=None,
    config=None,
    interpret=False,
):
    """Attention of q [B, Sq, Hq, D] over the first cache_seqlens[b] keys of
    each sequence's cache -> out [B, Sq, Hq, Dv] (and lse [B, Hq, Sq] f32).

    Caches: contiguous k_cache [B_cache, S, Hkv, D], v_cache [B_cache, S,
    Hkv, Dv] (sequence b uses row cache_batch_idx[b], default b), or paged
    [num_pages, page, Hkv, D|Dv] with block_table int [B, max_pages].
    Query i of sequence b sits at position cache_seqlens[b] - Sq + i
    (bottom-right aligned, as flash-attn): causal and window_size=(left,
    right) are relative to it. sinks [Hq]: a per-head logit added to the
    softmax denominator. Rows that see no key (and no sink): output 0, lse
    +inf. Lengths are clamped to the cache (checked values are the torch
    wrapper's job: it reads them once in eager mode). cache_layout "bhsd":
    contiguous caches [B_cache, Hkv, S, D] (transformers' cache), and then
    kv_mask [B, S] (nonzero: visible) may mask keys below the lengths too
    (left padding).
    """
    pb = checks.check_kvcache_inputs(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        sinks=sinks,
        cache_layout=cache_layout,
        kv_mask=kv_mask,
    )
    checks.scalars(softcap, softmax_scale)
    prm = decode_params(
        pb,
        q.dtype,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        softmax_scale=softmax_scale,
        config=config,
        sinks=sinks is not None,
        return_lse=return_lse,
    )
    if cache_layout == "bhsd":  # heads lead: one head's keys are whole tiles, any Hkv
        prm = dataclasses.replace(
            prm, heads_major=True, squeezed=False, has_kv_mask=kv_mask is not None
        )
    out_dtype = q.dtype
    if q.dtype == jnp.float16:
        # No f16 vector path on every generation: computed in f32 (the whole
        # cache is converted each call; keep caches bf16 on TPU).
        q, k_cache, v_cache = (x.astype(jnp.float32) for x in (q, k_cache, v_cache))
    b, sq, hq, d = q.shape
    hkv, grp, rows = pb.num_kv_heads, pb.group, pb.q_len * pb.group
    lengths = jnp.clip(jnp.asarray(cache_seqlens).astype(jnp.int32), 0, pb.cache_len)
    # Rows ordered (position, head) within each kv head.
    q4 = q.reshape(b, sq, hkv, grp, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)
    if prm.squeezed:
        k_cache, v_cache = k_cache[:, :, 0], v_cache[:, :, 0]
    if prm.paged:
        table = kernel_decode.safe_table(prm, block_table, lengths)
        max_blocks = -(-pb.max_pages // prm.pages_per_step)
    else:
        table = (
            jnp.arange(b, dtype=jnp.int32)
            if cache_batch_idx is None
            else jnp.asarray(cache_batch_idx).astype(jnp.int32)
        )
        max_blocks = -(-pb.cache_len // prm.block_kv)
    if b > kernel_decode.MAX_SEQS or max_blocks > kernel_decode.MAX_BLOCKS:
        # the schedule packs (sequence, block) into one int32 word
        raise ValueError(
            f"q: expected at most {kernel_decode.MAX_SEQS} sequences and "
            f"{kernel_decode.MAX_BLOCKS} cache blocks per sequence, got batch {b} and "
            f"{max_blocks} blocks of {prm.block_kv} positions"
        )
    sched, steps, touched = kernel_decode.schedule(prm, lengths, max_blocks)
    if kv_mask is not None:
        kv_mask = kv_mask.astype(jnp.int32)
    o, lse = kernel_decode.decode_call(
        prm, q4, k_cache, v_cache, lengths, sched, steps, table, interpret, kv_mask
    )
    if prm.direct:  # one partial, already normalized: no combine step
        out = o[0]
        if return_lse:  # empty rows: flash-attn's +inf
            lse = jnp.where(lse[0, ..., 0] == -jnp.inf, jnp.inf, lse[0, ..., 0])
    else:
        sinks_rows = None
        if sinks is not None:
            s = sinks.astype(jnp.float32).reshape(hkv, 1, grp)
            sinks_rows = jnp.broadcast_to(s, (hkv, sq, grp)).reshape(hkv, rows)
        out, lse = kernel_decode.combine(o, lse, touched, sinks_rows)
    out = out.reshape(b, hkv, sq, grp, -1).transpose(0, 2, 1, 3, 4).reshape(b, sq, hq, -1)
    out = out.astype(out_dtype)
    if not return_lse:
        return out
    lse = lse.reshape(b, hkv, sq, grp).transpose(0, 1, 3, 2).reshape(b, hq, sq)
    return out, lse
