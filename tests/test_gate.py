"""The compile gate's own rules (tests/gate.py): when a point counts as covered
by another point's compile, and what its worker processes start with.

A covered point is not compiled, so the check must refuse every difference a
compile could fail on: blocks, buffering, a larger VMEM limit in the cover,
kernel body. Only the sizes a point declares as extents (rows, sequence
length) may differ, and the cover's VMEM limit may be smaller.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import pytest

import gate
import gate_worker
from gate import GateProgram, spec

from flash_attention_tpu import api as fa
from flash_attention_tpu import tiling as fa_tiling
from ragged_dot_tpu import tiling
from ragged_dot_tpu.kernel_gmm import gmm
from ragged_dot_tpu.kernel_tgmm import tgmm

K, N, G = 256, 512, 4
MiB = 1 << 20


def _gmm(m, **cfg):
    cfg = {"block_m": 128, "block_n": 256, "chunk_m": 64, "vmem_limit_bytes": 32 * MiB, **cfg}
    fn = functools.partial(gmm, config=tiling.GmmConfig(**cfg))
    args = [spec((m, K)), spec((G, K, N)), spec((G,), jnp.int32)]
    return GateProgram(fn, args, "v6e", extents=(m,))


def _covered(prog, cover) -> bool:
    missing, total = gate.uncovered_launches(prog, cover)
    assert total == 1
    return missing == 0


def test_rows_alone_may_differ():
    # Several row tiles each: M changes the grid, the HBM extents and the
    # scalar bounds only.
    assert _covered(_gmm(1024), _gmm(4096))
    assert _covered(_gmm(520), _gmm(4096))  # a partial last tile


@pytest.mark.parametrize(
    "change",
    [
        {"block_m": 256},
        {"block_n": 128},
        {"chunk_m": 128},
    ],
    ids=lambda c: next(iter(c)),
)
def test_other_blocks_are_not_covered(change):
    assert not _covered(_gmm(1024), _gmm(4096, **change))
    assert not _covered(_gmm(1024, **change), _gmm(4096))


def test_a_compile_under_a_smaller_vmem_limit_covers_a_larger_one_only():
    # What Mosaic fits in 32 MiB it fits in 48; not the other way round.
    assert _covered(_gmm(1024, vmem_limit_bytes=48 * MiB), _gmm(4096))
    assert not _covered(_gmm(1024), _gmm(4096, vmem_limit_bytes=48 * MiB))


def test_single_row_tile_is_not_covered_by_several():
    # One tile: lhs is single-buffered, another pipeline than the cover's.
    assert not _covered(_gmm(128), _gmm(4096))


def test_decode_blocks_sized_to_the_rows_are_not_covered():
    # Decode tiles are all the rows: a block that differs with M is a block.
    assert not _covered(_gmm(16, block_m=16, chunk_m=16), _gmm(64, block_m=64, chunk_m=16))


def test_undeclared_sizes_are_not_covered():
    # Without extents, a different M is a different program.
    small, big = _gmm(1024), _gmm(4096)
    small.extents = big.extents = ()
    assert not _covered(small, big)
    # A different K is never an extent (it sizes the weight buffers).
    other_k = GateProgram(
        functools.partial(gmm, config=tiling.GmmConfig(128, 256, 64, 32 * MiB)),
        [spec((4096, 2 * K)), spec((G, 2 * K, N)), spec((G,), jnp.int32)],
        "v6e",
        extents=(4096,),
    )
    assert not _covered(_gmm(1024), other_k)


def test_tgmm_rows_alone_may_differ():
    def prog(m, block_k=256):
        cfg = tiling.TgmmConfig(128, block_k, 256, 128, 32 * MiB)
        args = [spec((m, K)), spec((m, N)), spec((G,), jnp.int32)]
        return GateProgram(functools.partial(tgmm, config=cfg), args, "v6e", extents=(m,))

    assert _covered(prog(1024), prog(4096))
    assert not _covered(prog(1024, block_k=128), prog(4096))


def _attention(seq, config="v6e"):
    def loss(q, k, v):
        o = fa.flash_attention(q, k, v, causal=True, config=config)
        return jnp.sum(o.astype(jnp.float32))

    args = [spec((1, 8, seq, 128)), spec((1, 2, seq, 128)), spec((1, 2, seq, 128))]
    return GateProgram(jax.grad(loss, argnums=(0, 1, 2)), args, "v6e", extents=(seq,))


def test_attention_sequence_length_alone_may_differ():
    # The forward's block schedule (scalar prefetch, SMEM) is longer at 2k; its
    # blocks are equal. The dK/dV kernel with dQ fused in holds one VMEM slot
    # of dQ per q block: a longer program covers a shorter one (more slots of
    # the same buffer), never the reverse.
    missing, total = gate.uncovered_launches(_attention(1024), _attention(2048))
    assert (missing, total) == (0, 2)
    missing, total = gate.uncovered_launches(_attention(2048), _attention(1024))
    assert (missing, total) == (1, 2)
    other = fa_tiling.BlockSizes(256, 512, 256, 512)
    missing, total = gate.uncovered_launches(_attention(1024, other), _attention(2048))
    assert missing == 2
    # From 4k, v6e's backward takes 1024-key blocks: only the forward matches.
    missing, total = gate.uncovered_launches(_attention(1024), _attention(4096))
    assert (missing, total) == (1, 2)
    # Without the fusion, the backward's two kernels match across lengths both ways.
    unfused = fa_tiling.BlockSizes(1024, 1024, 512, 512, fuse_dq=False)
    for a, b in ((1024, 2048), (2048, 1024)):
        missing, total = gate.uncovered_launches(_attention(a, unfused), _attention(b, unfused))
        assert (missing, total) == (0, 3)


class _CannedPool(gate.CompilePool):
    def __init__(self, results):
        super().__init__([])
        self.canned = results

    def result(self, module_file, point):
        return self.canned[point]


def test_a_covered_point_fails_with_its_cover():
    ok = gate.PointResult(True, None, 0.0, 0.0, True)
    covered = gate.PointResult(True, None, 0.0, 0.0, False, covered_by="big")
    failed = gate.PointResult(False, "VMEM OOM", 0.0, 0.0, True)
    pool = _CannedPool({"small": covered, "big": ok})
    try:
        assert pool.assert_ok("m.py", "small") is covered
        pool.canned["big"] = failed
        with pytest.raises(pytest.fail.Exception, match="covered by big.*VMEM OOM"):
            pool.assert_ok("m.py", "small")
    finally:
        pool.close()


def test_env_without_dumps():
    env = {
        "LIBTPU_INIT_ARGS": "--a=1 --xla_jf_dump_to=/tmp/d/llo --xla_jf_dump_llo_text=true --b",
        "XLA_FLAGS": "--xla_dump_to=/tmp/d/xla --xla_dump_hlo_as_text --xla_cpu_x=2",
    }
    assert gate_worker.env_without_dumps(env) == {
        "LIBTPU_INIT_ARGS": "--a=1 --b",
        "XLA_FLAGS": "--xla_cpu_x=2",
    }
    assert gate_worker.env_without_dumps({"XLA_FLAGS": "--xla_cpu_x=2"}) == {}


def test_workers_start_without_compiler_dumps(monkeypatch):
    # The session turns dumps on for bench (conftest imports it first); a
    # worker inherits the environment, and each dump costs up to 24x a compile.
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_jf_dump_to=/nowhere --xla_jf_dump_llo_text=true")
    pool = gate.CompilePool([], workers=1)
    try:
        assert pool.pool.submit(os.getenv, "LIBTPU_INIT_ARGS").result() == ""
    finally:
        pool.close()


def test_test_processes_share_one_queue_and_their_results(tmp_path):
    """Under pytest-xdist the test processes' pools work through one queue:
    every point is compiled once, by whichever pool claims it first, and
    every process reads every result from the shared folder."""
    module = tmp_path / "fake_gate_module.py"
    module.write_text(
        "import os, time\n"
        "def gate_program(point):\n"
        "    time.sleep(0.2)\n"
        "    raise ValueError(f'{point} ran in {os.getpid()}')\n"
    )
    keyed = [(str(module), f"p{i}") for i in range(8)]
    shares = [gate.Share(str(tmp_path / "share")) for _ in range(2)]
    for share in shares:
        share.WAIT_S = 60.0  # a result that never comes fails here, not in an hour
    pools = [gate.CompilePool(keyed, workers=1, share=share) for share in shares]
    try:
        pid = [p.pool.submit(os.getpid).result() for p in pools]
        for point in (p for _, p in keyed):
            errors = {reader.result(str(module), point).error for reader in pools}
            assert len(errors) == 1  # both processes read the one result
            (error,) = errors
            owner = [i for i in range(2) if error == f"ValueError: {point} ran in {pid[i]}"]
            assert len(owner) == 1, error
        ran = [sorted(k[1] for k, f in p.futures.items() if f.result() is not None) for p in pools]
        assert sorted(ran[0] + ran[1]) == sorted(p for _, p in keyed)  # each compiled once
        assert ran[0] and ran[1]  # and both pools took some
    finally:
        for p in pools:
            p.close()
