"""Pallas RMSNorm kernels (interpret mode) against the plain-JAX reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from rmsnorm_tpu import kernel, reference, tiling

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _close(actual, expected, dtype, scale=1.0):
    tol = reference.TOLERANCES[jnp.dtype(dtype)]
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32),
        atol=tol["atol"] * scale, rtol=tol["rtol"],
    )


shapes = st.tuples(
    st.lists(st.integers(1, 5), min_size=0, max_size=2),  # leading dims
    st.sampled_from([1, 7, 100, 128, 200, 384]),         # hidden: aligned and not
)


def _inputs(lead, hidden, dtype, seed, with_residual=False):
    ks = jax.random.split(jax.random.key(seed), 4)
    shape = (*lead, hidden)
    x = jax.random.normal(ks[0], shape, jnp.float32).astype(dtype)
    w = (1.0 + 0.1 * jax.random.normal(ks[1], (hidden,), jnp.float32)).astype(dtype)
    r = jax.random.normal(ks[2], shape, jnp.float32).astype(dtype) if with_residual else None
    dy = jax.random.normal(ks[3], shape, jnp.float32).astype(dtype)
    return x, w, r, dy


def _small_blocks(rows, hidden, dtype):
    # Force several row blocks and a ragged last block, so masking is exercised.
    sub = tiling.sublane_multiple(jnp.dtype(dtype).itemsize)
    return tiling.RMSNormConfig(block_rows=sub, vmem_limit_bytes=16 * 2**20)


@given(shape=shapes, dtype=st.sampled_from(DTYPES), gemma=st.booleans(),
       eps=st.sampled_from([1e-6, 1e-5, 0.1]), small=st.booleans(), seed=st.integers(0, 99))
def test_forward_matches_reference(shape, dtype, gemma, eps, small, seed):
    lead, hidden = shape
    x, w, _, _ = _inputs(lead, hidden, dtype, seed)
    rows = int(np.prod(lead)) if lead else 1
    cfg = _small_blocks(rows, hidden, dtype) if small else None
    y = kernel.rms_norm_fwd(x, w, eps=eps, gemma=gemma, interpret=True, config=cfg)
    assert y.shape == x.shape and y.dtype == x.dtype
    _close(y, reference.rms_norm_ref(x, w, eps, gemma), dtype)


@given(shape=shapes, dtype=st.sampled_from(DTYPES), gemma=st.booleans(),
       small=st.booleans(), seed=st.integers(0, 99))
def test_fused_residual_matches_reference(shape, dtype, gemma, small, seed):
    lead, hidden = shape
    x, w, r, _ = _inputs(lead, hidden, dtype, seed, with_residual=True)
    rows = int(np.prod(lead)) if lead else 1
    cfg = _small_blocks(rows, hidden, dtype) if small else None
    y, s = kernel.rms_norm_fwd(x, w, r, eps=1e-6, gemma=gemma, interpret=True, config=cfg)
    y_ref, s_ref = reference.fused_add_rms_norm_ref(x, r, w, 1e-6, gemma)
    _close(s, s_ref, dtype)
    _close(y, y_ref, dtype)


@given(shape=shapes, dtype=st.sampled_from(DTYPES), gemma=st.booleans(),
       with_ds=st.booleans(), small=st.booleans(), seed=st.integers(0, 99))
def test_backward_matches_reference(shape, dtype, gemma, with_ds, small, seed):
    lead, hidden = shape
    x, w, r, dy = _inputs(lead, hidden, dtype, seed, with_residual=with_ds)
    ds = r if with_ds else None  # any tensor of the right shape serves as the incoming grad
    rows = int(np.prod(lead)) if lead else 1
    cfg = _small_blocks(rows, hidden, dtype) if small else None
    dx, dw = kernel.rms_norm_bwd(dy, ds, x, w, eps=1e-6, gemma=gemma, interpret=True, config=cfg)
    dx_ref, dw_ref = reference.rms_norm_bwd_ref(dy, ds, x, w, 1e-6, gemma)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype and dw.shape == w.shape
    _close(dx, dx_ref, dtype, scale=4.0)
    # dweight sums `rows` terms of size ~1: its error grows like sqrt(rows).
    _close(dw, dw_ref, dtype, scale=4.0 * max(1.0, np.sqrt(rows)))


def test_custom_vjp_gradients_match_autodiff_of_reference():
    x, w, r, _ = _inputs((3, 10), 200, jnp.float32, 0, with_residual=True)

    def loss_kernel(x, r, w):
        y, s = kernel.fused_add_rms_norm(x, r, w, 1e-6, True, True)
        return jnp.sum(y * y) + jnp.sum(jnp.sin(s))

    def loss_ref(x, r, w):
        y, s = reference.fused_add_rms_norm_ref(x, r, w, 1e-6, True)
        return jnp.sum(y * y) + jnp.sum(jnp.sin(s))

    got = jax.grad(loss_kernel, argnums=(0, 1, 2))(x, r, w)
    want = jax.grad(loss_ref, argnums=(0, 1, 2))(x, r, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-4)

    g_plain = jax.grad(lambda x, w: jnp.sum(kernel.rms_norm(x, w, 1e-6, False, True) ** 3), (0, 1))(x, w)
    e_plain = jax.grad(lambda x, w: jnp.sum(reference.rms_norm_ref(x, w, 1e-6) ** 3), (0, 1))(x, w)
    for g, e in zip(g_plain, e_plain):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_rows_give_zeros_not_nan(dtype):
    x = jnp.zeros((5, 256), dtype)
    w = jnp.ones((256,), dtype)
    y = kernel.rms_norm_fwd(x, w, eps=1e-6, interpret=True)
    dx, dw = kernel.rms_norm_bwd(jnp.ones_like(x), None, x, w, eps=1e-6, interpret=True)
    for a in (y, dx, dw):
        assert not np.isnan(np.asarray(a, np.float32)).any()
    assert np.all(np.asarray(y, np.float32) == 0.0)


def test_empty_rows():
    x = jnp.zeros((0, 64), jnp.float32)
    y = kernel.rms_norm_fwd(x, jnp.ones((64,)), eps=1e-6, interpret=True)
    assert y.shape == (0, 64)


def test_block_choice_fits_budget_and_grows_with_rows():
    small = tiling.choose_config(16, 4096, (2, 2), "v6e")
    big = tiling.choose_config(65536, 4096, (2, 2), "v6e")
    assert small.block_rows == 16
    assert big.block_rows > small.block_rows
    for gen in tiling.VMEM_BUDGET:
        cfg = tiling.choose_config(65536, 8192, (2, 2, 2, 2), gen)
        assert tiling.vmem_need(cfg.block_rows, 8192, (2, 2, 2, 2)) <= tiling.VMEM_BUDGET[gen]
        assert cfg.block_rows % 16 == 0


def test_oversized_hidden_raises_with_need_and_budget():
    with pytest.raises(ValueError, match=r"needs \d+ bytes of VMEM, budget is \d+ bytes"):
        tiling.choose_config(64, 2**22, (4, 4), "v5e")
