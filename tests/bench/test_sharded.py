"""bench.sharded: the experts block of a TP-8 / EP-8 plan, compiled for v6e:2x4 (8 chips)."""

import pytest

import bench  # noqa: F401  (switches the compiler dumps on before libtpu loads)
from bench import decode_step as ds
from bench import sharded


@pytest.mark.parametrize(
    "model,plan,batch",
    [("gemma-4-26b-a4b", "tp8", 8), ("qwen3-30b-a3b", "ep8", 16)],
)
def test_compiler_emits_the_collectives_decode_step_charges(model, plan, batch):
    # Gemma 4 at TP-8 contracts over I/8 = 88 (not lane-aligned) on every rank;
    # Qwen3 at EP-8 holds 16 whole experts per rank and 2 sequences.
    cfg, pl = ds.MODELS[model], ds.parse_plan(plan)
    res = sharded.compile_moe_block(cfg, pl, batch, "v6e")
    assert res.ok, res.error
    got = [(c.kind, c.bytes) for c in res.collectives]
    assert got == ds.experts_collectives(cfg, pl, batch)
    # one all-reduce of the experts' partial outputs (the layer's other is
    # attention's); or the dispatch and combine all-to-alls
    assert [c.kind for c in res.collectives] == (
        ["all-reduce"] if pl.kind == "tp" else ["all-to-all", "all-to-all"]
    )


def test_collectives_are_read_from_the_optimized_hlo():
    hlo = """
  %all-to-all.3 = bf16[8,4,2048]{2,1,0:T(8,128)(2,1)} all-to-all(%gather), channel_id=2
  ROOT %psum.7 = bf16[64,2048]{1,0:T(8,128)(2,1)} all-reduce(%fusion.6), channel_id=1
  %fusion.2 = bf16[64,2048]{1,0} fusion(%p0), kind=kLoop
"""
    got = sharded.collectives(hlo)
    assert [(c.kind, c.bytes) for c in got] == [
        ("all-to-all", 8 * 4 * 2048 * 2),
        ("all-reduce", 64 * 2048 * 2),
    ]
