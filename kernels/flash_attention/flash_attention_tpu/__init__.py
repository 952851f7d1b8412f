"""flash-attention-tpu: flash attention (fwd + bwd, GQA, causal, sliding windows, softcap, sinks,
varlen) as Pallas TPU kernels for PyTorch, in flash-attn's conventions and as a transformers
attention function."""

from .layers import attention_forward, flash_attn_func, flash_attn_varlen_func
from .ops import LIB as LIB

__all__ = ["attention_forward", "flash_attn_func", "flash_attn_varlen_func"]
