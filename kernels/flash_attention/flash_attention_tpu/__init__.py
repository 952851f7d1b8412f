"""flash-attention-tpu: flash attention (fwd + bwd, GQA, causal, sliding windows, softcap, sinks,
varlen) as Pallas TPU kernels for PyTorch, in flash-attn's conventions and as a transformers
attention function.

Layout (the package contract, README "Layout"): kernel_fwd.py and
kernel_bwd.py the Pallas kernels (schedule.py the block schedule they walk);
api.py the JAX API (`flash_attention`, `flash_attention_varlen`) with their
forward/backward rules; kernel_decode.py and kvcache.py the decode kernel over a
KV cache and its JAX API (`flash_attention_kvcache`); tiling.py `BlockSizes` and their choice; checks.py the
argument rules; reference.py the pure-JAX reference; ops.py the torch ops;
layers.py flash-attn's functions and transformers' `attention_forward`.
"""

from .layers import (
    attention_forward,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from .ops import LIB as LIB

__all__ = [
    "attention_forward",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
