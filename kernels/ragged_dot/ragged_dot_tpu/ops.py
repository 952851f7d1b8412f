"""ragged-dot-tpu as torch ops: ragged_dot / grouped_mm, and the fused MoE experts layer.

Both ops are differentiable: their backward ops run jax.vjp of the same JAX
function, i.e. the kernels' own custom_vjp (gmm with transposed weights for
d_lhs, tgmm for d_rhs).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import checks, moe, reference
from .api import ragged_dot as _jax_ragged_dot
from ._torch_bindings import OpLibrary, validate

LIB = OpLibrary("ragged_dot_tpu", Path(__file__).parent)

_DTYPES = (torch.bfloat16, torch.float32)
_OUT_DTYPES = {"": None, "bfloat16": "bfloat16", "float32": "float32"}


def _rd_kernel(lhs, rhs, group_sizes, group_offset, transpose_rhs, out_dtype, *, interpret):
    return _jax_ragged_dot(
        lhs,
        rhs,
        group_sizes,
        group_offset=group_offset,
        preferred_element_type=_OUT_DTYPES[out_dtype] or None,
        transpose_rhs=transpose_rhs,
        interpret=interpret,
    )


def _rd_reference(lhs, rhs, group_sizes, group_offset, transpose_rhs, out_dtype):
    if transpose_rhs:
        rhs = rhs.swapaxes(1, 2)
    return reference.ragged_dot_reference(
        lhs, rhs, group_sizes, group_offset, _OUT_DTYPES[out_dtype] or None
    )


_ragged_dot = LIB.define_differentiable(
    "ragged_dot",
    "(Tensor lhs, Tensor rhs, Tensor group_sizes, int group_offset, bool transpose_rhs, str out_dtype) -> Tensor",
    kernel=_rd_kernel,
    reference=_rd_reference,
    differentiable=("lhs", "rhs"),
)


def _moe_kernel(
    hidden,
    top_k_index,
    top_k_weights,
    gate_up,
    down,
    gate_up_bias,
    down_bias,
    num_experts,
    has_gate,
    is_transposed,
    is_concatenated,
    activation,
    group_offset,
    alpha,
    limit,
    *,
    interpret,
):
    return moe.moe_experts(
        hidden,
        top_k_index,
        top_k_weights,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        num_experts=num_experts,
        has_gate=has_gate,
        is_transposed=is_transposed,
        is_concatenated=is_concatenated,
        activation=activation,
        group_offset=group_offset,
        alpha=alpha,
        limit=limit,
        interpret=interpret,
    )


def _moe_reference(*args):
    return moe.moe_experts_reference(*args)


_moe_experts = LIB.define_differentiable(
    "moe_experts",
    "(Tensor hidden, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, Tensor down, "
    "Tensor? gate_up_bias, Tensor? down_bias, int num_experts, bool has_gate, bool is_transposed, "
    "bool is_concatenated, str activation, int group_offset, float alpha, float limit) -> Tensor",
    kernel=_moe_kernel,
    reference=_moe_reference,
    differentiable=("hidden", "top_k_weights", "gate_up", "down", "gate_up_bias", "down_bias"),
)


def _check_group_sizes(group_sizes: torch.Tensor, m: int) -> None:
    # Value checks read the sizes: cheap on host tensors, a device sync on TPU,
    # and impossible while tracing, so only eager host/TPU tensors get them.
    if group_sizes.device.type == "meta" or torch.compiler.is_compiling():
        return
    checks.check_group_sizes_values(group_sizes.detach().cpu().numpy(), m)


def ragged_dot(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    group_offset: int = 0,
    transpose_rhs: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`jax.lax.ragged_dot` for torch: rows of group g times rhs[g].

    lhs [M, K]; rhs [G, K, N] ([G, N, K] with transpose_rhs, e.g. Linear
    weights); group_sizes int32/int64 [G_total] with G_total >= G (rows are
    the consecutive blocks of each group; rows past sum(group_sizes) come out
    zero). group_offset: first group held in rhs (expert parallelism; rows of
    other groups come out zero). bfloat16 or float32, f32 accumulation.
    """
    validate.check_tensor("lhs", lhs, ndim=2, dtypes=_DTYPES)
    validate.check_tensor("rhs", rhs, ndim=3, dtypes=_DTYPES)
    validate.check_tensor("group_sizes", group_sizes, ndim=1, dtypes=(torch.int32, torch.int64))
    validate.check_same_device(lhs=lhs, rhs=rhs, group_sizes=group_sizes)
    validate.check_supported_device("lhs", lhs)
    validate.check_same_dtype(lhs=lhs, rhs=rhs)
    k_axis = 2 if transpose_rhs else 1
    if rhs.shape[k_axis] != lhs.shape[1]:
        layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
        raise ValueError(
            f"rhs: expected {layout} with K={lhs.shape[1]} (lhs.shape[1]), got {list(rhs.shape)}"
        )
    if group_sizes.shape[0] < rhs.shape[0]:
        raise ValueError(
            f"group_sizes: expected length >= rhs.shape[0] = {rhs.shape[0]}, "
            f"got {group_sizes.shape[0]}"
        )
    if not 0 <= group_offset <= group_sizes.shape[0] - rhs.shape[0]:
        raise ValueError(
            f"group_offset: expected 0 <= group_offset <= {group_sizes.shape[0] - rhs.shape[0]}, "
            f"got {group_offset}"
        )
    if out_dtype is not None and out_dtype not in _DTYPES:
        raise ValueError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    _check_group_sizes(group_sizes, lhs.shape[0])
    name = "" if out_dtype is None else str(out_dtype).replace("torch.", "")
    return _ragged_dot(
        lhs, rhs, group_sizes.to(torch.int32), int(group_offset), bool(transpose_rhs), name
    )


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch.nn.functional.grouped_mm` convention: input [M, K], weight [G, K, N],
    offs [G] int32 = cumulative row ends of each group."""
    validate.check_tensor("offs", offs, ndim=1, dtypes=(torch.int32, torch.int64))
    if weight.dim() == 3 and offs.shape[0] != weight.shape[0]:
        raise ValueError(
            f"offs: expected length {weight.shape[0]} (weight.shape[0]), got {offs.shape[0]}"
        )
    sizes = torch.diff(offs.to(torch.int32), prepend=offs.new_zeros(1, dtype=torch.int32))
    return ragged_dot(input, weight, sizes)
