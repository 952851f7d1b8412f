"""flash-attention-tpu's torch API vs a plain torch softmax-attention reference.

Every numeric test runs the torch ops on CPU tensors through both CPU
implementations (`interpret`: the Pallas kernels in interpret mode, what
ships; `reference`: the XLA reference), forward and backward (dq, dk, dv and
the sink gradient), against `attention_torch` below: f32 math from the
(possibly bf16-rounded) inputs, explicit dense mask, K/V repeated for GQA.

Tolerances: per element (tests/tolerances.py), against the f32 torch
reference on the same (bf16-rounded) inputs and cotangent, each bound scaled
by the sums of absolute terms built from the reference's probabilities
(attention_torch with V = identity), as in the kernel tests.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import flash_attention_tpu as fa
from flash_attention_tpu import ops
from gate import meta_call
from tolerances import ATTENTION_ROUNDINGS, assert_close, attention_magnitudes

# The package's vendored bindings hold the switch its ops read: the top-level
# `torch_bindings` is a different module object with its own state.
from flash_attention_tpu._torch_bindings import cpu_impl

IMPLS = ["interpret", "reference"]


def attention_torch(
    q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, sinks=None, scale=None, key_valid=None
):
    """q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D] -> [B, Sq, Hq, Dv], f32. Bottom-right aligned;
    key_valid [B, Skv] bool hides padded keys. Rows that see nothing give 0."""
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    qi = torch.arange(sq)[:, None] + (skv - sq)
    kj = torch.arange(skv)[None, :]
    mask = torch.ones(sq, skv, dtype=torch.bool)
    left, right = window
    if causal:
        mask &= kj <= qi
    if right >= 0:
        mask &= kj <= qi + right
    if left >= 0:
        mask &= kj >= qi - left
    mask = mask[None, None]
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, :]
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.float()[None, :, None, None])
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    p = torch.exp(s - m).masked_fill(~mask, 0.0)
    denom = p.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks.float()[None, :, None, None] - m)
    out = (p / torch.where(denom == 0, torch.ones_like(denom), denom)) @ v
    return out.transpose(1, 2)


def attention_torch_varlen(q, k, v, cu_q, cu_k, **kw):
    outs = []
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        if q1 > q0 and k1 == k0:  # queries without keys give 0
            outs.append(q.new_zeros((q1 - q0, q.shape[1], v.shape[2])).float())
        elif q1 > q0:
            outs.append(attention_torch(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **kw)[0])
    return torch.cat(outs) if outs else q.new_zeros((0,) + q.shape[1:]).float()


def _grads(out, inputs, dy):
    live = [x for x in inputs if x is not None]
    got = torch.autograd.grad(out, live, dy, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(live, got)]


def _bshd_to_dense(x):  # [B, S, H, ...] -> [B, H, S, ...]
    return x.detach().float().transpose(1, 2).numpy()


def _packed(x):  # [T, H, ...] -> [1, H, T, ...]
    return x.detach().float().transpose(0, 1)[None].numpy()


def _check(impl, fn_ours, fn_ref, inputs, dtype, dy_shape, seed, *, scale, packed=False):
    """Output and every gradient against fn_ref in f32 on the same inputs, per element.

    fn_ref(q, k, v, sinks) is also run with V = identity to get the
    probabilities that scale the bounds (tolerances.attention_magnitudes).
    """
    dy = torch.randn(dy_shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    with cpu_impl(impl):  # the backward op too runs on the selected implementation
        out = fn_ours(*inputs)
        grads = _grads(out, inputs, dy)
    assert out.dtype == dtype and not torch.isnan(out.float()).any()
    ref_in = [None if x is None else x.detach().float().requires_grad_() for x in inputs]
    ref = fn_ref(*ref_in)
    ref_grads = _grads(ref, ref_in, dy.float())
    q, k, v, sinks = ref_in
    tk = k.shape[0] if packed else k.shape[1]
    if packed:
        eye = torch.eye(tk)[:, None, :].expand(tk, k.shape[1], tk)
    else:
        eye = torch.eye(tk)[None, :, None, :].expand(k.shape[0], tk, k.shape[2], tk)
    with torch.no_grad():
        p = fn_ref(q, k, eye, sinks)
    dense = _packed if packed else _bshd_to_dense
    back = (lambda x: np.swapaxes(x[0], 0, 1)) if packed else (lambda x: np.swapaxes(x, 1, 2))
    mags = attention_magnitudes(
        dense(p),
        dense(q),
        dense(k),
        dense(v),
        dense(dy),
        None,
        None if sinks is None else sinks.detach(),
        scale,
    )
    rnd = (lambda n: ATTENTION_ROUNDINGS[n]) if dtype == torch.bfloat16 else (lambda n: 0)
    assert_close(
        out, ref, dtype=dtype, magnitude=back(mags["out"]), roundings=rnd("out"), what="out"
    )
    for name, g, rg in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert g.dtype == dtype
        mag = mags[name] if name == "dsinks" else back(mags[name])
        assert_close(g, rg, dtype=dtype, magnitude=mag, roundings=rnd(name), what=name)


@st.composite
def dense_problems(draw):
    hq, hkv = draw(st.sampled_from([(2, 2), (4, 2), (4, 1)]))
    return dict(
        b=draw(st.integers(1, 2)),
        hq=hq,
        hkv=hkv,
        sq=draw(st.integers(1, 20)),
        skv=draw(st.integers(1, 20)),
        d=draw(st.sampled_from([64, 80])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        causal=draw(st.booleans()),
        window=draw(st.sampled_from([(-1, -1), (3, 0), (2, 1), (-1, 2)])),
        softcap=draw(st.sampled_from([0.0, 0.0, 2.5])),
        sinks=draw(st.booleans()),
        scale=draw(st.sampled_from([None, 0.3])),
        seed=draw(st.integers(0, 99)),
    )


# 5 draws per impl: this checks the op's layout, autograd and arguments; the
# kernels' numerics over the whole space are test_flash_attention.py's.
@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=5)
@given(p=dense_problems())
def test_flash_attn_func_and_grads_match_torch(impl, p):
    gen = torch.Generator().manual_seed(p["seed"])
    dt = p["dtype"]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dt).requires_grad_()

    q, k, v = (
        rnd(p["b"], p["sq"], p["hq"], p["d"]),
        rnd(p["b"], p["skv"], p["hkv"], p["d"]),
        rnd(p["b"], p["skv"], p["hkv"], p["d"]),
    )
    sinks = rnd(p["hq"]) if p["sinks"] else None
    kw = dict(
        causal=p["causal"], window_size=p["window"], softcap=p["softcap"], softmax_scale=p["scale"]
    )

    def ours(q, k, v, s):
        return fa.flash_attn_func(q, k, v, s_aux=s, **kw)

    def ref(q, k, v, s):
        return attention_torch(
            q,
            k,
            v,
            causal=p["causal"],
            window=p["window"],
            softcap=p["softcap"],
            sinks=s,
            scale=p["scale"],
        )

    scale = p["scale"] if p["scale"] is not None else 1.0 / math.sqrt(p["d"])
    _check(
        impl,
        ours,
        ref,
        [q, k, v, sinks],
        dt,
        (p["b"], p["sq"], p["hq"], p["d"]),
        p["seed"],
        scale=scale,
    )


VARLEN_CASES = [
    # seqlens_q, seqlens_k, causal, window, sinks, dtype, cu dtype
    ([5, 0, 7], [5, 0, 7], True, (-1, -1), False, torch.float32, torch.int32),
    ([3, 4, 1], [6, 4, 9], True, (2, 0), True, torch.bfloat16, torch.int64),
    ([4, 2], [0, 6], False, (-1, -1), True, torch.float32, torch.int64),
    ([1, 1, 1], [8, 3, 5], False, (1, 1), False, torch.float32, torch.int32),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", VARLEN_CASES)
def test_flash_attn_varlen_func_and_grads_match_torch(impl, case):
    lq, lk, causal, window, with_sinks, dt, cu_dtype = case
    gen = torch.Generator().manual_seed(sum(lq) + sum(lk))
    hq, hkv, d = 4, 2, 64

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dt).requires_grad_()

    q, k, v = rnd(sum(lq), hq, d), rnd(sum(lk), hkv, d), rnd(sum(lk), hkv, d)
    sinks = rnd(hq) if with_sinks else None
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=cu_dtype)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=cu_dtype)
    # transformers may hand max_seqlen over as a 0-d tensor.
    max_q, max_k = torch.tensor(max(lq)), max(lk)

    def ours(q, k, v, s):
        return fa.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window, s_aux=s
        )

    def ref(q, k, v, s):
        return attention_torch_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window, sinks=s)

    _check(
        impl,
        ours,
        ref,
        [q, k, v, sinks],
        dt,
        (sum(lq), hq, d),
        0,
        scale=1.0 / math.sqrt(d),
        packed=True,
    )


class _Attn(torch.nn.Module):
    def __init__(self, causal=True, sinks=None):
        super().__init__()
        self.is_causal = causal
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)


def _bhsd(*shape, gen):
    return torch.randn(*shape, generator=gen)


@pytest.mark.parametrize("mask_kind", ["none", "2d", "4d_bool", "4d_float"])
def test_attention_forward_padding_masks_and_sinks(mask_kind):
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv, s, d, window = 2, 4, 2, 9, 64, 5
    q, k, v = (
        _bhsd(b, hq, s, d, gen=gen),
        _bhsd(b, hkv, s, d, gen=gen),
        _bhsd(b, hkv, s, d, gen=gen),
    )
    module = _Attn(sinks=torch.randn(hq, generator=gen))
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[0, :3] = False  # left padding
    qi, kj = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (kj <= qi) & (kj > qi - window)
    allowed = allowed[None, None] & valid[:, None, None, :]
    mask = {
        "none": None,
        "2d": valid.long(),
        "4d_bool": allowed,
        "4d_float": torch.zeros(allowed.shape).masked_fill(
            ~allowed, torch.finfo(torch.float32).min
        ),
    }[mask_kind]
    key_valid = None if mask_kind == "none" else valid
    out, attn = fa.attention_forward(module, q, k, v, mask, scaling=0.2, sliding_window=window)
    assert attn is None and out.shape == (b, s, hq, d)
    want = attention_torch(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        causal=True,
        window=(window - 1, window - 1),
        sinks=module.sinks,
        scale=0.2,
        key_valid=key_valid,
    )
    torch.testing.assert_close(out, want.detach(), atol=2e-5, rtol=2e-5)


def test_attention_forward_rejects_masks_it_cannot_express():
    q, k, v = torch.randn(1, 2, 6, 64), torch.randn(1, 2, 6, 64), torch.randn(1, 2, 6, 64)
    arbitrary = torch.rand(1, 1, 6, 6) > 0.5
    with pytest.raises(ValueError, match="not expressible as causal=True"):
        fa.attention_forward(_Attn(), q, k, v, arbitrary)
    bias = torch.randn(1, 1, 6, 6)
    with pytest.raises(ValueError, match="additive biases"):
        fa.attention_forward(_Attn(), q, k, v, bias)
    with pytest.raises(ValueError, match="expected 2 or 4 dimensions"):
        fa.attention_forward(_Attn(), q, k, v, torch.ones(1, 6, 6))
    with pytest.raises(NotImplementedError, match="dropout"):
        fa.attention_forward(_Attn(), q, k, v, None, dropout=0.1)


@pytest.mark.parametrize("source", ["cu_seq_lens", "position_ids"])
def test_attention_forward_packed_sequences(source):
    gen = torch.Generator().manual_seed(3)
    q, k, v = _bhsd(1, 2, 7, 64, gen=gen), _bhsd(1, 2, 7, 64, gen=gen), _bhsd(1, 2, 7, 64, gen=gen)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    if source == "cu_seq_lens":  # DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4)
    else:  # positions restart at each packed sequence
        kw = dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))
    out, _ = fa.attention_forward(_Attn(), q, k, v, None, sliding_window=3, **kw)
    want = attention_torch_varlen(
        q[0].transpose(0, 1),
        k[0].transpose(0, 1),
        v[0].transpose(0, 1),
        cu,
        cu,
        causal=True,
        window=(2, 2),
    )
    torch.testing.assert_close(out[0], want, atol=2e-5, rtol=2e-5)
    # One unpacked sequence: no segments, same as no position ids.
    single, _ = fa.attention_forward(_Attn(), q, k, v, None, position_ids=torch.arange(7)[None] + 5)
    torch.testing.assert_close(single, fa.attention_forward(_Attn(), q, k, v, None)[0])


def test_torch_compile_fullgraph():
    """Dense and varlen ops traced by Dynamo with no graph break; the output and
    every gradient (q, k, v, sinks) match the eager torch reference."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 4, 64, generator=gen, requires_grad=True)
    k = torch.randn(1, 6, 2, 64, generator=gen, requires_grad=True)
    v = torch.randn(1, 6, 2, 64, generator=gen, requires_grad=True)
    sinks = torch.randn(4, generator=gen, requires_grad=True)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    w = torch.randn(1, 6, 4, 64, generator=gen)  # a non-uniform cotangent

    def loss(q, k, v, sinks, dense_fn, packed_fn):
        dense = dense_fn(q, k, v, sinks)
        packed = packed_fn(q[0], k[0], v[0])
        return (dense * w).sum() + (packed * w[0]).sum().mul(0.5), dense

    ours = torch.compile(fullgraph=True, backend="aot_eager")(
        lambda q, k, v, s: loss(
            q,
            k,
            v,
            s,
            lambda q, k, v, s: fa.flash_attn_func(q, k, v, causal=True, s_aux=s),
            lambda q, k, v: fa.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True),
        )
    )
    out, dense = ours(q, k, v, sinks)
    grads = torch.autograd.grad(out, (q, k, v, sinks))
    ref_out, ref_dense = loss(
        q,
        k,
        v,
        sinks,
        lambda q, k, v, s: attention_torch(q, k, v, causal=True, sinks=s),
        lambda q, k, v: attention_torch_varlen(q, k, v, cu, cu, causal=True),
    )
    ref_grads = torch.autograd.grad(ref_out, (q, k, v, sinks))
    torch.testing.assert_close(dense, ref_dense.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-5)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_meta_tensors_give_shapes():
    q, k, v = (torch.empty(2, 5, h, 64, device="meta") for h in (8, 2, 2))
    out = fa.flash_attn_func(q, k, v, causal=True, window_size=(3, 0))
    assert out.device.type == "meta" and out.shape == (2, 5, 8, 64)
    cu = torch.tensor([0, 4, 10], device="meta", dtype=torch.int32)
    out = fa.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 6, 6)
    assert out.device.type == "meta" and out.shape == (10, 8, 64)


def _qkv(hq=4, hkv=2, d=64, dk=None, dtype=torch.float32):
    return (
        torch.randn(1, 5, hq, d, dtype=dtype),
        torch.randn(1, 5, hkv, dk or d, dtype=dtype),
        torch.randn(1, 5, hkv, d, dtype=dtype),
    )


BAD_DENSE = [
    (
        lambda: (_qkv(hq=4, hkv=3), {}),
        ValueError,
        r"k: expected a number of kv heads dividing the 4 query heads",
    ),
    (lambda: (_qkv(dk=80), {}), ValueError, r"k: expected head_dim 64 like q, got 80"),
    (lambda: (_qkv(d=36, dk=36), {}), ValueError, r"q: expected head_dim a multiple of 8"),
    (
        lambda: (_qkv(dtype=torch.float64), {}),
        ValueError,
        r"q: expected dtype bfloat16, float16 or float32, got float64",
    ),
    (
        lambda: ((_qkv()[0], *_qkv(dtype=torch.bfloat16)[1:]), {}),
        ValueError,
        r"q, k, v: expected one dtype, got q float32, k bfloat16, v bfloat16",
    ),
    (
        lambda: ((_qkv()[0], _qkv()[1].to("meta"), _qkv()[2]), {}),
        ValueError,
        r"k: expected a tensor on cpu \(same device as q\)",
    ),
    (
        lambda: ((_qkv()[0][0], *_qkv()[1:]), {}),
        ValueError,
        r"q: expected a rank-4 array \[batch, heads, seq, head_dim\], got shape \(5, 4, 64\)",
    ),
    (lambda: (_qkv(), {"s_aux": torch.zeros(3)}), ValueError, r"sinks: expected shape \(4,\)"),
    (lambda: (_qkv(), {"window_size": (-2, 0)}), ValueError, r"window_size: expected values >= -1"),
    (lambda: (_qkv(), {"dropout_p": 0.1}), NotImplementedError, r"dropout_p"),
    (lambda: (_qkv(), {"alibi_slopes": torch.zeros(4)}), NotImplementedError, r"alibi_slopes"),
    (lambda: (_qkv(), {"return_attn_probs": True}), NotImplementedError, r"return_attn_probs"),
]


@pytest.mark.parametrize("make, exc, match", BAD_DENSE)
def test_bad_dense_inputs_raise_clear_errors(make, exc, match):
    (q, k, v), kw = make()
    with pytest.raises(exc, match=match):
        fa.flash_attn_func(q, k, v, **kw)


def test_bad_varlen_inputs_raise_clear_errors():
    q, k, v = torch.randn(6, 4, 64), torch.randn(6, 2, 64), torch.randn(6, 2, 64)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(
        ValueError, match=r"cu_seqlens_q: expected nondecreasing offsets from 0 to 6"
    ):
        fa.flash_attn_varlen_func(
            q, k, v, torch.tensor([0, 4, 2, 6]), torch.tensor([0, 2, 4, 6]), 4, 4
        )
    with pytest.raises(
        ValueError, match=r"cu_seqlens_k: expected nondecreasing offsets from 0 to 6"
    ):
        fa.flash_attn_varlen_func(q, k, v, cu, torch.tensor([0, 2, 5], dtype=torch.int32), 4, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens_q: expected an integer dtype, got float32"):
        fa.flash_attn_varlen_func(q, k, v, cu.float(), cu, 4, 4)
    with pytest.raises(
        ValueError, match=r"max_seqlen_k: expected at least the longest sequence \(4 tokens"
    ):
        fa.flash_attn_varlen_func(q, k, v, cu, cu, 4, 3)
    with pytest.raises(ValueError, match=r"cu_seqlens_k: expected a tensor on cpu"):
        fa.flash_attn_varlen_func(q, k, v, cu, cu.to("meta"), 4, 4)
    with pytest.raises(
        ValueError,
        match=r"q: expected a rank-3 array \[total, heads, head_dim\], got shape \(1, 6, 4, 64\)",
    ):
        fa.flash_attn_varlen_func(q[None], k, v, cu, cu, 4, 4)
    with pytest.raises(NotImplementedError, match=r"dropout_p"):
        fa.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, dropout_p=0.5)


def test_cpu_impl_switch_reaches_the_ops():
    q = torch.randn(1, 3, 2, 64)
    op = ops._flash_attention
    before = {key[0] for key in op._jit_cache}
    with cpu_impl("reference"):
        fa.flash_attn_func(q, q, q, softmax_scale=0.123)
    assert {key[0] for key in op._jit_cache} - before <= {"reference"}
    assert any(key[0] == "reference" and 0.123 in key[1] for key in op._jit_cache)


def test_transformers_passes_every_supported_option():
    """transformers picks the optional kwargs it passes from the varlen signature."""
    from transformers.modeling_flash_attention_utils import _lazy_define_process_function

    process = _lazy_define_process_function(fa.flash_attn_varlen_func)
    sinks = torch.zeros(4)
    kw = process(
        query_length=8,
        key_length=8,
        is_causal=True,
        dropout=0.0,
        softmax_scale=0.5,
        sliding_window=4,
        softcap=3.0,
        deterministic=True,
        s_aux=sinks,
        max_seqlen_q=torch.tensor(8),
        max_seqlen_k=torch.tensor(8),
    )
    assert kw["window_size"] == (3, 3) and kw["softcap"] == 3.0 and kw["s_aux"] is sinks
    assert kw["dropout_p"] == 0.0 and kw["deterministic"] is True and kw["causal"] is True
    assert "max_seqlen_q" in kw and "max_seqlen_k" in kw


# -- compile gate: the TorchTPU jax_op path at a model shape, on meta tensors ----


def test_torch_ops_lower_through_torch_tpu_jax_op_on_meta():
    b, hq, hkv, s, d = 1, 32, 8, 1024, 128
    q = torch.empty(b, hq, s, d, dtype=torch.bfloat16)
    k = torch.empty(b, hkv, s, d, dtype=torch.bfloat16)
    statics = ("bhsd", True, -1, -1, 0.0, 1.0 / math.sqrt(d))
    out = meta_call(ops._flash_attention, q, k, k, None, None, None, *statics)
    assert out.shape == q.shape and out.device.type == "meta"
    # The autograd path: the forward op also returns its residual, the f32
    # logsumexp in the kernels' layout [B, Hkv, G, S]; the backward op starts
    # from the inputs, the output and that residual.
    sinks = torch.empty(hq, dtype=torch.float32)
    op = ops._flash_attention
    out, residuals = meta_call(op.forward, q, k, k, sinks, None, None, *statics)
    assert [(tuple(r.shape), r.dtype) for r in residuals] == [
        ((b, hkv, hq // hkv, s), torch.float32)
    ]
    dq, dk, dv, dsinks = meta_call(
        op.backward, q, k, k, sinks, None, None, *statics, out, residuals, out, False
    )
    assert (
        dq.shape == q.shape
        and dk.shape == k.shape
        and dv.shape == k.shape
        and dsinks.shape == (hq,)
    )
