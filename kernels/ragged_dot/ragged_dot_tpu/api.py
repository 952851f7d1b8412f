"""Differentiable ragged_dot on the Pallas kernels.

Forward is ``gmm``; the backward never materialises a transposed weight copy:
d_lhs = gmm(grad, rhs, transpose_rhs=True) reads rhs [G, K, N] as [G, N', K']
and contracts on N; d_rhs = tgmm(lhs, grad) produces [G_local, K, N] directly.
Both use the same group_offset, so a shard's gradients only cover its groups
(rows of other shards get d_lhs = 0: their forward rows did not depend on
this shard's weights).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import checks
from . import tiling
from .kernel_gmm import gmm
from .kernel_tgmm import tgmm


def _configs(config):
    """(fwd, bwd_lhs, bwd_rhs) config-or-generation for the three kernels."""
    if config is None or isinstance(config, str):
        return config, config, config
    if isinstance(config, tiling.RaggedDotConfig):
        return config.fwd, config.bwd_lhs, config.bwd_rhs
    raise ValueError(
        f"config: expected None, a generation name or a RaggedDotConfig, got {config!r}"
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _ragged_dot(
    lhs, rhs, group_sizes, group_offset, transpose_rhs, preferred_element_type, config, interpret
):
    fwd, _, _ = _configs(config)
    return gmm(
        lhs,
        rhs,
        group_sizes,
        group_offset=group_offset,
        transpose_rhs=transpose_rhs,
        preferred_element_type=preferred_element_type,
        config=fwd,
        interpret=interpret,
    )


def _fwd(
    lhs, rhs, group_sizes, group_offset, transpose_rhs, preferred_element_type, config, interpret
):
    out = _ragged_dot(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        transpose_rhs,
        preferred_element_type,
        config,
        interpret,
    )
    return out, (lhs, rhs, group_sizes, group_offset)


def _bwd(transpose_rhs, preferred_element_type, config, interpret, res, grad):
    lhs, rhs, group_sizes, group_offset = res
    _, cfg_lhs, cfg_rhs = _configs(config)
    # rhs as [G, K, N]: d_lhs contracts grad with rhs on N (transposed read);
    # rhs as [G, N, K] (transpose_rhs): the same weights are already [G, N, K]
    # from d_lhs's point of view, so it is a plain gmm.
    d_lhs = gmm(
        grad,
        rhs,
        group_sizes,
        group_offset=group_offset,
        transpose_rhs=not transpose_rhs,
        preferred_element_type=lhs.dtype,
        config=cfg_lhs,
        interpret=interpret,
    )
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
    return d_lhs, d_rhs, None, None


_ragged_dot.defvjp(_fwd, _bwd)


def ragged_dot(
    lhs,
    rhs,
    group_sizes,
    *,
    group_offset=0,
    preferred_element_type=None,
    config=None,
    interpret=False,
    transpose_rhs=False,
):
    """``jax.lax.ragged_dot`` on TPU, differentiable in lhs and rhs.

    Args:
      lhs: [M, K] bfloat16 or float32, rows sorted by group.
      rhs: [G_local, K, N], same dtype as lhs ([G_local, N, K] with
        transpose_rhs: torch-style Linear weights, used without a copy).
      group_sizes: int32 [G], G >= G_local. Rows past sum(group_sizes) come out
        zero (and get zero gradient).
      group_offset: first group this shard holds (expert parallelism); rows of
        other groups come out zero. A Python int or an int32 scalar.
      preferred_element_type: output dtype (default lhs dtype); accumulation is
        always f32.
      config: None (detect the TPU generation), a generation name ("v5e",
        "v6e", "tpu7x"), or a tiling.RaggedDotConfig.
      interpret: run the Pallas kernels in interpret mode (CPU testing).
      transpose_rhs: rhs is given as [G_local, N, K].

    Returns:
      [M, N] array of dtype preferred_element_type.
    """
    checks.check_ragged_dot_args(
        lhs, rhs, group_sizes, group_offset, preferred_element_type, transpose_rhs=transpose_rhs
    )
    _configs(config)
    if preferred_element_type is not None:
        preferred_element_type = jnp.dtype(preferred_element_type)
    group_offset = jnp.asarray(group_offset, jnp.int32)
    return _ragged_dot(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        bool(transpose_rhs),
        preferred_element_type,
        config,
        interpret,
    )
