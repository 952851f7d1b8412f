"""`experts_forward`: a drop-in for transformers' experts interface (transformers 5.22).

Register it and load a model with it:

    ALL_EXPERTS_FUNCTIONS.register("ragged_dot_tpu", kernel.experts_forward)
    AutoModelForCausalLM.from_pretrained(..., experts_implementation="ragged_dot_tpu")

The whole layer (sort by expert, histogram, gather, gate/up ragged dot,
activation, down ragged dot, routing weights, unpermute, f32 sum over top-k)
is one op, i.e. one TPU program per MoE layer call in eager mode. That needs
the gate to be one we can express in JAX: transformers' default
`act_fn(gate) * up` with a known activation, or GPT-OSS's clamped GLU.
Anything else (a custom `_apply_gate`, an unknown activation module, a
post-expert norm) takes the documented slower path: the same two ragged-dot
kernels, with the model's own Python gate/norm between them.

Quantized experts: transformers' FP8 experts (`FP8Experts`, finegrained FP8:
float8_e4m3fn weights with `*_scale_inv` per 128 x 128 block, or per tensor)
run weight-only: the kernels read the FP8 bytes and widen them in VMEM, the
activations stay in bf16 (no activation quantization, so the result is the
dequantized model's, slightly more exact than FP8 x FP8). Register the same
function for them: `ALL_FP8_EXPERTS_FUNCTIONS.register("ragged_dot_tpu",
kernel.experts_forward)`. `experts_forward_w8a8` is the opt-in w8a8 form
(activations quantized in the kernel; per-tensor or per-channel scales).

FP4 experts (`FineGrainedFP8Config(expert_dtype="fp4")`: int8 weights
[E, N, K/2] holding two e2m1 values a byte, with e8m0 or power-of-two float
scales [E, N, K/32]) run as MXFP4: the first call converts each projection
once to the kernels' layout (mxfp4.to_kernel_layout) and keeps it on the
module; later calls reuse it while the weights are unchanged. GPT-OSS's MXFP4
checkpoints (`quant_method: mxfp4`) load 4-bit through `use_mxfp4_quantizer()`
(hf_mxfp4.py), already in that layout.
"""

from __future__ import annotations

import torch
from torch import nn

from . import mxfp4
from .ops import _moe_experts, ragged_dot

# transformers activation modules (by class name) -> our activation names.
_ACTIVATIONS = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "GELUTanh": "gelu_pytorch_tanh",
    "PytorchGELUTanh": "gelu_pytorch_tanh",
    "NewGELUActivation": "gelu_pytorch_tanh",
    "GELUActivation": "gelu",
    "ReLU": "relu",
    "ReLUSquaredActivation": "relu2",
}


def _activation_name(act_fn) -> str | None:
    if act_fn is None:
        return None
    name = _ACTIVATIONS.get(type(act_fn).__name__)
    if type(act_fn).__name__ == "GELU" and isinstance(act_fn, nn.GELU):
        name = "gelu_pytorch_tanh" if act_fn.approximate == "tanh" else "gelu"
    return name


def _fused_activation(module) -> str | None:
    """The activation name the fused op implements for this module, or None."""
    if getattr(module, "has_post_expert_norm", False):
        return None
    if getattr(module, "fused_activation", None):  # our own modules name theirs (hf_mxfp4)
        return module.fused_activation
    if not module.has_gate:
        return _activation_name(getattr(module, "act_fn", None))
    gate = getattr(type(module), "_apply_gate", None)
    qualname = getattr(gate, "__qualname__", "")
    if qualname == "_default_apply_gate":
        return _activation_name(getattr(module, "act_fn", None))
    if qualname == "FP8Experts._apply_gate":
        # Plain act(gate) * up unless the config asks for a clamped or SwiGLU-OAI gate.
        if getattr(module, "swiglu_alpha", None) is None and module.limit is None:
            return _activation_name(getattr(module, "act_fn", None))
        return None
    if qualname == "GptOssExperts._apply_gate":
        return "gpt_oss"
    return None


def _weights(module):
    gate_up = module.gate_up_proj if module.has_gate else module.up_proj
    prefix = "gate_up_proj" if module.has_gate else "up_proj"
    up_bias = getattr(module, f"{prefix}_bias", None) if module.has_bias else None
    down_bias = module.down_proj_bias if module.has_bias else None
    return gate_up, module.down_proj, up_bias, down_bias


def _fp8_scale(module, weight, scale_inv):
    """An FP8Experts projection's `*_scale_inv` as the kernels take it: 128 x 128
    block scales as they are, per-tensor ones (one per half of gate_up) per channel."""
    block = getattr(module, "block_size", None)
    scale = scale_inv.float()
    if block is not None:
        if tuple(block) != (128, 128):
            raise NotImplementedError(
                f"experts_forward: FP8 weight_block_size {list(block)}: only [128, 128]"
                " blocks (or per-tensor scales) are supported"
            )
        return scale
    # Per tensor: [E, parts, 1] with gate_up split in its halves.
    out, parts = weight.shape[1], scale.shape[1]
    return scale[..., 0].repeat_interleave(out // parts, dim=1)


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    """FP4 scales as e8m0 bytes: float8_e8m0fnu viewed, float32 converted
    (powers of two only: the kernels scale by exponent)."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    s = scale.float()
    e = torch.log2(s)
    if not bool(torch.all((s > 0) & (e == torch.round(e)) & (e >= -127) & (e <= 127))):
        raise NotImplementedError(
            "experts_forward: FP4 experts with float scales that are not powers of two;"
            " MXFP4 scales are e8m0 (FineGrainedFP8Config(scale_fmt='ue8m0'))"
        )
    return (e + 127).to(torch.uint8)


def _fp4_projection(weight, scale):
    """One FP4 projection ([E, N, K/2] int8, [E, N, K/32] scales) in mxfp4's
    kernel layout (mxfp4.to_kernel_layout's rule, in torch ops so the
    tensors stay on their device)."""
    w = weight.detach().view(torch.uint8).transpose(1, 2).contiguous()
    s = _e8m0(scale.detach()).transpose(1, 2)
    pad = mxfp4.scale_rows(2 * weight.shape[-1]) - s.shape[1]
    s = torch.nn.functional.pad(s, (0, 0, 0, pad), value=127).contiguous()
    return w, s


def _fp4_weights(module, gate_up, down):
    """(gate_up, its scales, down, its scales) of FP4 experts in the kernels'
    layout, converted once and kept on the module; None for other experts."""
    if gate_up.dtype not in (torch.int8, getattr(torch, "float4_e2m1fn_x2", None)):
        return None
    prefix = "gate_up_proj" if module.has_gate else "up_proj"
    up_s = getattr(module, f"{prefix}_scale_inv", None)
    down_s = getattr(module, "down_proj_scale_inv", None)
    if up_s is None or down_s is None:
        return None
    for w, sc in ((gate_up, up_s), (down, down_s)):
        want = (*w.shape[:2], 2 * w.shape[-1] // mxfp4.BLOCK)
        if tuple(sc.shape) != want:
            raise NotImplementedError(
                f"experts_forward: FP4 experts (int8 weights {tuple(w.shape)}, two values"
                f" a byte) need one scale per 32 inputs, {want}; got {tuple(sc.shape)}"
            )
    key = tuple((t.data_ptr(), t._version) for t in (gate_up, down, up_s, down_s))
    cached = module.__dict__.get("_ragged_dot_tpu_fp4")
    if cached is None or cached[0] != key:
        cached = (key, *_fp4_projection(gate_up, up_s), *_fp4_projection(down, down_s))
        module.__dict__["_ragged_dot_tpu_fp4"] = cached
    return cached[1:]


def _scales(module, gate_up, down):
    """(gate_up scales, down scales) of weight-only quantized experts, else (None, None)."""
    if gate_up.element_size() > 1 and down.element_size() > 1:
        return None, None
    prefix = "gate_up_proj" if module.has_gate else "up_proj"
    up_scale = getattr(module, f"{prefix}_scale_inv", None)
    down_scale = getattr(module, "down_proj_scale_inv", None)
    if up_scale is None or down_scale is None:
        raise NotImplementedError(
            f"experts_forward: {type(module).__name__} holds {gate_up.dtype} / {down.dtype}"
            " expert weights without `*_scale_inv` scales; quantized experts are supported"
            " as transformers' FP8Experts"
        )
    return _fp8_scale(module, gate_up, up_scale), _fp8_scale(module, down, down_scale)


def experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers experts interface: [T, H], [T, k] ids, [T, k] weights -> [T, H]."""
    return _experts(self, hidden_states, top_k_index, top_k_weights, quantize_activations=False)


def experts_forward_w8a8(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """experts_forward with w8a8: for FP8Experts with per-tensor scales (and
    int8 / float8_e4m3fn experts with per-channel ones), each row entering an
    expert matmul is quantized in the kernel (its largest magnitude to 127 or
    448) and the MXU runs 8-bit x 8-bit: fp8 on tpu7x, int8 on v5e / v6e.
    Opt-in, as its own name to register: the activations are rounded to 8
    bits. Block-scaled (128 x 128) or bf16 experts raise a ValueError."""
    return _experts(self, hidden_states, top_k_index, top_k_weights, quantize_activations=True)


def _experts(self, hidden_states, top_k_index, top_k_weights, *, quantize_activations):
    gate_up, down, up_bias, down_bias, up_scale, down_scale, is_transposed = _layer_weights(self)
    activation = _fused_activation(self)
    if activation is None:
        return _unfused_experts_forward(
            self, hidden_states, top_k_index, top_k_weights, quantize_activations
        )
    return _moe_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up,
        down,
        up_bias,
        down_bias,
        int(self.num_experts),
        bool(self.has_gate),
        is_transposed,
        bool(getattr(self, "is_concatenated", True)),
        activation,
        0,
        float(getattr(self, "alpha", 1.702)),
        float(getattr(self, "limit", None) or 7.0),
        up_scale,
        down_scale,
        quantize_activations,
    )


def _layer_weights(module):
    """(gate_up, down, their biases, their scales, is_transposed) as the kernels
    take them: FP4 experts converted (cached) to mxfp4's [E, in/2, out] layout."""
    gate_up, down, up_bias, down_bias = _weights(module)
    if getattr(module, "mxfp4_kernel_layout", False):  # hf_mxfp4.Mxfp4Experts: converted at load
        up_scale, down_scale = module.gate_up_proj_scales, module.down_proj_scales
        return gate_up, down, up_bias, down_bias, up_scale, down_scale, True
    fp4 = _fp4_weights(module, gate_up, down)
    if fp4 is not None:
        gate_up, up_scale, down, down_scale = fp4
        return gate_up, down, up_bias, down_bias, up_scale, down_scale, True
    up_scale, down_scale = _scales(module, gate_up, down)
    is_transposed = bool(getattr(module, "is_transposed", False))
    return gate_up, down, up_bias, down_bias, up_scale, down_scale, is_transposed


def _unfused_experts_forward(self, hidden_states, top_k_index, top_k_weights, quantize_lhs):
    """Slower path for gates and norms we cannot fuse: two ragged-dot kernel calls,
    the model's own `_apply_gate` / `act_fn` / `post_expert_norm` between them."""
    gate_up, down, up_bias, down_bias, up_scale, down_scale, is_transposed = _layer_weights(self)
    transpose = not is_transposed
    dtype = hidden_states.dtype if up_scale is not None else gate_up.dtype
    num_tokens, k = top_k_index.shape
    num_experts = int(self.num_experts)
    ids = top_k_index.reshape(-1)
    valid = (ids >= 0) & (ids < num_experts)  # expert-parallel sentinels are >= num_experts
    key = torch.where(valid, ids, num_experts)
    order = torch.argsort(key, stable=True)
    key_sorted = key[order]
    group_sizes = torch.bincount(key, minlength=num_experts + 1)[:num_experts].to(torch.int32)
    x = hidden_states[order // k].to(dtype)
    rows_expert = key_sorted.clamp(max=num_experts - 1)
    proj = ragged_dot(
        x,
        gate_up,
        group_sizes,
        transpose_rhs=transpose,
        rhs_scale=up_scale,
        quantize_lhs=quantize_lhs,
    )
    if up_bias is not None:
        proj = proj + up_bias[rows_expert]
    proj = self._apply_gate(proj) if self.has_gate else self.act_fn(proj)
    out = ragged_dot(
        proj.to(dtype),
        down,
        group_sizes,
        transpose_rhs=transpose,
        rhs_scale=down_scale,
        quantize_lhs=quantize_lhs,
    )
    if down_bias is not None:
        out = out + down_bias[rows_expert]
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    keep = valid[order].unsqueeze(-1)
    weighted = torch.where(keep, out.float(), 0.0) * top_k_weights.reshape(-1)[
        order
    ].float().unsqueeze(-1)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return weighted[inv].view(num_tokens, k, -1).sum(dim=1).to(hidden_states.dtype)
