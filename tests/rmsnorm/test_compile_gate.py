"""rmsnorm-tpu compiles for real TPU generations (libtpu AOT) at model shapes."""

import jax.numpy as jnp
import pytest
import torch

import rmsnorm_tpu
from rmsnorm_tpu import kernel
from gate import GENERATIONS, assert_compiles, meta_call, spec

HIDDEN = [2048, 2880, 4096, 5120, 8192]
TOKENS = 8192


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_forward_compiles(generation, hidden):
    x, w = spec((TOKENS, hidden)), spec((hidden,))
    assert_compiles(
        lambda x, w: kernel.rms_norm_fwd(x, w, eps=1e-6, config=generation), [x, w], generation
    )
    assert_compiles(
        lambda x, r, w: kernel.rms_norm_fwd(x, w, r, eps=1e-6, gemma=True, config=generation),
        [x, x, w],
        generation,
    )


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_backward_compiles(generation, hidden):
    x, w = spec((TOKENS, hidden)), spec((hidden,), jnp.float32)
    assert_compiles(
        lambda dy, ds, s, w: kernel.rms_norm_bwd(dy, ds, s, w, eps=1e-6, config=generation),
        [x, x, x, w],
        generation,
    )
    assert_compiles(
        lambda dy, s, w: kernel.rms_norm_bwd(dy, None, s, w, eps=1e-6, config=generation),
        [x, x, w],
        generation,
    )


def test_small_decode_shape_compiles():
    # One token, hidden not a multiple of 128 (GPT-OSS): a full-extent block.
    assert_compiles(
        lambda x, w: kernel.rms_norm_fwd(x, w, eps=1e-6, config="v6e"),
        [spec((1, 2880)), spec((2880,))],
        "v6e",
    )


def test_torch_ops_lower_through_torch_tpu_jax_op_on_meta():
    x = torch.empty(4, 2048, 2880, dtype=torch.bfloat16)
    w = torch.empty(2880, dtype=torch.bfloat16)
    y = meta_call(rmsnorm_tpu.ops._rms_norm, x, w, 1e-6, False)
    assert y.shape == x.shape and y.device.type == "meta"
    y, s = meta_call(rmsnorm_tpu.ops._fused_add_rms_norm, x, x, w, 1e-6, True)
    assert s.shape == x.shape
    # The autograd path: the forward op returns its residuals (none for
    # RMSNorm), the backward op takes inputs, output, residuals, cotangent.
    op = rmsnorm_tpu.ops._rms_norm
    y, residuals = meta_call(op.forward, x, w, 1e-6, False)
    assert y.shape == x.shape and residuals == []
    dx, dw = meta_call(op.backward, x, w, 1e-6, False, y, residuals, y, False)
    assert dx.shape == x.shape and dw.shape == w.shape
