"""The whole-model decode-step composition on fake per-layer MoE times (no compile)."""

import dataclasses

import pytest

from bench import decode_step as ds
from bench import model, moe

QWEN = ds.MODELS["qwen3-30b-a3b"]
GEMMA = ds.MODELS["gemma-4-26b-a4b"]
TP8, EP8 = ds.parse_plan("tp8"), ds.parse_plan("ep8")


def test_moe_dims_match_the_bench_table():
    for name, cfg in ds.MODELS.items():
        assert cfg.moe_shape.key == moe.MODELS[name].key, name
        assert cfg.source


def test_tp_splits_intermediate_and_heads():
    r = ds.rank_shapes(QWEN, TP8, 64)
    assert (r.moe.experts, r.moe.top_k, r.moe.intermediate) == (128, 8, 96)
    assert r.moe_tokens == 64 and r.seqs == 64
    assert r.heads == 4
    # 4 KV heads over 8 ranks: one replicated head per rank
    assert r.kv_heads == 1
    g = ds.rank_shapes(GEMMA, TP8, 64)
    assert g.moe.intermediate == 88 and g.dense_intermediate == 2112 // 8
    assert g.global_kv_heads == 1 and g.kv_heads == 1


def test_ep_splits_experts_and_routes_batch_times_topk_over_ranks():
    r = ds.rank_shapes(QWEN, EP8, 64)
    assert (r.moe.experts, r.moe.intermediate) == (16, 768)
    assert r.moe_tokens * r.moe.top_k == 64 * 8 // 8
    assert r.seqs == 8 and r.heads == 32
    m = ds.rank_shapes(ds.MODELS["mixtral-8x7b"], EP8, 64)
    assert m.moe.experts == 1 and m.moe_tokens * m.moe.top_k == 64 * 2 // 8
    # fewer rows than ranks still gives a rank one row
    assert ds.rank_shapes(ds.MODELS["mixtral-8x7b"], EP8, 1).moe_tokens == 1


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="tpN or epN"):
        ds.parse_plan("dp8")
    with pytest.raises(ValueError, match="tpN or epN"):
        ds.parse_plan("tp")
    with pytest.raises(ValueError, match="experts do not divide"):
        ds.rank_shapes(QWEN, ds.parse_plan("ep3"), 8)
    with pytest.raises(ValueError, match="heads do not divide"):
        ds.rank_shapes(QWEN, ds.parse_plan("tp3"), 8)
    with pytest.raises(ValueError, match="intermediate 768 does not divide"):
        ds.rank_shapes(dataclasses.replace(QWEN, heads=40), ds.parse_plan("tp5"), 8)
    with pytest.raises(ValueError, match="batch"):
        ds.rank_shapes(QWEN, TP8, 0)
    with pytest.raises(ValueError, match="generation"):
        ds.ici("v4")
    with pytest.raises(ValueError, match="kv"):
        ds.step(QWEN, TP8, "v6e", 8, 0, 1e-4)
    with pytest.raises(SystemExit):
        ds.parse_args(["--models", "llama"])
    with pytest.raises(SystemExit):
        ds.parse_args(["--parallel", "ep3"])


def test_collective_bytes_per_plan():
    assert ds.collective_bytes(QWEN, TP8, 64) == {"all_reduce": [64 * 2048 * 2] * 2}
    assert ds.collective_bytes(QWEN, EP8, 64) == {"all_to_all": [8 * 8 * 2048 * 2] * 2}


def test_ring_collectives_on_hand_numbers():
    link = ds.Ici("x", ring_bytes_per_s=100e9, hop_latency_s=1e-6, source="test")
    # all-reduce of 800 kB on 8 ranks: 14 steps of 1 us + 14/8 x 800 kB / 100 GB/s
    assert ds.all_reduce_s(800e3, 8, link) == pytest.approx(14e-6 + 1.75 * 8e-6)
    assert ds.all_to_all_s(800e3, 8, link) == pytest.approx(7e-6 + 7 / 8 * 8e-6)
    assert ds.all_reduce_s(1e9, 1, link) == 0.0


def test_step_is_layers_times_parts_and_moe_enters_once_per_layer():
    a = ds.step(QWEN, TP8, "v6e", 64, 1024, 100e-6)
    b = ds.step(QWEN, TP8, "v6e", 64, 1024, 300e-6)
    assert a.moe == pytest.approx(48 * 100e-6)
    # only the experts part moves, by layers x the difference
    assert b.total - a.total == pytest.approx(48 * 200e-6)
    assert b.other == pytest.approx(a.other)
    assert a.total == pytest.approx(sum(dataclasses.astuple(a)))
    # collectives: 48 layers x 2 all-reduces of [64, 2048] bf16
    link = ds.ici("v6e")
    assert a.collectives == pytest.approx(48 * 2 * ds.all_reduce_s(64 * 2048 * 2, 8, link))
    half = dataclasses.replace(QWEN, layers=24)
    h = ds.step(half, TP8, "v6e", 64, 1024, 100e-6)
    assert a.total - a.head == pytest.approx(2 * (h.total - h.head))


def test_attention_reads_the_kv_cache_once():
    # batch 512 x 8192 KV: memory bound; doubling KV adds exactly the KV bytes / bandwidth
    c = model.chip("v6e")
    a = ds.step(QWEN, TP8, "v6e", 512, 8192, 0.0)
    b = ds.step(QWEN, TP8, "v6e", 512, 16384, 0.0)
    kv = ds.kv_bytes_per_rank(QWEN, TP8, 512, 8192)
    assert kv == 512 * 8192 * 48 * 1 * 128 * 2 * 2
    assert b.attention - a.attention == pytest.approx(kv / c.hbm_bytes_per_s)
    # sliding layers stop growing at the window
    g1 = ds.kv_bytes_per_rank(GEMMA, TP8, 8, 2048)
    g2 = ds.kv_bytes_per_rank(GEMMA, TP8, 8, 4096)
    assert g2 - g1 == 8 * 2048 * 5 * 1 * 512 * 2 * 2


def test_tokens_per_s_and_required_baseline():
    assert ds.tokens_per_s(64, 0.02) == pytest.approx(3200)
    with pytest.raises(ValueError):
        ds.tokens_per_s(64, 0.0)
    ours = ds.step(QWEN, TP8, "v6e", 64, 1024, 100e-6)
    need = ds.required_moe_layer_s(21.5, ours, QWEN.layers)
    base = ds.step(QWEN, TP8, "v6e", 64, 1024, need)
    assert base.total / ours.total == pytest.approx(21.5)


def test_markdown_and_plot_from_fake_rows(tmp_path):
    rows = []
    for b in (1, 64):
        row = dict(model="qwen3-30b-a3b", plan="tp8", generation="v6e", kv=1024, batch=b)
        row.update(moe_shape="", hbm_gb=20.0, fits=True)
        for impl, us in zip(ds.IMPLS, (100.0, 500.0, None)):
            row[f"{impl}_moe_us"] = us
            row[f"{impl}_kind"] = "scheduled" if us else "skipped: test"
            st = ds.step(QWEN, TP8, "v6e", b, 1024, us * 1e-6) if us else None
            row[f"{impl}_step"] = (dataclasses.asdict(st) | {"total": st.total}) if st else None
        rows.append(row)
    md = tmp_path / "r.md"
    ds.write_markdown(str(md), rows, ["--x"])
    text = md.read_text()
    sp = ds.speedup(rows[1], "hf_grouped_mm")
    assert 1 < sp < 5
    assert f"| {sp:.2f} | n/a |" in text
    assert "21.5× needs grouped_mm's experts layer" in text
    png = tmp_path / "p.png"
    ds.plot(str(png), rows)
    assert png.stat().st_size > 1000


def test_moe_layer_us_says_what_the_figure_is():
    ok = {"status": "ok", "scheduled_us": 300.0, "modeled_us": 200.0, "compiles": True}
    rec = {"per_generation": {"v6e": ok}}
    assert ds.moe_layer_us(rec, "v6e") == (300.0, "scheduled")
    floor = dict(ok, notes=["XLA's estimated cycles (1 µs) exceed 100x ...: not used"])
    us, kind = ds.moe_layer_us({"per_generation": {"v6e": floor}}, "v6e")
    assert us == 300.0 and "lower bound" in kind
    ideal = dict(ok, scheduled_us=None, compiles=False)
    us, kind = ds.moe_layer_us({"per_generation": {"v6e": ideal}}, "v6e")
    assert us == 200.0 and "ideal" in kind and "does not compile" in kind
    skip = {"status": "skipped", "reason": "dims < 128"}
    us, kind = ds.moe_layer_us({"per_generation": {"v6e": skip}}, "v6e")
    assert us is None and "dims < 128" in kind
