"""Input validation for every flash attention entry point, in one place.

Shape and dtype rules read only `.shape` and `.dtype`, so they run on JAX
arrays, tracers and the torch ops' tensor specs alike (the ops call
check_inputs before they dispatch). Value rules (cu_seqlens offsets,
max_seqlen) run when the offsets are concrete: check_varlen_values.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

# flash-attn's rule: any multiple of 8 up to 256 (the kernels take the head
# dim whole as a block's last dim, so any size is a legal block; VMEM pads it
# to 128 lanes).
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8


def check_head_dim(name: str, d: int) -> None:
    if d % HEAD_DIM_MULTIPLE or not 0 < d <= MAX_HEAD_DIM:
        raise ValueError(
            f"{name}: expected head_dim a multiple of {HEAD_DIM_MULTIPLE} in "
            f"[{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}], got {d}"
        )


SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Problem:
    """Normalised shape facts of one call."""

    batch: int
    num_q_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    head_dim_v: int
    left: int  # -1: unbounded
    right: int  # -1: unbounded (causal is kept separately)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def _shape(x, name):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name}: expected an array, got {type(x).__name__}")
    return tuple(x.shape)


def window(window_size):
    """(left, right) from flash-attn's window_size; -1 means unbounded."""
    if window_size is None:
        return -1, -1
    try:
        left, right = window_size
        left, right = int(left), int(right)
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size: expected a pair (left, right) of ints, -1 meaning unbounded; "
            f"got {window_size!r}"
        ) from None
    if left < -1 or right < -1:
        raise ValueError(
            f"window_size: expected values >= -1 (-1 = unbounded), got {(left, right)}"
        )
    return left, right


def problem(q, k, v, *, varlen=False, window_size=None) -> Problem:
    """The shape facts of a call whose arguments passed check_inputs (no checks)."""
    left, right = window(window_size)
    if varlen:
        (tq, hq, d), (tk, hkv, _), (_, _, dv) = q.shape, k.shape, v.shape
        return Problem(1, hq, hkv, tq, tk, d, dv, left, right)
    (b, hq, sq, d), (_, hkv, skv, _), dv = q.shape, k.shape, v.shape[-1]
    return Problem(b, hq, hkv, sq, skv, d, dv, left, right)


def scalars(softcap, softmax_scale):
    """(softcap, softmax_scale) checked: softcap a float >= 0 (0 or None = off),
    softmax_scale a float or None (1/sqrt(head_dim))."""
    if softcap is not None and not (
        isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap >= 0
    ):
        raise ValueError(f"softcap: expected a float >= 0 (0 = off), got {softcap!r}")
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
    ):
        raise ValueError(f"softmax_scale: expected a float, got {softmax_scale!r}")
    return softcap, softmax_scale


def static_len(name: str, m) -> int:
    """A static sequence-length bound: an int >= 0."""
    if not isinstance(m, (int, np.integer)) or isinstance(m, bool) or m < 0:
        raise ValueError(f"{name}: expected a static int >= 0, got {m!r}")
    return int(m)


def _int_array(x, name, shape):
    got = _shape(x, name)
    if got != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {got}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name}: expected an integer dtype, got {x.dtype}")


def check_inputs(
    q,
    k,
    v,
    *,
    varlen=False,
    sinks=None,
    window_size=None,
    softcap=None,
    softmax_scale=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
) -> Problem:
    """Validates all arguments; raises ValueError naming the argument.

    Dense layout: q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv].
    Varlen layout: q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv].
    """
    if dropout_p:
        raise NotImplementedError("dropout_p: dropout is not supported (expected 0.0)")
    rank = 3 if varlen else 4
    shapes = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        s = _shape(x, name)
        if len(s) != rank:
            layout = "[total, heads, head_dim]" if varlen else "[batch, heads, seq, head_dim]"
            raise ValueError(f"{name}: expected a rank-{rank} array {layout}, got shape {s}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: expected dtype bfloat16, float16 or float32, got {x.dtype}")
        shapes[name] = s
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if varlen:
        (tq, hq, d), (tk, hkv, dk), (tv, hv, dv) = shapes["q"], shapes["k"], shapes["v"]
        b, sq, skv = 1, tq, tk
        if tv != tk:
            raise ValueError(f"v: expected {tk} tokens like k, got {tv}")
    else:
        (b, hq, sq, d), (bk, hkv, skv, dk), (bv, hv, sv, dv) = (
            shapes["q"],
            shapes["k"],
            shapes["v"],
        )
        if bk != b or bv != b:
            raise ValueError(f"k, v: expected batch {b} like q, got k {bk}, v {bv}")
        if sv != skv:
            raise ValueError(f"v: expected sequence length {skv} like k, got {sv}")
    if hv != hkv:
        raise ValueError(f"v: expected {hkv} heads like k, got {hv}")
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"k: expected a number of kv heads dividing the {hq} query heads, got {hkv}"
        )
    if dk != d:
        raise ValueError(f"k: expected head_dim {d} like q, got {dk}")
    check_head_dim("q", d)
    check_head_dim("v", dv)
    left, right = window(window_size)
    scalars(softcap, softmax_scale)
    if sinks is not None:
        s = _shape(sinks, "sinks")
        if s != (hq,):
            raise ValueError(f"sinks: expected shape ({hq},) (one logit per query head), got {s}")
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(f"sinks: expected a floating dtype, got {sinks.dtype}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids, kv_segment_ids: expected both or neither")
    if q_segment_ids is not None:
        if varlen:
            raise ValueError("q_segment_ids: not accepted by the varlen entry (use cu_seqlens)")
        _int_array(q_segment_ids, "q_segment_ids", (b, sq))
        _int_array(kv_segment_ids, "kv_segment_ids", (b, skv))
    if varlen:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu is None:
                raise ValueError(f"{name}: expected an int32 array [num_seqs + 1], got None")
            s = _shape(cu, name)
            if len(s) != 1 or s[0] < 2:
                raise ValueError(
                    f"{name}: expected shape [num_seqs + 1] with num_seqs >= 1, got {s}"
                )
            if not jnp.issubdtype(cu.dtype, jnp.integer):
                raise ValueError(f"{name}: expected an integer dtype, got {cu.dtype}")
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ValueError(
                f"cu_seqlens_k: expected shape {tuple(cu_seqlens_q.shape)} like cu_seqlens_q, "
                f"got {tuple(cu_seqlens_k.shape)}"
            )
        for name, m, total in (
            ("max_seqlen_q", max_seqlen_q, sq),
            ("max_seqlen_k", max_seqlen_k, skv),
        ):
            m = static_len(name, m)
            if m > total and total > 0:
                raise ValueError(f"{name}: expected at most the {total} packed tokens, got {m}")
        try:  # values only when concrete (not traced, not a torch op's spec)
            cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
        except Exception:  # noqa: BLE001 - traced: checked by shape only
            cu_q = None
        if cu_q is not None:
            check_varlen_values(cu_q, cu_k, sq, skv, max_seqlen_q, max_seqlen_k)
    return problem(q, k, v, varlen=varlen, window_size=(left, right))


def check_varlen_values(
    cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q: int, max_seqlen_k: int
) -> None:
    """Concrete offsets (NumPy): nondecreasing from 0 to the packed total, and
    max_seqlen at least the longest sequence (it bounds the kernel's block
    schedule, so a smaller one would skip keys)."""
    for name, cu, total, m, mname in (
        ("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, "max_seqlen_q"),
        ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, "max_seqlen_k"),
    ):
        c = np.asarray(cu)
        if c.ndim != 1 or len(c) < 2:
            continue  # a shape the shape rules report
        if c[0] != 0 or c[-1] != total or np.any(np.diff(c) < 0):
            raise ValueError(
                f"{name}: expected nondecreasing offsets from 0 to {total}, got {c.tolist()}"
            )
        longest = int(np.max(np.diff(c)))
        if longest > m:
            raise ValueError(
                f"{mname}: expected at least the longest sequence ({longest} tokens "
                f"in {name}), got {m}"
            )


# ---------------------------------------------------------------------------
# Decode over a KV cache (flash_attn_with_kvcache).


@dataclasses.dataclass(frozen=True)
class KvCacheProblem:
    """Normalised shape facts of one decode call."""

    batch: int
    num_q_heads: int
    num_kv_heads: int
    q_len: int
    head_dim: int
    head_dim_v: int
    cache_len: int  # positions a sequence can hold (contiguous S, or pages x page)
    page: int | None  # None: contiguous cache
    max_pages: int  # paged: block_table columns; contiguous: 0

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def check_kvcache_inputs(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    *,
    block_table=None,
    cache_batch_idx=None,
    sinks=None,
    cache_layout="bshd",
    kv_mask=None,
) -> KvCacheProblem:
    """Validates a decode call's arrays (shapes and dtypes); raises ValueError
    naming the argument.

    q [B, Sq, Hq, D]; k_cache [B_cache, S, Hkv, D] and v_cache [B_cache, S,
    Hkv, Dv], or paged [num_pages, page, Hkv, D|Dv] with block_table int
    [B, max_pages]; cache_seqlens int [B]; cache_batch_idx int [B] (the
    cache row of each sequence; contiguous caches only); sinks float [Hq].
    cache_layout "bhsd": contiguous caches [B_cache, Hkv, S, D] (transformers'),
    optionally with kv_mask int/bool [B, S] (nonzero = the key may be seen).
    """
    if cache_layout not in ("bshd", "bhsd"):
        raise ValueError(f"cache_layout: expected 'bshd' or 'bhsd', got {cache_layout!r}")
    if cache_layout == "bhsd" and block_table is not None:
        raise ValueError(
            "block_table: paged caches are [num_pages, page, kv_heads, head_dim] (bshd)"
        )
    if kv_mask is not None and cache_layout != "bhsd":
        raise ValueError("kv_mask: accepted only with cache_layout='bhsd'")
    shapes = {}
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        s = _shape(x, name)
        if len(s) != 4:
            layout = (
                "[batch, seq, heads, head_dim]"
                if name == "q"
                else (
                    "[batch_cache, seq, kv_heads, head_dim] or paged [num_pages, page, kv_heads, head_dim]"
                )
            )
            raise ValueError(f"{name}: expected a rank-4 array {layout}, got shape {s}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: expected dtype bfloat16, float16 or float32, got {x.dtype}")
        if name != "q" and cache_layout == "bhsd":
            s = (s[0], s[2], s[1], s[3])
        shapes[name] = s
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"q, k_cache, v_cache: expected one dtype, got q {q.dtype}, k_cache {k_cache.dtype}, "
            f"v_cache {v_cache.dtype}"
        )
    (b, sq, hq, d), (bc, s, hkv, dk), (bv, sv, hv, dv) = (
        shapes["q"],
        shapes["k_cache"],
        shapes["v_cache"],
    )
    if (bv, sv, hv) != (bc, s, hkv):
        raise ValueError(
            f"v_cache: expected leading dims {(bc, s, hkv)} like k_cache, got {(bv, sv, hv)}"
        )
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"k_cache: expected a number of kv heads dividing the {hq} query heads, got {hkv}"
        )
    if dk != d:
        raise ValueError(f"k_cache: expected head_dim {d} like q, got {dk}")
    check_head_dim("q", d)
    check_head_dim("v_cache", dv)
    if sq == 0:
        raise ValueError("q: expected at least one query position, got seqlen_q 0")
    _int_array(cache_seqlens, "cache_seqlens", (b,))
    page, max_pages, cache_len = None, 0, s
    if block_table is not None:
        t = _shape(block_table, "block_table")
        if len(t) != 2 or t[0] != b or t[1] == 0:
            raise ValueError(
                f"block_table: expected shape ({b}, max_pages) with max_pages >= 1, got {t}"
            )
        _int_array(block_table, "block_table", t)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: not accepted with block_table (paged caches)")
        page, max_pages, cache_len = s, t[1], s * t[1]
    elif bc < b and cache_batch_idx is None:
        raise ValueError(
            f"k_cache: expected at least batch {b} cache rows (or cache_batch_idx), got {bc}"
        )
    if cache_batch_idx is not None:
        _int_array(cache_batch_idx, "cache_batch_idx", (b,))
    if kv_mask is not None:
        got = _shape(kv_mask, "kv_mask")
        if got != (b, s):
            raise ValueError(f"kv_mask: expected shape {(b, s)}, got {got}")
        if not (jnp.issubdtype(kv_mask.dtype, jnp.integer) or kv_mask.dtype == jnp.bool_):
            raise ValueError(f"kv_mask: expected an integer or bool dtype, got {kv_mask.dtype}")
    if sinks is not None:
        sh = _shape(sinks, "s_aux")
        if sh != (hq,):
            raise ValueError(f"s_aux: expected shape ({hq},) (one logit per query head), got {sh}")
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(f"s_aux: expected a floating dtype, got {sinks.dtype}")
    return KvCacheProblem(b, hq, hkv, sq, d, dv, cache_len, page, max_pages)


def check_kvcache_values(
    pb: KvCacheProblem, cache_seqlens, block_table=None, cache_batch_idx=None, num_cache_rows=0
) -> None:
    """Concrete values (NumPy): lengths within the cache, table entries and
    cache rows within range (a wrong one would read another sequence's keys
    or outside the cache)."""
    lens = np.asarray(cache_seqlens)
    if lens.size and (lens.min() < 0 or lens.max() > pb.cache_len):
        raise ValueError(
            f"cache_seqlens: expected values in [0, {pb.cache_len}] (the cache holds "
            f"{pb.cache_len} positions per sequence), got {lens.tolist()}"
        )
    if block_table is not None:
        table = np.asarray(block_table)
        used = -(-lens // pb.page)  # pages each sequence reads
        cols = np.arange(table.shape[1])[None, :] < used[:, None]
        bad = cols & ((table < 0) | (table >= num_cache_rows))
        if bad.any():
            i, j = map(int, np.argwhere(bad)[0])
            raise ValueError(
                f"block_table: expected page indices in [0, {num_cache_rows}) for the pages "
                f"cache_seqlens uses, got block_table[{i}, {j}] = {int(table[i, j])}"
            )
    if cache_batch_idx is not None:
        idx = np.asarray(cache_batch_idx)
        if idx.size and (idx.min() < 0 or idx.max() >= num_cache_rows):
            raise ValueError(
                f"cache_batch_idx: expected values in [0, {num_cache_rows}), got {idx.tolist()}"
            )
