"""nn.Module forwards for `kernels.kernelize`.

kernelize swaps a model layer's `forward` for ours, keeping the layer's own
parameters: transformers' RMSNorm layers hold `weight` and `variance_epsilon`
(Gemma's hold `eps` and scale by 1 + weight). So these classes define no
`__init__` and read only those attributes.
"""

from __future__ import annotations

import torch
from torch import nn

from .ops import rms_norm


class RMSNorm(nn.Module):
    """Drop-in forward for Llama/Qwen/Mistral-style RMSNorm (`weight * normed`)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = rms_norm(hidden_states, self.weight, self.variance_epsilon)
        # transformers multiplies in the promoted dtype (fp32 weight * bf16 x -> fp32).
        return out.to(torch.result_type(self.weight, hidden_states))


class GemmaRMSNorm(nn.Module):
    """Drop-in forward for Gemma-style RMSNorm (`normed * (1 + weight)`, attribute `eps`)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, gemma=True)


__all__ = ["GemmaRMSNorm", "RMSNorm"]
