"""ragged-dot-tpu: grouped matmul (ragged dot) Pallas TPU kernels and a fused MoE experts layer for PyTorch.

Layout (the package contract, README "Layout"): kernel_gmm.py and
kernel_tgmm.py the Pallas kernels; api.py the JAX API (`ragged_dot`,
`moe_experts`) with their forward/backward rules; moe.py the MoE routing glue
around the two grouped matmuls; tiling.py the configs and their choice;
checks.py the argument rules; reference.py the pure-JAX reference
(reference_torch.py a torch loop for the tests); ops.py the torch ops;
layers.py transformers' `experts_forward`; hf_mxfp4.py and hf_fp8.py the
loaders of GPT-OSS's MXFP4 and finegrained FP8 checkpoints.
"""

from .layers import experts_forward, experts_forward_w8a8
from .ops import LIB as LIB, grouped_mm, ragged_dot


def use_fp8_quantizer(enable: bool = True) -> None:
    """Load finegrained FP8 checkpoints with FP8 experts on any device, their
    other Linears dequantized (hf_fp8.py; imports transformers, so only when
    called). Register experts_forward in ALL_FP8_EXPERTS_FUNCTIONS too."""
    from .hf_fp8 import use_fp8_quantizer as use

    use(enable)


def use_mxfp4_quantizer(enable: bool = True) -> None:
    """Load GPT-OSS's MXFP4 checkpoints 4-bit, run by experts_forward (hf_mxfp4.py;
    imports transformers, so only when called)."""
    from .hf_mxfp4 import use_mxfp4_quantizer as use

    use(enable)


__all__ = [
    "experts_forward",
    "experts_forward_w8a8",
    "grouped_mm",
    "ragged_dot",
    "use_fp8_quantizer",
    "use_mxfp4_quantizer",
]
