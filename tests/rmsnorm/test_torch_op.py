"""rmsnorm-tpu's torch ops: numerics vs a torch reference, autograd, torch.compile, errors."""

import pytest
import torch
from hypothesis import given, strategies as st

import rmsnorm_tpu
from tolerances import assert_close
from torch_bindings import cpu_impl


def torch_rms_norm(x, w, eps=1e-6, gemma=False):
    xf = x.float()
    wf = w.float() + 1.0 if gemma else w.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * wf).to(x.dtype)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    lead=st.lists(st.integers(1, 4), max_size=2),
    hidden=st.sampled_from([8, 96, 256]),
    gemma=st.booleans(),
    seed=st.integers(0, 50),
)
def test_forward_and_grads_match_torch(impl, dtype, lead, hidden, gemma, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, hidden, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(*lead, hidden, generator=g).to(dtype)
    with cpu_impl(impl):
        y = rmsnorm_tpu.rms_norm(x, w, 1e-6, gemma=gemma)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
    x2, w2 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    y_ref = torch_rms_norm(x2, w2, 1e-6, gemma)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x2, w2), dy.float())
    # Per element against f32 on the same values (tests/tolerances.py); the
    # backward's magnitudes are its sums of absolute terms.
    xf, d = x2.detach().reshape(-1, hidden), dy.float().reshape(-1, hidden)
    weff = w2.detach() + (1.0 if gemma else 0.0)
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
    xhat, g = xf * rstd, (d * weff).abs()
    mag_dx = rstd * (g + xhat.abs() * (g * xhat.abs()).mean(-1, keepdim=True))
    mag_dw = (d * xhat).abs().sum(0)
    assert_close(y, y_ref, what="y")
    assert_close(dx, dx_ref, magnitude=mag_dx.reshape(x.shape), what="dx")
    assert_close(dw, dw_ref, magnitude=mag_dw, what="dw")


def test_fused_add_grads_flow_to_both_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 128, generator=g, requires_grad=True)
    r = torch.randn(3, 5, 128, generator=g, requires_grad=True)
    w = torch.randn(128, generator=g, requires_grad=True)
    y, s = rmsnorm_tpu.fused_add_rms_norm(x, r, w, 1e-5)
    (y.square().sum() + s.sin().sum()).backward()
    x2, r2, w2 = (t.detach().clone().requires_grad_() for t in (x, r, w))
    s2 = x2 + r2
    y2 = torch_rms_norm(s2, w2, 1e-5)
    (y2.square().sum() + s2.sin().sum()).backward()
    torch.testing.assert_close(s, s2)
    torch.testing.assert_close(y, y2, atol=1e-5, rtol=1e-5)
    for a, b in ((x, x2), (r, r2), (w, w2)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)


def test_torch_compile_fullgraph_traces_op_and_backward():
    """Both ops traced with no graph break; every gradient matches eager torch."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=gen, requires_grad=True)
    r = torch.randn(4, 64, generator=gen, requires_grad=True)
    w = torch.randn(64, generator=gen, requires_grad=True)
    c = torch.randn(4, 64, generator=gen)

    def loss(x, r, w, norm, fused):
        y, s = fused(x, r, w)
        return (norm(x, w) * c).sum() + (y * c).sum() + (s.sin() * c).sum()

    ours = torch.compile(fullgraph=True, backend="aot_eager")(
        lambda x, r, w: loss(
            x,
            r,
            w,
            rmsnorm_tpu.rms_norm,
            lambda x, r, w: rmsnorm_tpu.fused_add_rms_norm(x, r, w, 1e-6),
        )
    )
    out = ours(x, r, w)
    grads = torch.autograd.grad(out, (x, r, w))
    ref = loss(x, r, w, torch_rms_norm, lambda x, r, w: (torch_rms_norm(x + r, w), x + r))
    ref_grads = torch.autograd.grad(ref, (x, r, w))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    for name, g, e in zip(("dx", "dresidual", "dweight"), grads, ref_grads):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_meta_tensors_give_shapes_without_running():
    x = torch.empty(2, 8192, 2880, device="meta", dtype=torch.bfloat16)
    w = torch.empty(2880, device="meta", dtype=torch.bfloat16)
    y, s = rmsnorm_tpu.fused_add_rms_norm(x, x, w)
    assert y.shape == x.shape and y.device.type == "meta" and s.dtype == torch.bfloat16


def test_mixed_weight_dtype_keeps_x_dtype():
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    w = torch.ones(32, dtype=torch.float32)
    assert rmsnorm_tpu.rms_norm(x, w).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: (torch.randn(4, 8), torch.randn(9)),
            r"weight: expected shape \(8,\) \(x's hidden size\), got \(9,\)",
        ),
        (
            lambda: (torch.randn(4, 8).int(), torch.randn(8)),
            r"x: expected dtype float32, bfloat16 or float16, got int32",
        ),
        (
            lambda: (torch.randn(4, 8), torch.randn(8).long()),
            r"weight: expected dtype float32, bfloat16 or float16, got int64",
        ),
        (lambda: ([1.0, 2.0], torch.randn(2)), r"x: expected a torch.Tensor"),
        (lambda: (torch.randn(4, 0), torch.randn(0)), r"x: expected a non-empty last"),
        (
            lambda: (torch.randn(4, 8), torch.randn(8, device="meta")),
            r"weight: expected a tensor on cpu",
        ),
    ],
)
def test_bad_inputs_raise_clear_errors(make, match):
    x, w = make()
    with pytest.raises((ValueError, TypeError), match=match):
        rmsnorm_tpu.rms_norm(x, w)


def test_bad_residual_raises():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"residual: expected x's shape \(4, 8\), got \(4, 9\)"):
        rmsnorm_tpu.fused_add_rms_norm(x, torch.randn(4, 9), torch.randn(8))
    with pytest.raises(ValueError, match=r"residual: expected x's dtype float32, got float16"):
        rmsnorm_tpu.fused_add_rms_norm(x, x.half(), torch.randn(8))


def test_cpu_impl_switch_rejects_unknown_values(monkeypatch):
    with pytest.raises(ValueError, match="impl: expected one of"):
        with cpu_impl("fast"):
            pass
    monkeypatch.setenv("TPU_KERNELS_CPU_IMPL", "gpu")
    with pytest.raises(ValueError, match="TPU_KERNELS_CPU_IMPL: expected one of"):
        rmsnorm_tpu.rms_norm(torch.randn(2, 8), torch.randn(8))


def test_repeated_calls_do_not_retrace():
    op = rmsnorm_tpu.ops._rms_norm
    x, w = torch.randn(3, 40), torch.randn(40)
    rmsnorm_tpu.rms_norm(x, w, 1e-6)
    fn = op._jitted("interpret", (1e-6, False))
    before = fn._cache_size()
    for _ in range(3):
        rmsnorm_tpu.rms_norm(x, w, 1e-6)
    assert op._jitted("interpret", (1e-6, False)) is fn
    assert fn._cache_size() == before
