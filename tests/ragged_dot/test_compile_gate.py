"""ragged-dot-tpu compiles for real TPU generations (libtpu AOT) at MoE layer shapes.

Each case compiles one kernel for one generation with the blocks tiling.py
picks for it: fwd = gmm, d_lhs = gmm(transpose_rhs=True), d_rhs = tgmm.
Rows = tokens x top_k. CI runs a subset that still covers every generation,
every kernel, decode and prefill, K not a multiple of 128 and Mixtral's huge
K; RAGGED_DOT_FULL_GATE=1 runs the whole matrix (models x projections x
batches x kernels x generations).
"""

from __future__ import annotations

import functools
import itertools
import os

import jax
import jax.numpy as jnp
import pytest

from gate import GENERATIONS, assert_compiles, spec
from ragged_dot_tpu.gmm import gmm
from ragged_dot_tpu.moe import moe_experts
from ragged_dot_tpu.tgmm import tgmm

# name: (experts, top_k, hidden, intermediate)
MODELS = {
    "qwen3_30b_a3b": (128, 8, 2048, 768),
    "gemma4_26b_a4b": (128, 8, 2816, 704),
    "mixtral_8x7b": (8, 2, 4096, 14336),
    "gpt_oss_20b": (32, 4, 2880, 2880),  # H = I = 2880: not a multiple of 128
}
TOKENS = [1, 8, 64, 512, 8192]
KERNELS = ["fwd", "d_lhs", "d_rhs"]
PROJECTIONS = ["gate_up", "down"]

CI_CASES = [
    ("qwen3_30b_a3b", "gate_up", 1),
    ("qwen3_30b_a3b", "down", 512),
    ("gemma4_26b_a4b", "down", 8192),  # prefill; K = 704 is not a multiple of 128
    ("mixtral_8x7b", "down", 8),  # K = 14336
    ("gpt_oss_20b", "down", 64),  # N = 2880: whole-expert DMA
    ("gpt_oss_20b", "down", 8192),  # d_rhs 2880 x 2880 blocks exceed VMEM: padded to 128
]

if os.environ.get("RAGGED_DOT_FULL_GATE"):
    CASES = list(itertools.product(MODELS, PROJECTIONS, TOKENS))
else:
    CASES = CI_CASES


def _dims(model, projection):
    e, top_k, h, i = MODELS[model]
    k, n = (h, 2 * i) if projection == "gate_up" else (i, h)
    return e, top_k, k, n


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("model,projection,tokens", CASES)
def test_kernel_compiles(model, projection, tokens, kernel, generation):
    e, top_k, k, n = _dims(model, projection)
    m = tokens * top_k
    sizes = spec((e,), jnp.int32)
    if kernel == "fwd":
        fn = functools.partial(gmm, config=generation)
        args = [spec((m, k)), spec((e, k, n)), sizes]
    elif kernel == "d_lhs":
        fn = functools.partial(gmm, transpose_rhs=True, config=generation)
        args = [spec((m, n)), spec((e, k, n)), sizes]
    else:
        fn = functools.partial(tgmm, config=generation)
        args = [spec((m, k)), spec((m, n)), sizes]
    assert_compiles(fn, args, generation)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_whole_moe_layer_fwd_and_grad_compile(generation):
    """Qwen3-30B-A3B experts layer, 64 tokens, torch weight layout, one program."""
    e, top_k, h, i = MODELS["qwen3_30b_a3b"]
    t = 64
    kw = dict(num_experts=e, has_gate=True, is_transposed=False, is_concatenated=True,
              activation="silu", config=generation)

    def fn(hid, idx, w, gu, dn):
        out = moe_experts(hid, idx, w, gu, dn, **kw)
        loss = lambda hid, w, gu, dn: jnp.sum(
            moe_experts(hid, idx, w, gu, dn, **kw).astype(jnp.float32))
        return out, jax.grad(loss, argnums=(0, 1, 2, 3))(hid, w, gu, dn)

    args = [spec((t, h)), spec((t, top_k), jnp.int32), spec((t, top_k)),
            spec((e, 2 * i, h)), spec((e, h, i))]
    assert_compiles(fn, args, generation)
