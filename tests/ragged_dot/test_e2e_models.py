"""End to end through the published artifact: get_kernel, register, from_pretrained, generate."""

import pytest
import torch

REPO = "tpu-kernels/ragged-dot-tpu"


def _save_tiny(family, path):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=96,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                moe_intermediate_size=24,
                intermediate_size=64,
                num_experts=8,
                num_experts_per_tok=2,
                head_dim=12,
                norm_topk_prob=True,
                **common,
            )
        )
    else:
        model = MixtralForCausalLM(
            MixtralConfig(
                intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **common
            )
        )
    # Larger weights than the default init, so routing and logits are not flat.
    for name, p in model.named_parameters():
        if "experts" in name:
            p.data.normal_(0.0, 0.2)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def kernel(published):
    import os

    os.environ["LOCAL_KERNELS"] = f"{REPO}={published['ragged-dot-tpu']}"
    from kernels import get_kernel
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    k = get_kernel(REPO, version=1, trust_remote_code=[REPO])
    assert k.__file__.startswith(str(published["ragged-dot-tpu"]))
    ALL_EXPERTS_FUNCTIONS.register("ragged_dot_tpu", k.experts_forward)
    return k


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_generate_matches_eager_f32_and_logits_match_bf16(family, kernel, tmp_path):
    from transformers import AutoModelForCausalLM

    _save_tiny(family, tmp_path)
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager").eval()
    ours = AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation="ragged_dot_tpu"
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)
        want = ref.generate(ids, max_new_tokens=2, do_sample=False)
        got = ours.generate(ids, max_new_tokens=2, do_sample=False)
    assert torch.equal(got, want)

    ref16 = AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation="eager", dtype=torch.bfloat16
    ).eval()
    ours16 = AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation="ragged_dot_tpu", dtype=torch.bfloat16
    ).eval()
    with torch.no_grad():
        a, b = ours16(ids).logits.float(), ref16(ids).logits.float()
    # bf16 end to end: a few bf16 ulps of the logit scale.
    torch.testing.assert_close(a, b, atol=5e-2 * b.abs().max().item(), rtol=5e-2)
