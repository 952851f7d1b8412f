"""ragged-dot-tpu as torch ops: ragged_dot / grouped_mm, and the fused MoE experts layer.

Both ops are differentiable through torch_bindings' one autograd path, with
api.py's forward and backward rules (gmm with transposed weights for d_lhs,
tgmm for d_rhs; the MoE layer's residuals from its forward). Argument rules
are checks.py's, run by the ops on tensor specs before they dispatch.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import torch

from . import api, checks, reference
from ._torch_bindings import OpLibrary, validate

LIB = OpLibrary("ragged_dot_tpu", Path(__file__).parent)


# -- ragged_dot -------------------------------------------------------------------


def _rd_statics(args, interpret):
    _, _, _, _, transpose_rhs, out_dtype, _, _, quantize_lhs = args
    return dict(
        transpose_rhs=transpose_rhs,
        preferred_element_type=jnp.dtype(out_dtype) if out_dtype else None,
        config=None,
        interpret=interpret,
        quantize_lhs=quantize_lhs,
    )


def _rd_arrays(args):
    lhs, rhs, group_sizes, group_offset, _, _, rhs_scale, bias, _ = args
    return lhs, rhs, group_sizes, jnp.asarray(group_offset, jnp.int32), rhs_scale, bias


def _rd_forward(*args, interpret):
    return api.ragged_dot_fwd(*_rd_arrays(args), **_rd_statics(args, interpret))


def _rd_backward(args, out, residuals, grad, *, interpret):
    d_lhs, d_rhs, _, _, _, d_bias = api.ragged_dot_bwd(
        _rd_arrays(args), out, residuals, grad, **_rd_statics(args, interpret)
    )
    return d_lhs, d_rhs, d_bias


def _rd_reference(
    lhs, rhs, group_sizes, group_offset, transpose_rhs, out_dtype, rhs_scale, bias, quantize_lhs
):
    if transpose_rhs:
        rhs, rhs_scale = reference.as_kn(rhs, rhs_scale)
    return reference.ragged_dot_reference(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        out_dtype or None,
        rhs_scale=rhs_scale,
        bias=bias,
        quantize_lhs=quantize_lhs,
    )


def _rd_check(
    lhs, rhs, group_sizes, group_offset, transpose_rhs, out_dtype, rhs_scale, bias, quantize_lhs
):
    checks.check_ragged_dot_args(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        transpose_rhs=transpose_rhs,
        rhs_scale=rhs_scale,
        bias=bias,
        quantize_lhs=quantize_lhs,
    )
    if out_dtype:
        checks.check_dtype("out_dtype", out_dtype)


_ragged_dot = LIB.define_differentiable(
    "ragged_dot",
    "(Tensor lhs, Tensor rhs, Tensor group_sizes, int group_offset, bool transpose_rhs, str out_dtype, "
    "Tensor? rhs_scale, Tensor? bias, bool quantize_lhs) -> Tensor",
    forward=_rd_forward,
    backward=_rd_backward,
    reference=_rd_reference,
    differentiable=("lhs", "rhs", "bias"),
    check=_rd_check,
)


# -- the fused MoE experts layer ---------------------------------------------------


def _moe_split(args, interpret):
    """The op's positional arguments as api.moe_experts_fwd's arrays and statics."""
    # The 7 tensors, group_offset, the 2 scales.
    arrays = (*args[:7], jnp.asarray(args[12], jnp.int32), *args[15:17])
    names = ("num_experts", "has_gate", "is_transposed", "is_concatenated", "activation")
    statics = dict(zip(names, args[7:12]), alpha=args[13], limit=args[14])
    statics["quantize_activations"] = args[17]
    return arrays, dict(statics, config=None, interpret=interpret)


def _moe_forward(*args, interpret):
    arrays, statics = _moe_split(args, interpret)
    return api.moe_experts_fwd(*arrays, **statics)


def _moe_primal(*args, interpret):
    arrays, statics = _moe_split(args, interpret)
    return api.moe_experts_primal(*arrays, **statics)


def _moe_backward(args, out, residuals, grad, *, interpret):
    arrays, statics = _moe_split(args, interpret)
    grads = api.moe_experts_bwd(arrays, out, residuals, grad, **statics)
    return tuple(grads[i] for i in (0, 2, 3, 4, 5, 6))


def _moe_check(*args):
    (hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, num_experts,
     has_gate, is_transposed, _, activation) = args[:12]  # fmt: skip
    gate_up_scale, down_scale, quantize_activations = args[15:18]
    checks.check_moe_args(
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
        activation,
        gate_up_scale,
        down_scale,
        quantize_activations=quantize_activations,
    )


_moe_experts = LIB.define_differentiable(
    "moe_experts",
    "(Tensor hidden, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, Tensor down, "
    "Tensor? gate_up_bias, Tensor? down_bias, int num_experts, bool has_gate, bool is_transposed, "
    "bool is_concatenated, str activation, int group_offset, float alpha, float limit, "
    "Tensor? gate_up_scale, Tensor? down_scale, bool quantize_activations) -> Tensor",
    forward=_moe_forward,
    backward=_moe_backward,
    primal=_moe_primal,
    reference=reference.moe_experts_reference,
    differentiable=("hidden", "top_k_weights", "gate_up", "down", "gate_up_bias", "down_bias"),
    check=_moe_check,
)


# -- public torch functions ----------------------------------------------------------


def _check_group_sizes(*args) -> None:
    # Value checks read the sizes: cheap on host tensors, a device sync on TPU,
    # and impossible while tracing, so only eager host/TPU tensors get them,
    # after the shapes (the op would check them next; the same check, remembered).
    lhs, _, group_sizes = args[:3]
    if group_sizes.device.type == "meta" or torch.compiler.is_compiling():
        return
    _ragged_dot.check_args(args)
    checks.check_group_sizes_values(group_sizes.detach().cpu().numpy(), lhs.shape[0])


def _index_tensor(t: torch.Tensor) -> torch.Tensor:
    # JAX runs without 64-bit integers: int64 indices travel as int32 (they fit).
    return t.to(torch.int32) if t.dtype == torch.int64 else t


def ragged_dot(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    group_offset: int = 0,
    transpose_rhs: bool = False,
    out_dtype: torch.dtype | None = None,
    rhs_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    quantize_lhs: bool = False,
) -> torch.Tensor:
    """`jax.lax.ragged_dot` for torch: rows of group g times rhs[g].

    lhs [M, K]; rhs [G, K, N] ([G, N, K] with transpose_rhs, e.g. Linear
    weights); group_sizes int32/int64 [G_total] with G_total >= G (rows are
    the consecutive blocks of each group; rows past sum(group_sizes) come out
    zero). group_offset: first group held in rhs (expert parallelism; rows of
    other groups come out zero). bfloat16 or float32 (lhs and rhs may differ:
    the MXU runs in rhs's dtype, the output defaults to the wider), f32
    accumulation. bias [G, N]: bias[g] is added to group g's rows.
    Weight-only quantized rhs (int8, float8_e4m3fn) takes rhs_scale: [G, N]
    per output channel, or [G, A/128, B/128] per 128 x 128 block of rhs
    [G, A, B]; such weights and scales are frozen (no gradient).
    quantize_lhs: w8a8 for int8 / float8_e4m3fn rhs with per-channel scales:
    each lhs row is quantized in the kernel (its largest magnitude to 127 or
    448) and the MXU runs 8-bit x 8-bit; d_lhs stays the weight-only product.
    """
    validate.check_tensors(
        ("rhs_scale", "bias"),
        lhs=lhs,
        rhs=rhs,
        group_sizes=group_sizes,
        rhs_scale=rhs_scale,
        bias=bias,
    )
    name = "" if out_dtype is None else str(out_dtype).removeprefix("torch.")
    args = (
        lhs,
        rhs,
        _index_tensor(group_sizes),
        int(group_offset),
        bool(transpose_rhs),
        name,
        rhs_scale,
        bias,
        bool(quantize_lhs),
    )
    _check_group_sizes(*args)
    return _ragged_dot(*args)


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch.nn.functional.grouped_mm` convention: input [M, K], weight [G, K, N],
    offs [G] int32 = cumulative row ends of each group."""
    validate.check_tensors(input=input, weight=weight, offs=offs)
    checks.check_grouped_mm_offs(validate.spec(offs), validate.spec(weight))
    offs = _index_tensor(offs)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    return ragged_dot(input, weight, sizes)
