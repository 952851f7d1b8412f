"""The grid walker on small kernels whose traffic can be counted by hand.

Nothing here runs a kernel: the walker traces the launch and replays its
grid, so these tests are fast whatever the shapes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bench import grid_walk, scalar_eval, tracing

BF16 = jnp.bfloat16


def _matmul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32).astype(
        o_ref.dtype
    )


def _matmul_2x3(x, w, tm=16, tn=128):
    m, k = x.shape
    n = w.shape[1]
    return pl.pallas_call(
        _matmul_kernel,
        grid=(m // tm, n // tn),
        in_specs=[
            pl.BlockSpec((tm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, tn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), BF16),
    )(x, w)


def test_matmul_2x3_grid_counts_by_hand():
    tm, k, tn = 16, 256, 128
    x = jax.ShapeDtypeStruct((2 * tm, k), BF16)
    w = jax.ShapeDtypeStruct((k, 3 * tn), BF16)
    [c] = grid_walk.analyze(_matmul_2x3, x, w)
    assert c.grid == (2, 3) and c.steps == 6
    by = {o.origin: o for o in c.operands}
    xs, ws, out = (o for o in c.operands)
    # x's block index (i, 0) changes at steps 0 and 3 only.
    assert xs.transfers == 2 and xs.bytes == 2 * tm * k * 2
    # w's block (0, j) changes every step: j = 0,1,2,0,1,2.
    assert ws.transfers == 6 and ws.bytes == 6 * k * tn * 2
    # every output block is written once.
    assert out.kind == "output" and out.transfers == 6
    assert out.bytes == 6 * tm * tn * 2
    assert c.pipeline_bytes == xs.bytes + ws.bytes + out.bytes
    assert c.flops == 6 * 2 * tm * k * tn
    assert c.dma_bytes == 0 and not c.uncounted
    assert len(by) == 3


def _gather_rows(idx, x, *, bm):
    """out[i] = x[idx[i]] block-wise, with idx as scalar prefetch."""
    n = idx.shape[0]

    def kernel(idx_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n * bm, x.shape[1]), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n,),
            in_specs=[pl.BlockSpec((bm, x.shape[1]), lambda i, idx: (idx[i], 0))],
            out_specs=pl.BlockSpec((bm, x.shape[1]), lambda i, idx: (i, 0)),
        ),
    )(idx, x)


def _scatter_rows(idx, x, *, bm):
    """Output block idx[i] visited at step i (revisits when idx repeats)."""
    n = idx.shape[0]

    def kernel(idx_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n,),
            in_specs=[pl.BlockSpec((bm, x.shape[1]), lambda i, idx: (i, 0))],
            out_specs=pl.BlockSpec((bm, x.shape[1]), lambda i, idx: (idx[i], 0)),
        ),
    )(idx, x)


def test_scalar_prefetch_repeated_block_is_not_refetched():
    bm, h = 8, 128
    x = jax.ShapeDtypeStruct((4 * bm, h), jnp.float32)
    idx = jnp.array([0, 0, 2, 2, 2, 1], jnp.int32)
    [c] = grid_walk.analyze(functools.partial(_gather_rows, bm=bm), idx, x)
    sp, xin, out = c.operands
    assert sp.kind == "scalar_prefetch" and sp.bytes == 6 * 4
    # fetched at steps 0 (block 0), 2 (block 2), 5 (block 1)
    assert xin.transfers == 3 and xin.bytes == 3 * bm * h * 4
    assert out.transfers == 6
    assert c.steps == 6 and c.flops == 0


def test_output_revisits():
    bm, h = 8, 128
    x = jax.ShapeDtypeStruct((5 * bm, h), jnp.float32)
    # consecutive revisit (0,0) stays resident: one write-back; coming back to
    # block 0 after block 1 writes it again.
    idx = jnp.array([0, 0, 1, 0, 3], jnp.int32)
    [c] = grid_walk.analyze(functools.partial(_scatter_rows, bm=bm), idx, x)
    out = c.operands[-1]
    assert out.transfers == 4
    assert out.bytes == 4 * bm * h * 4


def test_squeezed_dims_and_edge_blocks():
    # rhs block (None, 8, 128) over a (3, 20, 128) array; grid walks (e, row
    # tile) with 20 rows in tiles of 8: the last tile holds 4 real rows.
    def kernel(w_ref, o_ref):
        o_ref[...] = w_ref[...] * 2

    def f(w):
        return pl.pallas_call(
            kernel,
            grid=(3, 3),
            in_specs=[pl.BlockSpec((None, 8, 128), lambda e, r: (e, r, 0))],
            out_specs=pl.BlockSpec((None, 8, 128), lambda e, r: (e, r, 0)),
            out_shape=jax.ShapeDtypeStruct(w.shape, w.dtype),
        )(w)

    [c] = grid_walk.analyze(f, jax.ShapeDtypeStruct((3, 20, 128), jnp.float32))
    win, out = c.operands
    assert win.block_shape == (1, 8, 128)
    assert win.transfers == 9
    assert win.bytes == 3 * 20 * 128 * 4  # edge blocks clipped to the array
    assert out.bytes == 3 * 20 * 128 * 4


def test_dynamic_trip_count_from_scalar_prefetch():
    """A fori_loop whose bound is read from SMEM: flops follow the value."""
    tm, k, tn = 16, 128, 128

    def kernel(n_ref, x_ref, w_ref, o_ref):
        def body(i, acc):
            return acc + jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

        o_ref[...] = lax.fori_loop(
            0, n_ref[pl.program_id(0)], body, jnp.zeros((tm, tn), jnp.float32)
        )

    def f(n, x, w):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((3 * tm, tn), jnp.float32),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(3,),
                in_specs=[
                    pl.BlockSpec((tm, k), lambda i, n: (i, 0)),
                    pl.BlockSpec((k, tn), lambda i, n: (0, 0)),
                ],
                out_specs=pl.BlockSpec((tm, tn), lambda i, n: (i, 0)),
            ),
        )(n, x, w)

    trips = jnp.array([2, 0, 5], jnp.int32)
    [c] = grid_walk.analyze(
        f, trips, jax.ShapeDtypeStruct((3 * tm, k), BF16), jax.ShapeDtypeStruct((k, tn), BF16)
    )
    assert c.flops == (2 + 0 + 5) * 2 * tm * k * tn
    assert not any("cannot compute" in n for n in c.notes)


def test_manual_dma_counted_from_dma_start():
    """Weights left in HBM (memory_space ANY) and copied by the kernel: the
    pipeline does not move them, the kernel's dma_starts do."""
    rows, h = 8, 128

    def kernel(idx_ref, w_hbm, o_ref, buf, sem):
        i = pl.program_id(0)
        cp = pltpu.make_async_copy(w_hbm.at[pl.ds(idx_ref[i] * rows, rows), :], buf, sem.at[0])

        @pl.when(idx_ref[i] >= 0)
        def _():
            cp.start()
            cp.wait()

        o_ref[...] = buf[...]

    def f(idx, w):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((idx.shape[0] * rows, h), w.dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(idx.shape[0],),
                in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                out_specs=pl.BlockSpec((rows, h), lambda i, idx: (i, 0)),
                scratch_shapes=[pltpu.VMEM((rows, h), jnp.float32), pltpu.SemaphoreType.DMA((1,))],
            ),
        )(idx, w)

    idx = jnp.array([0, -1, 2, 1], jnp.int32)  # step 1 copies nothing
    [c] = grid_walk.analyze(f, idx, jax.ShapeDtypeStruct((4 * rows, h), jnp.float32))
    w_op = c.operands[1]
    assert not w_op.counted and w_op.bytes == 0
    assert c.dma_bytes == 3 * rows * h * 4
    assert c.hbm_bytes == c.pipeline_bytes + c.dma_bytes
    assert any("dma_start" in n for n in c.notes)


def test_unknown_predicate_counts_costliest_branch():
    """A branch on vector data the walker cannot read: the dot is counted."""

    def kernel(x_ref, w_ref, o_ref):
        big = jnp.sum(x_ref[...]) > 0

        @pl.when(big)
        def _():
            o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    def f(x, w):
        return pl.pallas_call(
            kernel,
            grid=(2,),
            in_specs=[
                pl.BlockSpec((8, 128), lambda i: (i, 0)),
                pl.BlockSpec((128, 128), lambda i: (0, 0)),
            ],
            out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        )(x, w)

    [c] = grid_walk.analyze(
        f,
        jax.ShapeDtypeStruct((16, 128), jnp.float32),
        jax.ShapeDtypeStruct((128, 128), jnp.float32),
    )
    assert c.flops == 2 * 2 * 8 * 128 * 128
    assert any("unknown predicate" in n for n in c.notes)


def test_smem_scratch_state_carries_across_steps():
    """A kernel that decides at step 0 how many dots later steps issue, through
    an SMEM scratch ref: evaluated step by step, the state carries."""

    def kernel(n_ref, x_ref, w_ref, o_ref, state):
        @pl.when(pl.program_id(0) == 0)
        def _():
            state[0] = n_ref[0] * 2

        def body(i, acc):
            return acc + jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

        o_ref[...] = lax.fori_loop(0, state[0], body, jnp.zeros((8, 128), jnp.float32))

    def f(n, x, w):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((24, 128), jnp.float32),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(3,),
                in_specs=[
                    pl.BlockSpec((8, 128), lambda i, n: (i, 0)),
                    pl.BlockSpec((128, 128), lambda i, n: (0, 0)),
                ],
                out_specs=pl.BlockSpec((8, 128), lambda i, n: (i, 0)),
                scratch_shapes=[pltpu.SMEM((1,), jnp.int32)],
            ),
        )(n, x, w)

    [c] = grid_walk.analyze(
        f,
        jnp.array([3], jnp.int32),
        jax.ShapeDtypeStruct((24, 128), jnp.float32),
        jax.ShapeDtypeStruct((128, 128), jnp.float32),
    )
    assert c.flops == 3 * 6 * 2 * 8 * 128 * 128


def test_pallas_call_inside_jit_and_custom_vjp_is_found():
    @jax.custom_vjp
    def op(x, w):
        return _matmul_2x3(x, w)

    op.defvjp(lambda x, w: (op(x, w), None), lambda r, g: (g, g))
    f = jax.jit(lambda x, w: op(x * 2, w) + 1)
    launches = tracing.trace_launches(
        f, jax.ShapeDtypeStruct((32, 256), BF16), jax.ShapeDtypeStruct((256, 384), BF16)
    )
    assert len(launches) == 1


def test_unknown_scalar_prefetch_is_a_clear_error():
    x = jax.ShapeDtypeStruct((32, 128), jnp.float32)
    idx = jax.ShapeDtypeStruct((4,), jnp.int32)  # shape only: grid undecidable
    with pytest.raises(scalar_eval.EvalError, match="scalar-prefetch"):
        grid_walk.analyze(functools.partial(_gather_rows, bm=8), idx, x)


@settings(deadline=None, max_examples=20, derandomize=True)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40))
def test_fetch_count_matches_runs_of_equal_indices(idx):
    """Property: an input whose block index is idx[i] at step i is fetched once
    per run of equal consecutive indices (independent count in numpy)."""
    bm, h = 8, 128
    arr = np.asarray(idx, np.int32)
    runs = 1 + int(np.count_nonzero(arr[1:] != arr[:-1]))
    [c] = grid_walk.analyze(
        functools.partial(_gather_rows, bm=bm),
        jnp.asarray(arr),
        jax.ShapeDtypeStruct((6 * bm, h), jnp.float32),
    )
    assert c.operands[1].transfers == runs
    assert c.operands[1].bytes == runs * bm * h * 4
