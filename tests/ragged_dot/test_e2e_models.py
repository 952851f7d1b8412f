"""End to end through the published artifact: get_kernel, register, from_pretrained, generate."""

import pytest
import torch
from mxfp4_checkpoints import as_gpt_oss_mxfp4, e2m1

REPO = "tpu-kernels/ragged-dot-tpu"


def _save_tiny(family, path, **sizes):
    """A tiny random model of `family` saved at `path`; `sizes` override its config."""
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
        config = dict(
            common,
            moe_intermediate_size=24,
            intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=12,
            norm_topk_prob=True,
        )
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**config, **sizes}))
    else:
        config = dict(common, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
        model = MixtralForCausalLM(MixtralConfig(**{**config, **sizes}))
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


def _counted_fp8_experts(kernel, monkeypatch, name):
    """Registers our experts_forward for transformers' FP8Experts (FP8 and FP4
    weights) under `name`, counting its calls (the list returned).

    transformers 5.22 refuses FP8 (or dequantizes a pre-quantized checkpoint
    to bf16) when no CUDA/XPU device is present, a TPU host included; the
    README says so. Here its environment check is skipped to get FP8Experts."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    from transformers.quantizers import quantizer_finegrained_fp8

    monkeypatch.setattr(
        quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer,
        "validate_environment",
        lambda self, *a, **k: None,
    )
    counted, calls = _counting(kernel.experts_forward)
    ALL_FP8_EXPERTS_FUNCTIONS.register(name, counted)
    return calls


def _counting(experts_fn):
    """(experts_fn recording each call's hidden states shape, the list of them)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return experts_fn(*args, **kwargs)

    return counted, calls


def _assert_same_model(ours, ref, calls):
    """f32 logits within 1e-5, our experts called once per layer (`calls`),
    and the same greedy tokens; returns the token ids it ran."""
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
        assert len(calls) == len(ours.model.layers)
        got = ours.generate(ids, max_new_tokens=2, do_sample=False)
        want = ref.generate(ids, max_new_tokens=2, do_sample=False)
    assert torch.equal(got, want)
    return ids


def _dequantized(weight, scale_inv, block):
    """FP8Experts weights in f32: per 128 x 128 block, or per tensor (gate_up's halves)."""
    s = scale_inv.float()
    if block is not None:
        s = s.repeat_interleave(128, 1).repeat_interleave(128, 2)
    else:
        s = s.repeat_interleave(weight.shape[1] // s.shape[1], 1)
    return weight.float() * s


@pytest.mark.parametrize("block", [[128, 128], None], ids=["blocks", "per_tensor"])
def test_fp8_checkpoint_experts_run_weight_only(block, kernel, tmp_path, monkeypatch):
    """transformers' finegrained FP8 experts (FP8Experts) through our experts_forward:
    the FP8 bytes stay FP8 in the model, and the logits and greedy tokens equal an
    f32 model holding the dequantized expert weights."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    calls = _counted_fp8_experts(kernel, monkeypatch, "ragged_dot_tpu_counted")
    # Block scales need 128-aligned expert dims.
    _save_tiny(
        "qwen3_moe",
        tmp_path,
        hidden_size=128,
        head_dim=32,
        moe_intermediate_size=128,
        intermediate_size=256,
        num_experts=4,
    )
    # Only the experts in FP8: FP8Linear's own matmul needs CUDA.
    quant = FineGrainedFP8Config(
        weight_block_size=block,
        modules_to_not_convert=["q_proj", "k_proj", "v_proj", "o_proj", "gate", "lm_head"],
    )
    ours = AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=quant,
        experts_implementation="ragged_dot_tpu_counted",
        dtype=torch.float32,
    ).eval()
    ref = AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation="eager", dtype=torch.float32
    ).eval()
    for lq, lr in zip(ours.model.layers, ref.model.layers):
        eq, er = lq.mlp.experts, lr.mlp.experts
        assert eq.gate_up_proj.dtype == eq.down_proj.dtype == torch.float8_e4m3fn
        er.gate_up_proj.data = _dequantized(eq.gate_up_proj, eq.gate_up_proj_scale_inv, block)
        er.down_proj.data = _dequantized(eq.down_proj, eq.down_proj_scale_inv, block)
    _assert_same_model(ours, ref, calls)


def _fp4_checkpoint(path):
    """Rewrites the tiny checkpoint at `path` as an FP4-experts one, as
    DeepSeek-V4-style checkpoints ship: each expert projection's weight
    [out, in/2] int8 (two e2m1 values a byte) and `weight_scale_inv`
    [out, in/32] float8_e8m0fnu."""
    import json

    from safetensors.torch import load_file, save_file

    sd = load_file(path / "model.safetensors")
    for name in [n for n in sd if ".mlp.experts." in n and n.endswith("_proj.weight")]:
        packed, scales = e2m1(sd[name].double().numpy())  # [out, in]
        sd[name] = packed.view(torch.int8)
        sd[name + "_scale_inv"] = scales.view(torch.float8_e8m0fnu)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "expert_dtype": "fp4",
        "scale_fmt": "ue8m0",
        "weight_block_size": None,
        "activation_scheme": "dynamic",
        "modules_to_not_convert": ["q_proj", "k_proj", "v_proj", "o_proj", "gate", "lm_head"],
    }
    (path / "config.json").write_text(json.dumps(config))


def _fp4_dequantized(weight, scale_inv):
    """FP4Experts weights [E, out, in/2] int8 + [E, out, in/32] e8m0 in f32 [E, out, in]."""
    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    b = weight.view(torch.uint8).long()
    vals = torch.stack([lut[b & 15], lut[b >> 4]], -1).reshape(*weight.shape[:-1], -1)
    return vals * torch.exp2(scale_inv.view(torch.uint8).float() - 127).repeat_interleave(32, -1)


def test_fp4_checkpoint_experts_run_as_mxfp4(kernel, tmp_path, monkeypatch):
    """transformers' FP4 experts (FineGrainedFP8Config expert_dtype='fp4': int8
    weights holding two e2m1 values a byte, e8m0 scales per 32 inputs) through
    our experts_forward: the weights stay 4-bit in the model, the kernels read
    them converted once to their layout, and the logits and greedy tokens equal
    an f32 model holding the dequantized expert weights."""
    from transformers import AutoModelForCausalLM

    calls = _counted_fp8_experts(kernel, monkeypatch, "ragged_dot_tpu_fp4_counted")
    sizes = dict(hidden_size=128, head_dim=32, moe_intermediate_size=96, num_experts=4)
    _save_tiny("qwen3_moe", tmp_path / "ref", **sizes)
    _save_tiny("qwen3_moe", tmp_path / "fp4", **sizes)
    _fp4_checkpoint(tmp_path / "fp4")
    ours = AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp4", experts_implementation="ragged_dot_tpu_fp4_counted", dtype=torch.float32
    ).eval()
    ref = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ref", experts_implementation="eager", dtype=torch.float32
    ).eval()
    for lq, lr in zip(ours.model.layers, ref.model.layers):
        eq, er = lq.mlp.experts, lr.mlp.experts
        assert eq.gate_up_proj.dtype == eq.down_proj.dtype == torch.int8
        assert eq.gate_up_proj.shape[-1] == 64  # 128 inputs, two a byte
        er.gate_up_proj.data = _fp4_dequantized(eq.gate_up_proj, eq.gate_up_proj_scale_inv)
        er.down_proj.data = _fp4_dequantized(eq.down_proj, eq.down_proj_scale_inv)
    ids = _assert_same_model(ours, ref, calls)
    # Converted once per layer and kept while the weights do not change.
    experts = ours.model.layers[0].mlp.experts
    kept = experts.__dict__["_ragged_dot_tpu_fp4"]
    with torch.no_grad():
        ours(ids)
    assert experts.__dict__["_ragged_dot_tpu_fp4"] is kept


def _gpt_oss_mxfp4_checkpoint(path):
    """A tiny random GPT-OSS saved at `path` in GPT-OSS's MXFP4 format."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        sliding_window=8,
    )
    model = GptOssForCausalLM(config)
    for name, p in model.named_parameters():
        if "experts" in name:
            p.data.normal_(0.0, 0.2)
    model.save_pretrained(path)
    as_gpt_oss_mxfp4(path)


@pytest.fixture
def mxfp4_quantizer(kernel):
    """Our MXFP4 quantizer in transformers' registry for the test, then theirs again."""
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    theirs = AUTO_QUANTIZER_MAPPING["mxfp4"]
    kernel.use_mxfp4_quantizer()
    assert AUTO_QUANTIZER_MAPPING["mxfp4"] is not theirs
    yield
    kernel.use_mxfp4_quantizer(False)
    assert AUTO_QUANTIZER_MAPPING["mxfp4"] is theirs


def test_gpt_oss_mxfp4_checkpoint_loads_4bit_and_runs_our_experts(
    kernel, mxfp4_quantizer, tmp_path, monkeypatch
):
    """GPT-OSS's MXFP4 checkpoint through `use_mxfp4_quantizer()`: the experts
    stay 4-bit (a quarter of bf16's bytes, in the kernels' layout), every
    layer runs our experts_forward, and the logits and greedy tokens equal an
    f32 model holding the weights transformers' own loader dequantizes (its
    code table, not ours); save_pretrained writes the checkpoint's bytes back."""
    import importlib

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _gpt_oss_mxfp4_checkpoint(tmp_path / "mxfp4")
    # transformers' own quantizer, with no Triton here, dequantizes at load.
    kernel.use_mxfp4_quantizer(False)
    ref = AutoModelForCausalLM.from_pretrained(
        tmp_path / "mxfp4", experts_implementation="eager", dtype=torch.float32
    ).eval()
    kernel.use_mxfp4_quantizer()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "mxfp4", dtype=torch.float32).eval()

    layers = importlib.import_module(kernel.__name__ + ".hf_mxfp4")
    counted, calls = _counting(kernel.experts_forward)
    monkeypatch.setattr(layers, "experts_forward", counted)
    for lq, lr in zip(ours.model.layers, ref.model.layers):
        eq, er = lq.mlp.experts, lr.mlp.experts
        assert type(eq).__name__ == "Mxfp4Experts"
        assert eq.gate_up_proj.dtype == eq.down_proj.dtype == torch.uint8
        assert eq.gate_up_proj.shape == (4, 32, 128)  # [E, H/2, 2I]: two values a byte
        assert eq.down_proj.shape == (4, 32, 64)
        assert eq.gate_up_proj.numel() * 2 == er.gate_up_proj.numel()
        for p in er.parameters():
            p.data = p.data.float()  # bf16 holds every e2m1 x 2^e exactly
    _assert_same_model(ours, ref, calls)

    ours.save_pretrained(tmp_path / "resaved")
    before = load_file(tmp_path / "mxfp4" / "model.safetensors")
    after = load_file(tmp_path / "resaved" / "model.safetensors")
    assert sorted(after) == sorted(before)
    for name in before:
        assert torch.equal(after[name], before[name]), name


def test_gpt_oss_mxfp4_quantizer_keeps_dequantize_and_refuses_quantizing(
    kernel, mxfp4_quantizer, tmp_path
):
    """With our quantizer registered, `Mxfp4Config(dequantize=True)` still loads
    bf16 experts, and a bf16 checkpoint asked to quantize while loading gets
    an error saying what the quantizer does."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    _gpt_oss_mxfp4_checkpoint(tmp_path / "mxfp4")
    bf16 = AutoModelForCausalLM.from_pretrained(
        tmp_path / "mxfp4", quantization_config=Mxfp4Config(dequantize=True)
    )
    experts = bf16.model.layers[0].mlp.experts
    assert type(experts).__name__ == "GptOssExperts"
    assert experts.gate_up_proj.shape == (4, 64, 128)
    bf16.save_pretrained(tmp_path / "bf16")
    with pytest.raises(ValueError, match="does not quantize bf16 weights while loading"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", quantization_config=Mxfp4Config())


@pytest.fixture
def fp8_quantizer(kernel):
    """Our FP8 quantizer in transformers' registry for the test, then theirs again."""
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    theirs = AUTO_QUANTIZER_MAPPING["fp8"]
    yield
    kernel.use_fp8_quantizer(False)
    assert AUTO_QUANTIZER_MAPPING["fp8"] is theirs


@pytest.mark.parametrize("block", [[128, 128], None], ids=["blocks", "per_tensor"])
def test_fp8_checkpoint_loads_fp8_experts_on_a_host_without_cuda(
    block, kernel, fp8_quantizer, tmp_path, monkeypatch
):
    """A pre-quantized finegrained FP8 checkpoint (every Linear FP8 but the
    router and lm_head, as Qwen3-30B-A3B-FP8 ships) through
    `use_fp8_quantizer()` on a host without CUDA: the experts stay FP8 and run
    our experts_forward, the other Linears are dequantized at load, and the
    logits and greedy tokens equal an f32 model holding the weights
    transformers' own loader dequantizes (its code, not ours)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.quantizers import quantizer_finegrained_fp8

    # Every quantized Linear 128-aligned, k_proj and v_proj included (4 KV heads
    # of 32): transformers' quantize-on-load leaves a smaller Linear's block
    # scale unwritten (torch.empty), and a NaN there made both models NaN.
    sizes = dict(
        hidden_size=128,
        head_dim=32,
        num_key_value_heads=4,
        moe_intermediate_size=128,
        num_experts=4,
    )
    _save_tiny("qwen3_moe", tmp_path / "bf16", **sizes)
    # The checkpoint, quantized by transformers' own quantizer (its environment
    # check lifted only to write it: quantizing needs no CUDA, its matmuls do).
    with monkeypatch.context() as m:
        m.setattr(
            quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer,
            "validate_environment",
            lambda self, *a, **k: None,
        )
        quant = FineGrainedFP8Config(
            weight_block_size=block, modules_to_not_convert=["gate", "lm_head"]
        )
        AutoModelForCausalLM.from_pretrained(
            tmp_path / "bf16", quantization_config=quant, dtype=torch.float32
        ).save_pretrained(tmp_path / "fp8")
    written = load_file(tmp_path / "fp8" / "model.safetensors")
    scales = [t for name, t in written.items() if name.endswith("_scale_inv")]
    assert scales and all(bool(torch.isfinite(s).all() and (s > 0).all()) for s in scales)

    # transformers' own loader, no CUDA here: it dequantizes the Linears. Its
    # experts come back as the FP8 bytes without their scales (the checkpoint
    # it wrote names the experts' scales fused, their weights per expert), so
    # the reference's experts are dequantized by this test from ours, below.
    ref = AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", experts_implementation="eager", dtype=torch.float32
    ).eval()
    counted, calls = _counting(kernel.experts_forward)
    ALL_FP8_EXPERTS_FUNCTIONS.register("ragged_dot_tpu_fp8_loaded", counted)
    kernel.use_fp8_quantizer()
    ours = AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", experts_implementation="ragged_dot_tpu_fp8_loaded", dtype=torch.float32
    ).eval()
    for layer, lr in zip(ours.model.layers, ref.model.layers):
        experts, attn = layer.mlp.experts, layer.self_attn
        assert isinstance(experts, FP8Experts)
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
        assert type(attn.q_proj) is torch.nn.Linear and attn.q_proj.weight.dtype == torch.float32
        for p in lr.parameters():
            p.data = p.data.float()
        er = lr.mlp.experts
        er.gate_up_proj.data = _dequantized(
            experts.gate_up_proj, experts.gate_up_proj_scale_inv, block
        )
        er.down_proj.data = _dequantized(experts.down_proj, experts.down_proj_scale_inv, block)
    _assert_same_model(ours, ref, calls)
    with pytest.raises(ValueError, match="does not quantize bf16 weights while loading"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", quantization_config=quant)
