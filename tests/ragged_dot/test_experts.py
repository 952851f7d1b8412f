"""experts_forward against transformers' grouped_mm_experts_forward, per model family layout."""

import pytest
import torch
from torch import nn

import ragged_dot_tpu
from ragged_dot_tpu import experts as experts_mod
from torch_bindings import cpu_impl

H, I, E, K, T = 32, 16, 6, 2, 7


def _module(family):
    from transformers import (DeepseekV3Config, Gemma4TextConfig, GptOssConfig, MixtralConfig,
                              NemotronHConfig, Qwen3MoeConfig)
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
        m = Gemma4TextExperts(Gemma4TextConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                               hidden_activation="gelu_pytorch_tanh"))
    elif family == "gpt_oss":
        m = GptOssExperts(GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E))
    elif family == "deepseek_v3":
        m = DeepseekV3Experts(DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E))
    elif family == "nemotron_h":
        m = NemotronHExperts(NemotronHConfig(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E,
                                             mlp_hidden_act="relu2"))
    else:
        raise AssertionError(family)
    g = torch.Generator().manual_seed(hash(family) % 1000)
    for p in m.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.3
    return m.float()


def _routing(seed, sentinel=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[0] = torch.tensor([1, 1 if K == 1 else 3])  # experts 0,2,4,5 may end up empty: fine
    if sentinel:
        idx[2, 0] = E  # expert-parallel sentinel (another shard's expert)
        idx[5, 1] = E + 3
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return hidden, idx, w


FAMILIES = ["qwen3_moe", "mixtral", "gemma4", "gpt_oss", "deepseek_v3", "nemotron_h"]


def _reference(module, hidden, idx, w):
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(module, hidden, idx, w)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_grads_match_transformers(family, impl):
    module = _module(family)
    assert experts_mod._fused_activation(module) is not None, "this layout should take the fused op"
    hidden, idx, w = _routing(0)
    hidden.requires_grad_(); w.requires_grad_()
    with cpu_impl(impl):
        out = ragged_dot_tpu.experts_forward(module, hidden, idx, w)
        grads = torch.autograd.grad(out.square().sum(), [hidden, w, *module.parameters()])
    ref_out = _reference(module, hidden, idx, w)
    ref_grads = torch.autograd.grad(ref_out.square().sum(), [hidden, w, *module.parameters()])
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    torch.testing.assert_close(out, ref_out, atol=2e-4, rtol=2e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=5e-4, rtol=5e-4)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_expert_parallel_sentinels_are_ignored(family):
    module = _module(family)
    module._is_expert_parallel = True
    hidden, idx, w = _routing(1, sentinel=True)
    out = ragged_dot_tpu.experts_forward(module, hidden, idx, w)
    torch.testing.assert_close(out, _reference(module, hidden, idx, w), atol=2e-4, rtol=2e-4)


def test_bf16_matches_within_bf16_tolerance():
    module = _module("qwen3_moe").bfloat16()
    hidden, idx, w = _routing(2)
    out = ragged_dot_tpu.experts_forward(module, hidden.bfloat16(), idx, w)
    ref = _reference(module, hidden.bfloat16(), idx, w)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


class _OddGate(nn.Module):
    pass


def test_custom_gate_and_post_norm_take_the_unfused_path():
    module = _module("qwen3_moe")
    # A Python gate the fused op cannot express: a model-defined _apply_gate.
    custom = type("CustomGateExperts", (type(module),), {
        "_apply_gate": lambda self, x: torch.tanh(x[..., :I]) * x[..., I:] + 0.1})
    module.__class__ = custom
    assert experts_mod._fused_activation(module) is None
    hidden, idx, w = _routing(3)
    hidden.requires_grad_()
    out = ragged_dot_tpu.experts_forward(module, hidden, idx, w)
    ref = _reference(module, hidden, idx, w)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    g, = torch.autograd.grad(out.sum(), hidden)
    g_ref, = torch.autograd.grad(ref.sum(), hidden)
    torch.testing.assert_close(g, g_ref, atol=5e-4, rtol=5e-4)

    module2 = _module("mixtral")
    module2.has_post_expert_norm = True
    module2.post_expert_norm = nn.LayerNorm(H)
    assert experts_mod._fused_activation(module2) is None
    torch.testing.assert_close(ragged_dot_tpu.experts_forward(module2, hidden.detach(), idx, w),
                               _reference(module2, hidden.detach(), idx, w), atol=2e-4, rtol=2e-4)


def test_fused_op_compiles_under_torch_compile_fullgraph():
    module = _module("qwen3_moe")
    hidden, idx, w = _routing(4)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(h, i, w):
        return ragged_dot_tpu.experts_forward(module, h, i, w)

    torch.testing.assert_close(f(hidden, idx, w), _reference(module, hidden, idx, w), atol=2e-4, rtol=2e-4)
