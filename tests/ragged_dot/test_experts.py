"""experts_forward against transformers' grouped_mm_experts_forward, per model family layout.

Every test compares the output and the gradients of every input and every
parameter. bf16 results are compared per element (tests/tolerances.py)
against transformers' layer in f32 on the same bf16-rounded weights and
inputs.
"""

import zlib

import pytest
import torch
from torch import nn

import ragged_dot_tpu
from ragged_dot_tpu import layers as experts_mod
from ragged_dot_tpu import ops as rd_ops
from tolerances import assert_close
from torch_bindings import cpu_impl

H, I, E, K, T = 32, 16, 6, 2, 7


def _module(family):
    from transformers import (
        DeepseekV3Config,
        Gemma4TextConfig,
        GptOssConfig,
        MixtralConfig,
        NemotronHConfig,
        Qwen3MoeConfig,
    )
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    if family == "qwen3_moe":
        m = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E))
    elif family == "mixtral":
        m = MixtralExperts(MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E))
    elif family == "gemma4":
        m = Gemma4TextExperts(
            Gemma4TextConfig(
                hidden_size=H,
                moe_intermediate_size=I,
                num_experts=E,
                hidden_activation="gelu_pytorch_tanh",
            )
        )
    elif family == "gpt_oss":
        m = GptOssExperts(GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E))
    elif family == "deepseek_v3":
        m = DeepseekV3Experts(
            DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E)
        )
    elif family == "nemotron_h":
        m = NemotronHExperts(
            NemotronHConfig(
                hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, mlp_hidden_act="relu2"
            )
        )
    else:
        raise AssertionError(family)
    # A stable seed (hash() of a str changes per process): failures reproduce.
    g = torch.Generator().manual_seed(zlib.crc32(family.encode()) % 1000)
    for p in m.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.3
    return m.float()


def _routing(seed, sentinel=False, k=K, duplicates=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    idx[0, 0] = 1  # experts 0,2,4,5 may end up empty: fine
    if sentinel:
        idx[2, 0] = E  # expert-parallel sentinel (another shard's expert)
        idx[5, k - 1] = E + 3
    if duplicates:  # the same expert twice within a token: two rows, weights add up
        idx[1, :] = 4
        idx[3, :] = 0
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    return hidden, idx, w


FAMILIES = ["qwen3_moe", "mixtral", "gemma4", "gpt_oss", "deepseek_v3", "nemotron_h"]


def _reference(module, hidden, idx, w):
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(module, hidden, idx, w)


def _run(fn, module, hidden, idx, w, ct):
    """(out, grads of hidden, routing weights and every parameter) of <fn(...), ct>."""
    hidden = hidden.detach().requires_grad_()
    w = w.detach().requires_grad_()
    out = fn(module, hidden, idx, w)
    grads = torch.autograd.grad(
        out, [hidden, w, *module.parameters()], ct.to(out.dtype), allow_unused=True
    )
    return out, grads


def _names(module):
    return ["hidden", "top_k_weights", *(n for n, _ in module.named_parameters())]


def _check_f32(fn, module, hidden, idx, w, ref_module=None, seed=0):
    """fn and transformers' layer on f32 tensors: output and every gradient."""
    ct = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(seed + 100))
    out, grads = _run(fn, module, hidden, idx, w, ct)
    ref_out, ref_grads = _run(lambda *a: _reference(*a), ref_module or module, hidden, idx, w, ct)
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    torch.testing.assert_close(out, ref_out, atol=2e-4, rtol=2e-4)
    for name, g, r in zip(_names(module), grads, ref_grads):
        assert g is not None, f"{name}: no gradient"
        r = torch.zeros_like(g) if r is None else r
        torch.testing.assert_close(g, r, atol=5e-4, rtol=5e-4, msg=lambda m: f"{name}: {m}")
    return out, grads


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_grads_match_transformers(family, impl):
    module = _module(family)
    assert experts_mod._fused_activation(module) is not None, "this layout should take the fused op"
    hidden, idx, w = _routing(0)
    with cpu_impl(impl):
        _check_f32(ragged_dot_tpu.experts_forward, module, hidden, idx, w)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_expert_parallel_sentinels_are_ignored(family):
    module = _module(family)
    module._is_expert_parallel = True
    hidden, idx, w = _routing(1, sentinel=True)
    _check_f32(ragged_dot_tpu.experts_forward, module, hidden, idx, w)


def _shard(module, lo, hi):
    """The experts [lo, hi) of `module` as an expert-parallel shard (transformers' EP layout)."""
    import copy

    shard = copy.deepcopy(module)
    for name, p in module.named_parameters():
        setattr(shard, name, nn.Parameter(p.detach()[lo:hi].clone()))
    shard.num_experts = hi - lo
    shard._is_expert_parallel = True
    return shard


@pytest.mark.parametrize("family", ["gpt_oss"])  # biases must not leak into other shards' rows
def test_expert_parallel_shard_with_expert_offset(family):
    """A shard holding experts [3, 6) of 6: through experts_forward with the router's
    local ids (sentinel = 3 for other shards' experts), and through the op with global
    ids and group_offset = 3; both shards together give the full layer."""
    module = _module(family)
    hidden, idx, w = _routing(5)
    lo, hi = 3, E
    shard = _shard(module, lo, hi)
    local = torch.where((idx >= lo) & (idx < hi), idx - lo, hi - lo)
    out_shard, grads_shard = _check_f32(ragged_dot_tpu.experts_forward, shard, hidden, local, w)

    def by_offset(m, h, i, wt):  # the torch op itself, global ids and a non-zero offset
        gate_up, down, up_bias, down_bias = experts_mod._weights(m)
        return rd_ops._moe_experts(
            h,
            idx,
            wt,
            gate_up,
            down,
            up_bias,
            down_bias,
            hi - lo,
            bool(m.has_gate),
            bool(m.is_transposed),
            bool(getattr(m, "is_concatenated", True)),
            experts_mod._fused_activation(m),
            lo,
            float(getattr(m, "alpha", 1.702)),
            float(getattr(m, "limit", 7.0)),
            None,
            None,
            False,
        )

    ct = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(100))
    out_off, grads_off = _run(by_offset, shard, hidden, idx, w, ct)
    torch.testing.assert_close(out_off, out_shard, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(_names(shard), grads_off, grads_shard):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    # The other shard completes the layer: outputs and input gradients add up.
    other = _shard(module, 0, lo)
    local0 = torch.where(idx < lo, idx, lo)
    out0, grads0 = _run(ragged_dot_tpu.experts_forward, other, hidden, local0, w, ct)
    full, grads_full = _run(_reference, module, hidden, idx, w, ct)
    torch.testing.assert_close(out0 + out_shard, full, atol=2e-4, rtol=2e-4)
    for a, b, f in zip(grads0[:2], grads_shard[:2], grads_full[:2]):
        torch.testing.assert_close(a + b, f, atol=5e-4, rtol=5e-4)


@pytest.mark.parametrize("routing", ["top1", "duplicates"])
def test_top_k_1_and_duplicate_expert_ids(routing):
    module = _module("qwen3_moe")
    if routing == "top1":
        hidden, idx, w = _routing(6, k=1)
    else:
        hidden, idx, w = _routing(7, duplicates=True)
        assert (idx[1] == 4).all()
    _check_f32(ragged_dot_tpu.experts_forward, module, hidden, idx, w)


# bf16 layer: the projections, the activation and the down projection each
# round to bf16, and the gradients chain bf16 matmuls on rounded intermediates.
# Each rounding costs at most u * (sum of absolute terms it feeds); those sums
# come from the same f32 layer run on absolute values (weights, inputs,
# routing weights, cotangent): all terms are then non-negative, so nothing
# cancels. silu(z) and silu'(z) on z >= 0 are within 2x of the |z| and 1.1
# bounds, so 8 roundings' worth of that magnitude covers the 6 rounding points.
# (A clamped activation, GPT-OSS's, has no such monotone bound: silu only.)
BF16_ROUNDINGS = 8


def _abs_module(module):
    import copy

    m = copy.deepcopy(module)
    for p in m.parameters():
        p.data = p.data.abs()
    return m


@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_bf16_forward_and_gradients(family):
    module = _module(family).bfloat16()
    hidden, idx, w = _routing(2)
    hidden = hidden.bfloat16()
    ct = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(100)).bfloat16()
    out, grads = _run(ragged_dot_tpu.experts_forward, module, hidden, idx, w, ct)
    assert out.dtype == torch.bfloat16
    assert all(g.dtype == p.dtype for g, p in zip(grads, [hidden, w, *module.parameters()]))
    # f32 reference on the same bf16-rounded weights and inputs.
    ref_module = _module(family)
    for p, p16 in zip(ref_module.parameters(), module.parameters()):
        p.data = p16.detach().float()
    ref_out, ref_grads = _run(_reference, ref_module, hidden.float(), idx, w, ct.float())
    mag_out, mag_grads = _run(
        _reference, _abs_module(ref_module), hidden.float().abs(), idx, w.abs(), ct.float().abs()
    )
    assert_close(
        out, ref_out, dtype=torch.bfloat16, magnitude=mag_out, roundings=BF16_ROUNDINGS, what="out"
    )
    for name, g, r, mag in zip(_names(module), grads, ref_grads, mag_grads):
        assert_close(g, r, dtype=torch.bfloat16, magnitude=mag, roundings=BF16_ROUNDINGS, what=name)


class _OddGate(nn.Module):
    pass


def test_custom_gate_and_post_norm_take_the_unfused_path():
    """The unfused path (two ragged-dot ops, the model's Python gate/norm between):
    output and every gradient, weights and router weights included."""
    module = _module("qwen3_moe")
    # A Python gate the fused op cannot express: a model-defined _apply_gate.
    custom = type(
        "CustomGateExperts",
        (type(module),),
        {"_apply_gate": lambda self, x: torch.tanh(x[..., :I]) * x[..., I:] + 0.1},
    )
    module.__class__ = custom
    assert experts_mod._fused_activation(module) is None
    hidden, idx, w = _routing(3)
    _check_f32(ragged_dot_tpu.experts_forward, module, hidden, idx, w)

    module2 = _module("mixtral")
    module2.has_post_expert_norm = True
    module2.post_expert_norm = nn.LayerNorm(H)
    assert experts_mod._fused_activation(module2) is None
    _check_f32(ragged_dot_tpu.experts_forward, module2, hidden, idx, w, seed=1)

    # Expert-parallel sentinels on the unfused path too.
    module.__class__ = custom
    module._is_expert_parallel = True
    hidden, idx, w = _routing(4, sentinel=True)
    _check_f32(ragged_dot_tpu.experts_forward, module, hidden, idx, w, seed=2)


def test_fused_op_compiles_under_torch_compile_fullgraph():
    module = _module("qwen3_moe")
    hidden, idx, w = _routing(4)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(m, h, i, w):
        return ragged_dot_tpu.experts_forward(m, h, i, w)

    _check_f32(f, module, hidden, idx, w)
