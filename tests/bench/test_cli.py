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
