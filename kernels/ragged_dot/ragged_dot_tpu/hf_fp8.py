"""transformers' finegrained FP8 checkpoints (``quant_method: fp8``, e.g.
Qwen3-30B-A3B-FP8) loaded with FP8 experts for our kernels on a TPU host.

transformers 5.22 keeps FP8 weights only when a CUDA or XPU device is present
and dequantizes a pre-quantized checkpoint to bf16 everywhere else, a TPU
included. ``use_fp8_quantizer()`` puts ``Fp8Quantizer`` in its place for
``fp8``. The experts stay ``FP8Experts`` (FP8 bytes, their ``*_scale_inv``),
which dispatch through ``ALL_FP8_EXPERTS_FUNCTIONS``: register
``experts_forward`` there. Every other FP8 Linear (attention, shared MLPs)
is dequantized once after loading into a plain ``nn.Linear`` in the model's
dtype, because FP8Linear's own matmul needs CUDA kernels; a MoE model's
expert weights are most of its bytes, so the FP8 savings stay where decode
reads them. ``FineGrainedFP8Config(dequantize=True)`` still loads bf16.

This module imports transformers; the package imports it only when asked.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.finegrained_fp8 import FP8Linear, _dequantize_fp8_weight
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer


class Fp8Quantizer(FineGrainedFP8HfQuantizer):
    """transformers' finegrained FP8 quantizer without its CUDA/XPU
    requirement: FP8 experts for our kernels, other FP8 Linears dequantized."""

    def validate_environment(self, *args, **kwargs):
        if self.quantization_config.dequantize:
            return
        if not self.pre_quantized:
            raise ValueError(
                "ragged-dot-tpu's FP8 quantizer loads FP8 checkpoints (weights with"
                " *_scale_inv); it does not quantize bf16 weights while loading"
            )

    def _process_model_after_weight_loading(self, model, **kwargs):
        super()._process_model_after_weight_loading(model, **kwargs)
        dtype = getattr(model, "dtype", torch.bfloat16)
        for name, module in list(model.named_modules()):
            if isinstance(module, FP8Linear) and module.weight.dtype != torch.int8:
                model.set_submodule(name, _dequantized_linear(module, dtype))
        return model


def _dequantized_linear(module: FP8Linear, dtype) -> nn.Linear:
    weight = _dequantize_fp8_weight(
        module.weight.detach(), module.weight_scale_inv.detach(), module.block_size, torch.float32
    )
    linear = nn.Linear(
        module.in_features,
        module.out_features,
        bias=module.bias is not None,
        device=weight.device,
        dtype=dtype,
    )
    with torch.no_grad():
        linear.weight.copy_(weight)
        if module.bias is not None:
            linear.bias.copy_(module.bias)
    linear.requires_grad_(False)
    return linear


def use_fp8_quantizer(enable: bool = True) -> None:
    """Make transformers load ``quant_method: fp8`` checkpoints with
    ``Fp8Quantizer``, for every later ``from_pretrained``; ``enable=False``
    puts transformers' own quantizer back."""
    AUTO_QUANTIZER_MAPPING["fp8"] = Fp8Quantizer if enable else FineGrainedFP8HfQuantizer
