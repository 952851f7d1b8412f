"""rmsnorm-tpu compiles for real TPU generations (libtpu AOT) at model shapes.

Every point compiles in the session's gate workers (tests/gate.py), beside the
other kernels' matrices: in the main process each compile also wrote the
compiler dumps bench reads (63 s of the suite's serial time, 2026-12-01).
"""

import itertools

import jax.numpy as jnp
import pytest
import torch

import rmsnorm_tpu
from rmsnorm_tpu import kernel
from gate import GENERATIONS, GateProgram, meta_call, session_pool, spec

HIDDEN = [2048, 2880, 4096, 5120, 8192]
TOKENS = 8192
# fwd: plain; fwd_fused: residual add + Gemma's (1 + w); bwd_ds: with the
# residual stream's gradient; bwd: without it.
KINDS = ("fwd", "fwd_fused", "bwd_ds", "bwd")
POINTS = list(itertools.product(KINDS, HIDDEN, GENERATIONS))  # (kind, hidden, generation)
# One token, hidden not a multiple of 128 (GPT-OSS): a full-extent block.
DECODE_POINT = ("fwd", 2880, "v6e", 1)


def gate_program(point) -> GateProgram:
    """The program a point compiles (called in the gate's worker processes)."""
    kind, hidden, generation, *tokens = point
    x = spec((tokens[0] if tokens else TOKENS, hidden))
    eps = 1e-6
    if kind == "fwd":
        fn, args = lambda x, w: kernel.rms_norm_fwd(x, w, eps=eps, config=generation), [x]
    elif kind == "fwd_fused":

        def fn(x, r, w):
            return kernel.rms_norm_fwd(x, w, r, eps=eps, gemma=True, config=generation)

        args = [x, x]
    elif kind == "bwd_ds":

        def fn(dy, ds, s, w):
            return kernel.rms_norm_bwd(dy, ds, s, w, eps=eps, config=generation)

        args = [x, x, x]
    else:

        def fn(dy, s, w):
            return kernel.rms_norm_bwd(dy, None, s, w, eps=eps, config=generation)

        args = [x, x]
    w = spec((hidden,), jnp.float32 if kind.startswith("bwd") else jnp.bfloat16)
    return GateProgram(fn, [*args, w], generation)


@pytest.fixture(scope="module")
def pool():
    return session_pool()  # conftest.py started it with this module's points


@pytest.mark.parametrize(
    "point", POINTS + [DECODE_POINT], ids=lambda pt: "-".join(str(x) for x in pt)
)
def test_compiles(point, pool):
    pool.assert_ok(__file__, point)


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
