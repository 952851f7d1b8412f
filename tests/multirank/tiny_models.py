"""Tiny random MoE models for the multi-rank tests, built from configs (no downloads).

Sizes are chosen so that every plan shards evenly at 4 ranks: 8 experts (2 per
rank under expert parallelism), 4 KV heads (1 per rank under tensor
parallelism, GQA 2:1), expert intermediate 32 (8 per rank, gate and up halves
split separately), vocabulary 96. head_dim 64 is the smallest our attention
kernel takes. Weights are drawn larger than the default init so routing and
logits are not flat: a dropped routing weight or a wrong expert changes the
logits by far more than the comparison tolerances.
"""

from __future__ import annotations

import torch

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "gemma4")
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 96, 64, 8, 4, 64
NUM_EXPERTS, TOP_K, MOE_INTERMEDIATE = 8, 2, 32
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    max_position_embeddings=64,
    initializer_range=0.1,
)
# Sliding window on the first layer, full attention on the second.
WINDOWED = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])


def build(family: str):
    import transformers as tf

    torch.manual_seed(0)
    if family == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(
            tf.Qwen3MoeConfig(
                num_experts=NUM_EXPERTS,
                num_experts_per_tok=TOP_K,
                moe_intermediate_size=MOE_INTERMEDIATE,
                intermediate_size=64,
                norm_topk_prob=True,
                **COMMON,
            )
        )
    elif family == "mixtral":
        model = tf.MixtralForCausalLM(
            tf.MixtralConfig(
                num_local_experts=NUM_EXPERTS,
                num_experts_per_tok=TOP_K,
                intermediate_size=MOE_INTERMEDIATE,
                **COMMON,
            )
        )
    elif family == "gpt_oss":  # biases, interleaved clamped GLU, attention sinks
        model = tf.GptOssForCausalLM(
            tf.GptOssConfig(
                num_local_experts=NUM_EXPERTS,
                num_experts_per_tok=TOP_K,
                intermediate_size=MOE_INTERMEDIATE,
                **WINDOWED,
                **COMMON,
            )
        )
        for layer in model.model.layers:
            layer.self_attn.sinks.data.normal_(0.0, 1.0)
    elif family == "gemma4":  # dense MLP beside the experts, own router, per-layer head dims
        model = tf.Gemma4ForCausalLM(
            tf.Gemma4TextConfig(
                enable_moe_block=True,
                num_experts=NUM_EXPERTS,
                top_k_experts=TOP_K,
                moe_intermediate_size=MOE_INTERMEDIATE,
                intermediate_size=64,
                hidden_size_per_layer_input=0,
                global_head_dim=128,
                **WINDOWED,
                **COMMON,
            )
        )
    else:
        raise ValueError(family)
    for name, p in model.named_parameters():
        if "experts" in name:
            p.data.normal_(0.0, 0.2)
    return model.eval()


def save(family: str, path) -> None:
    build(family).save_pretrained(path)
