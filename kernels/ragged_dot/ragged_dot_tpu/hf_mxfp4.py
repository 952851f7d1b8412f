"""transformers' MXFP4 checkpoints (GPT-OSS, ``quant_method: mxfp4``) loaded 4-bit for our kernels.

transformers runs these experts through Triton kernels on CUDA and XPU and
dequantizes them to bf16 everywhere else, a TPU included: four times the
expert bytes every decode step reads. ``use_mxfp4_quantizer()`` puts
``Mxfp4Quantizer`` in its place for ``mxfp4``. That quantizer replaces each
GptOssMLP's experts with ``Mxfp4Experts``, converts every projection's
``*_blocks`` / ``*_scales`` once, while the checkpoint loads, to the kernels'
layout (mxfp4.py), and runs the layer through ``experts_forward``.
``Mxfp4Config(dequantize=True)`` still loads bf16 experts, as before.

This module imports transformers; the package imports it only when asked.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps, _IdentityOp
from transformers.integrations.mxfp4 import Mxfp4Dequantize
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module

from . import mxfp4
from .layers import _fp4_projection, experts_forward

_PROJECTIONS = ("gate_up_proj", "down_proj")


class Mxfp4Experts(nn.Module):
    """GPT-OSS experts holding MXFP4 weights in the kernels' layout.

    ``gate_up_proj`` uint8 [E, H/2, 2I] (gate and up interleaved along 2I, as
    GPT-OSS stores them) with e8m0 ``gate_up_proj_scales`` [E, S(H), 2I];
    ``down_proj`` uint8 [E, I/2, H] with ``down_proj_scales`` [E, S(I), H];
    f32-or-model-dtype biases. The weights have no eager form, so the forward
    always runs our kernels, whatever ``experts_implementation`` says.
    """

    # Read by experts_forward, as transformers' experts decorator sets them on its modules.
    has_gate = True
    has_bias = True
    has_post_expert_norm = False
    is_transposed = True
    is_concatenated = False
    mxfp4_kernel_layout = True
    fused_activation = "gpt_oss"

    def __init__(self, config):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.num_experts = e
        self.hidden_size = h
        self.intermediate_size = i
        self.alpha = float(getattr(config, "swiglu_alpha", 1.702))
        self.limit = float(getattr(config, "swiglu_limit", 7.0))

        def frozen(*shape, dtype=torch.uint8):
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.gate_up_proj = frozen(e, h // 2, 2 * i)
        self.gate_up_proj_scales = frozen(e, mxfp4.scale_rows(h), 2 * i)
        self.gate_up_proj_bias = frozen(e, 2 * i, dtype=torch.float32)
        self.down_proj = frozen(e, i // 2, h)
        self.down_proj_scales = frozen(e, mxfp4.scale_rows(i), h)
        self.down_proj_bias = frozen(e, h, dtype=torch.float32)

    def forward(self, hidden_states, router_indices, routing_weights):
        return experts_forward(self, hidden_states, router_indices, routing_weights)


def _tensor(value):
    return value[0] if isinstance(value, list) else value


class _ToKernelLayout(ConversionOps):
    """One projection's checkpoint ``*_blocks`` [E, N, K/32, 16] and ``*_scales``
    [E, N, K/32] as the module's kernel-layout weight and scales."""

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, full_layer_name=None, **kwargs):
        proj = full_layer_name.rpartition(".")[2]
        blocks = _tensor(input_dict[f"{proj}_blocks"])
        scales = _tensor(input_dict[f"{proj}_scales"])
        if (
            blocks.dim() != 4
            or blocks.shape[-1] != 16
            or tuple(blocks.shape[:3]) != tuple(scales.shape)
        ):
            raise ValueError(
                f"{full_layer_name}: MXFP4 checkpoint tensors must be blocks [E, N, K/32, 16]"
                f" and scales [E, N, K/32]; got {tuple(blocks.shape)} and {tuple(scales.shape)}"
            )
        w, s = _fp4_projection(blocks.reshape(*blocks.shape[:2], -1), scales)
        return {full_layer_name: w, f"{full_layer_name}_scales": s}

    @property
    def reverse_op(self) -> ConversionOps:
        # Saving converts back in Mxfp4Quantizer.get_state_dict_and_metadata,
        # whose checkpoint names this converter's reverse no longer matches.
        return _IdentityOp()


class Mxfp4Quantizer(Mxfp4HfQuantizer):
    """transformers' MXFP4 quantizer, loading into ``Mxfp4Experts`` instead of
    Triton tensors: no Triton, any device."""

    def validate_environment(self, *args, **kwargs):
        if not self.pre_quantized and not self.quantization_config.dequantize:
            raise ValueError(
                "ragged-dot-tpu's MXFP4 quantizer loads MXFP4 checkpoints (GPT-OSS's"
                " *_blocks / *_scales); it does not quantize bf16 weights while loading"
            )

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return False

    def _process_model_before_weight_loading(self, model, **kwargs):
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        self.modules_to_not_convert = self.get_modules_to_not_convert(
            model, self.quantization_config.modules_to_not_convert, model._keep_in_fp32_modules
        )
        if self.quantization_config.dequantize:
            return model
        config = model.config.get_text_config()
        for name, module in list(model.named_modules()):
            experts = f"{name}.experts"
            if isinstance(module, GptOssMLP) and should_convert_module(
                experts, self.modules_to_not_convert
            ):
                with torch.device("meta"):
                    model.set_submodule(experts, Mxfp4Experts(config))
        return model

    def get_load_operations(self):
        return {"deserialize": _ToKernelLayout, "dequantize": Mxfp4Dequantize}

    def get_state_dict_and_metadata(self, model):
        """The checkpoint's names and layout back from the kernels': what
        ``save_pretrained`` writes loads here, or in transformers' own quantizer."""
        state = model.state_dict()
        for name, module in model.named_modules():
            if not isinstance(module, Mxfp4Experts):
                continue
            for proj in _PROJECTIONS:
                w = state.pop(f"{name}.{proj}")  # [E, K/2, N]
                s = state.pop(f"{name}.{proj}_scales")  # [E, S, N]
                e, half_k, n = w.shape
                state[f"{name}.{proj}_blocks"] = (
                    w.transpose(1, 2).reshape(e, n, half_k // 16, 16).contiguous()
                )
                state[f"{name}.{proj}_scales"] = s[:, : half_k // 16].transpose(1, 2).contiguous()
        return state, {}

    @property
    def is_trainable(self) -> bool:
        return False


def use_mxfp4_quantizer(enable: bool = True) -> None:
    """Make transformers load ``quant_method: mxfp4`` checkpoints (GPT-OSS) with
    ``Mxfp4Quantizer``, for every later ``from_pretrained``; ``enable=False``
    puts transformers' own quantizer back."""
    AUTO_QUANTIZER_MAPPING["mxfp4"] = Mxfp4Quantizer if enable else Mxfp4HfQuantizer
