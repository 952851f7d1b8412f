"""The one autograd path (torch_bindings/vjp.py) never runs a forward kernel again
in the backward.

Every differentiable op is three ops: `plain`, `forward` (outputs plus the
residuals autograd saves) and `backward` (inputs, outputs, residuals,
cotangents -> gradients). These tests read which Pallas kernels the backward
op's program launches, and count the forward launches while loss.backward()
traces it: a backward that recomputed the forward (as jax.vjp of the forward
would) has the forward's kernels in its program.
"""

from collections import Counter

import pytest
import torch

import flash_attention_tpu
import ragged_dot_tpu
import rmsnorm_tpu
from flash_attention_tpu import kernel_fwd
from flash_attention_tpu import ops as fa_ops
from ragged_dot_tpu import ops as rd_ops
from rmsnorm_tpu import kernel as rms_kernel
from rmsnorm_tpu import ops as rms_ops
from torch_bindings import convert
from gate import pallas_eqns


def _pallas_names(fn, args) -> Counter:
    """Names of the pallas_calls `fn(*args)` traces, through every nested jaxpr."""
    names: Counter = Counter()
    for eqn in pallas_eqns(fn, args):
        info = eqn.params.get("name_and_src_info")
        names[getattr(info, "name", None) or eqn.params.get("name")] += 1
    return names


def _kernels(op, args) -> Counter:
    """Pallas kernels of `op`'s JAX program (interpret mode) on these arguments."""
    tensors, statics = op._split(args)
    fn = op.jax_function("interpret")
    jax_tensors = [
        None
        if t is None
        else [convert.to_jax(x) for x in t]
        if isinstance(t, (list, tuple))
        else convert.to_jax(t)
        for t in tensors
    ]
    return _pallas_names(lambda *ts: fn(*op._merge(ts, statics)), jax_tensors)


def _forward_and_backward_kernels(dop, args):
    *outs, residuals = dop.forward.op(*args)
    bwd_args = (*args, *outs, residuals, *outs, False)  # the outputs as cotangents
    return _kernels(dop.forward, args), _kernels(dop.backward, bwd_args), residuals


def _rms_args():
    return (torch.randn(24, 256), torch.randn(256), 1e-6, False)


def _fused_args():
    return (torch.randn(24, 256), torch.randn(24, 256), torch.randn(256), 1e-6, True)


def _ragged_args():
    sizes = torch.tensor([5, 0, 11], dtype=torch.int32)
    return (torch.randn(24, 128), torch.randn(3, 128, 256), sizes, 0, False, "", None, None, False)


def _moe_args():
    t, h, i, e, k = 6, 128, 128, 4, 2
    return (
        torch.randn(t, h),
        torch.randint(0, e, (t, k), dtype=torch.int32),
        torch.rand(t, k),
        0.05 * torch.randn(e, 2 * i, h),
        0.05 * torch.randn(e, h, i),
        None,
        None,
        e,
        True,
        False,
        True,
        "silu",
        0,
        1.702,
        7.0,
        None,
        None,
        False,
    )


def _flash_args():
    q, k = torch.randn(1, 4, 136, 64), torch.randn(1, 2, 136, 64)
    return (q, k, k.clone(), torch.randn(4), None, None, "bhsd", True, -1, -1, 0.0, 0.125)


def _varlen_args():
    cu = torch.tensor([0, 40, 130], dtype=torch.int32)
    q, k = torch.randn(130, 4, 64), torch.randn(130, 2, 64)
    return (q, k, k.clone(), cu, cu.clone(), None, 90, 130, True, -1, -1, 0.0, 0.125)


# op, arguments, the forward's kernels, the backward's kernels, residual count
CASES = {
    "rms_norm": (rms_ops._rms_norm, _rms_args, {"rms_norm_fwd": 1}, {"rms_norm_bwd": 1}, 0),
    "fused_add_rms_norm": (
        rms_ops._fused_add_rms_norm,
        _fused_args,
        {"rms_norm_fwd": 1},
        {"rms_norm_bwd": 1},
        0,
    ),
    # d_lhs is a gmm too (transposed weights): one per forward gmm, with one tgmm.
    "ragged_dot": (
        rd_ops._ragged_dot,
        _ragged_args,
        {"ragged_dot_gmm": 1},
        {"ragged_dot_gmm": 1, "ragged_dot_tgmm": 1},
        0,
    ),
    "moe_experts": (
        rd_ops._moe_experts,
        _moe_args,
        {"ragged_dot_gmm": 2},
        {"ragged_dot_gmm": 2, "ragged_dot_tgmm": 2},
        None,
    ),
    "flash_attention": (
        fa_ops._flash_attention,
        _flash_args,
        {"flash_attention_fwd": 1},
        {"flash_attention_dkdv": 1},  # dQ fused into it (tiling.Plan.fuse_dq)
        1,
    ),
    "flash_attention_varlen": (
        fa_ops._flash_attention_varlen,
        _varlen_args,
        {"flash_attention_fwd": 1},
        {"flash_attention_dkdv": 1},  # dQ fused into it (tiling.Plan.fuse_dq)
        1,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_backward_program_runs_no_forward_kernel(name):
    dop, make_args, fwd_want, bwd_want, n_res = CASES[name]
    torch.manual_seed(0)
    fwd, bwd, residuals = _forward_and_backward_kernels(dop, make_args())
    assert fwd == Counter(fwd_want)
    assert bwd == Counter(bwd_want), f"backward program launches {dict(bwd)}"
    if n_res is not None:
        assert len(residuals) == n_res
    else:  # the MoE layer: jax.vjp's residuals, none of them an input
        assert residuals and all(isinstance(r, torch.Tensor) for r in residuals)


def test_flash_residual_is_the_forward_logsumexp():
    """The saved residual is the forward kernel's per-row logsumexp, in kernel layout."""
    args = _flash_args()
    *_, residuals = fa_ops._flash_attention.forward.op(*args)
    (lse,) = residuals
    q, k = args[0], args[1]
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, dim=1)) * 0.125
    n = q.shape[2]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    sinks = args[3].reshape(1, 4, 1)
    want = torch.logsumexp(torch.cat([s, sinks[..., None].expand(1, 4, n, 1)], -1), -1)
    torch.testing.assert_close(lse.reshape(1, 4, n), want, atol=1e-4, rtol=1e-5)


class _Counting:
    """Wraps a kernel launch function and counts the calls (made while tracing)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        return self.fn(*a, **kw)


@pytest.mark.parametrize("kind", ["flash", "rmsnorm"])
def test_loss_backward_does_not_launch_the_forward(monkeypatch, kind):
    """Through torch autograd: the forward kernel is traced once, in the forward;
    loss.backward() traces the backward kernels and no forward kernel."""
    if kind == "flash":
        module, fwd_name = kernel_fwd, "fwd_call"
        bwd_module, bwd_name = flash_attention_tpu.kernel_bwd, "dkdv_call"
        q = torch.randn(1, 40, 4, 64, requires_grad=True)  # a shape no other test traces
        k = torch.randn(1, 40, 2, 64, requires_grad=True)

        def loss():
            return flash_attention_tpu.flash_attn_func(q, k, k, causal=True).square().sum()

        ops = (fa_ops._flash_attention,)
    else:
        module, fwd_name = rms_kernel, "rms_norm_fwd"
        bwd_module, bwd_name = rms_kernel, "rms_norm_bwd"
        x = torch.randn(7, 384, requires_grad=True)
        w = torch.randn(384, requires_grad=True)

        def loss():
            return rmsnorm_tpu.rms_norm(x, w, 1e-5).square().sum()

        ops = (rms_ops._rms_norm,)
    fwd, bwd = _Counting(getattr(module, fwd_name)), _Counting(getattr(bwd_module, bwd_name))
    monkeypatch.setattr(module, fwd_name, fwd)
    monkeypatch.setattr(bwd_module, bwd_name, bwd)
    for op in ops:  # trace afresh, so the counts see every launch
        for part in (op.forward, op.backward):
            monkeypatch.setattr(part, "_jit_cache", {})
    out = loss()
    assert fwd.calls == 1 and bwd.calls == 0
    out.backward()
    assert bwd.calls == 1, "the backward was not traced: the test would prove nothing"
    assert fwd.calls == 1, "loss.backward() ran the forward kernel again"


def test_ragged_dot_public_function_uses_the_residual_path():
    lhs = torch.randn(16, 128, requires_grad=True)
    rhs = torch.randn(2, 128, 128, requires_grad=True)
    out = ragged_dot_tpu.ragged_dot(lhs, rhs, torch.tensor([7, 9]))
    assert out.grad_fn is not None and "ragged_dot_fwd" in out.grad_fn.name()
