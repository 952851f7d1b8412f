"""RMSNorm forward and backward as Pallas TPU kernels.

Layout: any leading dims are flattened to rows; a grid step owns a
[block_rows, hidden] slab with the full hidden size, so the mean of squares
never crosses a step and each element of x (and residual) is read once and
each output written once. A hidden size that is not a multiple of 128 is a
full-extent block: Mosaic pads lanes internally and the mean divides by the
true size. The last row block may run past the array: its extra rows are
independent garbage whose writes Pallas drops, except in the weight gradient,
where they are masked out before the reduction.

The weight gradient is reduced inside the backward kernel: an f32 [1, hidden]
output block that stays resident across the (sequential) row axis.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import tiling


def _resolve_config(config, rows, hidden, streams, n_out=None) -> tiling.RMSNormConfig:
    """config: None (the attached TPU's generation), a generation name, or a
    RMSNormConfig. n_out: how many of `streams` (the last) are outputs; a call
    that names them may take the copy ring."""
    if isinstance(config, tiling.RMSNormConfig):
        return config
    if config is None:
        from ._torch_bindings.backend import detected_generation  # no torch needed

        config = detected_generation()
    if n_out:
        ring = tiling.ring_config(rows, hidden, streams[:-n_out], streams[-n_out:], config)
        if ring is not None:
            return ring
    return tiling.choose_config(rows, hidden, streams, config)


def _effective_weight(w_ref, gemma):
    w = w_ref[...].astype(jnp.float32)
    return 1.0 + w if gemma else w


def _fwd_kernel(*refs, eps, gemma, has_residual):
    if has_residual:
        x_ref, r_ref, w_ref, y_ref, s_ref = refs
        s = (x_ref[...].astype(jnp.float32) + r_ref[...].astype(jnp.float32)).astype(s_ref.dtype)
        s_ref[...] = s
        x = s.astype(jnp.float32)
    else:
        x_ref, w_ref, y_ref = refs
        x = x_ref[...].astype(jnp.float32)
    _normalise(x, w_ref, y_ref, eps, gemma)


def _normalise(x, w_ref, y_dst, eps, gemma):
    """y = x / rms(x) * w for f32 rows x, stored to y_dst."""
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    y_dst[...] = (x * rstd * _effective_weight(w_ref, gemma)).astype(y_dst.dtype)


def _copy_ring(ins, outs, ibufs, obufs, isem, osem, *, rows, block_rows, body):
    """Streams row blocks of the HBM refs `ins` through VMEM slots and the
    blocks `body(b, slot, oslot)` writes into `obufs` back to `outs`:
    RING_IN_SLOTS - 1 blocks are in flight while one is worked on, and
    RING_OUT_SLOTS blocks' copies back may be. (The BlockSpec pipeline keeps
    one block in flight: a step whose vector work took as long as its copies
    then waited on the next block's DMA latency, 46 of 128 us at 8,192 x 8,192
    bf16 on tpu7x, by the schedule.) The last block is aligned to the array's
    end and may overlap the one before it (its shared rows are recomputed and
    written again with the same values; the backward's weight gradient
    takes them out once, _uncount_shared_rows)."""
    br = block_rows
    n_in, n_out = tiling.RING_IN_SLOTS, tiling.RING_OUT_SLOTS
    blocks = -(-rows // br)

    def first_row(b):
        return pl.multiple_of(jnp.minimum(b * br, rows - br), 8)

    def in_copies(b, slot):
        at = pl.ds(first_row(b), br)
        return [
            pltpu.make_async_copy(src.at[at], buf.at[slot], isem.at[slot])
            for src, buf in zip(ins, ibufs)
        ]

    def out_copies(b, slot):
        at = pl.ds(first_row(b), br)
        return [
            pltpu.make_async_copy(buf.at[slot], dst.at[at], osem.at[slot])
            for buf, dst in zip(obufs, outs)
        ]

    for b in range(min(n_in - 1, blocks)):
        for c in in_copies(b, b):
            c.start()

    def block(b, carry):
        slot, oslot = lax.rem(b, n_in), lax.rem(b, n_out)
        for c in in_copies(b, slot):
            c.wait()
        ahead = b + n_in - 1

        @pl.when(ahead < blocks)
        def _():
            for c in in_copies(ahead, lax.rem(ahead, n_in)):
                c.start()

        @pl.when(b >= n_out)
        def _():
            for c in out_copies(b - n_out, oslot):
                c.wait()

        body(b, slot, oslot)
        for c in out_copies(b, oslot):
            c.start()

        # The last copies are awaited inside the loop: placed after it, libtpu
        # put them just past the loop's closing branch (one empty bundle, then
        # the waits), where bench/llo.py's tpu7x branch-delay rule runs them on
        # every iteration, a wait no DMA satisfies (a hang on a chip).
        @pl.when(b == blocks - 1)
        def _():
            for last in range(max(blocks - n_out, 0), blocks):
                for c in out_copies(last, last % n_out):
                    c.wait()

        return carry

    lax.fori_loop(0, blocks, block, 0)


def _ring_chunks(block_rows, chunk, rows=None):
    """Runs chunk(rows slice) over a ring block, RING_CHUNK_ROWS rows at a
    time; rows: only the chunks that cover the block's first `rows` rows."""
    cr = math.gcd(block_rows, tiling.RING_CHUNK_ROWS)

    def run(c, carry):
        chunk(pl.ds(pl.multiple_of(c * cr, cr), cr))
        return carry

    lax.fori_loop(0, -(-(block_rows if rows is None else rows) // cr), run, 0)


def _fwd_ring_kernel(*refs, eps, gemma, has_residual, rows, block_rows):
    """The forward over HBM refs, through _copy_ring."""
    n = 1 + has_residual
    ins, w_ref, outs = refs[:n], refs[n], refs[n + 1 : 2 * n + 1]
    ibufs, obufs = refs[2 * n + 1 : 3 * n + 1], refs[3 * n + 1 : 4 * n + 1]
    isem, osem = refs[4 * n + 1 :]

    def body(b, slot, oslot):
        def chunk(rs):
            x = ibufs[0][slot, rs, :].astype(jnp.float32)
            if has_residual:
                s = (x + ibufs[1][slot, rs, :].astype(jnp.float32)).astype(obufs[1].dtype)
                obufs[1][oslot, rs, :] = s
                x = s.astype(jnp.float32)
            _normalise(x, w_ref, obufs[0].at[oslot, rs, :], eps, gemma)

        _ring_chunks(block_rows, chunk)

    _copy_ring(ins, outs, ibufs, obufs, isem, osem, rows=rows, block_rows=block_rows, body=body)


def _bwd_ring_kernel(*refs, eps, gemma, has_ds, rows, block_rows):
    """The backward over HBM refs, through _copy_ring; the weight gradient
    accumulates in VMEM, counting each row once (the last block's rows shared
    with the block before it are masked out of it)."""
    n = 2 + has_ds
    ins, w_ref, dx_hbm, dw_ref = refs[:n], refs[n], refs[n + 1], refs[n + 2]
    ibufs, dx_bufs = refs[n + 3 : 2 * n + 3], refs[2 * n + 3]
    isem, osem, acc_ref = refs[2 * n + 4 :]
    br = block_rows
    acc_ref[...] = jnp.zeros_like(acc_ref)
    w = _effective_weight(w_ref, gemma)

    hidden = w_ref.shape[-1]
    cw = next((c for c in (512, 256, 128) if hidden % c == 0), hidden)
    unroll = min(hidden // cw, 8)

    def body(b, slot, oslot):
        def chunk(rs):
            dy = ibufs[0][slot, rs, :].astype(jnp.float32)
            x = ibufs[-1][slot, rs, :].astype(jnp.float32)
            ds = ibufs[1][slot, rs, :] if has_ds else None
            dx, contrib = _bwd_rows(x, dy, ds, w, eps)
            dx_bufs[oslot, rs, :] = dx.astype(dx_bufs.dtype)
            acc_ref[...] += _sublane_sums(contrib)

        def lanes(rs):
            # Two passes over the row's columns, cw lanes at a time, unrolled
            # (up to 8): whole rows of f32 temporaries spilled to VMEM and
            # bound the loop by vector stores (tpu7x, H = 8192: 847 bundles a
            # 16-row chunk, 932 of them stores); in 1024-lane columns the
            # chunk is 606 bundles, bound by the VALU (2,047 ops, 4 a bundle).
            # 512-lane columns of 32-row chunks, the row sums in one lane
            # tile (_lane_tiles), schedule best at H 2048-8192 (tpu7x bwd
            # 47.3 -> 43.2 us at H = 2048, 171.5 -> 167.1 at 8192).
            def col(c):
                return pl.ds(pl.multiple_of(c * cw, cw), cw)

            def load(c):
                cs = col(c)
                dy = ibufs[0][slot, rs, cs].astype(jnp.float32)
                x = ibufs[-1][slot, rs, cs].astype(jnp.float32)
                return cs, x, dy

            def weight(cs):
                return _effective_weight(w_ref.at[:, cs], gemma)

            def sums(c, carry):
                cs, x, dy = load(c)
                g = dy * weight(cs)
                return carry[0] + _lane_tiles(x * x), carry[1] + _lane_tiles(g * x)

            zero = jnp.zeros((rs.size, min(cw, 128)), jnp.float32)
            sq, gx = lax.fori_loop(0, hidden // cw, sums, (zero, zero), unroll=unroll)
            rstd = jax.lax.rsqrt(jnp.sum(sq, axis=-1, keepdims=True) / hidden + eps)
            # dx = rstd * (g - xhat * mean(g * xhat)), xhat = x * rstd
            k = rstd * rstd * rstd * (jnp.sum(gx, axis=-1, keepdims=True) / hidden)

            def grads(c, carry):
                # dx = (rstd dy) w - k x and the weight gradient's rows
                # (rstd dy) x share a product (tpu7x H 8192: 1,224 -> 1,096
                # VALU ops a chunk, 167.1 -> 157.7 us)
                cs, x, dy = load(c)
                t = rstd * dy
                dx = t * weight(cs) - k * x
                if has_ds:
                    dx = dx + ibufs[1][slot, rs, cs].astype(jnp.float32)
                dx_bufs[oslot, rs, cs] = dx.astype(dx_bufs.dtype)
                acc_ref[:, cs] += _sublane_sums(t * x)
                return carry

            lax.fori_loop(0, hidden // cw, grads, 0, unroll=unroll)

        _ring_chunks(br, lanes if hidden % 128 == 0 else chunk)

    _copy_ring(ins, [dx_hbm], ibufs, [dx_bufs], isem, osem, rows=rows, block_rows=br, body=body)
    _uncount_shared_rows(ibufs, acc_ref, w, eps, rows=rows, block_rows=br)
    dw_ref[...] = jnp.sum(acc_ref[...], axis=0, keepdims=True)


def _uncount_shared_rows(ibufs, acc_ref, w, eps, *, rows, block_rows):
    """Takes out of the weight gradient the rows _copy_ring's last block
    shares with the one before it (both counted them): the first
    blocks * block_rows - rows rows of the last block's slot, which still
    holds them. Once a call, so that no chunk of the ring masks its rows."""
    blocks = -(-rows // block_rows)
    shared = blocks * block_rows - rows
    if not shared:
        return
    slot = (blocks - 1) % tiling.RING_IN_SLOTS

    def chunk(rs):
        dy = ibufs[0][slot, rs, :].astype(jnp.float32)
        x = ibufs[-1][slot, rs, :].astype(jnp.float32)
        _, contrib = _bwd_rows(x, dy, None, w, eps)
        row = rs.start + lax.broadcasted_iota(jnp.int32, (rs.size, 1), 0)
        acc_ref[...] -= _sublane_sums(jnp.where(row < shared, contrib, 0.0))

    _ring_chunks(block_rows, chunk, rows=shared)


# Rows the backward computes at a time: a block's f32 temporaries would not
# fit the register file, so the compiler stored every one of them to VMEM and
# the kernel was bound by vector stores (2x the bytes roofline on tpu7x);
# a 16-row slice keeps them in registers.
BWD_CHUNK_ROWS = 16


def _lane_tiles(x):
    """[rows, n] -> [rows, 128]: the sum of x's 128-lane tiles, whole-vreg
    adds into one accumulator tile a row group. Accumulating whole [rows, n]
    columns kept n/128 times the vregs live, which spilled (tpu7x bwd,
    H = 2048: 151 -> 134 bundles a 16-row chunk). One chain, not a tree: the tree
    scheduled slower (153 bundles)."""
    out = x[..., :128]
    for t in range(1, x.shape[-1] // 128):
        out = out + x[..., t * 128 : (t + 1) * 128]
    return out


def _sublane_sums(x):
    """[rows, n] -> [8, n]: sums over whole 8-row tiles (VPU adds; rows a
    multiple of 8), the one cross-sublane reduce left for the end."""
    return x.reshape(-1, 8, x.shape[-1]).sum(axis=0)


def _bwd_rows(x, dy, ds, w, eps):
    """(dx, dy * xhat) of f32 rows: the input gradient (plus ds, the gradient
    reaching the stored sum directly) and the rows' weight-gradient terms."""
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    xhat = x * rstd
    g = dy * w
    dx = rstd * (g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    if ds is not None:
        dx = dx + ds.astype(jnp.float32)
    return dx, dy * xhat


def _bwd_kernel(*refs, eps, gemma, has_ds, rows, block_rows):
    if has_ds:
        dy_ref, ds_ref, s_ref, w_ref, dx_ref, dw_ref, acc_ref = refs
    else:
        dy_ref, s_ref, w_ref, dx_ref, dw_ref, acc_ref = refs
        ds_ref = None
    i = pl.program_id(0)
    hidden = s_ref.shape[-1]

    @pl.when(i == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    w = _effective_weight(w_ref, gemma)
    cr = math.gcd(block_rows, BWD_CHUNK_ROWS)

    def chunk(c, carry):
        r0 = pl.multiple_of(c * cr, cr)
        rs = pl.ds(r0, cr)
        x = s_ref[rs, :].astype(jnp.float32)
        dy = dy_ref[rs, :].astype(jnp.float32)
        dx, contrib = _bwd_rows(x, dy, ds_ref[rs, :] if has_ds else None, w, eps)
        dx_ref[rs, :] = dx.astype(dx_ref.dtype)
        if rows % block_rows:  # the last block overhangs: its extra rows are garbage
            row = i * block_rows + r0 + jax.lax.broadcasted_iota(jnp.int32, dy.shape, 0)
            contrib = jnp.where(row < rows, contrib, 0.0)
        # Sublane-wise partial sums (VPU adds); one cross-sublane reduce at the end.
        if cr % 8 == 0:
            acc_ref[...] += contrib.reshape(cr // 8, 8, hidden).sum(axis=0)
        else:
            acc_ref[0:1, :] += jnp.sum(contrib, axis=0, keepdims=True)
        return carry

    jax.lax.fori_loop(0, block_rows // cr, chunk, 0)

    @pl.when(i == pl.num_programs(0) - 1)
    def _finish():
        dw_ref[...] = jnp.sum(acc_ref[...], axis=0, keepdims=True)


def _row_spec(block_rows, hidden):
    return pl.BlockSpec((block_rows, hidden), lambda i: (i, 0))


def _weight_spec(hidden):
    return pl.BlockSpec((1, hidden), lambda i: (0, 0))


def _flatten(x):
    return x.reshape(-1, x.shape[-1])


def rms_norm_fwd(
    x,
    weight,
    residual=None,
    *,
    eps: float,
    gemma: bool = False,
    interpret: bool = False,
    config=None,
):
    """y = x / rms(x) * w  (w -> 1 + w if gemma). With `residual`: returns (y, x + residual),
    y normalising the updated residual as stored in x's dtype."""
    shape = x.shape
    hidden = shape[-1]
    x2 = _flatten(x)
    rows = x2.shape[0]
    has_residual = residual is not None
    if rows == 0:  # an empty grid is not a valid launch
        return (x, x) if has_residual else x
    streams = (x.dtype.itemsize,) * (4 if has_residual else 2)  # x[, residual] in; y[, sum] out
    cfg = _resolve_config(config, rows, hidden, streams, n_out=1 + has_residual)
    br = cfg.block_rows
    operands = [x2] + ([_flatten(residual)] if has_residual else []) + [weight.reshape(1, hidden)]
    if cfg.ring:
        outs = _fwd_ring(operands, cfg, eps, gemma, has_residual, interpret)
        return (
            (outs[0].reshape(shape), outs[1].reshape(shape))
            if has_residual
            else outs[0].reshape(shape)
        )
    in_specs = [_row_spec(br, hidden)] * (1 + has_residual) + [_weight_spec(hidden)]
    out_shape = [jax.ShapeDtypeStruct((rows, hidden), x.dtype)] * (1 + has_residual)
    itemsize = x.dtype.itemsize
    outs = pl.pallas_call(
        functools.partial(_fwd_kernel, eps=eps, gemma=gemma, has_residual=has_residual),
        grid=(pl.cdiv(rows, br),),
        in_specs=in_specs,
        out_specs=[_row_spec(br, hidden)] * (1 + has_residual),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=cfg.vmem_limit_bytes
        ),
        cost_estimate=pl.CostEstimate(
            flops=4 * rows * hidden,
            transcendentals=rows,
            bytes_accessed=(len(operands) - 1 + len(out_shape)) * rows * hidden * itemsize
            + hidden * weight.dtype.itemsize,
        ),
        interpret=interpret,
        name="rms_norm_fwd",
    )(*operands)
    if has_residual:
        return outs[0].reshape(shape), outs[1].reshape(shape)
    return outs[0].reshape(shape)


def _ring_scratch(in_dtypes, out_dtypes, block_rows, hidden):
    """_copy_ring's VMEM slots (inputs', then outputs') and its two semaphores."""
    slots = [(tiling.RING_IN_SLOTS, d) for d in in_dtypes]
    slots += [(tiling.RING_OUT_SLOTS, d) for d in out_dtypes]
    return [pltpu.VMEM((count, block_rows, hidden), d) for count, d in slots] + [
        pltpu.SemaphoreType.DMA((tiling.RING_IN_SLOTS,)),
        pltpu.SemaphoreType.DMA((tiling.RING_OUT_SLOTS,)),
    ]


def _fwd_ring(operands, cfg, eps, gemma, has_residual, interpret):
    x2, w = operands[0], operands[-1]
    rows, hidden = x2.shape
    br, n = cfg.block_rows, 1 + has_residual
    _ring_rows_check(rows, br, x2.dtype)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(
        _fwd_ring_kernel,
        eps=eps,
        gemma=gemma,
        has_residual=has_residual,
        rows=rows,
        block_rows=br,
    )
    itemsize = x2.dtype.itemsize
    return pl.pallas_call(
        kernel,
        in_specs=[hbm] * n + [pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=[hbm] * n,
        out_shape=[jax.ShapeDtypeStruct((rows, hidden), x2.dtype)] * n,
        scratch_shapes=_ring_scratch([x2.dtype] * n, [x2.dtype] * n, br, hidden),
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=cfg.vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(
            flops=4 * rows * hidden,
            transcendentals=rows,
            bytes_accessed=2 * n * rows * hidden * itemsize + hidden * w.dtype.itemsize,
        ),
        interpret=interpret,
        name="rms_norm_fwd",
    )(*operands)


def _ring_rows_check(rows, br, dtype):
    sub = tiling.sublane_multiple(jnp.dtype(dtype).itemsize)
    if rows < br or rows % sub or br % sub:
        raise ValueError(
            f"config: the copy ring needs block_rows and rows multiples of {sub} with rows >="
            f" block_rows; got block_rows={br}, rows={rows}"
        )


def _bwd_ring(operands, dtype, cfg, eps, gemma, has_ds, interpret):
    rows, hidden = operands[0].shape
    br, n = cfg.block_rows, 2 + has_ds
    _ring_rows_check(rows, br, dtype)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    kernel = functools.partial(
        _bwd_ring_kernel, eps=eps, gemma=gemma, has_ds=has_ds, rows=rows, block_rows=br
    )
    return pl.pallas_call(
        kernel,
        in_specs=[hbm] * n + [vmem],
        out_specs=[hbm, vmem],
        out_shape=[
            jax.ShapeDtypeStruct((rows, hidden), dtype),
            jax.ShapeDtypeStruct((1, hidden), jnp.float32),
        ],
        scratch_shapes=_ring_scratch([a.dtype for a in operands[:n]], [dtype], br, hidden)
        + [pltpu.VMEM((8, hidden), jnp.float32)],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=cfg.vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(
            flops=10 * rows * hidden,
            transcendentals=rows,
            bytes_accessed=(n + 1) * rows * hidden * jnp.dtype(dtype).itemsize
            + hidden * (operands[-1].dtype.itemsize + 4),
        ),
        interpret=interpret,
        name="rms_norm_bwd",
    )(*operands)


def rms_norm_bwd(
    dy,
    ds,
    s,
    weight,
    *,
    eps: float,
    gemma: bool = False,
    interpret: bool = False,
    config=None,
):
    """(dx, dweight) of y = rms_norm(s); `ds` (or None) is the gradient flowing
    into s directly (the fused residual output), added to dx."""
    shape = s.shape
    hidden = shape[-1]
    s2, dy2 = _flatten(s), _flatten(dy)
    rows = s2.shape[0]
    if rows == 0:
        return jnp.zeros_like(s), jnp.zeros_like(weight)
    has_ds = ds is not None
    # dy[, ds], s in; dx out
    streams = (dy.dtype.itemsize,) + ((ds.dtype.itemsize,) if has_ds else ())
    streams += (s.dtype.itemsize, s.dtype.itemsize)
    cfg = _resolve_config(config, rows, hidden, streams, n_out=1)
    br = cfg.block_rows
    operands = [dy2] + ([_flatten(ds)] if has_ds else []) + [s2, weight.reshape(1, hidden)]
    if cfg.ring:
        dx, dw = _bwd_ring(operands, s.dtype, cfg, eps, gemma, has_ds, interpret)
        return dx.reshape(shape), dw.reshape(weight.shape).astype(weight.dtype)
    in_specs = [_row_spec(br, hidden)] * (2 + has_ds) + [_weight_spec(hidden)]
    dx, dw = pl.pallas_call(
        functools.partial(
            _bwd_kernel, eps=eps, gemma=gemma, has_ds=has_ds, rows=rows, block_rows=br
        ),
        grid=(pl.cdiv(rows, br),),
        in_specs=in_specs,
        out_specs=[_row_spec(br, hidden), _weight_spec(hidden)],
        out_shape=[
            jax.ShapeDtypeStruct((rows, hidden), s.dtype),
            jax.ShapeDtypeStruct((1, hidden), jnp.float32),
        ],
        scratch_shapes=[pltpu.VMEM((8, hidden), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            # The weight gradient accumulates across row blocks: sequential.
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=cfg.vmem_limit_bytes,
        ),
        cost_estimate=pl.CostEstimate(
            flops=10 * rows * hidden,
            transcendentals=rows,
            bytes_accessed=(len(operands) - 1 + 1) * rows * hidden * s.dtype.itemsize
            + hidden * (weight.dtype.itemsize + 4),
        ),
        interpret=interpret,
        name="rms_norm_bwd",
    )(*operands)
    return dx.reshape(shape), dw.reshape(weight.shape).astype(weight.dtype)
