"""ragged-dot-tpu: grouped matmul (ragged dot) Pallas TPU kernels and a fused MoE experts layer for PyTorch.

Layout (the package contract, README "Layout"): kernel_gmm.py and
kernel_tgmm.py the Pallas kernels; api.py the JAX API (`ragged_dot`,
`moe_experts`) with their forward/backward rules; moe.py the MoE routing glue
around the two grouped matmuls; tiling.py the configs and their choice;
checks.py the argument rules; reference.py the pure-JAX reference
(reference_torch.py a torch loop for the tests); ops.py the torch ops;
layers.py transformers' `experts_forward`; hf_mxfp4.py the loader of
GPT-OSS's MXFP4 checkpoints.
"""

from .layers import experts_forward, experts_forward_w8a8
from .ops import LIB as LIB, grouped_mm, ragged_dot


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
    "use_mxfp4_quantizer",
]
