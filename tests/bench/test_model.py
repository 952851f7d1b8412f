"""The time model's formula on hand numbers."""

import pytest

from bench import model


def test_kernel_time_memory_bound_plus_steps():
    # 1.64 GB at 1640 GB/s = 1 ms; 1 GFLOP at 918 TFLOP/s ~ 1.09 us; 100 steps
    t = model.kernel_time_s(1.64e9, 1e9, 100, "v6e")
    assert t == pytest.approx(1e-3 + 100 * 0.35e-6)


def test_kernel_time_compute_bound():
    # 197 TFLOP on v5e = 1 s; bytes negligible; no steps
    assert model.kernel_time_s(1.0, 197e12, 0, "v5e") == pytest.approx(1.0)


def test_roofline_and_grouped_min_bytes():
    g = model.GroupedMatmul(group_sizes=(3, 0, 1, 0), k=256, n=512)
    # 2 active experts' weights + 4 lhs rows + 4 output rows, bf16
    assert g.min_bytes == 2 * 256 * 512 * 2 + 4 * 256 * 2 + 4 * 512 * 2
    assert g.useful_flops == 2 * 4 * 256 * 512
    # tpu7x per JAX device (one TensorCore): 3.7 TB/s, 1155 TFLOP/s bf16
    want = max(g.min_bytes / 3.7e12, g.useful_flops / 1155e12)
    assert model.grouped_roofline_s([g], "tpu7x") == pytest.approx(want)


def test_unknown_generation_is_a_clear_error():
    with pytest.raises(ValueError, match="generation"):
        model.kernel_time_s(1, 1, 1, "v4")


def test_every_chip_cites_a_source():
    for c in model.CHIPS.values():
        assert c.source and c.peak_flops > 0 and c.hbm_bytes_per_s > 0
