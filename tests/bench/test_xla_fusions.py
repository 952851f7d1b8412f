"""bench.xla_fusions: an XLA program's fusions, each run from its own final bundles."""

from __future__ import annotations

import jax
import pytest
import jax.numpy as jnp

import bench  # noqa: F401  (switches the compiler dumps on before libtpu loads)
from bench import schedule, xla_fusions

ROWS, COLS = 8192, 2048  # 32 MiB per bf16 operand: DMA time, not latency, dominates


def _spec():
    return jax.ShapeDtypeStruct((ROWS, COLS), jnp.bfloat16)


def test_elementwise_add_streams_at_copy_bandwidth():
    s = xla_fusions.schedule_xla_parts(lambda a, b: a + b, [_spec(), _spec()], "v6e")
    assert len(s.fusions) == 1, [f.name for f in s.fusions]
    moved = 3 * ROWS * COLS * 2
    assert s.fusions[0].dma_bytes == moved
    floor = moved / schedule.copy_bytes_per_s("v6e") * 1e6
    assert floor <= s.total_us <= 1.10 * floor, (s.total_us, floor)


def test_vector_work_shows_in_the_schedule():
    # Same bytes, a transcendental per element: the fusion is VPU/EUP-bound,
    # which a bytes model cannot see.
    plain = xla_fusions.schedule_xla_parts(lambda a, b: a + b, [_spec(), _spec()], "v6e")
    heavy = xla_fusions.schedule_xla_parts(
        lambda a, b: jnp.sin(a) * b + 1, [_spec(), _spec()], "v6e"
    )
    assert heavy.fusions[0].dma_bytes == plain.fusions[0].dma_bytes
    assert heavy.total_us > 1.5 * plain.total_us, (heavy.total_us, plain.total_us)


def test_sweep_charges_the_xla_part_by_its_fusion_schedules(tmp_path):
    # The sweep's XLA part of our MoE layer (sort, dispatch, activation glue,
    # combine) is the run of its fusions' bundles, the same figure
    # schedule_xla_parts gives for the program with its Pallas kernels left out.
    import json
    import os

    from bench import cli, moe, registry

    out = str(tmp_path / "out")
    shape = ["--experts", "4", "--top-k", "2", "--hidden", "256", "--intermediate", "128"]
    rc = cli.main(
        shape
        # 600 tokens: past the one-launch layer (560 on v6e), the two gmm
        # launches with XLA's sort, gathers and combine around them.
        + ["--batches", "600", "--prefill", "", "--routing", "uniform"]
        + ["--impls", "ours_moe_experts", "--generations", "v6e", "--jobs", "1"]
        + ["--no-progress", "--out", out]
    )
    assert rc == 0
    (rec,) = json.load(open(os.path.join(out, "results.json")))["records"]
    g = rec["per_generation"]["v6e"]
    assert g["status"] == "ok", g
    assert g["xla_charged_by"] == "fusion schedules"

    point = moe.MoePoint(moe.MoeShape("custom", 4, 2, 256, 128), 600, "uniform")
    built = registry.REGISTRY["ours_moe_experts"].build(point, "v6e", None)
    s = xla_fusions.schedule_xla_parts(
        built.fn, registry.program_args(built, point.compile_args()), "v6e"
    )
    assert len(s.fusions) >= 3 and not s.incomplete
    assert abs(g["xla_scheduled_us"] - s.total_us) <= 1e-6 * s.total_us, (g, s.total_us)
    assert g["scheduled_us"] == pytest.approx(g["pallas_scheduled_us"] + s.total_us)
    assert g["xla_floored_us"] == pytest.approx(sum(f.us for f in s.fusions if f.floored))


def test_hbm_bytes_reads_operands_and_leaves_out_vmem_arrays():
    hlo = """
ENTRY %main {
  %p0 = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = f32[8,128]{1,0:T(8,128)S(1)} parameter(1)
  %fusion.3 = bf16[64,128]{1,0:T(8,128)(2,1)} fusion(%p0, %p1), kind=kLoop
  ROOT %fusion.4 = f32[8,128]{1,0:T(8,128)S(1)} fusion(%fusion.3, %p1), kind=kLoop
}
"""
    got = xla_fusions.hbm_bytes(hlo)
    assert got["fusion.3"] == 2 * 64 * 128 * 2  # p0 in, result out; p1 is in VMEM
    assert got["fusion.4"] == 64 * 128 * 2  # its VMEM result and operand count 0


def test_a_fusion_that_cannot_see_its_loop_bounds_is_charged_its_operands():
    # transformers' grouped_mm as TorchTPU lowers it: XLA's ragged dot, whose
    # weight loop reads group bounds the run cannot see (it moved 6 MB of the
    # 805 MB gate_up weights). At 64 tokens x top-8 every one of Qwen3's 128
    # experts has rows, so the two ragged dots read every expert's weights.
    from bench import moe, registry

    shape = moe.MODELS["qwen3-30b-a3b"]
    point = moe.MoePoint(shape, 64, "uniform")
    built = registry.REGISTRY["hf_grouped_mm"].build(point, "v6e", None)
    s = xla_fusions.schedule_xla_parts(
        built.fn, registry.program_args(built, point.compile_args()), "v6e"
    )
    weights = shape.experts * 3 * shape.hidden * shape.intermediate * 2
    # the weights' relayout copies (transposed views) are separate fusions
    dots = [f for f in s.fusions if not f.name.startswith("copy")]
    assert any(f.floored for f in dots), dots[:4]
    assert sum(f.us for f in dots) >= weights / schedule.copy_bytes_per_s("v6e") * 1e6


def test_a_pallas_kernel_with_several_outputs_is_not_an_xla_fusion():
    # Flash attention's forward returns (o, lse): a tuple-typed custom call.
    # Its bundles sit beside the fusions' in the dumps; charged as a fusion
    # they doubled the kernel's time whenever its run fit under MAX_BUNDLES.
    from flash_attention_tpu import api

    q = jax.ShapeDtypeStruct((1, 4, 1024, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1, 1024, 128), jnp.bfloat16)
    s = xla_fusions.schedule_xla_parts(
        lambda q, k, v: api.flash_attention(q, k, v, causal=True, config="v6e"), [q, k, k], "v6e"
    )
    assert not [f.name for f in s.fusions if "flash_attention" in f.name], s.fusions


def test_a_record_of_an_older_instrument_is_compiled_again(tmp_path, monkeypatch):
    # A compile cache reused across an instrument change (the main job's
    # results/ folder) must not hand back figures the old instrument computed.
    import types

    from bench import xla_cost

    path = str(tmp_path / "cache.jsonl")
    spec = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    first = xla_cost.CompileCache(path).get(("add",), "v6e", lambda a: a + 1, [spec])
    assert first.ok
    again = types.SimpleNamespace(ok=True, error=None, to_json=lambda: {})
    monkeypatch.setattr(xla_cost, "compile_program", lambda *a, **k: again)
    assert xla_cost.CompileCache(path).get(("add",), "v6e", lambda a: a + 1, [spec]) is not again
    monkeypatch.setattr(xla_cost, "INSTRUMENT_VERSION", xla_cost.INSTRUMENT_VERSION + 1)
    assert xla_cost.CompileCache(path).get(("add",), "v6e", lambda a: a + 1, [spec]) is again


def test_a_record_of_other_code_is_compiled_again(tmp_path, monkeypatch):
    # Keys name programs by role, not text: after a code change the same key
    # may name another program, so a record from other code is a miss.
    import types

    from bench import xla_cost

    path = str(tmp_path / "cache.jsonl")
    spec = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    assert xla_cost.CompileCache(path).get(("add",), "v6e", lambda a: a + 1, [spec]).ok
    again = types.SimpleNamespace(ok=True, error=None, to_json=lambda: {})
    monkeypatch.setattr(xla_cost, "compile_program", lambda *a, **k: again)
    assert xla_cost.CompileCache(path).get(("add",), "v6e", lambda a: a + 1, [spec]) is not again
    monkeypatch.setattr(xla_cost, "_FINGERPRINT", "edited")
    assert xla_cost.CompileCache(path).get(("add",), "v6e", lambda a: a + 1, [spec]) is again


def test_the_code_digest_follows_kernels_and_bench_only(tmp_path):
    from bench import xla_cost

    for rel in (
        "kernels/rmsnorm/rmsnorm_tpu/kernel.py",
        "torch_bindings/aot.py",
        "bench/registry.py",
        "tests/test_x.py",
        "README.md",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    first = xla_cost.code_digest(tmp_path)
    (tmp_path / "tests/test_x.py").write_text("x = 2\n")
    (tmp_path / "README.md").write_text("edited\n")
    assert xla_cost.code_digest(tmp_path) == first  # tests and docs do not count
    for rel in (
        "kernels/rmsnorm/rmsnorm_tpu/kernel.py",
        "torch_bindings/aot.py",
        "bench/registry.py",
    ):
        before = xla_cost.code_digest(tmp_path)
        (tmp_path / rel).write_text((tmp_path / rel).read_text() + "y = 2\n")
        assert xla_cost.code_digest(tmp_path) != before, rel


def test_a_sparsecore_gather_is_charged_its_bytes():
    # v6e's XLA runs a row gather on the SparseCore (an async offload whose code
    # is not in the TensorCore dumps): it is charged reading and writing its
    # result at copy bandwidth, where it used to cost nothing.
    rows = jax.ShapeDtypeStruct((4 * ROWS,), jnp.int32)
    s = xla_fusions.schedule_xla_parts(lambda x, i: x[i], [_spec(), rows], "v6e")
    offloads = [f for f in s.fusions if xla_fusions._OFFLOAD_NOTE in f.notes]
    assert len(offloads) == 1, s.fusions
    moved = 2 * 4 * ROWS * COLS * 2 + 4 * ROWS * 4  # the rows twice, the indices once
    assert offloads[0].dma_bytes == moved
    assert s.total_us >= moved / schedule.copy_bytes_per_s("v6e") * 1e6
