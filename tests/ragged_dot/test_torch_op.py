"""ragged-dot-tpu's torch ops (ragged_dot, grouped_mm) vs an independent torch reference."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ragged_dot_tpu
from ragged_dot_tpu.reference_torch import ragged_dot_torch
from tolerances import assert_close
from torch_bindings import cpu_impl


def _torch_fwd_bwd(lhs, rhs_kn, gs, dy, transpose):
    """ragged_dot_torch in f32 and its gradients (rhs gradient in the op's layout)."""
    lhs32 = lhs.detach().float().requires_grad_()
    rhs32 = rhs_kn.detach().float().requires_grad_()
    out = ragged_dot_torch(lhs32, rhs32, gs)
    if out.requires_grad:
        d_lhs, d_rhs = torch.autograd.grad(out, (lhs32, rhs32), dy.float(), allow_unused=True)
    else:  # no row in any group: nothing depends on the inputs
        d_lhs = d_rhs = None
    d_lhs = torch.zeros_like(lhs32) if d_lhs is None else d_lhs
    d_rhs = torch.zeros_like(rhs32) if d_rhs is None else d_rhs
    return out.detach(), d_lhs, d_rhs.transpose(1, 2) if transpose else d_rhs


@st.composite
def problems(draw):
    g = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(0, 9), min_size=g, max_size=g))
    m = sum(sizes) + draw(st.integers(0, 5))  # rows past the sum must come out zero
    m = max(m, 1)
    k = draw(st.sampled_from([8, 40, 128]))
    n = draw(st.sampled_from([16, 72, 128]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    transpose = draw(st.booleans())
    return sizes, m, k, n, dtype, transpose, draw(st.integers(0, 99))


# 5 draws per impl: this checks the op's layout, autograd and arguments; the
# kernels' numerics over the whole space are test_gmm.py's.
@pytest.mark.parametrize("impl", ["interpret", "reference"])
@settings(max_examples=5)
@given(problem=problems())
def test_ragged_dot_and_grads_match_torch(impl, problem):
    sizes, m, k, n, dtype, transpose, seed = problem
    gen = torch.Generator().manual_seed(seed)
    lhs = torch.randn(m, k, generator=gen).to(dtype).requires_grad_()
    rhs_kn = torch.randn(len(sizes), k, n, generator=gen).to(dtype)
    rhs = (rhs_kn.transpose(1, 2).contiguous() if transpose else rhs_kn).requires_grad_()
    gs = torch.tensor(sizes, dtype=torch.int32)
    dy = torch.randn(m, n, generator=gen).to(dtype)
    with cpu_impl(impl):
        out = ragged_dot_tpu.ragged_dot(lhs, rhs, gs, transpose_rhs=transpose)
        d_lhs, d_rhs = torch.autograd.grad(out, (lhs, rhs), dy)
    ref = _torch_fwd_bwd(lhs, rhs_kn, gs, dy, transpose)
    # Magnitudes: the same products on absolute values (tests/tolerances.py).
    mags = _torch_fwd_bwd(lhs.abs(), rhs_kn.abs(), gs, dy.abs(), transpose)
    assert out.dtype == dtype and out.shape == (m, n)
    assert torch.all(out[sum(sizes) :] == 0)
    for name, got, want, mag in zip(("out", "d_lhs", "d_rhs"), (out, d_lhs, d_rhs), ref, mags):
        assert_close(got, want, magnitude=mag, what=name)


def test_group_offset_shards_sum_to_full_result():
    gen = torch.Generator().manual_seed(0)
    lhs, rhs = torch.randn(20, 32, generator=gen), torch.randn(4, 32, 24, generator=gen)
    gs = torch.tensor([5, 0, 9, 4], dtype=torch.int32)
    full = ragged_dot_tpu.ragged_dot(lhs, rhs, gs)
    a = ragged_dot_tpu.ragged_dot(lhs, rhs[:2], gs, group_offset=0)
    b = ragged_dot_tpu.ragged_dot(lhs, rhs[2:], gs, group_offset=2)
    torch.testing.assert_close(a + b, full)
    assert torch.all(a[5:] == 0) and torch.all(b[:5] == 0)


def test_grouped_mm_convention_and_out_dtype():
    gen = torch.Generator().manual_seed(1)
    x, w = (
        torch.randn(12, 16, generator=gen).bfloat16(),
        torch.randn(3, 16, 8, generator=gen).bfloat16(),
    )
    offs = torch.tensor([4, 4, 12], dtype=torch.int32)
    out = ragged_dot_tpu.grouped_mm(x, w, offs)
    ref = ragged_dot_torch(x.float(), w.float(), torch.tensor([4, 0, 8]))
    mag = ragged_dot_torch(x.float().abs(), w.float().abs(), torch.tensor([4, 0, 8]))
    assert_close(out, ref.float(), magnitude=mag, what="grouped_mm")
    f32 = ragged_dot_tpu.ragged_dot(x, w, torch.tensor([4, 0, 8]), out_dtype=torch.float32)
    assert f32.dtype == torch.float32


def test_torch_compile_fullgraph():
    """Traced with no graph break; output and both gradients match the torch loop."""
    gen = torch.Generator().manual_seed(4)
    lhs = torch.randn(10, 16, generator=gen, requires_grad=True)
    rhs = torch.randn(2, 16, 8, generator=gen, requires_grad=True)
    gs = torch.tensor([3, 5], dtype=torch.int32)  # 2 tail rows past the sum
    c = torch.randn(10, 8, generator=gen)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(a, b, g):
        return (ragged_dot_tpu.ragged_dot(a, b, g) * c).sum()

    out = f(lhs, rhs, gs)
    grads = torch.autograd.grad(out, (lhs, rhs))
    ref = (ragged_dot_torch(lhs, rhs, gs) * c).sum()
    ref_grads = torch.autograd.grad(ref, (lhs, rhs))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    for name, g, r in zip(("d_lhs", "d_rhs"), grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert torch.all(grads[0][8:] == 0)


def test_mixed_dtypes_and_group_bias_with_grads():
    """bf16 activations, f32 weights and a per-group bf16 bias (the op's whole
    differentiable surface) against a torch loop in f32."""
    gen = torch.Generator().manual_seed(5)
    lhs = torch.randn(14, 32, generator=gen).bfloat16().requires_grad_()
    rhs = torch.randn(3, 24, 32, generator=gen).requires_grad_()  # [G, N, K]
    bias = torch.randn(3, 24, generator=gen).bfloat16().requires_grad_()
    sizes = [4, 0, 7]  # 3 rows past the sum: no bias there
    dy = torch.randn(14, 24, generator=gen)
    with cpu_impl("interpret"):
        out = ragged_dot_tpu.ragged_dot(
            lhs, rhs, torch.tensor(sizes), transpose_rhs=True, bias=bias
        )
        grads = torch.autograd.grad(out, (lhs, rhs, bias), dy)
    assert out.dtype == torch.float32

    def ref(a, b, c):
        rows = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes))
        y = ragged_dot_torch(a, b.transpose(1, 2), torch.tensor(sizes))
        return y + torch.cat([c[rows], c.new_zeros(3, 24)])

    leaves = [t.detach().float().requires_grad_() for t in (lhs, rhs, bias)]
    want = ref(*leaves)
    want_grads = torch.autograd.grad(want, leaves, dy)
    # Magnitudes: the same function and vjp on absolute values.
    abs_leaves = [t.detach().abs().requires_grad_() for t in leaves]
    mag = ref(*abs_leaves)
    mag_grads = torch.autograd.grad(mag, abs_leaves, dy.abs())
    # lhs bf16 times f32 weights runs the MXU in f32; the cotangent is rounded
    # to lhs's bf16 once for both weight gradients (tests/tolerances.py).
    assert_close(out, want.detach(), magnitude=mag.detach(), what="out")
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.bfloat16]
    for name, got, w, m in zip(("d_lhs", "d_rhs", "d_bias"), grads, want_grads, mag_grads):
        assert_close(got, w, dtype=torch.bfloat16, roundings=1, magnitude=m, what=name)


BAD = [
    (lambda l, r, g: (l, r, g[:1]), r"group_sizes: expected length >= rhs.shape\[0\] = 2"),
    (
        lambda l, r, g: (l, r, g.float()),
        r"group_sizes: expected an integer dtype \(int32; others are cast\), got float32",
    ),
    (
        lambda l, r, g: (l, r, torch.tensor([-1, 3], dtype=torch.int32)),
        r"group_sizes: expected non-negative",
    ),
    (
        lambda l, r, g: (l, r, torch.tensor([5, 9], dtype=torch.int32)),
        r"group_sizes: expected sum\(group_sizes\) <= lhs.shape\[0\] = 8",
    ),
    (
        lambda l, r, g: (l, r[:, :5], g),
        r"rhs: expected shape \[G, K=16, N\] to match lhs \[M, K\], got \(2, 5, 4\)",
    ),
    (
        lambda l, r, g: (l, r.half(), g),
        r"rhs.dtype: expected bfloat16 or float32, or int8 / float8_e4m3fn / uint8 \(MXFP4\) with scales",
    ),
    (
        lambda l, r, g: (l.half(), r.half(), g),
        r"lhs.dtype: expected bfloat16 or float32, got float16",
    ),
    (lambda l, r, g: (l, r.to("meta"), g), r"rhs: expected a tensor on cpu \(same device as lhs\)"),
    (lambda l, r, g: (l[0], r, g), r"lhs: expected a 2-D array \[M, K\], got shape \(16,\)"),
]


@pytest.mark.parametrize("mutate, match", BAD)
def test_bad_inputs_raise_clear_errors(mutate, match):
    lhs, rhs, gs = (
        torch.randn(8, 16),
        torch.randn(2, 16, 4),
        torch.tensor([3, 5], dtype=torch.int32),
    )
    with pytest.raises((ValueError, TypeError), match=match):
        ragged_dot_tpu.ragged_dot(*mutate(lhs, rhs, gs))


def test_bad_group_offset_and_offs():
    lhs, rhs = torch.randn(8, 16), torch.randn(2, 16, 4)
    with pytest.raises(
        ValueError,
        match=r"group_offset: expected 0 <= group_offset <= len\(group_sizes\) - rhs.shape\[0\] = 1, got 2",
    ):
        ragged_dot_tpu.ragged_dot(
            lhs, rhs, torch.tensor([3, 5, 0], dtype=torch.int32), group_offset=2
        )
    with pytest.raises(ValueError, match=r"offs: expected length 2"):
        ragged_dot_tpu.grouped_mm(lhs, rhs, torch.tensor([8], dtype=torch.int32))
