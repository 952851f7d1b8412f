"""End to end through the published artifact: transformers models with the Hub attention vs eager.

Routes (see kernels/flash_attention/CARD.md):
- string form `attn_implementation="tpu-kernels/flash-attention-tpu"`: transformers
  loads the kernel with kernels.get_kernel (LOCAL_KERNELS points it at the
  built repo) and drives `flash_attn_func` / `flash_attn_varlen_func` through
  its own flash-attention wrapper (2-D padding masks, unpadding to varlen);
- registration `ALL_ATTENTION_FUNCTIONS.register(name, kernel.attention_forward)`:
  our attention interface gets the model's mask directly. GPT-OSS needs it:
  it lists `_compatible_flash_implementations`, and transformers replaces any
  requested implementation whose name contains "flash" by the first of those
  (a CUDA kernel), so the string form never reaches our kernel.

Tiny random models (hidden 64, head_dim 64, 2 layers, 8 tokens) with larger
than default init (initializer_range 0.2) so attention is not uniform: a
wrong mask, window, softcap or sink changes the logits by O(1), far above
the 1e-4 tolerance of these f32 comparisons (checked when writing the test).
"""

import os

import pytest
import torch

REPO = "tpu-kernels/flash-attention-tpu"
NAME = "flash-attention-tpu"
VOCAB, SEQ, NEW = 96, 8, 2
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=64,
    initializer_range=0.2,
)
WINDOWED = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])


def _save_tiny(family, path):
    import transformers as tf

    torch.manual_seed(0)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON))
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON))
    elif family == "gemma3":  # sliding window, q/k norms, query_pre_attn_scalar scaling
        model = tf.Gemma3ForCausalLM(
            tf.Gemma3TextConfig(query_pre_attn_scalar=48, **WINDOWED, **COMMON)
        )
    elif family == "gemma2":  # sliding window + attention logit softcapping
        model = tf.Gemma2ForCausalLM(
            tf.Gemma2Config(
                query_pre_attn_scalar=64, attn_logit_softcapping=2.0, **WINDOWED, **COMMON
            )
        )
    elif family == "gpt_oss":  # attention sinks + sliding window, GQA 2:1
        model = tf.GptOssForCausalLM(
            tf.GptOssConfig(num_local_experts=4, num_experts_per_tok=2, **WINDOWED, **COMMON)
        )
        for layer in model.model.layers:
            layer.self_attn.sinks.data.normal_(0.0, 1.0)
    else:
        raise ValueError(family)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def kernel(published):
    prev = os.environ.get("LOCAL_KERNELS")
    entry = f"{REPO}={published[NAME]}"
    os.environ["LOCAL_KERNELS"] = entry if not prev else f"{prev}:{entry}"
    from kernels import get_kernel
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    k = get_kernel(REPO, version=1, trust_remote_code=[REPO])
    assert k.__file__.startswith(str(published[NAME]))
    AttentionInterface.register("tpu_attention", k.attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(
        "tpu_attention", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    )
    # attention_forward also takes 4-D masks: sdpa's boolean masks exercise that path.
    AttentionInterface.register("tpu_attention_4d", k.attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register("tpu_attention_4d", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    yield k
    if prev is None:
        os.environ.pop("LOCAL_KERNELS", None)
    else:
        os.environ["LOCAL_KERNELS"] = prev


def _inputs():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding of the first row
    return ids, mask


def _load(path, impl, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=impl, allow_all_kernels=True, **kw
    ).eval()


def _compare(ours, ref):
    ids, mask = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)
        a = ours(ids, attention_mask=mask).logits
        b = ref(ids, attention_mask=mask).logits
        keep = mask.bool()  # padded positions' logits are not defined by either side
        torch.testing.assert_close(a[keep], b[keep], atol=1e-4, rtol=1e-4)
        for m in (None, mask):
            want = ref.generate(ids, attention_mask=m, max_new_tokens=NEW, do_sample=False)
            got = ours.generate(ids, attention_mask=m, max_new_tokens=NEW, do_sample=False)
            assert torch.equal(got, want), (got[:, SEQ:], want[:, SEQ:])


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gemma2"])
def test_string_form_matches_eager(family, kernel, published, tmp_path):
    import transformers.modeling_flash_attention_utils as fau

    _save_tiny(family, tmp_path)
    ours = _load(tmp_path, REPO)
    assert ours.config._attn_implementation == REPO
    # transformers' flash wrapper now calls the published build's functions.
    assert fau._flash_varlen_fn.__code__.co_filename.startswith(str(published[NAME]))
    _compare(ours, _load(tmp_path, "eager"))


@pytest.mark.parametrize(
    "family, impl", [("gpt_oss", "tpu_attention"), ("llama", "tpu_attention_4d")]
)
def test_registered_attention_forward_matches_eager(family, impl, kernel, tmp_path):
    _save_tiny(family, tmp_path)
    ours = _load(tmp_path, impl)
    assert ours.config._attn_implementation == impl
    _compare(ours, _load(tmp_path, "eager"))


def test_gpt_oss_string_form_is_redirected_by_transformers(kernel, tmp_path, monkeypatch):
    """Why GPT-OSS uses the registration route: transformers swaps the requested
    name for the model's own `_compatible_flash_implementations[0]` before loading."""
    import transformers.modeling_utils as mu
    from transformers import GptOssConfig, GptOssForCausalLM

    requested = []
    monkeypatch.setattr(
        mu, "lazy_import_flash_attention", lambda impl, **kw: requested.append(impl)
    )  # no download attempt
    model = GptOssForCausalLM(GptOssConfig(num_local_experts=4, num_experts_per_tok=2, **COMMON))
    got = model._check_and_adjust_attn_implementation(REPO)
    assert got != REPO and requested == [got]
    assert got == GptOssForCausalLM._compatible_flash_implementations[0]


def test_bf16_logits_close_to_eager(kernel, tmp_path):
    _save_tiny("qwen3", tmp_path)
    ids, _ = _inputs()
    with torch.no_grad():
        a = _load(tmp_path, REPO, dtype=torch.bfloat16)(ids).logits.float()
        b = _load(tmp_path, "eager", dtype=torch.bfloat16)(ids).logits.float()
    # bf16 end to end: a few bf16 ulps of the logit scale.
    torch.testing.assert_close(a, b, atol=5e-2 * b.abs().max().item(), rtol=5e-2)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gpt_oss"])
def test_static_cache_generation_runs_the_decode_kernel(family, kernel, tmp_path, monkeypatch):
    """transformers' StaticCache (fixed-size [B, Hkv, max_len, D] tensors, what
    TPU generation uses for static shapes): every decode step runs the kernel
    over the cache where it lies, and greedy tokens match eager's."""
    calls = []
    decode = kernel.layers.flash_attention_kvcache

    def counting(*a, **kw):
        calls.append(a[1].shape)
        return decode(*a, **kw)

    monkeypatch.setattr(kernel.layers, "flash_attention_kvcache", counting)
    _save_tiny(family, tmp_path)
    ours, ref = _load(tmp_path, "tpu_attention"), _load(tmp_path, "eager")
    ids, mask = _inputs()
    kw = dict(max_new_tokens=3, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=mask, **kw)
        got = ours.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(got, want), (got[:, SEQ:], want[:, SEQ:])
    # 2 layers x (prefill + 2 decode steps); full-attention layers read the
    # whole static cache (max_len = SEQ + new - 1), sliding ones their window's.
    assert len(calls) == 6 and max(s[2] for s in calls) == SEQ + 2, calls
