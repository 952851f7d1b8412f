"""A tiny end-to-end sweep (walker only, no TPU compile): files come out."""

import json
import os

from bench import cli


def test_tiny_sweep_writes_json_markdown_and_plots(tmp_path):
    out = str(tmp_path / "out")
    rc = cli.main(
        [
            "--kernels",
            "moe",
            "--experts",
            "4",
            "--top-k",
            "2",
            "--hidden",
            "256",
            "--intermediate",
            "128",
            "--batches",
            "1,8",
            "--prefill",
            "",
            "--routing",
            "uniform,zipf",
            "--impls",
            "megablox_default,xla_ragged_dot",
            "--no-compile",
            "--jobs",
            "1",
            "--no-progress",
            "--out",
            out,
        ]
    )
    assert rc == 0
    data = json.load(open(os.path.join(out, "results.json")))
    recs = data["records"]
    assert len(recs) == 2 * 2 * 2
    mb = [r for r in recs if r["impl"] == "megablox_default"]
    for r in mb:
        g = r["per_generation"]["v6e"]
        assert g["status"] == "ok" and g["modeled_us"] > 0
        assert g["measured_us"] is None  # never a CPU time
        assert g["launches"] and g["bytes_over_min"] >= 0.99
    xla = [r for r in recs if r["impl"] == "xla_ragged_dot"]
    assert all(r["per_generation"]["v6e"]["status"] == "error" for r in xla)
    assert os.path.exists(os.path.join(out, "results.md"))
    assert os.path.exists(os.path.join(out, "moe_throughput_custom-e4-k2-h256-i128.png"))


def test_bad_custom_shape_is_rejected(capsys):
    import pytest

    with pytest.raises(SystemExit):
        cli.parse_args(["--experts", "4", "--top-k", "8", "--hidden", "8", "--intermediate", "8"])
    assert "--top-k" in capsys.readouterr().err


def test_rmsnorm_points_time_each_kernel_at_its_bytes(tmp_path):
    """Forward and backward alone, plain and fused: one launch each, moving
    the point's minimum bytes (every stream once)."""
    out = str(tmp_path / "out")
    argv = ["--kernels", "rmsnorm", "--rmsnorm-hidden", "256", "--rmsnorm-tokens", "512"]
    argv += ["--rmsnorm-variants", "plain,residual", "--rmsnorm-directions", "fwd,bwd"]
    argv += ["--impls", "ours_rmsnorm", "--generations", "v6e", "--no-compile"]
    assert cli.main(argv + ["--jobs", "1", "--no-progress", "--out", out]) == 0
    recs = json.load(open(os.path.join(out, "results.json")))["records"]
    got = sorted((r["variant"], r["direction"]) for r in recs)
    assert got == [("plain", "bwd"), ("plain", "fwd"), ("residual", "bwd"), ("residual", "fwd")]
    for r in recs:
        g = r["per_generation"]["v6e"]
        assert [l["name"] for l in g["launches"]] == [f"rms_norm_{r['direction']}"]
        # fwd: x, y (fused: x, r, y, sum); bwd: x, dy, dx (fused: sum, dy, d sum, dx)
        streams = {("plain", "fwd"): 2, ("plain", "bwd"): 3}.get((r["variant"], r["direction"]), 4)
        assert r["min_bytes"] == streams * 512 * 256 * 2 + 256 * 2
        assert 1.0 <= g["bytes_over_min"] <= 1.02


def test_unknown_rmsnorm_variant_is_rejected(capsys):
    import pytest

    with pytest.raises(SystemExit, match="--rmsnorm-variants"):
        cli.main(["--kernels", "rmsnorm", "--rmsnorm-variants", "fused", "--no-compile"])
