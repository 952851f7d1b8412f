"""Numerics (interpret mode) and structure tests for flash_attention_tpu.

Every numeric test compares the Pallas kernels, run with interpret=True on
CPU, against reference.attention_reference (plain f32 softmax with an
explicit dense mask, on the same bf16/f16-rounded inputs) for the output,
logsumexp and all gradients, element by element with tests/tolerances.py.
The magnitudes that scale each bound are sums of absolute terms built from
the reference's own probabilities P (the reference run with V = identity):
out ~ P|V|, dV ~ P^T|dO|, dQ/dK ~ scale * P (2D + |dO||V|^T) |K| / |Q| where
D = |dO| . P|V| + |dlse| bounds delta. Counted bf16 roundings: P before the
PV and dV matmuls (1), and for dQ/dK dS before the matmul plus the bf16
forward output inside delta (4 in all). Shapes stay small (interpret mode
runs the grid as a scan); block sizes of 128 make every shape span several
blocks with ragged tails.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from flash_attention_tpu import schedule as bsched  # noqa: E402
from flash_attention_tpu import checks, kernel_fwd, tiling  # noqa: E402
from flash_attention_tpu import api as fa  # noqa: E402
from flash_attention_tpu import reference as ref  # noqa: E402
from gate import pallas_eqns  # noqa: E402
from tolerances import ATTENTION_ROUNDINGS, assert_close, attention_magnitudes  # noqa: E402

SMALL = tiling.BlockSizes(block_q=128, block_kv=128, block_q_bwd=128, block_kv_bwd=128)
# 256 blocks cut into 128 sub-tiles: exercises the sub-tiled masked path.
SUBTILED = tiling.BlockSizes(
    block_q=256, block_kv=256, block_q_bwd=256, block_kv_bwd=256, sub_block=128
)
# Fully visible pairs of 256-position blocks computed 64 matmul rows a step
# (G = 1/2/4/8 heads: 64/32/16/8 positions a slab): the forward's slab loop.
SLABBED = tiling.BlockSizes(
    block_q=256, block_kv=128, block_q_bwd=128, block_kv_bwd=128, slab_rows=64
)
HYP = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
# Pallas' interpreter with each DMA run at its wait, not at its start: a read
# issued before a write of the same memory has landed reads stale data, as
# on a TPU (plain interpret=True runs every copy at once). For dQ streamed
# through HBM (tiling.Plan.stream_dq), whose steps overlap reads and writes.
ON_WAIT = pltpu.InterpretParams(dma_execution_mode="on_wait")
# dQ: the separate kernel, fused in VMEM, fused and streamed through HBM.
DQ_MODES = {
    "dq-kernel": dict(fuse_dq=False),
    "fused-dq": dict(fuse_dq=True),
    "streamed-dq": dict(fuse_dq=True, stream_dq=True),
}
SCALES = [None, 0.05, 0.3]  # softmax_scale: default 1/sqrt(D), and two others


# jitted: one program per shape; eager, each of its ops compiled per shape.
@functools.partial(jax.jit, static_argnums=tuple(range(1, 10)))
def _inputs(seed, b, hq, hkv, sq, skv, d, dv, dtype, with_sinks):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (b, hq, sq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, hkv, skv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, hkv, skv, dv), jnp.float32).astype(dtype)
    # The kernel receives dO rounded to its dtype: give the reference the same values.
    do = jax.random.normal(ks[3], (b, hq, sq, dv), jnp.float32).astype(dtype).astype(jnp.float32)
    sinks = jax.random.normal(ks[4], (hq,), jnp.float32) if with_sinks else None
    return q, k, v, do, sinks


def _check_all(
    kernel_fn,
    ref_fn,
    probs_fn,
    q,
    k,
    v,
    do,
    sinks,
    dtype,
    scale,
    to_dense=lambda x: x,
    from_dense=lambda x: x,
):
    """Output, logsumexp and grads of q, k, v (and sinks) vs the reference, per element.

    probs_fn(q, k, sinks) -> the reference's probabilities; to_dense/from_dense
    map the caller's layout to [B, H, S, ...] and back (varlen: packed tokens).
    """
    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)

    # The loss also weights the logsumexp, so its cotangent path is checked.
    # (numpy where no program needs it: eager JAX compiles each op per shape)
    w_lse = 0.1 * np.cos(np.arange(do.size // do.shape[-1], dtype=np.float32))

    def loss(fn):
        def f(q, k, v, sinks):
            o, lse = fn(q, k, v, sinks)
            lse_term = jnp.where(jnp.isfinite(lse), lse, 0.0).reshape(-1) * w_lse
            return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(lse_term), (o, lse)

        return f

    # One jit per side: eager mode would compile every small op separately.
    grads, (o, lse) = jax.jit(jax.grad(loss(kernel_fn), argnums=argnums, has_aux=True))(
        q, k, v, sinks
    )
    f32 = lambda x: None if x is None else x.astype(jnp.float32)  # noqa: E731
    rgrads, (ro, rlse) = jax.jit(jax.grad(loss(ref_fn), argnums=argnums, has_aux=True))(
        f32(q), f32(k), f32(v), sinks
    )
    assert o.dtype == q.dtype
    assert not np.isnan(np.asarray(o).astype(np.float32)).any()
    dlse = np.where(np.isfinite(rlse), w_lse.reshape(rlse.shape), np.float32(0.0))
    p = jax.jit(probs_fn)(f32(q), f32(k), sinks)
    mags = attention_magnitudes(
        to_dense(p),
        to_dense(q),
        to_dense(k),
        to_dense(v),
        to_dense(do),
        to_dense(dlse),
        sinks,
        scale,
    )
    rnd = (lambda name: ATTENTION_ROUNDINGS[name]) if dtype == jnp.bfloat16 else (lambda name: 0)
    low = jnp.dtype(dtype)
    assert_close(
        o, ro, dtype=low, magnitude=from_dense(mags["out"]), roundings=rnd("out"), what="out"
    )
    # f32 logsumexp: exp-sum and log in another order, relative to |lse| + 1,
    # the sum over the bf16-rounded P (see ATTENTION_ROUNDINGS).
    lse_mag = np.where(np.isfinite(rlse), np.abs(np.asarray(rlse)), 0.0) + 1.0
    assert_close(lse, rlse, dtype=low, magnitude=lse_mag, roundings=rnd("lse"), what="lse")
    for name, g, rg in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads):
        assert g.shape == rg.shape and g.dtype == (q.dtype if name != "dsinks" else sinks.dtype)
        mag = mags[name] if name == "dsinks" else from_dense(mags[name])
        assert_close(g, rg, dtype=low, magnitude=mag, roundings=rnd(name), what=name)
    return o, grads


def _eye_v(hkv, skv, b=1):
    """V = identity: attention's output is then its probability matrix."""
    return jnp.broadcast_to(jnp.eye(skv, dtype=jnp.float32), (b, hkv, skv, skv))


def _dense_case(
    *,
    seed=0,
    b=1,
    hq=4,
    hkv=2,
    sq=136,
    skv=136,
    d=64,
    dv=None,
    dtype=jnp.float32,
    causal=False,
    window=(-1, -1),
    softcap=None,
    with_sinks=False,
    segments=None,
    scale=None,
    block_sizes=SMALL,
    interpret=None,
):
    """interpret: None: ON_WAIT where dQ streams (block_sizes.stream_dq), else True."""
    dv = dv or d
    if interpret is None:
        interpret = ON_WAIT if block_sizes is not None and block_sizes.stream_dq else True
    q, k, v, do, sinks = _inputs(seed, b, hq, hkv, sq, skv, d, dv, dtype, with_sinks)
    qs, ks = segments if segments is not None else (None, None)
    kw = dict(
        causal=causal,
        window_size=window,
        softcap=softcap,
        softmax_scale=scale,
        q_segment_ids=qs,
        kv_segment_ids=ks,
    )

    def kern(q, k, v, s):
        return fa.flash_attention(
            q, k, v, sinks=s, config=block_sizes, interpret=interpret, return_lse=True, **kw
        )

    def refn(q, k, v, s):
        return ref.attention_reference(q, k, v, sinks=s, **kw)

    def probs(q, k, s):
        return ref.attention_reference(q, k, _eye_v(hkv, skv, b), sinks=s, **kw)[0]

    eff_scale = scale if scale is not None else 1.0 / math.sqrt(d)
    return _check_all(kern, refn, probs, q, k, v, do, sinks, dtype, eff_scale)


# ---------------------------------------------------------------------------
# Property test over the dense entry.


def _segment_ids(draw, b, sq, skv):
    """Sorted segment ids (packed sequences), some q segments without keys."""
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    n = draw(st.integers(1, 4))
    qs = np.sort(rng.integers(0, n, (b, sq)), axis=1)
    ks = np.sort(rng.integers(0, n, (b, skv)), axis=1)
    if draw(st.booleans()):
        qs[:, -min(5, sq) :] = n + 1  # a segment only queries have: rows see nothing
    return jnp.asarray(qs, jnp.int32), jnp.asarray(ks, jnp.int32)


@st.composite
def dense_cases(draw):
    group = draw(st.sampled_from([1, 2, 4, 8]))
    hkv = draw(st.sampled_from([1, 2])) if group <= 4 else 1
    causal = draw(st.booleans())
    win = draw(st.sampled_from(["none", "left", "both"]))
    window = (-1, -1)
    if win == "left":
        window = (draw(st.integers(0, 80)), -1)
    elif win == "both":
        window = (draw(st.integers(0, 80)), draw(st.integers(0, 40)))
    b = draw(st.sampled_from([1, 2]))
    sq, skv = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    segments = _segment_ids(draw, b, sq, skv) if draw(st.booleans()) else None
    return dict(
        seed=draw(st.integers(0, 2**16)),
        b=b,
        hq=group * hkv,
        hkv=hkv,
        sq=sq,
        skv=skv,
        d=draw(st.sampled_from([64, 128])),
        dtype=draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
        causal=causal,
        window=window,
        softcap=draw(st.sampled_from([None, 5.0])),
        with_sinks=draw(st.booleans()),
        segments=segments,
        scale=draw(st.sampled_from(SCALES)),
        block_sizes=dataclasses.replace(
            draw(st.sampled_from([SMALL, SUBTILED, SLABBED])),
            **DQ_MODES[draw(st.sampled_from(sorted(DQ_MODES)))],
        ),
    )


# 6 draws: the targeted cases below pin each feature (head dims, scales, GQA 8,
# decode, segments, sub-tiles); the draws mix them. Each draw is ~3 compiles
# (~8 CPU-s), the suite's budget is 25 minutes on 2 cores.
@settings(max_examples=6, **HYP)
@given(dense_cases())
def test_dense_matches_reference(case):
    _dense_case(**case)


# ---------------------------------------------------------------------------
# Targeted cases.


# flash-attn takes any multiple of 8 up to 256 (32, 40, 160, 224 are in its own tests).
@pytest.mark.parametrize(
    "d,dv", [(32, 32), (40, 40), (80, 80), (160, 160), (192, 128), (224, 224), (256, 256)]
)
def test_head_dims(d, dv):
    _dense_case(seed=d, hq=2, hkv=1, sq=130, skv=140, d=d, dv=dv, dtype=jnp.bfloat16, causal=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scale", [0.05, 0.3])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused-dq", "dq-kernel"])
def test_softmax_scale_reaches_every_kernel(dtype, scale, fuse):
    # A scale other than 1/sqrt(D), through the forward, dK/dV and dQ kernels
    # (masked and unmasked pairs, GQA, softcap so the scale sits inside tanh),
    # dQ fused into dK/dV's kernel or not.
    _dense_case(
        seed=11,
        hq=4,
        hkv=2,
        sq=200,
        skv=260,
        dtype=dtype,
        causal=True,
        softcap=5.0,
        scale=scale,
        block_sizes=dataclasses.replace(SMALL, fuse_dq=fuse),
    )


# dQ streamed through HBM (kernel_bwd.py: stream_dq), one f32 q block a step,
# over the walks that stress its read/write ordering. name -> (group,
# block_q_bwd, block_kv_bwd, window, sq, skv). Causal 128 x 128 blocks end
# with q blocks n-1, n-2, n-1, n-1: a block read the step after another
# block's write, one step after its own write (the read must wait for it),
# and a block two steps running (kept in its slot). 256-position blocks of
# 128 keys visit each q block from two kv blocks running; a window moves the
# first q block of each kv block; sq > skv leaves the first q blocks without
# a visible key (their dQ is 0: the buffer starts zeroed); blocks of one
# lane chunk add each masked sub-tile's rows at their offset.
STREAMED_WALKS = {
    "read-after-write": (2, 128, 128, (-1, 0), 520, 520),
    "same-block-twice": (4, 256, 128, (-1, 0), 600, 600),
    "window": (2, 128, 256, (200, 0), 700, 700),
    "rows-see-nothing": (2, 128, 128, (-1, 0), 400, 150),
    # one 512-row lane chunk a block: masked pairs run as 128-row sub-tiles
    "sub-tiles": (2, 256, 256, (-1, 0), 600, 600),
}


@pytest.mark.parametrize("walk", sorted(STREAMED_WALKS))
def test_streamed_dq_matches_reference(walk):
    group, bq, bkv, window, sq, skv = STREAMED_WALKS[walk]
    bs = tiling.BlockSizes(
        block_q=128, block_kv=128, block_q_bwd=bq, block_kv_bwd=bkv, sub_block=128, stream_dq=True
    )
    kw = dict(q_len=sq, kv_len=skv, group=group, head_dim=64, head_dim_v=64, itemsize=4)
    plan = tiling.plan(generation="v6e", block_sizes=bs, **kw)
    assert (plan.fuse_dq, plan.stream_dq) == (True, True)
    assert (plan.dkdv.block_pos, plan.dkdv.block_kv) == (bq, bkv)
    _dense_case(
        seed=len(walk),
        hq=group,
        hkv=1,
        sq=sq,
        skv=skv,
        causal=True,
        window=window,
        block_sizes=bs,
    )


@pytest.mark.parametrize("one_core", [True, False], ids=["deferred", "megacore"])
def test_fused_dq_copies_carried_across_kv_heads_land(one_core, monkeypatch):
    # dQ in VMEM goes out a q block at a time through two slots; a kv head's
    # last copies are waited for only where the next head reuses their slots
    # (kernel_bwd.py: defer_dq_waits), the grid's last ones at its last step;
    # on a megacore device each head waits for its own at its end. Under
    # ON_WAIT a copy runs at its wait, so a wait skipped or moved past the
    # slot's next write leaves that block's dQ unwritten or overwritten.
    # 5 q blocks a head (odd: the slots' parity crosses heads), 2 batches x 2
    # kv heads.
    bs = dataclasses.replace(SMALL, fuse_dq=True)
    kw = dict(q_len=600, kv_len=600, group=2, head_dim=64, head_dim_v=64, itemsize=4)
    plan = tiling.plan(generation="v6e", block_sizes=bs, **kw)
    assert (plan.fuse_dq, plan.stream_dq, plan.dkdv.num_q_blocks) == (True, False, 5)
    assert tiling.grid_on_one_core()  # no TPU attached
    monkeypatch.setattr(tiling, "grid_on_one_core", lambda: one_core)
    _causal_on_wait_two_batches_two_kv_heads(7, 600, bs)


def _causal_on_wait_two_batches_two_kv_heads(seed, t, block_sizes):
    """A causal case over 2 batches x 2 kv heads (2 query heads each), every
    copy run at its wait with race detection: where copies carried from one
    grid step to the next cross a head and a batch."""
    _dense_case(
        seed=seed,
        b=2,
        hq=4,
        hkv=2,
        sq=t,
        skv=t,
        d=64,
        causal=True,
        block_sizes=block_sizes,
        interpret=pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True),
    )


@pytest.mark.parametrize("block_kv", [1024, 512], ids=["two-q-blocks-a-kv-block", "one"])
def test_fused_dq_written_inside_the_diagonal_pipelines_lands(block_kv):
    # Causal over whole blocks, 512-row dK/dV blocks of 1024 or 512 keys:
    # each kv block's first step writes the dQ of the q blocks the walk has
    # finished inside its diagonal pair's pipeline, and a head's first step
    # the last head's last ones (kernel_bwd.py: dq_writes_in_pipeline). 2
    # batches x 2 kv heads: the carried blocks cross a head and a batch.
    # Under ON_WAIT with race detection, a block written to another head's
    # or block's rows, or a slot filled before its copy ran, fails.
    bs = tiling.BlockSizes(
        block_q=512, block_kv=1024, block_q_bwd=512, block_kv_bwd=block_kv, max_rows=4096
    )
    kw = dict(q_len=2048, kv_len=2048, group=2, head_dim=64, head_dim_v=64, itemsize=4)
    plan = tiling.plan(generation="v6e", block_sizes=bs, **kw)
    got = (plan.fuse_dq, plan.stream_dq, plan.own_delta, plan.dkdv.num_q_blocks)
    assert got == (True, False, True, 4) and plan.dkdv.num_kv_blocks == 2048 // block_kv
    assert tiling.grid_on_one_core()  # no TPU attached: the deferred waits
    _causal_on_wait_two_batches_two_kv_heads(11, 2048, bs)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_slabs_match_reference(causal):
    # 300 keys: two full kv blocks and a masked tail; the slab loop must be
    # the path the fully visible pairs take (16 positions x 4 heads a step).
    plan = tiling.plan(
        generation="v6e",
        q_len=300,
        kv_len=300,
        group=4,
        head_dim=64,
        head_dim_v=64,
        itemsize=4,
        block_sizes=SLABBED,
    )
    assert tiling.slab(plan.fwd, plan.slab_rows, 4) == 16
    _dense_case(seed=5, hq=8, hkv=2, sq=300, skv=300, d=64, causal=causal, block_sizes=SLABBED)


# The forward's fully visible pairs run in lane chunks (tiling.fwd_chunk_lanes)
# through a two-buffer pipeline: chunks made of several heads' units, chunks
# inside one head's unit, and units of one head a chunk. (group, block_q,
# block_kv, slab_rows) -> (positions a unit, query rows a chunk, chunks a
# unit). Sub-tiles as large as the blocks are none: the unit is the block.
CHUNK_LAYOUTS = {
    "heads-in-a-chunk": ((8, 256, 128, 1024), (128, 512, 2)),
    "chunks-in-a-head": ((1, 1024, 1024, 0), (1024, 512, 2)),
    "a-head-a-chunk": ((2, 512, 512, 0), (512, 512, 2)),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", sorted(CHUNK_LAYOUTS))
def test_forward_chunk_layouts_match_reference(layout, dtype):
    (group, block_q, block_kv, slab_rows), want = CHUNK_LAYOUTS[layout]
    bs = tiling.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_q_bwd=128,
        block_kv_bwd=128,
        max_rows=4096,
        sub_block=block_kv,
        slab_rows=slab_rows,
    )
    t = 2 * block_q + 40  # a fully visible pair, the diagonal's, and a ragged tail
    plan = tiling.plan(
        generation="v6e",
        q_len=t,
        kv_len=t,
        group=group,
        head_dim=64,
        head_dim_v=64,
        itemsize=2,
        block_sizes=bs,
    )
    slab = tiling.slab(plan.fwd, plan.slab_rows, group)
    sub = bsched.sub_tiles(plan.fwd, block_kv, eligible=True, rows=slab)
    unit = sub[0] if sub is not None else (slab or plan.fwd.block_pos)
    lanes = tiling.fwd_chunk_lanes(group, unit)
    assert (unit, lanes, group * unit // lanes) == want
    _dense_case(
        seed=len(layout),
        hq=group,
        hkv=1,
        sq=t,
        skv=t,
        d=64,
        dtype=dtype,
        causal=True,
        block_sizes=bs,
    )


# The dK/dV kernel's fully visible pairs run the same two-buffer pipeline over
# lane chunks of query rows, with dQ fused in (tiling.Plan.fuse_dq) or not.
# (group, block_q_bwd) -> (query rows a chunk, chunks a block): four chunks,
# so the pipeline's fori_loop runs with a traced step.
BWD_CHUNK_LAYOUTS = {
    "heads-in-a-chunk": ((16, 128), (512, 4)),
    "chunks-in-a-head": ((2, 1024), (512, 4)),
    "a-head-a-chunk": ((4, 512), (512, 4)),
}


@pytest.mark.parametrize("fuse", [True, False], ids=["fused-dq", "dq-kernel"])
@pytest.mark.parametrize("layout", sorted(BWD_CHUNK_LAYOUTS))
def test_backward_chunk_layouts_match_reference(layout, fuse):
    (group, block_q_bwd), want = BWD_CHUNK_LAYOUTS[layout]
    bs = tiling.BlockSizes(
        block_q=128,
        block_kv=128,
        block_q_bwd=block_q_bwd,
        block_kv_bwd=min(256, block_q_bwd),  # q block 1 sees all of kv block 0
        max_rows=4096,
        sub_block=256,
        fuse_dq=fuse,
    )
    t = 2 * block_q_bwd + 40  # a fully visible pair, the diagonal's, and ragged tails
    kw = dict(q_len=t, kv_len=t, group=group, head_dim=64, head_dim_v=64, itemsize=4)
    plan = tiling.plan(generation="v6e", block_sizes=bs, **kw)
    assert plan.fuse_dq == fuse
    lanes = tiling.fwd_chunk_lanes(group, plan.dkdv.block_pos)
    assert (lanes, plan.dkdv.rows // lanes) == want
    q = jax.ShapeDtypeStruct((1, group, t, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 1, t, 64), jnp.float32)
    grad = jax.grad(
        lambda q, k, v: jnp.sum(
            fa.flash_attention(q, k, v, causal=True, config=bs, interpret=True)
        ),
        argnums=(0, 1, 2),
    )
    launches = str(jax.make_jaxpr(grad)(q, kv, kv))
    assert ("flash_attention_dq" in launches) == (not fuse)
    _dense_case(
        seed=len(layout),
        hq=group,
        hkv=1,
        sq=t,
        skv=t,
        d=64,
        dtype=jnp.float32,
        causal=True,
        block_sizes=bs,
    )


# Masked pairs of dense calls (the diagonal, window edges, tails) run the
# full pairs' pipelines once per key sub-tile range their rows can see, the
# mask applied (kernel_fwd.py and kernel_bwd.py: masked_pair). name ->
# (group, block_q, block_kv, sub_block, window, sq, skv) and what the plan
# must give: (forward lanes a chunk, chunks a state unit; dK/dV lanes a
# chunk, chunks a block). Windows leave rows that see nothing in a unit's
# first key range; sq < skv puts the diagonal off the block grid; all have
# ragged tails. With 256-key ranges (the tables' size) and 512-position dK/dV
# blocks, the block's later rows see a key range its first sub-tile rows do
# not (the forward's unit there is one lane chunk: sub-tiles). Three heads:
# an odd count of chunks a unit and a block, which run one pipeline per key
# range (the forward's masked_range, the dK/dV kernel's). The forward
# scores a unit's next key range while it updates this one, two ranges a
# loop trip and the one or two left after it: 512-key blocks of 128-key
# ranges give units 1 to 4 ranges (the diagonal of a causal call; 3 at most
# in a 200-key window).
MASKED_PIPELINES = {
    "heads-in-a-chunk-window": ((8, 256, 512, 128, (200, 0), 552, 552), (512, 2, 512, 2)),
    "heads-in-a-chunk-causal": ((8, 256, 512, 128, (-1, 0), 552, 552), (512, 2, 512, 2)),
    "a-head-a-chunk-offset": ((2, 512, 1024, 512, (-1, 0), 1064, 2088), (512, 2, 512, 2)),
    "a-head-a-chunk-256-key-ranges": (
        (2, 512, 1024, 256, (-1, 0), 1064, 2088),
        (512, 1, 512, 2),
    ),
    "three-heads-odd-chunks": ((3, 512, 512, 256, (-1, 0), 1064, 1064), (256, 3, 512, 3)),
    # Whole blocks, q block = kv block: every masked pair is a diagonal one,
    # and the forward runs it as one pipeline of growing key spans, a static
    # triangle on each unit's last range (kernel_fwd.py: diagonal_pair):
    # units of 128 rows of 8 heads (a chunk holds 4 heads' units, one
    # diagonal pair), and 256 rows of 4 heads (2 a chunk) with the diagonal
    # a block off (sq < skv). The dK/dV kernel does the same with each key
    # range's rows from its diagonal on (kernel_bwd.py: diagonal_pair), a
    # head's block one lane chunk (4 heads) or two (2 heads: the range's
    # rows start mid-chunk, and its last chunk is narrower); 512-row blocks
    # of 1024 keys put a pair's first row 0 or 512 positions past its first
    # key (two static variants). A window of more than two blocks leaves the
    # diagonal pairs whole triangles: they take these pipelines, and the
    # pairs its far edge cuts the diagonal's mirror in the dK/dV kernel (one
    # static variant per offset: 2 at 512 x 512, 3 at 512 x 1024 with a
    # (1700, 0) window), in the forward where the window is whole kv blocks
    # (1024 keys here), else the masked-range pipelines.
    "diagonal-heads-in-a-chunk": ((8, 512, 512, 128, (-1, 0), 512, 512), (512, 2, 512, 4)),
    "diagonal-offset": ((4, 512, 512, 256, (-1, 0), 512, 1024), (512, 2, 512, 4)),
    "diagonal-two-chunks-a-head": ((2, 1024, 1024, 256, (-1, 0), 2048, 2048), (512, 1, 512, 4)),
    "diagonal-two-offsets": ((4, 512, 1024, 256, (-1, 0), 1024, 1024), (512, 2, 512, 4)),
    "diagonal-and-window-edge": ((4, 512, 512, 256, (1100, 0), 2048, 2048), (512, 2, 512, 4)),
    "diagonal-and-window-of-whole-blocks": (
        (4, 512, 512, 256, (1023, 0), 2048, 2048),
        (512, 2, 512, 4),
    ),
    "diagonal-two-offsets-and-window-edge": (
        (2, 512, 1024, 256, (1700, 0), 3072, 3072),
        (512, 1, 512, 2),
    ),
}


@pytest.mark.parametrize("case", sorted(MASKED_PIPELINES))
def test_masked_pair_pipelines_match_reference(case):
    (group, bq, bkv, sub_block, window, sq, skv), want = MASKED_PIPELINES[case]
    bs = tiling.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_q_bwd=bq // 2 if group == 8 else bq,
        block_kv_bwd=bkv,
        max_rows=4096,
        sub_block=sub_block,
    )
    kw = dict(q_len=sq, kv_len=skv, group=group, head_dim=64, head_dim_v=64, itemsize=4)
    plan = tiling.plan(generation="v6e", block_sizes=bs, **kw)
    fwd_sub = bsched.sub_tiles(plan.fwd, sub_block, eligible=True)
    bwd_sub = bsched.sub_tiles(plan.dkdv, sub_block, eligible=True)
    assert fwd_sub is not None and bwd_sub is not None
    lanes = tiling.fwd_chunk_lanes(group, fwd_sub[0])
    blanes = tiling.fwd_chunk_lanes(group, plan.dkdv.block_pos)
    got = (lanes, group * fwd_sub[0] // lanes, blanes, plan.dkdv.rows // blanes)
    assert got == want
    _dense_case(
        seed=len(case),
        hq=group,
        hkv=1,
        sq=sq,
        skv=skv,
        d=64,
        dtype=jnp.float32,
        window=window,
        block_sizes=bs,
    )


def test_plan_fuses_dq_in_vmem_while_the_kv_heads_dq_fits_else_streams_it():
    # Dense calls pipeline every pair over 512-row lane chunks, so a dK/dV
    # step holds a chunk's temporaries; segmented (varlen) calls hold the
    # whole block's in their masked pairs. dQ stays in VMEM while the kv
    # head's fits beside the rest, else streams through HBM (three q block
    # slots), before any block shrinks: tpu7x keeps 1024-key blocks from 16k.
    kw = dict(group=4, head_dim=128, head_dim_v=128, itemsize=2)
    for gen, t, segmented, stream, own, bkv in (
        ("v6e", 8192, False, False, True, 1024),
        ("v6e", 32768, False, False, True, 1024),
        ("v6e", 32768, True, True, True, 1024),
        ("tpu7x", 8192, False, False, True, 1024),
        # O's blocks and delta rows do not fit beside dQ; 1024 keys' whole-block
        # temporaries fit with neither dQ
        ("tpu7x", 8192, True, False, False, 512),
        ("tpu7x", 16384, False, True, True, 1024),
        ("tpu7x", 32768, False, True, True, 1024),
        ("tpu7x", 32768, True, True, True, 512),
    ):
        case = (gen, t, segmented)
        p = tiling.plan(generation=gen, q_len=t, kv_len=t, segmented=segmented, **kw)
        assert (p.fuse_dq, p.stream_dq, p.own_delta, p.dkdv.block_kv) == (
            True,
            stream,
            own,
            bkv,
        ), case
        rows = tiling.dkdv_tile_rows(p.dkdv, p.sub_block, segmented)
        assert (p.dkdv.rows, rows) == (2048, 2048 if segmented else 512), case
        budget = tiling.VMEM_BUDGET_BYTES[gen]

        def need(plan):
            return dict(plan.vmem_needs(4, 128, 128, 2))["dK/dV"]

        assert need(p) <= budget, case
        resident = dataclasses.replace(p, stream_dq=False, own_delta=False)
        assert (need(resident) <= budget) == (not stream), case
        if not own:
            assert need(dataclasses.replace(p, own_delta=True)) > budget, case
        if bkv < 1024:  # the table's 1024 keys fit with no fused dQ at all
            wide = tiling.geometry(512, 1024, q_len=t, kv_len=t, group=4, max_rows=p.dkdv.rows)
            streamed = dataclasses.replace(p, dkdv=wide, stream_dq=True, own_delta=False)
            assert need(streamed) > budget, case


def test_v6e_d256_backward_takes_1024_positions_while_dq_stays_in_vmem():
    # bwd_resident: the table's (1024 positions, 4096 rows) dK/dV blocks
    # where the kv head's dQ and delta stay in VMEM beside them, else the
    # entry's 512 x 1024 with dQ in VMEM (16k at 32/8 heads) or streamed.
    for group, t, pos, stream in (
        (4, 2048, 1024, False),
        (4, 8192, 1024, False),
        (4, 16384, 512, False),
        (4, 32768, 512, True),
        (8, 4096, 512, False),
        (8, 8192, 256, False),
    ):
        kw = dict(group=group, head_dim=256, head_dim_v=256, itemsize=2)
        p = tiling.plan(generation="v6e", q_len=t, kv_len=t, **kw)
        case = (group, t)
        assert (p.fuse_dq, p.stream_dq, p.dkdv.block_pos, p.dkdv.block_kv) == (
            True,
            stream,
            pos,
            1024,
        ), case
        entry = tiling.BLOCK_TABLE[("v6e", tiling.regime(t), 256)]
        own = dataclasses.replace(entry, bwd_resident=())
        assert p.fwd == tiling.plan(generation="v6e", q_len=t, kv_len=t, block_sizes=own, **kw).fwd
        if pos == 512 and group == 4:  # the resident blocks did not fit
            big = tiling.geometry(1024, 1024, q_len=t, kv_len=t, group=group, max_rows=4096)
            resident = dataclasses.replace(p, dkdv=big, dq=big, stream_dq=False, own_delta=False)
            need = dict(resident.vmem_needs(group, 256, 256, 2))
            assert need["dK/dV"] > tiling.VMEM_BUDGET_BYTES["v6e"], case
    # explicit block sizes take it too; () keeps their own
    bs = tiling.BlockSizes(1024, 1024, 512, 1024, bwd_resident=(1024, 4096))
    kw = dict(q_len=4096, kv_len=4096, group=4, head_dim=256, head_dim_v=256, itemsize=2)
    assert tiling.plan(generation="v6e", block_sizes=bs, **kw).dkdv.block_pos == 1024
    bs = dataclasses.replace(bs, bwd_resident=())
    assert tiling.plan(generation="v6e", block_sizes=bs, **kw).dkdv.block_pos == 512


def test_short_head_dims_reach_the_kernels_with_their_minor_axes_swapped():
    # A TPU keeps an array whose minor dim is under 128 positions-minor; the
    # kernels take such q/k/v-side arrays as (..., D, positions), a bitcast of
    # that layout (test_compile_gate.py compiles one and finds no copy).
    # Decode's rows interleave positions and heads, and D >= 128 stays row-major.
    assert kernel_fwd.swapped_layout(64, 64, seq_major=False)
    assert kernel_fwd.swapped_layout(96, 40, seq_major=False)
    assert not kernel_fwd.swapped_layout(128, 128, seq_major=False)
    assert not kernel_fwd.swapped_layout(64, 192, seq_major=False)
    assert not kernel_fwd.swapped_layout(64, 64, seq_major=True)

    def launches(d, sq):
        q = jax.ShapeDtypeStruct((1, 4, sq, d), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, 2, 384, d), jnp.bfloat16)
        loss = lambda q, k, v: jnp.sum(  # noqa: E731
            fa.flash_attention(q, k, v, causal=True, config="v6e").astype(jnp.float32)
        )
        out = {}
        for eqn in pallas_eqns(jax.grad(loss, argnums=(0, 1, 2)), (q, kv, kv)):
            info = eqn.params.get("name_and_src_info")
            name = getattr(info, "name", None) or eqn.params.get("name")
            n = eqn.params["grid_mapping"].num_index_operands  # scalar prefetch first
            out[name] = [tuple(v.aval.shape) for v in eqn.invars[n : n + 4]]
        return out

    # q (B, Hkv, G, D, T), k and v (B, Hkv, D, Skv), then dO or O
    got = launches(64, 384)
    assert set(got) == {"flash_attention_fwd", "flash_attention_dkdv"}
    assert got["flash_attention_fwd"][:3] == [(1, 2, 2, 64, 384), (1, 2, 64, 384), (1, 2, 64, 384)]
    assert got["flash_attention_dkdv"][:4] == [
        (1, 2, 2, 64, 384),
        (1, 2, 64, 384),
        (1, 2, 64, 384),
        (1, 2, 2, 64, 384),
    ]
    assert launches(128, 384)["flash_attention_fwd"][0] == (1, 2, 2, 384, 128)


def test_calls_with_segments_plan_whole_block_temporaries(monkeypatch):
    # Segment ids and varlen's positions make masked pairs whole-block tiles:
    # a plan that counted a chunk's temporaries there would fuse dQ where
    # Mosaic runs out of VMEM (tpu7x 16k: 46.8 of 48 MiB counted, ~18 more held).
    seen = []
    plan = tiling.plan
    monkeypatch.setattr(tiling, "plan", lambda **kw: seen.append(kw["segmented"]) or plan(**kw))
    t, hq, hkv, d = 256, 4, 2, 64
    q = jax.ShapeDtypeStruct((1, hq, t, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, hkv, t, d), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32)
    jax.eval_shape(lambda q, k, v: fa.flash_attention(q, k, v, causal=True), q, kv, kv)
    jax.eval_shape(
        lambda q, k, v, s: fa.flash_attention(q, k, v, q_segment_ids=s, kv_segment_ids=s),
        q,
        kv,
        kv,
        seg,
    )
    qv = jax.ShapeDtypeStruct((t, hq, d), jnp.bfloat16)
    kvv = jax.ShapeDtypeStruct((t, hkv, d), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)
    jax.eval_shape(
        lambda q, k, v, c: fa.flash_attention_varlen(q, k, v, c, c, t, t, causal=True),
        qv,
        kvv,
        kvv,
        cu,
    )
    assert seen == [False, True, True]


def test_dkdv_tile_rows_follow_the_kernels_paths():
    # Blocks that a 512-row chunk does not cut, and the decode layout, run
    # masked pairs as one whole-block tile (kernel_bwd.py, _run_pair).
    def rows(q_len, group, segmented=False, block_q=512, block_kv=512):
        geom = tiling.geometry(
            block_q, block_kv, q_len=q_len, kv_len=max(q_len, 4096), group=group, max_rows=2048
        )
        return geom.rows, tiling.dkdv_tile_rows(geom, 256, segmented)

    assert rows(4096, 4) == (2048, 512)
    assert rows(4096, 4, segmented=True) == (2048, 2048)
    assert rows(4096, 1) == (512, 512)  # one chunk: the block
    assert rows(256, 4, block_q=256, block_kv=256) == (1024, 1024)  # no sub-tiles
    assert rows(16, 8) == (128, 128)  # decode layout


def test_full_pairs_keep_the_running_maximum_in_logit_units():
    # The fully visible pairs fold the softmax scale into exp2 and compare raw
    # scores' maxima, scaled, with the state the masked pairs keep in logit
    # units. Logits ~40x the usual: a maximum left unscaled (8x too large at
    # D = 64) would underflow every probability of the row to 0.
    t, d = 256, 64
    rng = np.random.default_rng(3)
    q = 40.0 * rng.standard_normal((1, 4, t, d))
    k, v = rng.standard_normal((2, 1, 1, t, d))
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    o, lse = fa.flash_attention(q, k, v, causal=True, config=SMALL, interpret=True, return_lse=True)
    ro, rlse = ref.attention_reference(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rlse), rtol=1e-5)


def test_gqa_8_causal_cross_lengths_f32():
    # Sq > Skv: bottom-right alignment leaves the first rows with no key.
    o, grads = _dense_case(hq=8, hkv=1, sq=150, skv=100, causal=True)
    np.testing.assert_array_equal(np.asarray(o[:, :, :50]), 0.0)
    np.testing.assert_array_equal(np.asarray(grads[0][:, :, :50]), 0.0)


def test_masked_keys_with_the_largest_logits_stay_out_of_the_maximum():
    # Future keys whose logits exceed every visible one by up to ~340: a
    # running maximum that let them in would underflow every visible
    # probability to 0 (the masked p themselves are zeroed either way).
    t, d = 136, 64
    rng = np.random.default_rng(0)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    q = u + 0.1 * rng.standard_normal((1, 4, t, d))
    k = (1.0 + 20.0 * np.arange(t)[:, None]) * u + 0.1 * rng.standard_normal((1, 1, t, d))
    v = rng.standard_normal((1, 1, t, d))
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    o, lse = fa.flash_attention(q, k, v, causal=True, config=SMALL, interpret=True, return_lse=True)
    ro, rlse = ref.attention_reference(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rlse), rtol=1e-5)


def test_decode_single_token_long_kv():
    _dense_case(hq=8, hkv=2, sq=1, skv=300, causal=True, dtype=jnp.bfloat16)


def test_decode_layout_multiple_row_blocks_with_sinks():
    # Decode layout, rows = Sq * G = 600 split in 128-row blocks; G = 6 does
    # not divide the block, so sinks must follow the global row's head.
    bs = tiling.BlockSizes(block_q=16, block_kv=128, block_q_bwd=16, block_kv_bwd=128)
    _dense_case(
        hq=6, hkv=1, sq=100, skv=170, causal=True, window=(60, -1), with_sinks=True, block_sizes=bs
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_segment_ids_no_cross_attention(dtype):
    b, sq, skv = 2, 140, 150
    rng = np.random.default_rng(0)
    qs = jnp.asarray(np.sort(rng.integers(0, 4, (b, sq)), axis=1), jnp.int32)
    ks = jnp.asarray(np.sort(rng.integers(0, 4, (b, skv)), axis=1), jnp.int32)
    # Segment 5 exists only in q: those rows must output exactly 0.
    qs = qs.at[:, -7:].set(5)
    o, grads = _dense_case(
        b=b,
        sq=sq,
        skv=skv,
        causal=True,
        segments=(qs, ks),
        with_sinks=False,
        dtype=dtype,
        scale=0.3,
    )
    np.testing.assert_array_equal(np.asarray(o[:, :, -7:], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(grads[0][:, :, -7:], np.float32), 0.0)


def test_f16_inputs():
    _dense_case(sq=140, skv=140, dtype=jnp.float16, causal=True, softcap=10.0)


def test_default_block_sizes_single_block():
    # Table block sizes (512) exceed these lengths: one ragged block each.
    _dense_case(hq=4, hkv=1, sq=200, skv=300, causal=True, block_sizes=None)


# ---------------------------------------------------------------------------
# Varlen.


def _lengths(draw, n, hi):
    return draw(st.lists(st.integers(0, hi), min_size=n, max_size=n))


@st.composite
def varlen_cases(draw):
    # A few sequences up to 70 tokens, or many (10-30) short ones, some empty.
    n = draw(st.sampled_from([1, 3, 4, 12, 30]))
    hi = 70 if n <= 4 else 24
    lq, lk = _lengths(draw, n, hi), _lengths(draw, n, hi)
    if sum(lq) == 0:
        lq[0] = 1
    if sum(lk) == 0:
        lk[-1] = 1
    group = draw(st.sampled_from([1, 2, 4]))
    win = draw(st.sampled_from([(-1, -1), (16, -1), (20, 4)]))
    return dict(
        lq=lq,
        lk=lk,
        group=group,
        causal=draw(st.booleans()),
        window=win,
        with_sinks=draw(st.booleans()),
        scale=draw(st.sampled_from(SCALES)),
        softcap=draw(st.sampled_from([None, 5.0])),
        dtype=draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
    )


def _packed_mask(lq, lk, causal, window):
    """[Tq, Tk] visibility of packed tokens: the reference's per-sequence masks on the diagonal."""
    cq, ck = np.cumsum([0, *lq]), np.cumsum([0, *lk])
    m = np.zeros((cq[-1], ck[-1]), bool)
    for s in range(len(lq)):
        if lq[s] and lk[s]:
            m[cq[s] : cq[s + 1], ck[s] : ck[s + 1]] = np.asarray(
                ref.visibility_mask(lq[s], lk[s], causal=causal, window_size=window)
            )[0]
    return m


def _packed_reference(q, k, v, mask, *, sinks=None, softmax_scale=None, softcap=None, probs=False):
    """attention_reference's f32 math over all packed tokens at once, one [Tq, Tk]
    mask (one XLA program, where a per-sequence loop compiles one per sequence).

    q [Tq, Hq, D], k/v [Tk, Hkv, D] -> (out [Tq, Hq, Dv], lse [Hq, Tq]), or with
    probs=True the probabilities [Tq, Hq, Tk].
    """
    hq, d = q.shape[1], q.shape[2]
    grp = hq // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qf = q.astype(jnp.float32)
    kf = jnp.repeat(k.astype(jnp.float32), grp, axis=1)
    s = jnp.einsum("qhd,khd->hqk", qf, kf, precision="highest") * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    mask = jnp.asarray(mask)[None]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks.astype(jnp.float32)[:, None, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sinks.astype(jnp.float32)[:, None, None] - m)
    empty = denom == 0.0
    safe = jnp.where(empty, 1.0, denom)
    if probs:
        return jnp.swapaxes(p / safe, 0, 1)
    vf = jnp.repeat(v.astype(jnp.float32), grp, axis=1)
    out = jnp.einsum("hqk,khd->qhd", p / safe, vf, precision="highest")
    return out, jnp.where(empty, jnp.inf, m + jnp.log(safe))[..., 0]


def test_packed_reference_matches_the_per_sequence_reference():
    lq, lk = [5, 0, 9, 3], [7, 4, 0, 11]
    q = jax.random.normal(jax.random.PRNGKey(1), (sum(lq), 4, 64))
    k = jax.random.normal(jax.random.PRNGKey(2), (sum(lk), 2, 64))
    v = jax.random.normal(jax.random.PRNGKey(3), (sum(lk), 2, 64))
    sinks = jnp.asarray([0.5, -1.0, 0.0, 2.0])
    kw = dict(causal=True, window_size=(3, -1))
    cq, ck = np.cumsum([0, *lq]), np.cumsum([0, *lk])
    want = ref.attention_reference_varlen(q, k, v, cq, ck, sinks=sinks, softcap=4.0, **kw)
    got = _packed_reference(
        q,
        k,
        v,
        _packed_mask(lq, lk, **{"causal": True, "window": (3, -1)}),
        sinks=sinks,
        softcap=4.0,
    )
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def _varlen_case(
    lq,
    lk,
    group=2,
    causal=True,
    window=(-1, -1),
    with_sinks=False,
    dtype=jnp.float32,
    d=64,
    scale=None,
    softcap=None,
    block_sizes=SMALL,
):
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    tq, tk, hkv = int(cq[-1]), int(ck[-1]), 2
    hq = group * hkv
    q, k, v, do, sinks = _inputs(tq + 7 * tk, 1, hq, hkv, tq, tk, d, d, dtype, with_sinks)
    q, k, v = (x[0].transpose(1, 0, 2) for x in (q, k, v))
    do = do[0].transpose(1, 0, 2)
    kw = dict(causal=causal, window_size=window, softmax_scale=scale, softcap=softcap)

    def kern(q, k, v, s):
        return fa.flash_attention_varlen(
            q,
            k,
            v,
            jnp.asarray(cq),
            jnp.asarray(ck),
            max(lq),
            max(lk),
            sinks=s,
            config=block_sizes,
            interpret=True,
            return_lse=True,
            **kw,
        )

    mask = _packed_mask(lq, lk, causal, window)
    rkw = dict(softmax_scale=scale, softcap=softcap)

    def refn(q, k, v, s):
        return _packed_reference(q, k, v, mask, sinks=s, **rkw)

    def probs(q, k, s):
        return _packed_reference(q, k, None, mask, sinks=s, probs=True, **rkw)

    def to_dense(x):  # packed [T, H, ...] (lse: [H, T]) -> [1, H, T, ...]
        return x[None] if x.ndim == 2 else jnp.swapaxes(x, 0, 1)[None]

    def from_dense(x):
        return np.swapaxes(x[0], 0, 1)

    eff_scale = scale if scale is not None else 1.0 / math.sqrt(d)
    o, grads = _check_all(
        kern,
        refn,
        probs,
        q,
        k,
        v,
        do,
        sinks,
        dtype,
        eff_scale,
        to_dense=to_dense,
        from_dense=from_dense,
    )
    # Queries of sequences without keys: exactly zero output and gradient.
    for s in range(len(lq)):
        if lk[s] == 0 and lq[s] > 0:
            np.testing.assert_array_equal(np.asarray(o[cq[s] : cq[s + 1]], np.float32), 0.0)
            np.testing.assert_array_equal(np.asarray(grads[0][cq[s] : cq[s + 1]], np.float32), 0.0)


# 4 draws: the varlen cases below pin empty, single-token and many sequences.
@settings(max_examples=4, **HYP)
@given(varlen_cases())
def test_varlen_matches_reference(case):
    _varlen_case(**case)


def test_varlen_empty_and_single_token_sequences():
    # A sequence with a query but no key, an empty one, a length-1 one, and a
    # long one crossing block boundaries.
    _varlen_case([5, 0, 1, 130, 40], [7, 3, 0, 100, 40], group=4, causal=True, with_sinks=True)


def test_varlen_many_sequences_some_empty():
    # 24 packed sequences crossing several 128-token blocks: empty ones (no
    # query, no key, neither), single tokens, a non-default scale, sinks, bf16.
    rng = np.random.default_rng(5)
    lq = [int(x) for x in rng.integers(0, 30, 24)]
    lk = [int(x) for x in rng.integers(0, 30, 24)]
    lq[3], lk[3] = 0, 9
    lq[7], lk[7] = 6, 0
    lq[11], lk[11] = 0, 0
    lq[15], lk[15] = 1, 1
    _varlen_case(
        lq,
        lk,
        group=2,
        causal=True,
        window=(12, -1),
        with_sinks=True,
        dtype=jnp.bfloat16,
        scale=0.2,
    )


def test_varlen_jit_traced_cu_seqlens():
    cq = jnp.asarray([0, 3, 3, 90], jnp.int32)
    ck = jnp.asarray([0, 5, 20, 150], jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(1), (90, 2, 64), jnp.float32)
    k = jax.random.normal(jax.random.PRNGKey(2), (150, 1, 64), jnp.float32)
    v = jax.random.normal(jax.random.PRNGKey(3), (150, 1, 64), jnp.float32)
    f = jax.jit(
        lambda q, k, v, cq, ck: fa.flash_attention_varlen(
            q, k, v, cq, ck, 87, 130, causal=True, config=SMALL, interpret=True
        )
    )
    out = f(q, k, v, cq, ck)
    expected, _ = ref.attention_reference_varlen(
        q, k, v, np.asarray(cq), np.asarray(ck), causal=True
    )
    eye = jnp.broadcast_to(jnp.eye(150, dtype=jnp.float32)[:, None, :], (150, 1, 150))
    p, _ = ref.attention_reference_varlen(q, k, eye, np.asarray(cq), np.asarray(ck), causal=True)
    mag = jnp.einsum("qhk,khd->qhd", p, jnp.abs(jnp.repeat(v, 2, axis=1)), precision="highest")
    assert_close(out, expected, magnitude=mag, what="out")


# ---------------------------------------------------------------------------
# Block schedule structure.


def _token_mask(geom, group, q_offset, causal, window, seq_major):
    rows = np.arange(geom.q_rows_total)
    pos = rows // group + q_offset if seq_major else rows + q_offset
    kj = np.arange(geom.kv_len)
    m = np.ones((len(rows), len(kj)), bool)
    left, right = window
    if causal:
        m &= kj[None] <= pos[:, None]
    if left >= 0:
        m &= kj[None] >= pos[:, None] - left
    if right >= 0:
        m &= kj[None] <= pos[:, None] + right
    return m


def _visible_blocks(geom, group, q_offset, causal, window, seq_major):
    """Brute-force: which (q block, kv block) pairs have a visible entry."""
    m = _token_mask(geom, group, q_offset, causal, window, seq_major)
    nq, nk = geom.num_q_blocks, geom.num_kv_blocks
    vis = np.zeros((nq, nk), bool)
    full = np.zeros((nq, nk), bool)
    for i in range(nq):
        for j in range(nk):
            blk = m[
                i * geom.block_pos : (i + 1) * geom.block_pos,
                j * geom.block_kv : (j + 1) * geom.block_kv,
            ]
            vis[i, j] = blk.any()
            full[i, j] = blk.all() and blk.shape == (geom.block_pos, geom.block_kv)
    return vis, full


@pytest.mark.parametrize(
    "sq,skv,group,causal,window,block_q",
    [
        (1000, 1000, 1, True, (-1, -1), 128),
        (700, 1300, 4, True, (200, -1), 128),
        (1300, 700, 2, True, (-1, -1), 256),
        (900, 900, 1, False, (100, 50), 128),
        (900, 900, 1, False, (-1, -1), 128),
        (60, 1000, 4, True, (300, -1), 16),  # decode layout
    ],
)
def test_schedule_visits_exactly_visible_pairs(sq, skv, group, causal, window, block_q):
    geom = tiling.geometry(block_q, 128, q_len=sq, kv_len=skv, group=group, max_rows=4096)
    q_offset = skv - sq
    vis, full = _visible_blocks(geom, group, q_offset, causal, window, geom.seq_major)
    kw = dict(
        q_offset=q_offset,
        group=group,
        causal=causal,
        left=window[0],
        right=window[1],
        segmented=False,
    )
    rows_sched, cols_sched = bsched.dense_schedules(geom, geom, **kw)
    for sched, q_major in ((rows_sched, True), (cols_sched, False)):
        outer, inner, flags = bsched.decode_word(sched)
        qi, kj = (outer, inner) if q_major else (inner, outer)
        comp = (flags & bsched.COMPUTE) != 0
        got = np.zeros_like(vis)
        got[qi[comp], kj[comp]] = True
        np.testing.assert_array_equal(got, vis)
        assert comp.sum() == vis.sum()  # no pair twice
        masked = (flags & bsched.MASK) != 0
        np.testing.assert_array_equal(masked[comp], ~full[qi[comp], kj[comp]])
        # Every outer block initialises and finalises exactly once, in order.
        n_outer = geom.num_q_blocks if q_major else geom.num_kv_blocks
        assert np.array_equal(outer[(flags & bsched.INIT) != 0], np.arange(n_outer))
        assert np.array_equal(outer[(flags & bsched.FINAL) != 0], np.arange(n_outer))
        assert np.all(np.diff(outer) >= 0)
        _assert_first_visits(qi, flags, q_major)
    _assert_o_blocks(cols_sched)


def _assert_o_blocks(words, xp=np):
    """o_blocks: at every FIRST step (where dK/dV reads O) O's block is that
    step's q block, and it changes only where a later FIRST step needs
    another, so each q block's O is copied once."""
    words = np.asarray(words)
    o = np.asarray(bsched.o_blocks(xp.asarray(words), xp=xp))
    assert o.shape == words.shape
    _, qi, flags = bsched.decode_word(words)
    first = (flags & bsched.FIRST) != 0
    np.testing.assert_array_equal(o[first], qi[first])
    assert np.count_nonzero(np.diff(o)) <= max(np.count_nonzero(first) - 1, 0)


def _assert_first_visits(qi, flags, q_major):
    """FIRST marks each q block's first computed step of the kv-major walk
    (where dK/dV derives its delta, read by every later step), and nothing else."""
    first = (flags & bsched.FIRST) != 0
    if q_major:
        assert not first.any()
        return
    comp = np.flatnonzero((flags & bsched.COMPUTE) != 0)
    want = np.zeros_like(first)
    _, at = np.unique(qi[comp], return_index=True)
    want[comp[at]] = True
    np.testing.assert_array_equal(first, want)


@pytest.mark.parametrize(
    "sq,skv,causal,window,block,sub",
    [
        (1000, 1000, True, (-1, -1), 512, 128),
        (700, 1300, True, (200, -1), 512, 256),
        (1300, 700, True, (-1, -1), 256, 128),
        (900, 900, False, (100, 50), 512, 128),
    ],
)
def test_sub_tiles_cover_exactly_the_visible_ones(sq, skv, causal, window, block, sub):
    geom = tiling.geometry(block, block, q_len=sq, kv_len=skv, group=1, max_rows=4096)
    tiles = bsched.sub_tiles(geom, sub, eligible=True)
    assert tiles == (sub, sub)
    m = _token_mask(geom, 1, skv - sq, causal, window, False)
    left, right = bsched._dense_band(window[0], window[1], causal)
    for i in range(geom.num_q_blocks):
        for j in range(geom.num_kv_blocks):
            for a in range(block // sub):
                lo, hi = bsched.chunk_bounds(
                    i, j, a, geom=geom, sub=tiles, q_offset=skv - sq, left=left, right=right
                )
                r0 = i * block + a * sub
                want = [
                    c
                    for c in range(block // sub)
                    if m[r0 : r0 + sub, j * block + c * sub : j * block + (c + 1) * sub].any()
                ]
                assert list(range(int(lo), int(hi))) == want, (i, j, a)


def _issued_over_useful(t, d, generation, group=4):
    plan = tiling.plan(
        generation=generation, q_len=t, kv_len=t, group=group, head_dim=d, head_dim_v=d, itemsize=2
    )
    kw = dict(q_offset=0, group=group, causal=True, left=-1, right=-1, segmented=False)
    (fwd,) = bsched.dense_schedules(plan.fwd, None, **kw)
    dq, dkdv = bsched.dense_schedules(plan.dq, plan.dkdv, **kw)
    useful = 2 * group * (t * (t + 1) // 2) * (d + d)  # 2 matmuls over visible entries

    def issued(sched, geom, q_major, slab=None):
        sub = bsched.sub_tiles(geom, plan.sub_block, eligible=True, rows=slab)
        return bsched.mxu_work(sched, geom, d, d, group, q_major=q_major, sub=sub, causal=True)

    slab = tiling.slab(plan.fwd, plan.slab_rows, group)
    return {
        "fwd": issued(fwd, plan.fwd, True, slab) / useful,
        "dq": issued(dq, plan.dq, True) / useful,
        "dkdv": issued(dkdv, plan.dkdv, False) / useful,
        "fwd_steps": len(fwd),
        "plan": plan,
    }


def test_causal_grid_visits_only_lower_triangle_v6e():
    r = _issued_over_useful(8192, 128, "v6e")
    assert r["plan"].fwd.block_pos == 1024 and r["plan"].fwd.block_kv == 1024
    # Lower-triangle block pairs only: q block i sees kv blocks 0..i.
    assert r["fwd_steps"] == sum(i + 1 for i in range(8))
    for kernel in ("fwd", "dq", "dkdv"):
        # Whole 512-key diagonal blocks would give 17/16 = 1.0625 (the forward's
        # 1024-position blocks 9/8); 256-key sub-tiles cut the diagonal's waste.
        assert r[kernel] <= 1.04, (kernel, r[kernel])


_RNG_SEQ = np.random.default_rng(9)
MANY_Q = [int(x) for x in _RNG_SEQ.integers(0, 60, 25)]
MANY_K = [int(x) for x in _RNG_SEQ.integers(0, 60, 25)]


@pytest.mark.parametrize(
    "lq,lk",
    [([5, 0, 1, 300, 40, 129], [7, 3, 0, 250, 400, 129]), (MANY_Q, MANY_K)],
    ids=["long", "many"],
)
def test_varlen_schedule_bound_and_coverage(lq, lk):
    """Data-dependent schedules: every visible (q block, kv block) pair is computed,
    once, and nothing outside each q block's hull of visible kv blocks is; the
    static schedule length is the documented bound."""
    cq = jnp.asarray(np.concatenate([[0], np.cumsum(lq)]), jnp.int32)
    ck = jnp.asarray(np.concatenate([[0], np.cumsum(lk)]), jnp.int32)
    tq, tk = sum(lq), sum(lk)
    for causal, window in ((True, (-1, -1)), (False, (30, 10)), (False, (-1, -1))):
        geom = tiling.geometry(128, 128, q_len=tq, kv_len=tk, group=1, max_rows=4096)
        seg, pos, (rows, cols) = bsched.varlen_schedules(
            cq,
            ck,
            tq,
            tk,
            geom,
            geom,
            group=1,
            causal=causal,
            left=window[0],
            right=window[1],
            max_seqlen_k=max(lk),
        )
        vis_tok = _packed_mask(lq, lk, causal, window)  # the reference's per-sequence masks
        nq, nk = geom.num_q_blocks, geom.num_kv_blocks
        vis = np.zeros((nq, nk), bool)
        for i in range(nq):
            for j in range(nk):
                vis[i, j] = vis_tok[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].any()
        hull = np.zeros_like(vis)
        for i in range(nq):
            if vis[i].any():
                js = np.flatnonzero(vis[i])
                hull[i, js[0] : js[-1] + 1] = True
        step_bound = bsched.varlen_step_bound(nq, nk, 128, max(lk))
        for sched, q_major in ((rows, True), (cols, False)):
            assert len(sched) == step_bound + (0 if q_major else nk)
            outer, inner, flags = (np.asarray(x) for x in bsched.decode_word(sched))
            qi, kj = (outer, inner) if q_major else (inner, outer)
            comp = (flags & bsched.COMPUTE) != 0
            got = np.zeros_like(vis)
            got[qi[comp], kj[comp]] = True
            assert np.all(got[vis]), "a visible pair is missing from the schedule"
            assert comp.sum() == got.sum(), "a pair is computed twice"
            assert not np.any(got & ~hull), "a pair outside the visible hull is computed"
            n_outer = nq if q_major else nk
            assert np.array_equal(outer[(flags & bsched.INIT) != 0], np.arange(n_outer))
            assert np.array_equal(outer[(flags & bsched.FINAL) != 0], np.arange(n_outer))
            _assert_first_visits(qi, flags, q_major)
        _assert_o_blocks(cols, xp=jnp)


# ---------------------------------------------------------------------------
# Tiling table and VMEM checks.


@pytest.mark.parametrize("generation", tiling.GENERATIONS)
def test_table_fits_vmem(generation):
    for d, dv in ((64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 256)):
        for group in (1, 2, 4, 8, 16):
            for q_len, kv_len in ((1, 32768), (100, 5000), (1024, 1024), (32768, 32768)):
                for itemsize in (2, 4):
                    plan = tiling.plan(
                        generation=generation,
                        q_len=q_len,
                        kv_len=kv_len,
                        group=group,
                        head_dim=d,
                        head_dim_v=dv,
                        itemsize=itemsize,
                    )
                    budget = tiling.VMEM_BUDGET_BYTES[generation]
                    for kernel, need in plan.vmem_needs(group, d, dv, itemsize):
                        assert need <= budget, kernel


def test_oversized_block_sizes_raise_with_need_and_budget():
    bs = tiling.BlockSizes(
        block_q=4096, block_kv=8192, block_q_bwd=4096, block_kv_bwd=8192, max_rows=16384
    )
    with pytest.raises(ValueError, match=r"needs about [\d.]+ MiB .* tpu7x budget is 48.0 MiB"):
        tiling.plan(
            generation="tpu7x",
            q_len=32768,
            kv_len=32768,
            group=4,
            head_dim=128,
            head_dim_v=128,
            itemsize=2,
            block_sizes=bs,
        )


def test_long_sequences_take_the_long_table_entry():
    def fwd(gen, q_len, kv_len):
        p = tiling.plan(
            generation=gen,
            q_len=q_len,
            kv_len=kv_len,
            group=4,
            head_dim=128,
            head_dim_v=128,
            itemsize=2,
        )
        return p.fwd.block_kv, p.slab_rows

    bwd = tiling.plan(
        generation="v6e", q_len=8192, kv_len=8192, group=4, head_dim=128, head_dim_v=128, itemsize=2
    )
    assert bwd.dkdv.block_kv == bwd.dq.block_kv == 1024
    short = tiling.plan(
        generation="v6e", q_len=2048, kv_len=2048, group=4, head_dim=128, head_dim_v=128, itemsize=2
    )
    assert short.dkdv.block_kv == short.dq.block_kv == 512
    assert fwd("v6e", 2048, 2048) == fwd("v6e", 8192, 8192) == (1024, 1024)
    assert fwd("tpu7x", 8192, 8192) == fwd("tpu7x", 2048, 2048)  # no long entry: prefill's


def test_a_table_entry_over_budget_shrinks_only_the_kernels_that_are_over():
    """A backward that needs smaller key blocks must not take the forward's
    with it, and a fused plan is not held back by the dQ kernel it never launches."""
    entry = tiling.BLOCK_TABLE[("tpu7x", "prefill", 128)]
    assert entry.block_kv == entry.block_kv_bwd == 1024
    kw = dict(group=4, head_dim=128, head_dim_v=128, itemsize=2)
    budget = tiling.VMEM_BUDGET_BYTES["tpu7x"]
    for t in (4096, 8192):
        p = tiling.plan(generation="tpu7x", q_len=t, kv_len=t, **kw)
        assert (p.fwd.block_kv, p.dkdv.block_kv, p.fuse_dq) == (1024, 1024, True), t
        assert tiling.dq_vmem_bytes(p.dq.rows, 1024, 128, 128, 2) > budget  # unlaunched
        assert [k for k, _ in p.vmem_needs(**kw)] == ["forward", "dK/dV"]
    # Segmented 8k (whole-block temporaries): 1024-key dK/dV blocks fit with
    # no dQ in the kernel, in VMEM or streamed, nor do a dQ kernel's
    p = tiling.plan(generation="tpu7x", q_len=8192, kv_len=8192, segmented=True, **kw)
    assert p.fwd.block_kv == 1024
    assert p.dkdv.block_kv == p.dq.block_kv == 512
    assert p.fuse_dq


def test_block_sizes_validation():
    with pytest.raises(ValueError, match="block_kv"):
        tiling.BlockSizes(512, 500, 512, 512)
    with pytest.raises(ValueError, match="slab_rows"):
        tiling.BlockSizes(512, 512, 512, 512, slab_rows=100)
    with pytest.raises(ValueError, match="max_rows_fwd"):
        tiling.BlockSizes(512, 512, 512, 512, max_rows_fwd=-1)
    with pytest.raises(ValueError, match="max_rows_fwd"):
        tiling.BlockSizes(512, 512, 512, 512, max_rows_fwd=2048.0)
    for bad in ((1024,), (1024, 0), [1024, 4096], (1024.0, 4096)):
        with pytest.raises(ValueError, match="bwd_resident"):
            tiling.BlockSizes(512, 512, 512, 512, bwd_resident=bad)
    with pytest.raises(ValueError, match="generation"):
        tiling.check_generation("v4")


# ---------------------------------------------------------------------------
# Bad input.


def _arr(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(q=_arr(1, 6, 8, 64), k=_arr(1, 4, 8, 64), v=_arr(1, 4, 8, 64)),
            "k: expected a number of kv heads",
        ),
        (
            dict(q=_arr(1, 4, 8, 64), k=_arr(1, 2, 8, 128), v=_arr(1, 2, 8, 128)),
            "k: expected head_dim 64",
        ),
        (
            dict(q=_arr(1, 4, 8, 264), k=_arr(1, 2, 8, 264), v=_arr(1, 2, 8, 264)),
            "q: expected head_dim a multiple of 8 in \\[8, 256\\], got 264",
        ),
        (
            dict(q=_arr(1, 4, 8, 64, dtype=jnp.int8), k=_arr(1, 2, 8, 64), v=_arr(1, 2, 8, 64)),
            "q: expected dtype",
        ),
        (
            dict(q=_arr(1, 4, 8, 64), k=_arr(1, 2, 8, 64, dtype=jnp.float32), v=_arr(1, 2, 8, 64)),
            "q, k, v: expected one dtype",
        ),
        (dict(q=_arr(4, 8, 64), k=_arr(1, 2, 8, 64), v=_arr(1, 2, 8, 64)), "q: expected a rank-4"),
        (
            dict(q=_arr(1, 4, 8, 64), k=_arr(1, 2, 9, 64), v=_arr(1, 2, 8, 64)),
            "v: expected sequence length 9",
        ),
        (
            dict(
                q=_arr(1, 4, 8, 64),
                k=_arr(1, 2, 8, 64),
                v=_arr(1, 2, 8, 64),
                sinks=_arr(3, dtype=jnp.float32),
            ),
            "sinks: expected shape",
        ),
        (
            dict(
                q=_arr(1, 4, 8, 64), k=_arr(1, 2, 8, 64), v=_arr(1, 2, 8, 64), window_size=(-2, 0)
            ),
            "window_size",
        ),
        (
            dict(q=_arr(1, 4, 8, 64), k=_arr(1, 2, 8, 64), v=_arr(1, 2, 8, 64), softcap=-1.0),
            "softcap",
        ),
        (
            dict(
                q=_arr(1, 4, 8, 64),
                k=_arr(1, 2, 8, 64),
                v=_arr(1, 2, 8, 64),
                q_segment_ids=_arr(1, 8, dtype=jnp.int32),
            ),
            "q_segment_ids, kv_segment_ids",
        ),
        (
            dict(
                q=_arr(1, 4, 8, 64),
                k=_arr(1, 2, 8, 64),
                v=_arr(1, 2, 8, 64),
                q_segment_ids=_arr(1, 7, dtype=jnp.int32),
                kv_segment_ids=_arr(1, 8, dtype=jnp.int32),
            ),
            "q_segment_ids: expected shape",
        ),
    ],
)
def test_bad_dense_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        checks.check_inputs(**kwargs)
    concrete = {
        n: (jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x)
        for n, x in kwargs.items()
    }
    with pytest.raises(ValueError, match=match):  # the public entry validates first
        fa.flash_attention(**concrete, interpret=True)


def test_bad_varlen_inputs():
    q, k, v = jnp.zeros((10, 4, 64)), jnp.zeros((12, 2, 64)), jnp.zeros((12, 2, 64))
    good_q, good_k = jnp.asarray([0, 4, 10], jnp.int32), jnp.asarray([0, 5, 12], jnp.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected shape"):
        fa.flash_attention_varlen(q, k, v, good_q[None], good_k, 6, 7)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected shape"):
        fa.flash_attention_varlen(q, k, v, good_q, jnp.asarray([0, 12], jnp.int32), 6, 7)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected nondecreasing offsets"):
        fa.flash_attention_varlen(q, k, v, jnp.asarray([0, 4, 9], jnp.int32), good_k, 6, 7)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected an integer"):
        fa.flash_attention_varlen(q, k, v, good_q, good_k.astype(jnp.float32), 6, 7)
    with pytest.raises(ValueError, match="max_seqlen_k: expected a static int"):
        fa.flash_attention_varlen(q, k, v, good_q, good_k, 6, None)
    with pytest.raises(ValueError, match="q: expected a rank-3"):
        fa.flash_attention_varlen(q[None], k, v, good_q, good_k, 6, 7)


def test_dropout_not_supported():
    with pytest.raises(NotImplementedError, match="dropout"):
        checks.check_inputs(
            jnp.zeros((1, 2, 8, 64)),
            jnp.zeros((1, 2, 8, 64)),
            jnp.zeros((1, 2, 8, 64)),
            dropout_p=0.1,
        )
