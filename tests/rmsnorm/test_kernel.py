"""Pallas RMSNorm kernels (interpret mode) against the plain-JAX reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from rmsnorm_tpu import api, kernel, reference, tiling
from tolerances import assert_close

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _f32(*xs):
    return [None if x is None else jnp.asarray(x, jnp.float32) for x in xs]


def _check_forward(y, x, w, eps, gemma, what="y"):
    """y against the f32 reference on the same (rounded) inputs, per element."""
    assert_close(y, reference.rms_norm_ref(*_f32(x, w), eps, gemma), what=what)


def _check_backward(dx, dw, dy, ds, s, w, eps, gemma):
    """(dx, dw) against autodiff of the f32 reference on the same inputs, per element.

    Magnitudes (sums of absolute terms) bound the f32 reordering error:
    dx = rstd * (g - xhat * mean(g * xhat)) + ds with g = dy * w, and
    dw = sum over rows of dy * xhat (rows of several row blocks).
    """
    dy32, ds32, s32, w32 = _f32(dy, ds, s, w)
    dx_ref, dw_ref = reference.rms_norm_bwd_ref(dy32, ds32, s32, w32, eps, gemma)
    x = np.asarray(s32).reshape(-1, s.shape[-1])
    d = np.asarray(dy32).reshape(x.shape)
    weff = np.asarray(w32) + (1.0 if gemma else 0.0)
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    xhat = x * rstd
    g = np.abs(d * weff)
    mag_dx = rstd * (g + np.abs(xhat) * np.mean(g * np.abs(xhat), axis=-1, keepdims=True))
    if ds is not None:
        mag_dx = mag_dx + np.abs(np.asarray(ds32)).reshape(x.shape)
    mag_dw = np.sum(np.abs(d * xhat), axis=0)
    assert_close(dx, dx_ref, magnitude=mag_dx.reshape(s.shape), what="dx")
    assert_close(dw, dw_ref, magnitude=mag_dw.reshape(w.shape), what="dweight")


shapes = st.tuples(
    st.lists(st.integers(1, 5), min_size=0, max_size=2),  # leading dims
    st.sampled_from([1, 7, 100, 128, 200, 384]),  # hidden: aligned and not
)


def _inputs(lead, hidden, dtype, seed, with_residual=False, x_scale=1.0):
    return _draw(seed, (*lead, hidden), dtype, with_residual, x_scale)


# jitted: one program per shape; eager, each of its ops compiled per shape.
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _draw(seed, shape, dtype, with_residual, x_scale):
    ks = jax.random.split(jax.random.key(seed), 4)
    hidden = shape[-1]
    x = (x_scale * jax.random.normal(ks[0], shape, jnp.float32)).astype(dtype)
    w = (1.0 + 0.1 * jax.random.normal(ks[1], (hidden,), jnp.float32)).astype(dtype)
    r = (
        (x_scale * jax.random.normal(ks[2], shape, jnp.float32)).astype(dtype)
        if with_residual
        else None
    )
    dy = jax.random.normal(ks[3], shape, jnp.float32).astype(dtype)
    return x, w, r, dy


def _small_blocks(dtype):
    # The smallest legal row block: several row blocks and a ragged last one.
    sub = tiling.sublane_multiple(jnp.dtype(dtype).itemsize)
    return tiling.RMSNormConfig(block_rows=sub, vmem_limit_bytes=16 * 2**20)


# eps is drawn against the input scale: with x ~ 1e-3 the mean square (1e-6)
# is of the order of eps, so eps placement (rsqrt(ms + eps), not
# 1 / (sqrt(ms) + eps)) changes the result by far more than the tolerance.
EPS = [1e-6, 1e-5, 0.1]
X_SCALES = [1.0, 1e-3]


@settings(max_examples=6)
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    gemma=st.booleans(),
    eps=st.sampled_from(EPS),
    x_scale=st.sampled_from(X_SCALES),
    small=st.booleans(),
    seed=st.integers(0, 99),
)
def test_forward_matches_reference(shape, dtype, gemma, eps, x_scale, small, seed):
    lead, hidden = shape
    x, w, _, _ = _inputs(lead, hidden, dtype, seed, x_scale=x_scale)
    cfg = _small_blocks(dtype) if small else None
    y = kernel.rms_norm_fwd(x, w, eps=eps, gemma=gemma, interpret=True, config=cfg)
    assert y.shape == x.shape and y.dtype == x.dtype
    _check_forward(y, x, w, eps, gemma)


@settings(max_examples=6)
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    gemma=st.booleans(),
    eps=st.sampled_from(EPS),
    small=st.booleans(),
    seed=st.integers(0, 99),
)
def test_fused_residual_matches_reference(shape, dtype, gemma, eps, small, seed):
    lead, hidden = shape
    x, w, r, _ = _inputs(lead, hidden, dtype, seed, with_residual=True)
    cfg = _small_blocks(dtype) if small else None
    y, s = kernel.rms_norm_fwd(x, w, r, eps=eps, gemma=gemma, interpret=True, config=cfg)
    _, s_ref = reference.fused_add_rms_norm_ref(x, r, w, eps, gemma)
    # The stored sum is one rounding of the f32 sum in both: bit-identical.
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))
    _check_forward(y, s_ref, w, eps, gemma)  # y normalises the sum as stored


@settings(max_examples=6)
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    gemma=st.booleans(),
    with_ds=st.booleans(),
    eps=st.sampled_from(EPS),
    x_scale=st.sampled_from(X_SCALES),
    small=st.booleans(),
    seed=st.integers(0, 99),
)
def test_backward_matches_reference(shape, dtype, gemma, with_ds, eps, x_scale, small, seed):
    lead, hidden = shape
    x, w, r, dy = _inputs(lead, hidden, dtype, seed, with_residual=with_ds, x_scale=x_scale)
    ds = r if with_ds else None  # any tensor of the right shape serves as the incoming grad
    cfg = _small_blocks(dtype) if small else None
    dx, dw = kernel.rms_norm_bwd(dy, ds, x, w, eps=eps, gemma=gemma, interpret=True, config=cfg)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype and dw.shape == w.shape
    _check_backward(dx, dw, dy, ds, x, w, eps, gemma)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma,with_ds", [(False, False), (True, True)])
def test_backward_across_row_blocks_with_eps_that_matters(dtype, gemma, with_ds):
    """Weight gradient summed over 4 row blocks (the last one ragged), and eps of
    the order of the mean square: an overwritten (not accumulated) dweight, a
    dropped tail mask or eps applied as 1 / (sqrt(ms) + eps) all fail here."""
    sub = tiling.sublane_multiple(jnp.dtype(dtype).itemsize)
    rows, hidden, eps = 3 * sub + 5, 200, 1e-2
    x, w, r, dy = _inputs((rows,), hidden, dtype, 7, with_residual=with_ds, x_scale=0.1)
    ds = r if with_ds else None
    cfg = _small_blocks(dtype)
    assert -(-rows // cfg.block_rows) == 4
    dx, dw = kernel.rms_norm_bwd(dy, ds, x, w, eps=eps, gemma=gemma, interpret=True, config=cfg)
    _check_backward(dx, dw, dy, ds, x, w, eps, gemma)
    y = kernel.rms_norm_fwd(x, w, eps=eps, gemma=gemma, interpret=True, config=cfg)
    _check_forward(y, x, w, eps, gemma)


def test_default_blocks_span_several_row_blocks():
    """The block size the product picks (not a test override) over 3 row blocks."""
    rows, hidden, eps = 300, 4096, 1e-6
    cfg = tiling.choose_config(rows, hidden, (4, 4, 4), "v6e")
    assert -(-rows // cfg.block_rows) >= 2
    x, w, _, dy = _inputs((rows,), hidden, jnp.float32, 3)
    dx, dw = kernel.rms_norm_bwd(dy, None, x, w, eps=eps, interpret=True, config="v6e")
    _check_backward(dx, dw, dy, None, x, w, eps, False)


def test_custom_vjp_gradients_match_autodiff_of_reference():
    x, w, r, _ = _inputs((3, 10), 200, jnp.float32, 0, with_residual=True)

    def loss_kernel(x, r, w):
        y, s = api.fused_add_rms_norm(x, r, w, eps=1e-6, gemma=True, interpret=True)
        return jnp.sum(y * y) + jnp.sum(jnp.sin(s))

    def loss_ref(x, r, w):
        y, s = reference.fused_add_rms_norm_ref(x, r, w, 1e-6, True)
        return jnp.sum(y * y) + jnp.sum(jnp.sin(s))

    got = jax.grad(loss_kernel, argnums=(0, 1, 2))(x, r, w)
    want = jax.grad(loss_ref, argnums=(0, 1, 2))(x, r, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-4)

    g_plain = jax.grad(
        lambda x, w: jnp.sum(api.rms_norm(x, w, eps=1e-6, interpret=True) ** 3), (0, 1)
    )(x, w)
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


# -- the forward's copy ring (large inputs; rows a multiple of the sublane tile) --


def _ring_blocks(dtype, rows_in_subs):
    sub = tiling.sublane_multiple(jnp.dtype(dtype).itemsize)
    return tiling.RMSNormConfig(
        block_rows=rows_in_subs * sub, vmem_limit_bytes=16 * 2**20, ring=True
    )


RING = dict(
    dtype=st.sampled_from(DTYPES),
    # 768: three 256-lane columns a pass (an odd count, two lane tiles
    # each); 2048: four of 512; 200: whole-row chunks.
    hidden=st.sampled_from([128, 200, 768, 2048]),
    # rows / block: the ring's slots wrap several times; a count that is not
    # a multiple of the block makes the last block overlap the one before.
    blocks=st.sampled_from([1, 2, 3, 4.5, 7.5]),
    # bf16 blocks of 16, 32, 64 rows: part of a 32-row chunk, one, two.
    block_subs=st.sampled_from([1, 2, 4]),
    gemma=st.booleans(),
    eps=st.sampled_from(EPS),
    x_scale=st.sampled_from(X_SCALES),
    seed=st.integers(0, 99),
)
# 4.5 blocks of 32 bf16 rows: 144 rows, the last block sharing 16 with the one
# before it (at 16-row blocks 4.5 rounds down to 4 whole blocks).
_RING_EXAMPLE = dict(
    dtype=jnp.bfloat16, hidden=200, blocks=4.5, block_subs=2, gemma=True, eps=0.1, x_scale=1e-3
)


def _ring_rows(dtype, cfg, blocks):
    sub = tiling.sublane_multiple(jnp.dtype(dtype).itemsize)
    return int(blocks * cfg.block_rows) // sub * sub


@example(**_RING_EXAMPLE, residual=True, seed=1)
@settings(max_examples=6, deadline=None)
@given(residual=st.booleans(), **RING)
def test_ring_forward_matches_reference(
    dtype, hidden, blocks, block_subs, residual, gemma, eps, x_scale, seed
):
    cfg = _ring_blocks(dtype, block_subs)
    rows = _ring_rows(dtype, cfg, blocks)
    x, w, r, _ = _inputs([rows], hidden, dtype, seed, with_residual=residual, x_scale=x_scale)
    out = kernel.rms_norm_fwd(x, w, r, eps=eps, gemma=gemma, interpret=True, config=cfg)
    if residual:
        y, s = out
        _, s_ref = reference.fused_add_rms_norm_ref(x, r, w, eps, gemma)
        np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))
        _check_forward(y, s_ref, w, eps, gemma)
    else:
        _check_forward(out, x, w, eps, gemma)


def test_ring_is_chosen_for_large_aligned_inputs_only():
    big = tiling.ring_config(8192, 8192, (2,), (2,), "tpu7x")
    assert big is not None and big.ring and 8192 >= tiling.RING_MIN_BLOCKS * big.block_rows
    assert tiling.ring_config(8192 - 8, 8192, (2,), (2,), "tpu7x") is None  # not whole bf16 tiles
    assert tiling.ring_config(64, 8192, (2,), (2,), "tpu7x") is None  # too few blocks
    assert kernel._resolve_config("v6e", 8192, 4096, (2, 2), n_out=1).ring
    # Without its outputs named (n_out), a call keeps the BlockSpec pipeline.
    assert not kernel._resolve_config("v6e", 8192, 4096, (2, 2, 2)).ring


def test_ring_refuses_rows_it_cannot_copy():
    x = jnp.zeros((40, 128), jnp.bfloat16)
    w = jnp.ones((128,), jnp.bfloat16)
    with pytest.raises(ValueError, match="copy ring needs"):
        kernel.rms_norm_fwd(
            x[:37], w, eps=1e-6, interpret=True, config=_ring_blocks(jnp.bfloat16, 1)
        )
    with pytest.raises(ValueError, match="copy ring needs"):
        kernel.rms_norm_fwd(
            x[:16], w, eps=1e-6, interpret=True, config=_ring_blocks(jnp.bfloat16, 2)
        )


@example(**_RING_EXAMPLE, with_ds=True, seed=3)
@example(**{**_RING_EXAMPLE, "hidden": 768, "block_subs": 4}, with_ds=False, seed=4)
@settings(max_examples=6, deadline=None)
@given(with_ds=st.booleans(), **RING)
def test_ring_backward_matches_reference(
    dtype, hidden, blocks, block_subs, with_ds, gemma, eps, x_scale, seed
):
    """The weight gradient counts each row once, the rows the last block
    shares with the one before it included."""
    cfg = _ring_blocks(dtype, block_subs)
    rows = _ring_rows(dtype, cfg, blocks)
    x, w, r, dy = _inputs([rows], hidden, dtype, seed, with_residual=with_ds, x_scale=x_scale)
    ds = r if with_ds else None
    dx, dw = kernel.rms_norm_bwd(dy, ds, x, w, eps=eps, gemma=gemma, interpret=True, config=cfg)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype and dw.shape == w.shape
    _check_backward(dx, dw, dy, ds, x, w, eps, gemma)
