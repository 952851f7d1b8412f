"""Public API: flash-attn's functions and transformers' attention interface.

`flash_attn_func` / `flash_attn_varlen_func` follow flash-attn 2's calling
conventions ([B, S, H, D] and packed [total, H, D]), plus `s_aux` (attention
sinks, GPT-OSS) as in vLLM's flash-attn 3. transformers (5.22) reads the
varlen function's signature to decide which optional arguments it passes
(`modeling_flash_attention_utils._lazy_define_process_function`): every name
below that it knows (dropout_p, softmax_scale, causal, window_size, softcap,
deterministic, s_aux, max_seqlen_q, max_seqlen_k) is therefore passed.

`attention_forward` is a drop-in for transformers' attention interface
(`ALL_ATTENTION_FUNCTIONS`): it takes [B, H, S, D] tensors and the model's
mask and calls the dense kernel directly, GQA natively (no repeated K/V).
"""

from __future__ import annotations

import torch

from .ops import flash_attention, flash_attention_kvcache, flash_attention_varlen


def _unsupported(dropout_p, alibi_slopes, return_attn_probs):
    if dropout_p:
        raise NotImplementedError(
            f"dropout_p: attention dropout is not supported by flash-attention-tpu (got {dropout_p}); "
            "expected 0.0 (call the model in eval mode or set attention_dropout=0)"
        )
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not supported by flash-attention-tpu")
    if return_attn_probs:
        raise NotImplementedError(
            "return_attn_probs: flash-attention-tpu returns only the attention output"
        )


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    s_aux=None,
):
    """Attention over q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv] -> [B, Sq, Hq, Dv].

    Hq must be a multiple of Hkv (GQA/MQA, no K/V repeat). causal is aligned
    to the bottom right when Sq != Skv. window_size=(left, right): keys
    within [i - left, i + right] of query i, -1 unbounded. softcap > 0:
    logits -> softcap * tanh(logits / softcap). s_aux [Hq]: per-head sink
    logit added to the softmax denominator. deterministic is accepted and
    ignored: the kernels are always deterministic. Not supported (raise
    NotImplementedError): dropout_p > 0, alibi_slopes, return_attn_probs.
    """
    _unsupported(dropout_p, alibi_slopes, return_attn_probs)
    return flash_attention(
        q,
        k,
        v,
        sinks=s_aux,
        layout="bshd",
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        softmax_scale=softmax_scale,
    )


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    s_aux=None,
):
    """Packed sequences: q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv] -> [total_q, Hq, Dv].

    cu_seqlens_q/k: int32 or int64 [num_seqs + 1], nondecreasing offsets from
    0 to total (empty sequences allowed). max_seqlen_q/k: int or one-element
    tensor, at least the longest sequence. No attention across sequences;
    causal and windows are aligned per sequence (bottom right). Other
    arguments as in flash_attn_func.
    """
    _unsupported(dropout_p, alibi_slopes, return_attn_probs)
    return flash_attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        sinks=s_aux,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        softmax_scale=softmax_scale,
    )


# -- packed forms: q, k, v stacked in one tensor (flash-attn's *packed_func) ---------


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    s_aux=None,
):
    """qkv [B, S, 3, H, D] -> [B, S, H, D]; flash_attn_func on its three slices
    (gradients flow back into qkv). Other arguments as flash_attn_func."""
    _packed("qkv", qkv, 5, 3, "[batch, seq, 3, heads, head_dim]")
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        s_aux,
    )


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    s_aux=None,
):
    """q [B, Sq, Hq, D], kv [B, Skv, 2, Hkv, D] -> [B, Sq, Hq, D] (GQA as
    flash_attn_func). Other arguments as flash_attn_func."""
    _packed("kv", kv, 5, 2, "[batch, seq, 2, kv_heads, head_dim]")
    k, v = kv.unbind(dim=2)
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        s_aux,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    s_aux=None,
):
    """Packed sequences, qkv [total, 3, H, D] -> [total, H, D]; one cu_seqlens
    and max_seqlen for queries and keys. Other arguments as flash_attn_varlen_func."""
    _packed("qkv", qkv, 4, 3, "[total, 3, heads, head_dim]")
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        s_aux,
    )


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    s_aux=None,
):
    """Packed sequences, q [total_q, Hq, D], kv [total_k, 2, Hkv, D] ->
    [total_q, Hq, D]. Other arguments as flash_attn_varlen_func."""
    _packed("kv", kv, 4, 2, "[total, 2, kv_heads, head_dim]")
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        s_aux,
    )


def _packed(name, x, rank, parts, layout):
    axis = rank - 3
    if not isinstance(x, torch.Tensor) or x.dim() != rank or x.shape[axis] != parts:
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected a tensor {layout}, got {got}")


def _append_to_cache(k_cache, v_cache, k, v, lengths, block_table, cache_batch_idx):
    """Writes k/v [B, S_new, Hkv, D] into the caches (in place) at each
    sequence's positions lengths[b] .. lengths[b] + S_new - 1."""
    b, s_new = k.shape[:2]
    pos = lengths.to(torch.long)[:, None] + torch.arange(s_new, device=k.device)[None, :]
    if block_table is None:
        rows = torch.arange(b, device=k.device) if cache_batch_idx is None else cache_batch_idx
        index = (rows.to(torch.long)[:, None].expand(b, s_new), pos)
    else:
        page = k_cache.shape[1]
        index = (torch.gather(block_table.to(torch.long), 1, pos // page), pos % page)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    s_aux=None,
):
    """flash-attn's decode entry: q [B, Sq, Hq, D] over a KV cache -> out
    [B, Sq, Hq, Dv] (and softmax_lse [B, Hq, Sq] f32 with return_softmax_lse).

    k_cache/v_cache: [B_cache, S, Hkv, D|Dv], or paged [num_pages, page,
    Hkv, D|Dv] with block_table int32 [B, max_pages]. cache_seqlens: int or
    int32 [B], the keys already in each sequence's cache (None: the whole
    contiguous cache). k/v [B, S_new, Hkv, D|Dv], if given, are written into
    the caches in place at positions cache_seqlens .. + S_new, and attention
    then covers cache_seqlens + S_new keys (cache_seqlens itself is not
    updated, as in flash-attn). Queries are aligned to the bottom right of
    each sequence's keys for causal and window_size. cache_batch_idx [B]:
    each sequence's cache row (contiguous caches). s_aux [Hq]: attention
    sinks. num_splits is accepted and ignored (the kernel splits the work
    itself). Not supported (NotImplementedError): rotary_cos/rotary_sin,
    cache_leftpad, alibi_slopes.
    """
    _unsupported(0.0, alibi_slopes, False)
    if rotary_cos is not None or rotary_sin is not None:
        raise NotImplementedError(
            "rotary_cos/rotary_sin: rotary embedding inside the kernel is not supported by "
            "flash-attention-tpu; apply it to q and k before the call"
        )
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad: left-padded caches are not supported")
    if (k is None) != (v is None):
        raise ValueError("k, v: expected both (new keys and values to append) or neither")
    batch = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() else 0
    if cache_seqlens is None:
        if block_table is not None:
            raise ValueError("cache_seqlens: expected the lengths of a paged cache, got None")
        cache_seqlens = k_cache.shape[1] - (0 if k is None else k.shape[1])
    if not isinstance(cache_seqlens, torch.Tensor):
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
            raise ValueError(
                f"cache_seqlens: expected an int or an int32 tensor [batch], got {cache_seqlens!r}"
            )
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    lengths = cache_seqlens
    if k is not None:
        for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
            if not isinstance(new, torch.Tensor) or new.dim() != 4:
                raise ValueError(
                    f"{name}: expected a tensor [batch, seqlen_new, kv_heads, head_dim]"
                )
            want = (batch, k.shape[1], *cache.shape[2:])
            if tuple(new.shape) != want or new.dtype != cache.dtype:
                raise ValueError(
                    f"{name}: expected shape {list(want)} and dtype {cache.dtype} (the cache's), "
                    f"got {list(new.shape)} {new.dtype}"
                )
        if cache_seqlens.shape != (batch,) or cache_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"cache_seqlens: expected an int32 tensor [{batch}], got "
                f"{list(cache_seqlens.shape)} {cache_seqlens.dtype}"
            )
        lengths = cache_seqlens.to(torch.int32) + k.shape[1]
        if lengths.device.type != "meta" and not torch.compiler.is_compiling():
            capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
            if int(lengths.max()) > capacity or int(cache_seqlens.min()) < 0:
                raise ValueError(
                    f"cache_seqlens: expected values in [0, {capacity - k.shape[1]}] so that the "
                    f"{k.shape[1]} new keys fit the cache, got {cache_seqlens.tolist()}"
                )
        _append_to_cache(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx)
    out, lse = flash_attention_kvcache(
        q,
        k_cache,
        v_cache,
        lengths,
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        sinks=s_aux,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        softmax_scale=softmax_scale,
    )
    return (out, lse) if return_softmax_lse else out


# -- transformers attention interface --------------------------------------------

_MASK_HELP = (
    "supported masks: None, a 2-D padding mask [batch, kv_len] (1/True = keep; what transformers' "
    "flash_attention_2 mask function returns), or a 4-D [batch, 1, q_len, kv_len] boolean/additive "
    "mask that equals the causal/sliding-window pattern combined with key padding"
)


def _band(q_len, kv_len, causal, left, right, device):
    """[Sq, Skv] bool: visibility of key j from query i, bottom-right aligned."""
    qi = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    kj = torch.arange(kv_len, device=device)[None, :]
    band = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if causal:
        band &= kj <= qi
    elif right >= 0:
        band &= kj <= qi + right
    if left >= 0:
        band &= kj >= qi - left
    return band


def _kv_valid_from_4d(mask, batch, q_len, kv_len, causal, left, right):
    """Key padding [B, Skv] of a 4-D mask, checked (eager) to be all the mask says."""
    if (
        mask.shape[1] != 1
        or mask.shape[2] != q_len
        or mask.shape[3] != kv_len
        or mask.shape[0] not in (1, batch)
    ):
        raise ValueError(
            f"attention_mask: expected shape [{batch} or 1, 1, {q_len}, {kv_len}], "
            f"got {list(mask.shape)}; {_MASK_HELP}"
        )
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask == 0
    kv_valid = allowed.any(dim=2)[:, 0].expand(batch, kv_len)
    if mask.device.type != "meta" and not torch.compiler.is_compiling():
        if mask.dtype != torch.bool:
            blocked = mask <= torch.finfo(mask.dtype).min / 2
            if not bool(torch.all(allowed | blocked)):
                raise ValueError(
                    f"attention_mask: additive biases other than 0 / -inf are not supported; "
                    f"{_MASK_HELP}"
                )
        want = _band(q_len, kv_len, causal, left, right, mask.device)[None] & kv_valid[:, None, :]
        if not torch.equal(want, allowed[:, 0].expand(batch, q_len, kv_len)):
            raise ValueError(
                f"attention_mask: this mask is not expressible as causal={causal}, "
                f"window=({left}, {right}) plus key padding; {_MASK_HELP}"
            )
    return kv_valid


def _packed_segments(position_ids, batch, q_len, kv_len):
    """Segment ids [1, S] of sequences packed in one row (positions restart), else None.

    Like transformers' flash path, packing is recognised from position ids
    that restart at their minimum; with segment ids, causal and window masks
    by packed index are exactly the per-sequence ones. Eager mode reads the
    ids once (a device sync) to keep unpacked rows on the faster segment-free
    path; under torch.compile the segments are always used.
    """
    if (
        position_ids is None
        or batch != 1
        or q_len != kv_len
        or q_len < 2
        or position_ids.numel() != q_len
    ):
        return None
    pos = position_ids.reshape(1, q_len)
    seg = torch.cumsum((pos == pos.min()).to(torch.int32), dim=1, dtype=torch.int32)
    if pos.device.type != "meta" and not torch.compiler.is_compiling() and int(seg[0, -1]) == 1:
        return None
    return seg


# Query lengths up to this (a decode step, speculative tokens) run the decode
# kernel over the cache: it reads the keys where the cache holds them, every
# head's in one ring of DMAs, instead of the dense kernel's blocks.
DECODE_MAX_Q_LEN = 16


def _decode_forward(query, key, value, attention_mask, causal, window, sinks, softcap, scaling, kw):
    """A decode step through flash_attention_kvcache on transformers' [B, Hkv, S, D]
    cache, or None when the call is not one (packed sequences)."""
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    if kw.get("cu_seq_lens_q") is not None or q_len > kv_len:
        return None
    if (
        attention_mask is None
        and _packed_segments(kw.get("position_ids"), batch, q_len, kv_len) is not None
    ):
        return None
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, sinks)
    ):
        return None  # training: the decode kernel has no backward; the dense one has
    kv_mask, length = None, kv_len
    if attention_mask is not None:
        if attention_mask.dim() == 2:
            if attention_mask.shape[0] != batch or attention_mask.shape[1] > kv_len:
                return None  # the dense path reports it
            kv_mask = attention_mask.bool()
            length = attention_mask.shape[1]  # a static cache's slots past it are unused
        else:
            kv_mask = _kv_valid_from_4d(
                attention_mask, batch, q_len, kv_len, causal, window[0], window[1]
            )
        kv_mask = kv_mask.to(torch.int32)
        if kv_mask.shape[1] < kv_len:
            kv_mask = torch.nn.functional.pad(kv_mask, (0, kv_len - kv_mask.shape[1]))
    lengths = torch.full((batch,), length, dtype=torch.int32, device=query.device)
    out, _ = flash_attention_kvcache(
        query.transpose(1, 2),
        key,
        value,
        lengths,
        sinks=sinks,
        causal=causal,
        window_size=window,
        softcap=softcap,
        softmax_scale=scaling,
        cache_layout="bhsd",
        kv_mask=kv_mask,
    )
    return out


def attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """transformers attention interface: query [B, Hq, Sq, D], key/value [B, Hkv, Skv, D]
    -> (out [B, Sq, Hq, D], None).

    Causal from `is_causal` (kwarg, else `module.is_causal`); sinks from the
    `s_aux` kwarg or `module.sinks` (GPT-OSS); `sliding_window` w means the
    last w keys (transformers' convention). Padding masks run the dense kernel
    with segment ids (keys of padding get another segment), so shapes stay
    static; packed sequences given as `cu_seq_lens_q/k` + `max_length_q/k`
    (DataCollatorWithFlattening) run the varlen kernel, packed sequences
    given only by restarting `position_ids` (batch 1, no mask) run the dense
    kernel with segment ids. Any other mask raises a ValueError.
    """
    _unsupported(dropout, None, False)
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    left = right = -1
    if sliding_window is not None:
        left = right = int(sliding_window) - 1
    window = (left, right)

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if attention_mask is None and all(x is not None for x in (cu_q, cu_k, max_q, max_k)):
        b, hq = query.shape[:2]
        q, k, v = (
            x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (query, key, value)
        )
        out = flash_attention_varlen(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            sinks=sinks,
            causal=causal,
            window_size=window,
            softcap=softcap,
            softmax_scale=scaling,
        )
        return out.view(b, -1, hq, out.shape[-1]), None

    if query.shape[2] <= DECODE_MAX_Q_LEN and (attention_mask is None or attention_mask.dim() != 3):
        out = _decode_forward(
            query, key, value, attention_mask, causal, window, sinks, softcap, scaling, kwargs
        )
        if out is not None:
            return out, None

    q_seg = kv_seg = None
    if attention_mask is None:
        q_seg = kv_seg = _packed_segments(
            kwargs.get("position_ids"), query.shape[0], query.shape[2], key.shape[2]
        )
    else:
        batch, q_len = query.shape[0], query.shape[2]
        if attention_mask.dim() == 2:
            kv_len = key.shape[2]
            if (
                attention_mask.shape[1] < kv_len
            ):  # static cache: keys past the mask are unused slots
                key, value = (
                    key[:, :, : attention_mask.shape[1]],
                    value[:, :, : attention_mask.shape[1]],
                )
            kv_valid = attention_mask[:, -key.shape[2] :].bool()
            if kv_valid.shape[0] != batch:
                raise ValueError(
                    f"attention_mask: expected batch {batch}, got shape {list(attention_mask.shape)}"
                )
            # transformers' flash mask is None unless there is padding: no sync to test for it.
            padded = True
        elif attention_mask.dim() == 4:
            kv_valid = _kv_valid_from_4d(
                attention_mask, batch, q_len, key.shape[2], causal, left, right
            )
            # The check above already read the mask; without padding the
            # segment-free kernel path (sub-tiled diagonal) is faster.
            padded = (
                kv_valid.device.type == "meta"
                or torch.compiler.is_compiling()
                or not bool(kv_valid.all())
            )
        else:
            raise ValueError(
                f"attention_mask: expected 2 or 4 dimensions, got shape "
                f"{list(attention_mask.shape)}; {_MASK_HELP}"
            )
        if padded:
            # Query rows all share segment 1: like eager, a padded query still
            # sees the valid keys; padded keys (segment 0) are seen by none.
            q_seg = torch.ones(batch, q_len, dtype=torch.int32, device=query.device)
            kv_seg = kv_valid.to(torch.int32)

    out = flash_attention(
        query,
        key,
        value,
        sinks=sinks,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        layout="bhsd",
        causal=causal,
        window_size=window,
        softcap=softcap,
        softmax_scale=scaling,
    )
    return out.transpose(1, 2), None
