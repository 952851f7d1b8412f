"""Decode attention over a KV cache (kernel_decode.py, `flash_attn_with_kvcache`).

Numerics: the Pallas kernel in interpret mode against
reference.attention_kvcache_reference (f32 softmax over each sequence's
gathered keys, on the same rounded inputs), element by element with
tests/tolerances.py: the output's bound counts one bf16 rounding (P before
the PV matmul) of P|V|, the reference run on |V|. Cache positions past each
sequence's length (and pages no sequence uses) hold NaN, so reading or
weighting any of them fails the comparison. Block sizes are small so every
sequence spans several steps; `splits` > 1 cuts the work list as on a
multi-core device and exercises the combine step.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flash_attention_tpu as fa  # noqa: E402
from flash_attention_tpu import checks, kernel_decode, kvcache, tiling  # noqa: E402
from flash_attention_tpu import reference as ref  # noqa: E402
from gate import meta_call  # noqa: E402
from tolerances import assert_close  # noqa: E402

HYP = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def _case(seed, *, b, sq, hq, hkv, d, cap, page, lens, dtype, with_sinks):
    """q, caches (NaN past every length), lengths, block table, sinks."""
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int32)
    q = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
    if page:
        pages_per_seq = cap // page
        n_pages = b * pages_per_seq + 2  # two pages no sequence uses
        table = rng.permutation(n_pages)[: b * pages_per_seq].reshape(b, pages_per_seq)
        kc = np.full((n_pages, page, hkv, d), np.nan, np.float32)
        vc = np.full((n_pages, page, hkv, d), np.nan, np.float32)
        for i in range(b):
            for p in range(pages_per_seq):
                n = int(np.clip(lens[i] - p * page, 0, page))
                kc[table[i, p], :n] = rng.standard_normal((n, hkv, d))
                vc[table[i, p], :n] = rng.standard_normal((n, hkv, d))
        table = jnp.asarray(table, jnp.int32)
    else:
        table = None
        kc = rng.standard_normal((b, cap, hkv, d)).astype(np.float32)
        vc = rng.standard_normal((b, cap, hkv, d)).astype(np.float32)
        valid = np.arange(cap)[None, :] < lens[:, None]
        kc[~valid], vc[~valid] = np.nan, np.nan
    sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32) if with_sinks else None
    cast = lambda x: jnp.asarray(x).astype(dtype)  # noqa: E731
    return cast(q), cast(kc), cast(vc), jnp.asarray(lens), table, sinks


def _heads_major(kc, vc, b, cap, seed, with_mask):
    """The caches as [B, Hkv, S, D] (transformers' layout) and, optionally, a
    random keep mask with holes (left padding and more)."""
    kc, vc = kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3)
    mask = None
    if with_mask:
        mask = jnp.asarray(np.random.default_rng(seed + 1).random((b, cap)) < 0.8, jnp.int32)
    return kc, vc, mask


def _check(q, kc, vc, lens, table, sinks, *, config, **kw):
    out, lse = kvcache.flash_attention_kvcache(
        q,
        kc,
        vc,
        lens,
        block_table=table,
        sinks=sinks,
        return_lse=True,
        config=config,
        interpret=True,
        **kw,
    )
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    rout, rlse = ref.attention_kvcache_reference(
        f32(q), f32(kc), f32(vc), lens, block_table=table, sinks=sinks, **kw
    )
    # P|V|: the reference on |V| (NaN past the lengths stays masked and zeroed).
    mag, _ = ref.attention_kvcache_reference(
        f32(q), f32(kc), jnp.abs(f32(vc)), lens, block_table=table, sinks=sinks, **kw
    )
    bf16 = q.dtype == jnp.bfloat16
    assert_close(out, rout, magnitude=mag, roundings=1 if bf16 else 0, what="out")
    assert_close(
        lse, rlse, magnitude=1.0 + jnp.abs(jnp.where(jnp.isfinite(rlse), rlse, 0)), what="lse"
    )
    return out, lse


@st.composite
def kvcache_cases(draw):
    hkv = draw(st.sampled_from([1, 2, 4]))
    b = draw(st.integers(1, 3))
    page = draw(st.sampled_from([None, 16]))
    layout = "bshd" if page else draw(st.sampled_from(["bshd", "bhsd"]))
    cap = 64 if page else draw(st.sampled_from([48, 64, 80]))
    lens = draw(st.lists(st.integers(0, cap), min_size=b, max_size=b))
    window = draw(st.sampled_from([(-1, -1), (-1, -1), (24, 0), (10, 3)]))
    return dict(
        seed=draw(st.integers(0, 2**16)),
        b=b,
        sq=draw(st.sampled_from([1, 1, 2, 5])),
        hq=hkv * draw(st.sampled_from([1, 2, 4])),
        hkv=hkv,
        d=draw(st.sampled_from([64, 128])),
        cap=cap,
        page=page,
        lens=lens,
        dtype=draw(st.sampled_from(["bfloat16", "bfloat16", "float32", "float16"])),
        with_sinks=draw(st.booleans()),
        causal=draw(st.booleans()),
        window=window,
        softcap=draw(st.sampled_from([None, None, 8.0])),
        block_kv=draw(st.sampled_from([16, 32])),
        splits=draw(st.sampled_from([1, 2, 3])),
        layout=layout,
        kv_mask=layout == "bhsd" and draw(st.booleans()),
    )


@settings(max_examples=3, **HYP)
@given(kvcache_cases())
def test_kvcache_matches_reference(c):
    q, kc, vc, lens, table, sinks = _case(
        c["seed"],
        b=c["b"],
        sq=c["sq"],
        hq=c["hq"],
        hkv=c["hkv"],
        d=c["d"],
        cap=c["cap"],
        page=c["page"],
        lens=c["lens"],
        dtype=DTYPES[c["dtype"]],
        with_sinks=c["with_sinks"],
    )
    config = tiling.DecodeBlockSizes(block_kv=c["block_kv"], splits=c["splits"])
    layout = {}
    if c["layout"] == "bhsd":
        kc, vc, mask = _heads_major(kc, vc, c["b"], c["cap"], c["seed"], c["kv_mask"])
        layout = dict(cache_layout="bhsd", kv_mask=mask)
    _check(
        q,
        kc,
        vc,
        lens,
        table,
        sinks,
        config=config,
        **layout,
        causal=c["causal"],
        window_size=c["window"],
        softcap=c["softcap"],
    )


@pytest.mark.parametrize(
    "name, kw",
    [
        # GQA decode, one sequence empty, one full, split across two "cores";
        # 32-position blocks of an 80-position cache: the last block's copy
        # is shifted back inside the cache and its first half masked.
        ("gqa-splits", dict(b=3, sq=1, hq=8, hkv=2, lens=[0, 80, 37], splits=2, block_kv=32)),
        # Speculative decoding: 4 new queries, causal, sinks, a long sequence
        # cut across three partials (the combine merges three).
        ("spec-sinks", dict(b=1, sq=4, hq=4, hkv=1, lens=[77], splits=3, sinks=True, causal=True)),
        # Paged, the pages of each sequence scattered, a sliding window that
        # starts past the first blocks (they are never scheduled).
        (
            "paged-window",
            dict(b=2, sq=2, hq=4, hkv=2, lens=[64, 50], page=16, window_size=(20, 0), causal=True),
        ),
        # transformers' cache layout [B, Hkv, S, D] with a keep mask (left
        # padding and holes), GQA, two partials.
        (
            "heads-major-mask",
            dict(b=2, sq=1, hq=8, hkv=2, lens=[80, 61], splits=2, block_kv=32, heads_major=True),
        ),
        # 512-position blocks scored 256 positions at a time, the last block
        # of the 600-position cache shifted back inside it.
        ("chunks", dict(b=1, sq=1, hq=2, hkv=2, lens=[600], block_kv=512, cap=600)),
        # Query rows past the keys (Sq > length): rows that see nothing.
        ("short", dict(b=2, sq=5, hq=2, hkv=2, lens=[3, 0], causal=True)),
        # 10 query rows a kv head cut into 8-row blocks: q and outputs are
        # fetched and written per sequence (not resident), one sequence empty.
        ("row-blocks", dict(b=3, sq=5, hq=4, hkv=2, lens=[70, 0, 33], block_rows=8)),
    ],
)
def test_kvcache_cases(name, kw):
    kw = dict(kw)
    splits = kw.pop("splits", 1)
    block_kv = kw.pop("block_kv", 16)
    block_rows = kw.pop("block_rows", 0)
    q, kc, vc, lens, table, sinks = _case(
        7,
        b=kw.pop("b"),
        sq=kw.pop("sq"),
        hq=kw.pop("hq"),
        hkv=kw.pop("hkv"),
        d=64,
        cap=kw.pop("cap", 80 if not kw.get("page") else 64),
        page=kw.pop("page", None),
        lens=kw.pop("lens"),
        dtype=jnp.bfloat16,
        with_sinks=kw.pop("sinks", False),
    )
    if kw.pop("heads_major", False):
        kc, vc, mask = _heads_major(kc, vc, 2, 80, 7, True)
        kw.update(cache_layout="bhsd", kv_mask=mask)
    config = tiling.DecodeBlockSizes(block_kv=block_kv, splits=splits, block_rows=block_rows)
    out, lse = _check(q, kc, vc, lens, table, sinks, config=config, **kw)
    if name in ("short", "row-blocks"):  # seq 1 has no key: zeros and +inf, not NaN
        assert bool(jnp.all(out[1] == 0)) and bool(jnp.all(lse[1] == jnp.inf))


def test_schedule_walks_only_valid_blocks():
    """The grid's work list is exactly the blocks holding a visible key: one
    item per (sequence, block), none for padding or blocks before a window."""
    prm = kvcache.decode_params(
        checks.KvCacheProblem(5, 8, 2, 1, 64, 64, 1000, None, 0),
        jnp.bfloat16,
        causal=True,
        window_size=(100, 0),
        config=tiling.DecodeBlockSizes(block_kv=64, splits=2),
    )
    lengths = jnp.asarray([0, 1000, 64, 65, 300], jnp.int32)
    sched, steps, touched = kernel_decode.schedule(prm, lengths, max_blocks=16)
    sched, steps, touched = np.asarray(sched), int(steps), np.asarray(touched)
    want = set()
    for b, n in enumerate(np.asarray(lengths)):
        lo = max(0, n - 1 - 100) // 64
        want |= {(b, j) for j in range(lo, -(-int(n) // 64))}
    words = sched[:, :steps]
    live = (words & kernel_decode.COMPUTE) != 0
    seq = (words >> kernel_decode.SEQ_SHIFT) & (kernel_decode.MAX_SEQS - 1)
    blk = words >> kernel_decode.BLOCK_SHIFT
    got = list(zip(seq[live].tolist(), blk[live].tolist()))
    assert sorted(got) == sorted(want) and len(got) == len(want)
    assert steps == -(-len(want) // 2)  # the work is halved between the two cores
    for c in range(2):
        for b in range(5):
            assert touched[c, b] == any(s == b for s in seq[c][live[c]].tolist())


# -- torch: flash_attn_with_kvcache --------------------------------------------


def _torch_case(b=2, s=64, hkv=2, hq=4, d=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return r(b, 1, hq, d), r(b, s, hkv, d), r(b, s, hkv, d), r(b, 1, hkv, d), r(b, 1, hkv, d)


def _ref_torch(q, kc, vc, lens, **kw):
    j = lambda t: None if t is None else jnp.asarray(t.float().numpy())  # noqa: E731
    table = kw.pop("block_table", None)
    run = lambda v: ref.attention_kvcache_reference(  # noqa: E731
        j(q),
        j(kc),
        v,
        jnp.asarray(lens.numpy()),
        block_table=None if table is None else jnp.asarray(table.numpy()),
        **kw,
    )
    (out, lse), (mag, _) = run(j(vc)), run(jnp.abs(j(vc)))
    return tuple(torch.from_numpy(np.array(x)) for x in (out, lse, mag))


def test_with_kvcache_appends_new_keys_and_attends_to_them():
    q, kc, vc, k, v = _torch_case()
    before = kc.clone()
    lens = torch.tensor([5, 40], dtype=torch.int32)
    out, lse = fa.flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=lens, causal=True, return_softmax_lse=True
    )
    assert torch.equal(kc[0, 5], k[0, 0]) and torch.equal(kc[1, 40], k[1, 0])
    assert torch.equal(vc[1, 40], v[1, 0])
    changed = (kc != before).any(-1).any(-1)
    assert changed.sum() == 2  # nothing else written
    assert lens.tolist() == [5, 40]  # like flash-attn, the caller advances the lengths
    rout, rlse, mag = _ref_torch(q, kc, vc, lens + 1, causal=True)
    assert out.shape == (2, 1, 4, 64) and lse.shape == (2, 4, 1)
    assert_close(out, rout, magnitude=mag, what="out")
    assert_close(lse, rlse, magnitude=1.0 + rlse.abs(), what="lse")


def test_with_kvcache_paged_append_and_int_seqlens():
    q, _, _, k, v = _torch_case(b=2)
    page, n_pages = 16, 9
    kc = torch.randn(n_pages, page, 2, 64)
    vc = torch.randn(n_pages, page, 2, 64)
    table = torch.tensor([[3, 7, 1, 0], [8, 2, 5, 6]], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=33, block_table=table)
    # position 33 is page 2 (33 // 16), offset 1 of each sequence's table
    assert torch.equal(kc[1, 1], k[0, 0]) and torch.equal(kc[5, 1], k[1, 0])
    rout, _, mag = _ref_torch(q, kc, vc, torch.tensor([34, 34]), block_table=table)
    assert_close(out, rout, magnitude=mag, what="out")


def test_with_kvcache_cache_batch_idx_reads_the_named_rows():
    q, kc, vc, _, _ = _torch_case(b=2)
    big_k = torch.cat([torch.full_like(kc, float("nan")), kc])  # rows 2, 3 hold the data
    big_v = torch.cat([torch.full_like(vc, float("nan")), vc])
    lens = torch.tensor([10, 64], dtype=torch.int32)
    idx = torch.tensor([2, 3], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, big_k, big_v, cache_seqlens=lens, cache_batch_idx=idx)
    rout, _, mag = _ref_torch(q, kc, vc, lens)
    assert_close(out, rout, magnitude=mag, what="out")


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(cache_seqlens=torch.tensor([3, 65], dtype=torch.int32)),
            "cache_seqlens: expected values in \\[0, 64\\]",
        ),
        (dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)), "cache_seqlens: expected shape"),
        (dict(cache_seqlens=torch.tensor([1.0, 2.0])), "cache_seqlens: expected an integer dtype"),
        (
            dict(
                block_table=torch.tensor([[0], [9]], dtype=torch.int32),
                cache_seqlens=torch.tensor([1, 1], dtype=torch.int32),
            ),
            "block_table: expected page indices",
        ),
        (
            dict(
                cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32),
                cache_seqlens=torch.tensor([1, 1], dtype=torch.int32),
            ),
            "cache_batch_idx: expected values",
        ),
        (dict(k_heads=3), "k_cache: expected a number of kv heads dividing"),
        (dict(rotary_cos=torch.zeros(1)), "rotary_cos"),
        (dict(cache_leftpad=torch.zeros(2)), "cache_leftpad"),
    ],
)
def test_with_kvcache_bad_input_names_the_argument(kw, match):
    q, kc, vc, _, _ = _torch_case()
    if kw.pop("k_heads", None):
        kc, vc = torch.randn(2, 64, 3, 64), torch.randn(2, 64, 3, 64)
    if "block_table" in kw:
        kc, vc = kc.reshape(8, 16, 2, 64), vc.reshape(8, 16, 2, 64)
    err = NotImplementedError if match in ("rotary_cos", "cache_leftpad") else ValueError
    with pytest.raises(err, match=match):
        fa.flash_attn_with_kvcache(q, kc, vc, **kw)


def test_new_keys_past_the_cache_are_rejected_before_writing():
    q, kc, vc, k, v = _torch_case()
    before = kc.clone()
    with pytest.raises(ValueError, match="cache_seqlens: expected values in \\[0, 63\\]"):
        fa.flash_attn_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=torch.tensor([0, 64], dtype=torch.int32)
        )
    assert torch.equal(kc, before)


def test_kvcache_op_lowers_through_torch_tpu_jax_op_on_meta():
    """The torch op's TPU path is the real Pallas-to-Mosaic lowering (dynamic
    grid, scalar-prefetched schedule and block table)."""
    q = torch.empty(8, 1, 32, 128, dtype=torch.bfloat16)
    kc = torch.empty(256, 64, 8, 128, dtype=torch.bfloat16)
    lens = torch.empty(8, dtype=torch.int32)
    table = torch.empty(8, 32, dtype=torch.int32)
    out, lse = meta_call(
        fa.ops._flash_attention_kvcache,
        *(q, kc, kc, lens, table, None, None, None, "bshd", True, -1, 0, 0.0, 0.088),
    )
    assert out.shape == q.shape and out.device.type == "meta" and lse.shape == (8, 32, 1)


# -- flash-attn's packed forms ---------------------------------------------------


def test_packed_forms_equal_the_unpacked_calls_and_their_grads():
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 9, 3, 2, 40, generator=g, requires_grad=True)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(4, 0))
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv.unbind(2))
    want = fa.flash_attn_func(q, k, v, causal=True, window_size=(4, 0))
    assert torch.equal(out, want)
    dout = torch.randn_like(out)
    out.backward(dout)
    want.backward(dout)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2))

    qg = torch.randn(2, 9, 4, 40, generator=g)
    kv = torch.randn(2, 9, 2, 2, 40, generator=g)  # GQA: 4 query heads on 2 kv heads
    torch.testing.assert_close(
        fa.flash_attn_kvpacked_func(qg, kv), fa.flash_attn_func(qg, kv[:, :, 0], kv[:, :, 1])
    )
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    flat = qkv.detach().flatten(0, 1)[:9]  # [total, 3, H, D]
    torch.testing.assert_close(
        fa.flash_attn_varlen_qkvpacked_func(flat, cu, 5, causal=True),
        fa.flash_attn_varlen_func(flat[:, 0], flat[:, 1], flat[:, 2], cu, cu, 5, 5, causal=True),
    )
    kvf = kv.flatten(0, 1)[:9]
    torch.testing.assert_close(
        fa.flash_attn_varlen_kvpacked_func(qg.flatten(0, 1)[:9], kvf, cu, cu, 5, 5),
        fa.flash_attn_varlen_func(qg.flatten(0, 1)[:9], kvf[:, 0], kvf[:, 1], cu, cu, 5, 5),
    )
    with pytest.raises(ValueError, match=r"qkv: expected a tensor \[batch, seq, 3, heads"):
        fa.flash_attn_qkvpacked_func(qkv.detach()[:, :, :2])


def test_batch_past_the_schedule_word_is_rejected():
    """The work list packs (sequence, block) into one int32 word: a batch it
    cannot address is an error, not a wrong answer."""
    b = kernel_decode.MAX_SEQS + 1
    q = jax.ShapeDtypeStruct((b, 1, 8, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((b, 64, 2, 64), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((b,), jnp.int32)
    with pytest.raises(ValueError, match="q: expected at most 4096 sequences"):
        jax.eval_shape(
            lambda *a: kvcache.flash_attention_kvcache(*a, config="v6e"), q, cache, cache, lens
        )
