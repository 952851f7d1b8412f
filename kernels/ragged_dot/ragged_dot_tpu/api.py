"""ragged_dot's JAX API: `ragged_dot` and the fused MoE layer `moe_experts`, each
differentiable through one autograd path (torch_bindings/vjp.py: a forward rule
returning residuals, a backward rule starting from them) that the torch ops share.

ragged_dot's forward is ``gmm``; the backward never materialises a transposed
weight copy: d_lhs = gmm(grad, rhs, transpose_rhs=True) reads rhs [G, K, N] as [G, N', K']
and contracts on N; d_rhs = tgmm(lhs, grad) produces [G_local, K, N] directly.
Both use the same group_offset, so a shard's gradients only cover its groups
(rows of other shards get d_lhs = 0: their forward rows did not depend on
this shard's weights).
"""

from __future__ import annotations

import functools

import jax

import jax.numpy as jnp

from . import checks, moe, mxfp4, tiling
from .kernel_combine import combine
from .kernel_gmm import gmm, resolve_config
from .kernel_moe_decode import fused_moe_decode
from .kernel_tgmm import tgmm
from ._torch_bindings.vjp import differentiable, split_vjp


def _configs(config):
    """(fwd, bwd_lhs, bwd_rhs) config-or-generation for the three kernels."""
    if config is None or isinstance(config, str):
        return config, config, config
    if isinstance(config, tiling.RaggedDotConfig):
        return config.fwd, config.bwd_lhs, config.bwd_rhs
    raise ValueError(
        f"config: expected None, a generation name or a RaggedDotConfig, got {config!r}"
    )


def _hbm_view(rhs, transpose_rhs):
    """(rhs as the kernels read it, its transpose_rhs, whether it was swapped).

    The kernels take rhs as XLA lays it out in HBM (tiling.weight_minor_swapped):
    the swap is a bitcast there, not the copy of every expert's weights that a
    row-major request would cost. FP4 weights come in mxfp4's kernel layout,
    which XLA keeps row-major: read as they are."""
    if tiling.weight_minor_swapped(rhs.shape) and not mxfp4.is_mxfp4(rhs.dtype):
        return jnp.swapaxes(rhs, 1, 2), not transpose_rhs, True
    return rhs, transpose_rhs, False


def _kernel_scale(rhs_scale, swapped, channel_axis):
    """(scales as the kernel takes them, their scale_axis).

    [G, N] per output channel -> [G, N] f32 on `channel_axis` ("n" in the
    forward, "k" in d_lhs, where N is contracted). [G, A/128, B/128] blocks of
    rhs [G, A, B] -> [G, A/128 * B/128] f32 in the order of rhs as the kernel
    reads it (swapped with it), "block" in both passes."""
    if rhs_scale is None:
        return None, None
    if rhs_scale.ndim == 3 and jnp.dtype(rhs_scale.dtype) in mxfp4.SCALE_DTYPES:
        return rhs_scale, "mx"
    s = rhs_scale.astype(jnp.float32)
    if s.ndim == 2:
        return s, channel_axis
    if swapped:
        s = jnp.swapaxes(s, 1, 2)
    return s.reshape(s.shape[0], -1), "block"


def _row_groups(group_sizes, group_offset, m, num_local):
    """(local group of each of m rows clipped to [0, num_local), whether the row
    belongs to a local group): rows past the sum and other shards' rows do not."""
    ends = jnp.cumsum(group_sizes, dtype=jnp.int32)
    local = jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right") - group_offset
    valid = jnp.logical_and(local >= 0, local < num_local)
    return jnp.clip(local, 0, num_local - 1), valid


def _add_bias(out, bias, group_sizes, group_offset, out_dtype):
    """out (f32) + bias[g] on group g's rows, rounded once to out_dtype. Plain
    XLA after the kernel: XLA fuses the gather of bias rows into the add."""
    local, valid = _row_groups(group_sizes, group_offset, out.shape[0], bias.shape[0])
    rows = jnp.where(valid[:, None], bias[local].astype(jnp.float32), 0.0)
    return (out.astype(jnp.float32) + rows).astype(out_dtype)


def _bias_grad(grad, bias, group_sizes, group_offset):
    """Sum of the output cotangent over each local group's rows, in f32."""
    local, valid = _row_groups(group_sizes, group_offset, grad.shape[0], bias.shape[0])
    g = jnp.where(valid[:, None], grad.astype(jnp.float32), 0.0)
    return jax.ops.segment_sum(g, local, num_segments=bias.shape[0]).astype(bias.dtype)


def ragged_dot_fwd(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    rhs_scale,
    bias,
    *,
    transpose_rhs,
    preferred_element_type,
    config,
    interpret,
    quantize_lhs=False,
):
    """Forward rule: (out, residuals). No residuals: the backward needs only the inputs."""
    fwd, _, _ = _configs(config)
    rhs, transpose_rhs, swapped = _hbm_view(rhs, transpose_rhs)
    scale, scale_axis = _kernel_scale(rhs_scale, swapped, "n")
    out_dtype = preferred_element_type or tiling.default_out_dtype(lhs.dtype, rhs.dtype)
    out = gmm(
        lhs,
        rhs,
        group_sizes,
        group_offset=group_offset,
        rhs_scale=scale,
        scale_axis=scale_axis,
        transpose_rhs=transpose_rhs,
        # With a bias the sum is rounded once, after the bias is added.
        preferred_element_type=out_dtype if bias is None else jnp.float32,
        config=fwd,
        interpret=interpret,
        quantize_lhs=quantize_lhs,
    )
    if bias is not None:
        out = _add_bias(out, bias, group_sizes, group_offset, out_dtype)
    return out, ()


def ragged_dot_bwd(
    args,
    out,
    residuals,
    grad,
    *,
    transpose_rhs,
    preferred_element_type,
    config,
    interpret,
    quantize_lhs=False,
):
    """Backward rule: (d_lhs, d_rhs, None, None, None, d_bias) from the inputs
    and the output cotangent. Quantized weights are frozen: d_rhs and d_scale
    are None. d_lhs is the weight-only product (with quantize_lhs too: the
    cotangent is not quantized; the forward's activation rounding is treated
    as the identity, a straight-through estimate)."""
    del quantize_lhs
    lhs, rhs, group_sizes, group_offset, rhs_scale, bias = args
    frozen = rhs_scale is not None  # quantized weights get no gradient
    _, cfg_lhs, cfg_rhs = _configs(config)
    d_bias = None if bias is None else _bias_grad(grad, bias, group_sizes, group_offset)
    rhs, transpose_rhs, swapped = _hbm_view(rhs, transpose_rhs)
    # The MXU runs in the inputs' dtype: a wider cotangent (f32 output of bf16
    # inputs) is rounded once, here, whichever operand of tgmm it becomes.
    grad = grad.astype(lhs.dtype)
    if mxfp4.is_mxfp4(rhs.dtype):
        # d_lhs of FP4 weights contracts on N, across the packing: the weights
        # are dequantized by XLA (every local expert's, each backward call)
        # and d_lhs is a bf16 gmm. Right, not fast: for adapters on a frozen model.
        rhs, rhs_scale = mxfp4.dequantize(rhs, rhs_scale, lhs.dtype), None
    # d_lhs = grad @ (s * W)^T: per-channel scales sit on the contraction axis.
    scale, scale_axis = _kernel_scale(rhs_scale, swapped, "k")
    # rhs as [G, K, N]: d_lhs contracts grad with rhs on N (transposed read);
    # rhs as [G, N, K] (transpose_rhs): the same weights are already [G, N, K]
    # from d_lhs's point of view, so it is a plain gmm.
    d_lhs = gmm(
        grad,
        rhs,
        group_sizes,
        group_offset=group_offset,
        rhs_scale=scale,
        scale_axis=scale_axis,
        transpose_rhs=not transpose_rhs,
        preferred_element_type=lhs.dtype,
        config=cfg_lhs,
        interpret=interpret,
    )
    if frozen:
        return d_lhs, None, None, None, None, d_bias
    if transpose_rhs:
        d_rhs = tgmm(
            grad,
            lhs,
            group_sizes,
            group_offset=group_offset,
            num_groups=rhs.shape[0],
            preferred_element_type=rhs.dtype,
            config=cfg_rhs,
            interpret=interpret,
        )
    else:
        d_rhs = tgmm(
            lhs,
            grad,
            group_sizes,
            group_offset=group_offset,
            num_groups=rhs.shape[0],
            preferred_element_type=rhs.dtype,
            config=cfg_rhs,
            interpret=interpret,
        )
    if swapped:
        d_rhs = jnp.swapaxes(d_rhs, 1, 2)
    return d_lhs, d_rhs, None, None, None, d_bias


_ragged_dot = differentiable(ragged_dot_fwd, ragged_dot_bwd)


def ragged_dot(
    lhs,
    rhs,
    group_sizes,
    *,
    group_offset=0,
    rhs_scale=None,
    bias=None,
    preferred_element_type=None,
    config=None,
    interpret=False,
    transpose_rhs=False,
    quantize_lhs=False,
):
    """``jax.lax.ragged_dot`` on TPU, differentiable in lhs, rhs and bias.

    Args:
      lhs: [M, K] bfloat16 or float32, rows sorted by group.
      rhs: [G_local, K, N] bfloat16 or float32 ([G_local, N, K] with
        transpose_rhs: torch-style Linear weights, used without a copy); or
        weight-only quantized, int8 or float8_e4m3fn, with rhs_scale; or
        MXFP4, uint8 [G_local, K/2, N] in mxfp4's kernel layout (two e2m1
        values a byte; checkpoints' [G, N, K/2] go through
        mxfp4.to_kernel_layout once), not transpose_rhs. The MXU runs in
        rhs's dtype (lhs is cast to it, as megablox does); quantized rhs is
        widened to lhs's dtype instead.
      rhs_scale: with quantized rhs, [G_local, N] float32 (or bfloat16)
        per-output-channel scales: the weights are rhs[g, :, n] * rhs_scale[g, n];
        or 128 x 128 block scales [G_local, A/128, B/128] in rhs's own axis
        order (rhs [G_local, A, B], A and B multiples of 128; FP8 checkpoints'
        `weight_scale_inv` for transpose_rhs): rhs[g, a, b] * rhs_scale[g, a//128, b//128];
        with MXFP4 rhs, e8m0 scales [G_local, S, N] (uint8 or float8_e8m0fnu,
        S = K/32 or mxfp4.scale_rows(K)), one per 32 k of a column.
        Quantized weights and their scales are frozen: they get no gradient
        (zeros), lhs does.
      bias: [G_local, N] bfloat16 or float32, or None: bias[g] is added to the
        rows of group g (in f32, before the one rounding to the output dtype).
      group_sizes: integer [G] (int32; uint32 / int64 are cast), G >= G_local.
        Rows past sum(group_sizes) come out
        zero (and get zero gradient).
      group_offset: first group this shard holds (expert parallelism); rows of
        other groups come out zero. A Python int or an int32 scalar.
      preferred_element_type: output dtype (default: the wider of lhs's and
        rhs's dtypes; lhs's for quantized rhs); accumulation is always f32.
      config: None (detect the TPU generation), a generation name ("v5e",
        "v6e", "tpu7x"), or a tiling.RaggedDotConfig.
      interpret: run the Pallas kernels in interpret mode (CPU testing).
      transpose_rhs: rhs is given as [G_local, N, K].
      quantize_lhs: w8a8, with int8 or float8_e4m3fn rhs and per-channel
        scales: each row of lhs is quantized in the kernel to rhs's dtype (one
        scale per row, w8a8.quantize_rows) and the MXU runs int8 x int8 (v5e,
        v6e) or fp8 x fp8 (tpu7x) at twice the bf16 rate. Less exact than
        weight-only (the activations are rounded to 8 bits); opt-in.

    Returns:
      [M, N] array of dtype preferred_element_type.
    """
    checks.check_ragged_dot_args(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        preferred_element_type,
        transpose_rhs=transpose_rhs,
        rhs_scale=rhs_scale,
        bias=bias,
        quantize_lhs=quantize_lhs,
    )
    _configs(config)
    if preferred_element_type is not None:
        preferred_element_type = jnp.dtype(preferred_element_type)
    group_offset = jnp.asarray(group_offset, jnp.int32)
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    return _ragged_dot(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        rhs_scale,
        bias,
        transpose_rhs=bool(transpose_rhs),
        preferred_element_type=preferred_element_type,
        config=config,
        interpret=interpret,
        quantize_lhs=bool(quantize_lhs),
    )


# -- the fused MoE experts layer ------------------------------------------------


def _generation(config):
    """The generation a config-or-generation names (None: the attached chip's)."""
    return config if isinstance(config, str) else None


def _moe_configs(config):
    """(gate_up, down) config-or-generation of the two projections."""
    if config is None or isinstance(config, str):
        return config, config
    if isinstance(config, tiling.MoeConfig):
        return config.gate_up, config.down
    if isinstance(config, tiling.FusedMoeConfig):  # the backward of the fused forward
        return None, None
    raise ValueError(
        f"config: expected None, a generation name, a MoeConfig or a FusedMoeConfig, got {config!r}"
    )


def _moe_program(
    hidden,
    top_k_index,
    top_k_weights,
    gate_up,
    down,
    gate_up_bias,
    down_bias,
    group_offset,
    gate_up_scale=None,
    down_scale=None,
    *,
    num_experts,
    has_gate,
    is_transposed,
    is_concatenated,
    activation,
    alpha,
    limit,
    config,
    interpret,
    quantize_activations=False,
    inference=False,
):
    """The two-launch layer. inference (the primal's choice: not
    differentiable): where _glu_fusable allows, the gate/up gmm applies the
    activation in its epilogue; where _combine_fusable allows, the down gmm
    writes packed rows and kernel_combine sums each token's."""
    configs = dict(zip(("up", "down"), _moe_configs(config)))
    scales = {"up": gate_up_scale, "down": down_scale}
    zero = jnp.zeros((), jnp.int32)

    def matmul(x, w, group_sizes, which):
        return _ragged_dot(
            x,
            w,
            group_sizes,
            zero,
            scales[which],
            None,
            transpose_rhs=not is_transposed,
            preferred_element_type=None,
            config=configs[which],
            interpret=interpret,
            quantize_lhs=quantize_activations,
        )

    def gmm_as_stored(x, w, group_sizes, scale, cfg, **kw):
        """gmm on the weights as the model stores them, with their scales."""
        w, transpose_rhs, swapped = _hbm_view(w, not is_transposed)
        scale, scale_axis = _kernel_scale(scale, swapped, "n")
        return gmm(
            x,
            w,
            group_sizes,
            group_offset=zero,
            rhs_scale=scale,
            scale_axis=scale_axis,
            transpose_rhs=transpose_rhs,
            config=cfg,
            interpret=interpret,
            **kw,
        )

    def matmul_glu(x, w, group_sizes, gather=None):
        return gmm_as_stored(
            x,
            w,
            group_sizes,
            gate_up_scale,  # FP4's, or none
            config,
            glu=(activation, alpha, limit),
            gather=gather,
            glu_interleaved=not is_concatenated,
            bias=gate_up_bias,
        )

    up_config, down_config = (_configs(configs[p])[0] for p in ("up", "down"))  # the forward's

    def matmul_up(x, w, group_sizes):
        return gmm_as_stored(x, w, group_sizes, gate_up_scale, up_config, bias=gate_up_bias)

    def matmul_down(x, w, group_sizes):
        return gmm_as_stored(x, w, group_sizes, down_scale, down_config, bias=down_bias)

    def down_combine(x, w, group_sizes, slots, weights):
        rows = gmm_as_stored(
            x, w, group_sizes, down_scale, down_config, packed=True, bias=down_bias
        )
        return combine(
            rows,
            slots,
            weights,
            hidden=hidden.shape[1],
            out_dtype=hidden.dtype,
            generation=_generation(config),
            interpret=interpret,
        )

    # A MoeConfig's gate/up blocks are for the unfused product: kept as given.
    fused = (
        inference
        and not isinstance(config, tiling.MoeConfig)
        and _glu_fusable(
            hidden,
            top_k_index,
            gate_up,
            gate_up_bias,
            gate_up_scale,
            has_gate,
            is_transposed,
            is_concatenated,
            config,
        )
    )
    return moe.experts_program(
        hidden,
        top_k_index,
        top_k_weights,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        matmul=matmul,
        matmul_glu=matmul_glu if fused and not quantize_activations else None,
        # The down bias in the down gmm's epilogue: XLA gathered each row's
        # bias into an [S, H] copy and added it in a pass of its own (8,192
        # GPT-OSS tokens on v6e: 210 + 409 us by their schedules).
        matmul_down=matmul_down
        if inference and down_bias is not None and not quantize_activations
        else None,
        # The gate/up bias likewise where the gate/up gmm does not apply the
        # activation (tpu7x's bf16 GPT-OSS, whose whole-expert slabs it cannot
        # hold two of).
        matmul_up=matmul_up
        if inference and gate_up_bias is not None and not quantize_activations
        else None,
        down_combine=down_combine
        if inference
        and not quantize_activations
        and _combine_fusable(
            hidden,
            top_k_index,
            down,
            down_bias,
            down_scale,
            is_transposed,
            down_config,
        )
        else None,
        num_experts=num_experts,
        has_gate=has_gate,
        is_concatenated=is_concatenated,
        activation=activation,
        group_offset=group_offset,
        alpha=alpha,
        limit=limit,
        glu_gathers=fused
        and not quantize_activations
        and _gather_fusable(hidden, top_k_index, gate_up, is_transposed, config),
    )


def _gather_fusable(hidden, top_k_index, gate_up, is_transposed, config) -> bool:
    """Whether the fused gate/up gmm can gather its rows itself (gmm's
    gather=): bf16 hidden states and weights, tiling.GATHER_MIN_TOKENS or
    more, H as tiling.combine_in_kernel allows (rows packed as
    pairs.pack_rows lays them out), and its blocks (as tiling picks them)
    covering all of the output's columns, so each row tile is fetched
    once. Where it can, it does in the one-hot routing's range too (the
    dispatch matmul's [T * k, H] product is written and read otherwise)."""
    h = hidden.shape[1]
    if (
        hidden.dtype != jnp.bfloat16
        or gate_up.dtype != jnp.bfloat16
        or hidden.shape[0] < tiling.GATHER_MIN_TOKENS
        # rows packed as the combine's are (padded to whole tiles where H is
        # not a multiple of 2048)
        or not tiling.combine_in_kernel(h, _generation(config))
    ):
        return False
    w, transpose_rhs, _ = _hbm_view(gate_up, not is_transposed)
    n_out = (w.shape[1] if transpose_rhs else w.shape[2]) // 2
    m = top_k_index.shape[0] * top_k_index.shape[1]
    try:
        cfg = resolve_config(
            config,
            m,
            h,
            n_out,
            w.shape[0],
            hidden.dtype,
            w.dtype,
            hidden.dtype,
            glu=True,
            gather=True,
            gather_tokens=hidden.shape[0],
        )
    except ValueError:  # no block of the whole output fits VMEM
        return False
    return cfg.block_n == n_out


def _glu_fusable(
    hidden, top_k_index, gate_up, bias, scale, has_gate, is_transposed, is_concatenated, config
) -> bool:
    """Whether the gate/up gmm can apply act(gate) * up itself (and the
    bias before it): unquantized weights (the rows reach the gmm in their
    dtype), or MXFP4's with interleaved columns (GPT-OSS's checkpoints);
    concatenated halves on a tile boundary of the weights as XLA stores them,
    without a bias, or interleaved columns (GPT-OSS) with or without one
    (tiling.glu_fusable); and a block that fits VMEM (GPT-OSS's 2,880 columns
    admit only whole-expert slabs, 33 MB of them in bf16, which tpu7x's VMEM
    cannot hold two of: it keeps the unfused product there; 8 MB in FP4).
    Interleaved, from tiling.GLU_INTERLEAVED_MIN_GROUP_ROWS rows an expert."""
    fp4 = mxfp4.is_mxfp4(gate_up.dtype)
    if not has_gate or (is_concatenated and bias is not None):
        return False
    if scale is not None and not (fp4 and not is_concatenated):
        return False
    w, transpose_rhs, _ = _hbm_view(gate_up, not is_transposed)
    n = w.shape[1] if transpose_rhs else w.shape[2]
    # The rows reach the gmm in the weights' dtype (FP4: the activations'), as does its output.
    dtype = hidden.dtype if fp4 else w.dtype
    sub = tiling.sublane(dtype, w.dtype)
    interleaved = not is_concatenated
    if n % 2 or not tiling.glu_fusable(n // 2, transpose_rhs, w.dtype, sub, interleaved):
        return False
    m, k = top_k_index.shape[0] * top_k_index.shape[1], hidden.shape[1]
    if interleaved and m < tiling.GLU_INTERLEAVED_MIN_GROUP_ROWS * w.shape[0]:
        return False
    shape = (m, k, n // 2, w.shape[0], dtype, w.dtype, dtype)
    try:
        cfg = resolve_config(
            config, *shape, glu=True, interleaved=interleaved, bias=bias is not None
        )
    except ValueError:  # no block fits VMEM
        return False
    if fp4:
        # FP4 decodes each weight piece once a row tile and pass: where the
        # fused block's VMEM (whole 2,880-column experts) leaves smaller row
        # tiles than the unfused product's, the decodes it adds outweigh the
        # XLA pass it saves (tpu7x, GPT-OSS at 2,048 tokens: 128-row tiles
        # against 512, its gate/up 1,230.5 -> 2,061.8 us).
        plain = resolve_config(config, *shape[:2], n, *shape[3:])
        return cfg.block_m >= plain.block_m
    return True


def _combine_fusable(hidden, top_k_index, down, bias, scale, is_transposed, config) -> bool:
    """Whether the down gmm writes its rows packed for kernel_combine (gmm's
    packed=True): bf16 hidden states and projection, H as
    tiling.combine_in_kernel allows, and the down gmm's blocks (as given or
    as tiling picks them) covering all of H. A down bias is added in the
    gmm's epilogue before its rows are packed, as the unpacked gmm adds it."""
    h = hidden.shape[1]
    if hidden.dtype != jnp.bfloat16 or not tiling.combine_in_kernel(h, _generation(config)):
        return False
    out_dtype = down.dtype if jnp.dtype(down.dtype).itemsize > 1 else hidden.dtype
    if out_dtype != jnp.bfloat16:
        return False
    w, transpose_rhs, _ = _hbm_view(down, not is_transposed)
    k, n = (w.shape[2], w.shape[1]) if transpose_rhs else w.shape[1:]
    m = top_k_index.shape[0] * top_k_index.shape[1]
    cfg = resolve_config(
        config,
        m,
        k,
        n,
        w.shape[0],
        hidden.dtype,
        w.dtype,
        out_dtype,
        packed=True,
        bias=bias is not None,
    )
    return n == h and cfg.block_n == n


# Forward and backward rules of the whole layer: jax.vjp's residuals of the
# program (routing, gathered rows, projections), the kernels' own backward
# rules applied to them; top_k_index, group_offset and the quantized weights'
# scales get no gradient (quantized weights themselves get None from ragged_dot).
_program_fwd, _program_bwd = split_vjp(_moe_program, diff=(0, 2, 3, 4, 5, 6))


def _fused_config(arrays, statics) -> tiling.FusedMoeConfig | None:
    """The one-launch decode layer's blocks where it applies (tiling's rule),
    else None. A MoeConfig names the two projections' kernels: kept."""
    hidden, _, _, gate_up, down, gate_up_bias, down_bias, _, gate_up_scale, _ = arrays
    config = statics["config"]
    if isinstance(config, tiling.MoeConfig) or statics.get("quantize_activations"):
        return None
    inter = down.shape[1] if statics["is_transposed"] else down.shape[2]
    if mxfp4.is_mxfp4(down.dtype):  # [E, I/2, H]: two values a byte
        inter *= 2
    if isinstance(config, tiling.FusedMoeConfig):
        # Blocks given by hand: the layer must be one the kernel carries.
        rule = _fused_config(arrays, dict(statics, config=None))
        if rule is None:
            most = tiling.fused_moe_max_tokens(
                hidden.shape[1],
                inter,
                config.block_i,
                has_gate=statics["has_gate"],
                w_dtype=gate_up.dtype,
            )
            raise ValueError(
                "config: a FusedMoeConfig needs a layer the one-launch kernel carries (bf16"
                " activations; bf16, per-channel int8/fp8 or MXFP4 weights; gate/up halves whose"
                " scales or biases start on 128-lane tiles, or interleaved gate/up with I a"
                f" multiple of {tiling.GLU_INTERLEAVED_MULTIPLE}; at most {most} tokens with these"
                f" shapes); got {hidden.shape[0]} tokens of"
                f" {hidden.dtype.name} with {gate_up.dtype.name} weights"
            )
        interleaved = statics["has_gate"] and not statics["is_concatenated"]
        _, dn_torch, _ = _hbm_view(down, not statics["is_transposed"])
        multiple = tiling.fused_moe_block_multiple(interleaved, not dn_torch)
        tiling.check_fused_moe_config(config, inter, multiple)
        return config
    return tiling.fused_moe_config(
        hidden.shape[0],
        hidden.shape[1],
        inter,
        hidden.dtype,
        gate_up.dtype,
        has_gate=statics["has_gate"],
        is_transposed=statics["is_transposed"],
        is_concatenated=statics["is_concatenated"],
        has_bias=gate_up_bias is not None or down_bias is not None,
        # MXFP4's e8m0 scales are 3-D too; the weights' dtype names them.
        block_scales=gate_up_scale is not None
        and gate_up_scale.ndim == 3
        and not mxfp4.is_mxfp4(gate_up.dtype),
        generation=config,
    )


def moe_experts_fwd(*arrays, **statics):
    """(output, residuals): one fused launch at decode sizes (no residuals:
    the backward recomputes the two-launch program's), else the program's."""
    fused = _fused_config(arrays, statics)
    if fused is None:
        return _program_fwd(*arrays, **statics)
    hidden, top_k_index, top_k_weights, gate_up, down = arrays[:5]
    # Each weight as XLA stores it (gmm's rule), in gmm's terms: transpose_rhs
    # is the torch layout, the kernel's "transposed" the other one.
    gate_up, gu_torch, _ = _hbm_view(gate_up, not statics["is_transposed"])
    down, dn_torch, _ = _hbm_view(down, not statics["is_transposed"])
    out = fused_moe_decode(
        hidden,
        top_k_index,
        top_k_weights,
        gate_up,
        down,
        arrays[7],
        arrays[8],
        arrays[9],
        gate_up_bias=arrays[5],
        down_bias=arrays[6],
        num_experts=statics["num_experts"],
        has_gate=statics["has_gate"],
        gu_transposed=not gu_torch,
        dn_transposed=not dn_torch,
        interleaved=statics["has_gate"] and not statics["is_concatenated"],
        activation=statics["activation"],
        alpha=statics["alpha"],
        limit=statics["limit"],
        config=fused,
        interpret=statics["interpret"],
    )
    return out, ()


def moe_experts_primal(*arrays, **statics):
    """The layer when no gradient is asked for: the fused decode launch where
    it applies, else the two launches with the activation in the gate/up
    gmm's epilogue where that applies (nothing is kept for a backward)."""
    if _fused_config(arrays, statics) is not None:
        return moe_experts_fwd(*arrays, **statics)[0]
    return _moe_program(*arrays, **statics, inference=True)


def moe_experts_bwd(arrays, outputs, residuals, cotangents, **statics):
    if _fused_config(arrays, statics) is not None:
        outputs, residuals = _program_fwd(*arrays, **statics)
    return _program_bwd(arrays, outputs, residuals, cotangents, **statics)


_moe_experts = differentiable(moe_experts_fwd, moe_experts_bwd, moe_experts_primal)


@functools.partial(
    jax.jit,
    static_argnames=(
        "num_experts",
        "has_gate",
        "is_transposed",
        "is_concatenated",
        "activation",
        "alpha",
        "limit",
        "config",
        "interpret",
        "quantize_activations",
    ),
)
def moe_experts(
    hidden,
    top_k_index,
    top_k_weights,
    gate_up,
    down,
    gate_up_bias=None,
    down_bias=None,
    gate_up_scale=None,
    down_scale=None,
    *,
    num_experts: int,
    has_gate: bool = True,
    is_transposed: bool = False,
    is_concatenated: bool = True,
    activation: str = "silu",
    group_offset=0,
    alpha: float = 1.702,
    limit: float = 7.0,
    config=None,
    interpret=False,
    quantize_activations: bool = False,
):
    """Fused MoE experts: [T, H] hidden -> [T, H] in hidden.dtype.

    Args:
      hidden: [T, H]. top_k_index: [T, k] expert ids. top_k_weights: [T, k].
      gate_up: [E, 2I, H] (or [E, H, 2I] if is_transposed); [E, I, H] / [E, H, I]
        when has_gate is False (up_proj only).
      down: [E, H, I] (or [E, I, H] if is_transposed).
      gate_up_bias: [E, 2I] or None. down_bias: [E, H] or None.
      gate_up_scale, down_scale: with int8 / float8_e4m3fn weights (weight-only
        quantization), their per-output-channel scales, [E, 2I] and [E, H]
        float32 (or bfloat16); the weights are frozen (no gradient).
      num_experts: experts held here (E). group_offset: id of the first one;
        ids outside [group_offset, group_offset + E) are ignored.
      is_concatenated: gate/up halves ([gate; up]) vs interleaved (GPT-OSS).
      activation: "silu", "gelu", "gelu_pytorch_tanh", "relu", "relu2" or
        "gpt_oss" (clamped GLU with alpha/limit).
      config: None (detect the TPU generation), a generation name, a
        tiling.MoeConfig (two gmm launches, one RaggedDotConfig per
        projection), or a tiling.FusedMoeConfig (the one-launch decode
        kernel's blocks; by default it runs where tiling.fused_moe_config
        says it applies).
      interpret: run the kernels in interpret mode.
      quantize_activations: w8a8 for int8 / float8_e4m3fn weights with
        per-channel scales: both projections quantize their input rows in the
        kernel (ragged_dot's quantize_lhs); two gmm launches.
    """
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
        quantize_activations,
    )
    return _moe_experts(
        hidden,
        top_k_index,
        top_k_weights,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        jnp.asarray(group_offset, jnp.int32),
        gate_up_scale,
        down_scale,
        num_experts=num_experts,
        has_gate=has_gate,
        is_transposed=is_transposed,
        is_concatenated=is_concatenated,
        activation=activation,
        alpha=alpha,
        limit=limit,
        config=config,
        interpret=interpret,
        quantize_activations=bool(quantize_activations),
    )
