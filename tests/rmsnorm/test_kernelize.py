"""kernelize swaps transformers' RMSNorm forwards for the published rmsnorm-tpu layer."""

import copy
import pytest
import torch


def _tiny(family):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    # Non-trivial norm weights, so a wrong weight use cannot pass.
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.uniform_(0.5, 1.5)
    return model.float()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kernelized_model_matches_forward_and_backward(family, published):
    repo = published["rmsnorm-tpu"]
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    ref = _tiny(family)
    model = copy.deepcopy(ref)
    # The built repo, loaded as the Hub copy would be (kernels' LayerRepository
    # asks the network for the version even with LOCAL_KERNELS set).
    mapping = {"RMSNorm": {"cpu": LocalLayerRepository(repo_path=repo, layer_name="RMSNorm")}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        model = kernelize(model, device="cpu", mode=Mode.TRAINING)

    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    # kernelize binds the layer's forward on each instance.
    assert norms and all(
        m.forward.__func__.__module__.endswith(".layers")
        and m.forward.__func__.__module__.startswith("_rmsnorm_tpu_")
        for m in norms
    ), [m.forward.__func__.__module__ for m in norms]

    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    out = model(ids, labels=ids)
    out_ref = ref(ids, labels=ids)
    torch.testing.assert_close(out.logits, out_ref.logits, atol=2e-4, rtol=2e-4)
    out.loss.backward()
    out_ref.loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.testing.assert_close(p.grad, ref_params[name].grad, atol=2e-4, rtol=2e-3)
