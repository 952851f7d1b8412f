"""The scheduled-time model: running the compiler's final VLIW schedule.

Three kinds of check: the executor on hand-written bundles (trip counts from
SMEM, predicates, delay slots, DMA waits), the executor on our real kernels
compiled for each generation (it must move exactly the bytes the jaxpr walk
says and never branch on an unknown predicate, which is what pins each
generation's branch-delay rule), and deliberately slowed kernels that cost
more in scheduled time but not in the ideal model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import bench  # noqa: F401  (switches the compiler dumps on before libtpu loads)
from bench import grid_walk, llo, model, schedule, tracing

HBM = llo.HbmModel(bytes_per_cycle=100.0, latency_cycles=50.0)


def _bundle(addr, body, mark="", depth=0, regions=""):
    tail = f" /* {regions} */" if regions else ""
    return f"  {addr:#x} {mark}: {'>' * depth} {{ {body} }}{tail}"


def _loop_program(delay_pad: int) -> str:
    """Counts s3 up to smem[2] (read from operand 0) in a 3-bundle loop body."""
    lines = [
        _bundle(
            0,
            "%s1_s0 = inlined_call_operand.hbm [shape: s32[8], index: 0, kind: input, "
            "shape index: {}]  ;;  %s2_s1 = smov.u32 [#allocation3]",
        ),
        _bundle(
            1,
            "%3 = dma.hbm_to_smem /*hbm=*/%s1_s0, /*size_in_granules=*/1, "
            "/*smem=*/%s2_s1, /*dst_syncflagno=*/[#allocation1]",
        ),
        _bundle(2, "%4 = dma.done.wait [#allocation1], 1"),
        _bundle(3, "%s5_s2 = sld [smem:[#allocation3 + $0x2]]  ;;  %s6_s3 = smov.u32 0"),
        _bundle(4, "%s7_s3 = sadd.s32 1, %s6_s3", "LB", 1, "Start region 5"),
        _bundle(5, "%p8_p0 = scmp.ge.s32.totalorder %s7_s3, %s5_s2", "", 1),
        _bundle(6, "%9 = sbr.rel (!%p8_p0) target = $region5", "", 1),
    ]
    addr = 7
    for _ in range(delay_pad):
        lines.append(_bundle(addr, "", "", 0))
        addr += 1
    lines.append(_bundle(addr, "%s10_s4 = smov.u32 (%p8_p0), 7"))
    return "\n".join(lines)


def _run(text, values, rule="fixed4", mxu=None):
    return llo._Machine(llo.parse(text), values, HBM, 10_000, rule, mxu).run()


@pytest.mark.parametrize("trips", [1, 3, 9])
def test_loop_runs_the_trip_count_read_from_smem(trips):
    text = _loop_program(delay_pad=4)
    r = _run(text, {0: [0, 0, trips, 0, 0, 0, 0, 0]})
    (loop,) = r.loops
    assert loop.iterations == trips
    assert r.unknown_branches == 0
    # 4 straight bundles, then per pass 3 body bundles + 4 delay slots (the
    # last pass falls through the same 4), then the exit bundle.
    assert r.bundles == 4 + trips * 7 + 1
    # the one DMA (32 bytes) waited on at once: latency + its transfer exposed
    assert r.stall_cycles == pytest.approx(50 + 32 / 100.0 - 1, abs=1.0)


def test_a_run_cut_off_at_the_bundle_limit_says_so():
    # 9 passes issue 68 bundles; a limit below that stops the run early, and
    # its times are then lower bounds the sweep must not report as figures.
    text = _loop_program(delay_pad=4)
    values = {0: [0, 0, 9, 0, 0, 0, 0, 0]}
    for limit, stopped in ((1_000, False), (68, False), (67, True), (30, True)):
        r = llo._Machine(llo.parse(text), values, HBM, limit, "fixed4").run()
        assert r.stopped == stopped, limit
        assert r.bundles == (limit + 1 if stopped else 68), limit


def test_unknown_predicate_is_reported_not_guessed():
    text = _loop_program(delay_pad=4)
    r = _run(text, {})  # no operand values: the trip count is unknown
    assert r.unknown_branches >= 1
    assert any("unknown" in n for n in r.notes)


def test_block_delay_rule_stops_at_the_next_region():
    # tpu7x: a forward branch whose padding is one empty bundle before the
    # target region must not execute the target's bundles as delay slots.
    lines = [
        _bundle(0, "%s1_s0 = smov.u32 1"),
        _bundle(1, "%p2_p0 = scmp.eq.s32.totalorder %s1_s0, 1"),
        _bundle(2, "%3 = sbr.rel (%p2_p0) target = $region9"),
        _bundle(3, ""),
        _bundle(4, "%s4_s0 = smov.u32 5", "PF", 0, "Start region 8"),
        _bundle(5, "%s5_s1 = smov.u32 6", "", 0, "Start region 9"),
    ]
    m = llo._Machine(llo.parse("\n".join(lines)), {}, HBM, 100, "block")
    assert m.run().unknown_branches == 0
    assert m.regs["s0"] == 1  # the PF bundle was jumped over
    assert m.regs["s1"] == 6


_OPERAND = (
    "%s9_s9 = inlined_call_operand.hbm [shape: bf16[4096], index: 0, kind: input, shape index: {}]"
)
_COPY = (
    "%{n} = dma.hbm_to_vmem [thread:$0] {pred} /*hbm=*/%s9_s9, /*size_in_granules=*/100, "
    "/*vmem=*/[#allocation2], /*dst_syncflagno=*/[#allocation4]"
)


def _forward_branch_program(taken: bool, block: list[str]) -> str:
    """A forward branch over `block` (one op a bundle) that follows one empty
    padding bundle outside the branch's depth, tpu7x's shape of both a
    `pl.when` block and a pipelined grid loop's branch over its body."""
    lines = [
        _bundle(0, _OPERAND, "", 1),
        _bundle(1, f"%s1_s0 = smov.u32 {1 if taken else 0}", "", 1),
        _bundle(2, "%p2_p0 = scmp.eq.s32.totalorder %s1_s0, 1", "", 1),
        _bundle(3, "%3 = sbr.rel (%p2_p0) target = $region9", "", 1),
        _bundle(4, ""),
    ]
    lines += [_bundle(5 + j, body, "", 1) for j, body in enumerate(block)]
    lines.append(_bundle(5 + len(block), "%s5_s2 = smov.u32 6", "", 1, "Start region 9"))
    return "\n".join(lines)


@pytest.mark.parametrize("taken", [True, False])
def test_block_delay_rule_never_runs_a_skipped_blocks_wait_or_copy(taken):
    # kernel_combine's per-slot block starts with that slot's semaphore wait,
    # unpredicated, right after the branch and one padding bundle: running it
    # on the taken path waited on another slot every step (48 us of DMA
    # stalls at 8,192 Qwen3 tokens that the kernel does not have).
    block = ["%s4_s1 = smov.u32 5", _COPY.format(n=7, pred="")]
    text = _forward_branch_program(taken, block)
    m = llo._Machine(llo.parse(text), {}, HBM, 100, "block")
    r = m.run()
    assert r.unknown_branches == 0
    assert r.dmas == (0 if taken else 1)
    assert m.regs["s2"] == 6


def test_block_delay_rule_runs_a_predicated_copy_past_the_padding():
    # A pipelined grid loop on tpu7x: the branch that skips the body at the
    # prologue step is followed by empty padding and then the next step's
    # prefetch (predicated on its own condition), which runs on both paths:
    # otherwise the body's wait for it finds no copy.
    block = ["%s4_s1 = smov.u32 5", _COPY.format(n=7, pred="(%p2_p0),")]
    m = llo._Machine(llo.parse(_forward_branch_program(True, block)), {}, HBM, 100, "block")
    r = m.run()
    assert r.unknown_branches == 0
    assert r.dmas == 1
    assert m.regs["s1"] == 5


def _back_edge_program(trips: int, body_depth: int) -> str:
    """A loop counting s0 up to `trips` (body at `body_depth`) whose back-edge
    sits at depth 1, then an empty padding bundle and an s1 increment at
    depth 1: the body's last op where the body is at depth 1, the code after
    the loop where it is deeper."""
    return "\n".join(
        [
            _bundle(0, "%s1_s0 = smov.u32 0  ;;  %s2_s1 = smov.u32 0"),
            _bundle(1, "%s3_s0 = sadd.s32 1, %s1_s0", "LB", body_depth, "Start region 5"),
            _bundle(2, f"%p4_p0 = scmp.ge.s32.totalorder %s3_s0, {trips}", "", body_depth),
            _bundle(3, "%5 = sbr.rel (!%p4_p0) target = $region5", "", 1),
            _bundle(4, ""),
            _bundle(5, "%s6_s1 = sadd.s32 1, %s2_s1", "", 1),
            _bundle(6, "%s7_s2 = smov.u32 9", "", 0, "Start region 6"),
        ]
    )


@pytest.mark.parametrize("trips", [1, 4])
@pytest.mark.parametrize("body_depth", [1, 2])
def test_block_delay_rule_keeps_a_back_edges_slots_in_its_loop(trips, body_depth):
    # Depth 1: the body's last op sits after an empty padding bundle, in the
    # back-edge's delay slots, and runs on every pass (gmm's inner loops have
    # this shape; stopping at the padding dropped their stores and made
    # gate/up 4x faster than its MXU work). Depth 2: the back-edge sits one
    # level above its body (the dK/dV kernel's dQ write loop), and the op
    # after the padding is the code after the loop (there, the waits for the
    # loop's last copies): it runs once, after the last trip.
    m = llo._Machine(llo.parse(_back_edge_program(trips, body_depth)), {}, HBM, 100, "block")
    r = m.run()
    assert r.unknown_branches == 0
    assert m.regs["s0"] == trips
    assert m.regs["s1"] == (trips if body_depth == 1 else 1)


def test_dmas_share_one_pipe():
    lines = [
        _bundle(
            0,
            "%s1_s0 = inlined_call_operand.hbm [shape: bf16[4096], index: 0, kind: input, shape index: {}]",
        ),
        _bundle(
            1,
            "%2 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s1_s0, /*size_in_granules=*/100, "
            "/*vmem=*/[#allocation2], /*dst_syncflagno=*/[#allocation4]",
        ),
        _bundle(
            2,
            "%3 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s1_s0, /*size_in_granules=*/100, "
            "/*vmem=*/[#allocation3], /*dst_syncflagno=*/[#allocation5]",
        ),
        _bundle(3, "%4 = dma.done.wait [#allocation5], 100"),
    ]
    r = _run("\n".join(lines), {})
    # two 3200-byte copies back to back at 100 B/cycle, then the latency
    assert r.cycles == pytest.approx(1 + 64 + 50, abs=2)
    assert r.dma_bytes == 6400


def test_constant_false_predicate_never_runs():
    # v6e keeps DMAs whose predicate the compiler folded to a constant: "(0)"
    # never runs, "(1)" always does (read as unpredicated, the fused MoE
    # kernel's schedule moved 22 MB more than its jaxpr).
    lines = [
        _bundle(0, _OPERAND),
        _bundle(1, _COPY.format(n=2, pred="(0),")),
        _bundle(2, _COPY.format(n=3, pred="(1),")),
        _bundle(3, _COPY.format(n=4, pred="(!1),")),
    ]
    r = _run("\n".join(lines), {})
    assert r.dmas == 1 and r.dma_bytes == 3200


# ------------------------------------------------------------ real kernels


def _require_dumps():
    if schedule.enable_dumps() is None:
        pytest.fail(
            "libtpu was loaded before bench enabled the compiler dumps: "
            "import bench before anything imports torch_tpu"
        )


def _gmm_launch(generation):
    from ragged_dot_tpu.api import ragged_dot

    rng = np.random.default_rng(3)
    # Weights larger than any VMEM (100 MB), so the compiler keeps them in HBM
    # even when the kernel is compiled on its own.
    experts, k, n, tokens, top_k = 64, 1024, 768, 6, 2
    ids = np.concatenate([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    sizes = np.bincount(ids, minlength=experts).astype(np.int32)
    fn = functools.partial(ragged_dot, config=generation)
    (launch,) = tracing.trace_launches(
        fn,
        jax.ShapeDtypeStruct((tokens * top_k, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((experts, k, n), jnp.bfloat16),
        jnp.asarray(sizes),
    )
    return launch, int((sizes > 0).sum())


@pytest.mark.parametrize("generation", ["v5e", "v6e", "tpu7x"])
def test_gmm_schedule_moves_what_the_walk_counts(generation):
    """Our gmm on each generation: the executed schedule DMAs exactly the
    active experts' weights (the walk's count, from the jaxpr), and every
    branch it takes is decided."""
    _require_dumps()
    launch, active = _gmm_launch(generation)
    cost = grid_walk.walk_launch(launch)
    s = schedule.schedule_launch(launch, generation)
    assert s.unknown_branches == 0, s.notes
    weights = active * 1024 * 768 * 2  # one expert is ~9% of the total here
    assert s.dma_bytes >= weights
    # Within 1% of the walk: the schedule also moves the tile padding of the
    # small lhs/out windows, and on tpu7x the lhs arrives as a VMEM operand.
    assert abs(s.dma_bytes - cost.hbm_bytes) <= 0.01 * cost.hbm_bytes
    assert s.seconds > 0
    assert s.cycles >= s.bundles


@pytest.mark.parametrize("rows, cols", [(4, 8), (8, 8), (6, 8), (4, 128)])
def test_int8_smem_words_follow_the_compiled_addressing(rows, cols):
    """_memory_words on an int8 [2, rows, 8] array against the address a
    kernel compiled for v6e / tpu7x computes for element [h, i, j] (read off
    splash attention's bundles at [1, 4, 4] and [1, 8, 8]: word
    (i >> 2) * 128 + j of its slab, byte i & 3; a slab is its rows padded to
    four, a row of 128 words each four). At [2, 4, 128] the row-major bytes
    are as many: the tiled layout still wins."""
    a = (np.arange(2 * rows * cols) % 251).astype(np.int8).reshape(2, rows, cols)
    slab = -(-rows // 4) * 128
    words = llo._memory_words(a, 2 * slab * 4)
    assert words is not None and len(words) == 2 * slab
    for h in range(2):
        for i in range(rows):
            for j in range(cols):
                w = h * slab + (i >> 2) * 128 + j
                assert (int(words[w]) >> (8 * (i & 3))) & 0xFF == a.view(np.uint8)[h, i, j], (
                    h,
                    i,
                    j,
                )


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("generation", ["v6e", "tpu7x"])
def test_int8_scalar_prefetch_is_read_as_the_kernel_lays_it_out(generation, n):
    """An int8 [n, n] block mask in SMEM (what JAX's splash attention
    prefetches): a kernel that copies a block only where mask[i, j] != 0
    starts exactly as many copies in its executed schedule as the mask has
    nonzeros. Until 2026-12-06 the executor packed four elements of a row to
    a word where the kernel reads four rows of a column, and splash read most
    of its causal mask as empty (its scheduled times were about half)."""
    _require_dumps()
    rng = np.random.default_rng(7)
    mask = (rng.random((n, n)) < 0.4).astype(np.int8) * rng.integers(1, 3, (n, n)).astype(np.int8)
    assert 0 < np.count_nonzero(mask) < n * n

    def kernel(mask_ref, o_hbm, buf, sem):
        i, j = pl.program_id(0), pl.program_id(1)

        # (Mosaic compares no int8 scalars: widened first.)
        @pl.when(mask_ref[i, j].astype(jnp.int32) != 0)
        def _():
            buf[...] = jnp.full(buf.shape, 1.0, jnp.float32)
            copy = pltpu.make_async_copy(buf, o_hbm.at[pl.ds(i * 8, 8)], sem.at[0])
            copy.start()
            copy.wait()

    def f():
        # The output in HBM (an input this small XLA may place in VMEM, where
        # its copies are no DMAs): one 4 KiB copy per nonzero of the mask.
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(n, n),
                in_specs=[],
                out_specs=pl.BlockSpec(memory_space=pl.ANY),
                scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA((1,))],
            ),
            out_shape=jax.ShapeDtypeStruct((8 * n, 128), jnp.float32),
        )(jnp.asarray(mask))

    with tracing.pretend_tpu(generation):
        [launch] = tracing.trace_launches(f)
    s = schedule.schedule_launch(launch, generation)
    assert s.unknown_branches == 0, s.notes
    # The mask's own copy into SMEM: a row of 128 words each four rows.
    assert divmod(s.dma_bytes, 4096) == (np.count_nonzero(mask), n * 128), (s.dmas, s.notes)


def test_tpu7x_combine_waits_only_for_copies_it_started():
    """The combine on tpu7x: a `pl.when` block per row slot, each starting
    with its slot's semaphore wait, inside a pipelined grid loop whose
    prologue step skips the body but must still issue the next step's
    prefetch. Under the delay-slot rule every wait finds the copies it waits
    for (a block's first wait run on the taken path, or a prefetch dropped
    there, leaves one without), and the run moves the bytes the jaxpr walk
    counts."""
    from ragged_dot_tpu import pairs
    from ragged_dot_tpu.kernel_combine import combine

    _require_dumps()
    hidden, tokens, k = 2048, 96, 8
    # 32,768 rows (128 MB), so the compiler leaves them in HBM.
    rows = jax.ShapeDtypeStruct((32768 * pairs.row_words(hidden), 128), jnp.uint32)
    rng = np.random.default_rng(0)
    slots = jnp.asarray(rng.choice(32768, (tokens, k), replace=False), jnp.int32)
    weights = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    (launch,) = tracing.trace_launches(
        lambda r, s, w: combine(r, s, w, hidden=hidden), rows, slots, weights
    )
    s = schedule.schedule_launch(launch, "tpu7x")
    assert s.unknown_branches == 0, s.notes
    assert not any("no started DMA" in n for n in s.notes), s.notes
    cost = grid_walk.walk_launch(launch)
    assert s.dmas >= tokens * k
    assert abs(s.dma_bytes - cost.hbm_bytes) <= 0.01 * cost.hbm_bytes


@pytest.mark.parametrize("generation", ["v6e", "tpu7x"])
@pytest.mark.parametrize("projection", ["gate_up", "down"])
def test_gmm_streams_qwen3_decode_weights_at_copy_bandwidth(generation, projection):
    """Qwen3-30B-A3B at 64 tokens (~114 active experts): the scheduled time of
    our gmm is within 6% of moving its bytes at the modeled copy bandwidth.
    With one weight DMA in flight (the former 2-slot ring) every expert paid
    the DMA latency: 1.3-1.6x on these shapes."""
    from ragged_dot_tpu.kernel_gmm import gmm

    _require_dumps()
    tokens, experts, top_k = 64, 128, 8
    k, n = {"gate_up": (2048, 1536), "down": (768, 2048)}[projection]
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    sizes = np.bincount(ids, minlength=experts).astype(np.int32)
    m = tokens * top_k
    (launch,) = tracing.trace_launches(
        functools.partial(gmm, config=generation),
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((experts, k, n), jnp.bfloat16),
        jnp.asarray(sizes),
    )
    s = schedule.schedule_launch(launch, generation)
    assert s.unknown_branches == 0, s.notes
    min_bytes = int((sizes > 0).sum()) * k * n * 2 + m * (k + n) * 2
    floor = min_bytes / schedule.copy_bytes_per_s(generation)
    assert s.seconds <= 1.06 * floor, (s.seconds, floor)


# ---------------------------------------------------- deliberately slowed


def _scale_kernel(x_ref, o_ref, *, extra):
    y = x_ref[...] * 2.0
    for i in range(extra):  # VPU work the ideal model cannot see
        y = jnp.tanh(y) * 1.0001 + y * 0.5
    o_ref[...] = y


def _scale(x, extra):
    return pl.pallas_call(
        functools.partial(_scale_kernel, extra=extra),
        grid=(x.shape[0] // 256,),
        in_specs=[pl.BlockSpec((256, 512), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((256, 512), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(x)


def _copy_kernel(x_hbm, w_hbm, o_ref, xbuf, wbuf, sem, *, wait_early):
    cx = pltpu.make_async_copy(x_hbm, xbuf, sem.at[0])
    cw = pltpu.make_async_copy(w_hbm, wbuf, sem.at[1])
    cx.start()
    cw.start()
    if wait_early:  # the weight DMA waited right after it starts
        cw.wait()
    cx.wait()
    y = xbuf[...]
    for _ in range(8):
        y = y * 1.5 + 1.0
    if not wait_early:
        cw.wait()
    o_ref[...] = y + wbuf[...]


def _copy(x, w, wait_early):
    return pl.pallas_call(
        functools.partial(_copy_kernel, wait_early=wait_early),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[
            pltpu.VMEM(x.shape, x.dtype),
            pltpu.VMEM(w.shape, w.dtype),
            pltpu.SemaphoreType.DMA((2,)),
        ],
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(x, w)


def _both_models(fn, args, generation="v6e"):
    (launch,) = tracing.trace_launches(fn, *args)
    c = grid_walk.walk_launch(launch)
    ideal = model.kernel_time_s(c.hbm_bytes, c.flops, c.steps, generation)
    return ideal, schedule.schedule_launch(launch, generation)


def test_extra_vpu_work_costs_scheduled_time_not_ideal_time():
    _require_dumps()
    x = jax.ShapeDtypeStruct((2048, 512), jnp.float32)
    ideal0, s0 = _both_models(lambda a: _scale(a, 0), (x,))
    ideal1, s1 = _both_models(lambda a: _scale(a, 20), (x,))
    assert ideal1 == ideal0
    assert s1.seconds > 1.5 * s0.seconds
    assert s1.bundles > s0.bundles


def test_a_dma_waited_at_once_costs_scheduled_time_not_ideal_time():
    _require_dumps()
    x = jax.ShapeDtypeStruct((512, 1024), jnp.float32)
    w = jax.ShapeDtypeStruct((512, 1024), jnp.float32)
    ideal_late, late = _both_models(lambda a, b: _copy(a, b, False), (x, w))
    ideal_early, early = _both_models(lambda a, b: _copy(a, b, True), (x, w))
    assert ideal_early == ideal_late
    assert early.stall_cycles > late.stall_cycles
    assert early.seconds > late.seconds


def test_mxu_result_pops_are_one_slot_class_on_every_generation():
    """v6e pops its MXU results from a FIFO (`.mrf.mxuN`), tpu7x from a result
    buffer (`.mrb`); either binds a matmul loop the same way, and an EUP
    result pop or an ALU op is not one."""
    assert llo.slot_of("vpop.f32.mrf.mxu0") == "mxu_pop"
    assert llo.slot_of("vpop.f32.mrb") == "mxu_pop"
    assert llo.slot_of("vmatmul.mubr.bf16.gmra.mrb") == "mxu_matmul"
    assert llo.slot_of("vpop.erf") != "mxu_pop"
    assert llo.slot_of("vmul.f32") == "valu"


def _matmuls(mxus, gap):
    """One 16-row bf16 matmul per listed MXU, `gap` bundles apart."""
    lines, addr = [], 0
    for x in mxus:
        lines.append(_bundle(addr, f"vmatmul.mubr.bf16.gmra.mrb[0].mxu{x} %v1_v1"))
        addr += 1
        for _ in range(gap - 1):
            lines.append(_bundle(addr, ""))
            addr += 1
    return "\n".join(lines)


@pytest.mark.parametrize("rows_per_cycle", [1, 2])
def test_matmuls_issued_faster_than_their_mxu_takes_them_wait(rows_per_cycle):
    c = 16 // rows_per_cycle  # cycles a 16-row bf16 op holds its MXU
    mxu = llo.MxuModel(rows_per_cycle)
    n = 40
    burst = _run(_matmuls([0] * n, gap=1), {}, mxu=mxu)
    # the MXU takes one op every c cycles; the queue lets the issue run one op ahead
    assert burst.cycles == pytest.approx((n - 1) * c, abs=c)
    assert burst.mxu_stall_cycles > 0
    # two MXUs take alternate ops: half the time
    both = _run(_matmuls([0, 1] * (n // 2), gap=1), {}, mxu=mxu)
    assert both.cycles == pytest.approx(burst.cycles / 2, abs=c)
    # issued at the MXU's own pace: no wait, one cycle a bundle
    paced = _run(_matmuls([0] * n, gap=c), {}, mxu=mxu)
    assert paced.mxu_stall_cycles == 0
    assert paced.cycles == n * c


def test_8bit_and_32bit_matmuls_hold_the_mxu_for_their_rows():
    m = llo.MxuModel(2)
    # 32 int8 rows at twice the rate: a bf16 op's time; 8 f32 rows: half of it
    assert m.cycles("vmatmul.mubr.s8.gmra") == m.cycles("vmatmul.mubr.bf16.gmra") == 8
    assert m.cycles("vmatmul.mubr.f32.gmra") == 4


def _matmul_kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)


@pytest.mark.parametrize("generation", ["v5e", "v6e", "tpu7x"])
def test_a_matmul_never_schedules_faster_than_its_mxus(generation):
    """The compiler's schedule issues matmuls faster than the MXUs can take
    them (on tpu7x a 16-row op every ~4 bundles per MXU, half the time the
    clock's own 2 rows per cycle allows): the executor must hold the MXUs'
    rate, so a matmul costs at least its flops at the peak the clock was
    derived from, and not much more when nothing else binds."""
    _require_dumps()
    from torch_bindings import tpu_info

    m, k, n = 512, 1024, 1024
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))

    def f(a, b):
        return pl.pallas_call(
            _matmul_kernel,
            out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
            compiler_params=pltpu.CompilerParams(vmem_limit_bytes=48 << 20),
        )(a, b)

    (launch,) = tracing.trace_launches(f, *args)
    s = schedule.schedule_launch(launch, generation)
    floor = 2 * m * k * n / tpu_info.facts(generation).mxu_flops_per_cycle
    compute = s.cycles - s.stall_cycles  # the DMAs of a grid-less call are not overlapped
    assert floor <= compute <= 1.35 * floor, (compute, floor, s.mxu_stall_cycles)


def test_the_sweep_reports_no_time_for_a_run_cut_off(monkeypatch):
    # A launch whose schedule the bundle limit cut (a causal 32k flash
    # backward under the old 50M limit scheduled 0.91x its MXU floor) gets no
    # scheduled time, and says why.
    from bench import sweep, xla_cost

    def run(stopped):
        sch = schedule.LaunchSchedule(
            "k", "v6e", 1e-3, 1e6, 1_000_001, 10, 0.0, 0, 0, [], 0, [], 0.0, stopped
        )
        comp = xla_cost.Compiled("v6e", True, None, None, None, None, None, 0.0, schedule="x")
        ctx = sweep.Context(generations=("v6e",), compiles=None)
        monkeypatch.setattr(ctx, "compile", lambda *a, **k: comp)
        monkeypatch.setattr(tracing, "launch_program", lambda launch: (None, ()))
        monkeypatch.setattr(tracing, "launch_signature", lambda launch: "sig")
        monkeypatch.setattr(schedule, "operand_values", lambda operands: {})
        monkeypatch.setattr(schedule, "unpack", lambda text: text)
        monkeypatch.setattr(schedule, "run_schedule", lambda *a: sch)
        return ctx.gate_and_schedule(type("L", (), {"operands": (), "name": "k"})(), "v6e")

    _, sch, why = run(stopped=False)
    assert sch is not None and why is None
    _, sch, why = run(stopped=True)
    assert sch is None and "cut off after 1,000,001 bundles" in why
