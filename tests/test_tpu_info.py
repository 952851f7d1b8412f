"""torch_bindings.tpu_info is the one source of TPU facts, and it is right.

* Its constants match JAX's own table (`get_tpu_info_for_chip`), so editing
  one by hand fails here.
* Its per-device core count and generation detection match the devices libtpu
  compiles for (the AOT topologies).
* The compiler cross-check it records is what the TPU compiler's cost model
  says today.
* Every tiling table, the compile gate and bench read their numbers from it.
"""

from __future__ import annotations

import pytest

from torch_bindings import aot, backend, tpu_info

ti = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")

MiB = 1 << 20


def _jax_info(f: tpu_info.TpuFacts):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.get_tpu_info_for_chip(ti.ChipVersion(f.chip_version), f.tensor_cores_per_device)


def _or_zero(x):
    return 0 if x is None else x


@pytest.mark.parametrize("generation", tpu_info.GENERATIONS)
def test_table_matches_jax_get_tpu_info_for_chip(generation):
    f = tpu_info.facts(generation)
    info = _jax_info(f)
    cores = f.tensor_cores_per_device
    assert info.num_cores == cores
    # JAX reports per TensorCore; a JAX device is `cores` TensorCores.
    assert f.bf16_flops_per_s == pytest.approx(info.bf16_ops_per_second * cores, rel=1e-9)
    assert _or_zero(f.int8_ops_per_s) == pytest.approx(info.int8_ops_per_second * cores, rel=1e-9)
    assert _or_zero(f.fp8_flops_per_s) == pytest.approx(info.fp8_ops_per_second * cores, rel=1e-9)
    assert f.hbm_bytes_per_s == pytest.approx(info.mem_bw_bytes_per_second * cores, rel=1e-9)
    assert f.hbm_capacity_bytes == pytest.approx(info.hbm_capacity_bytes * cores, rel=1e-9)
    assert f.vmem_capacity_bytes == info.vmem_capacity_bytes  # per TensorCore
    assert f.num_mxus == info.num_mxus
    assert f.mxu_width == info.mxu_column_size


def test_tpu7x_device_is_one_tensorcore_not_the_chip():
    f = tpu_info.facts("tpu7x")
    assert f.tensor_cores_per_device == 1
    assert f.bf16_flops_per_s == 1155e12 and f.hbm_bytes_per_s == 3.7e12  # not 2307e12 / 7.4e12


@pytest.mark.parametrize("generation", tpu_info.GENERATIONS)
def test_topology_device_matches_table_and_detection(generation):
    """The AOT device's kind maps back to the generation, with the table's cores."""
    dev = aot.topology_device(generation)
    f = tpu_info.facts(generation)
    assert dev.num_cores == f.tensor_cores_per_device
    assert tpu_info.generation_of_kind(dev.device_kind) == generation
    assert ti.chip_version_from_device_kind(dev.device_kind) == ti.ChipVersion(f.chip_version)


def test_generation_of_kind():
    kinds = {
        "TPU v5 lite": "v5e",
        "TPU v5e": "v5e",
        "TPU v6 lite": "v6e",
        "TPU v6e": "v6e",
        "TPU7x": "tpu7x",
        "TPU7": "tpu7x",
        "TPU v5": "v5p",
        "TPU v5p": "v5p",
        "TPU v4": "tpu7x",  # unknown: the smallest VMEM any table plans for
    }
    for kind, gen in kinds.items():
        assert tpu_info.generation_of_kind(kind) == gen, kind
    # The one rule agrees with JAX's own device-kind table where both know the kind.
    by_chip = {tpu_info.facts(g).chip_version: g for g in tpu_info.GENERATIONS}
    for kind in kinds:
        cv = ti.chip_version_from_device_kind(kind)
        if cv is not None and cv.value in by_chip:
            assert tpu_info.generation_of_kind(kind) == by_chip[cv.value], kind
    # backend re-exports the same functions (no second rule)
    assert backend.generation_of_kind is tpu_info.generation_of_kind
    assert backend.detected_generation is tpu_info.detected_generation


def test_detected_generation_env_override_and_default(monkeypatch):
    try:
        monkeypatch.setenv("TPU_KERNELS_GENERATION", "tpu7x")
        tpu_info.detected_generation.cache_clear()
        assert tpu_info.detected_generation() == "tpu7x"
        monkeypatch.delenv("TPU_KERNELS_GENERATION")
        tpu_info.detected_generation.cache_clear()
        expected = tpu_info.attached_generation() or tpu_info.DEFAULT_GENERATION
        assert tpu_info.detected_generation() == expected
    finally:
        tpu_info.detected_generation.cache_clear()


def test_unknown_generation_is_a_clear_error():
    with pytest.raises(ValueError, match="generation"):
        tpu_info.facts("v4")


def test_vmem_policy_is_three_quarters_of_a_tensorcore():
    expected = {"v5e": 96 * MiB, "v6e": 96 * MiB, "tpu7x": 48 * MiB, "v5p": 48 * MiB}
    for g, budget in expected.items():
        assert tpu_info.vmem_budget_bytes(g) == budget
        assert tpu_info.vmem_limit_bytes(g) == budget
        assert budget < tpu_info.facts(g).vmem_capacity_bytes


def test_clock_assumptions_follow_the_stated_derivation():
    expected_ghz = {"v5e": 1.50, "v6e": 1.75, "tpu7x": 1.90, "v5p": 1.50}
    for g, ghz in expected_ghz.items():
        f = tpu_info.facts(g)
        assert f.clock_hz == pytest.approx(
            f.compiler_bf16_flops_per_s
            / (f.tensor_cores_per_device * f.num_mxus * f.mxu_width**2 * 2 * f.mxu_rows_per_cycle)
        )
        assert f.clock_hz / 1e9 == pytest.approx(ghz, abs=0.01)


@pytest.mark.parametrize("generation", tpu_info.GENERATIONS)
def test_compiler_cross_check_is_what_the_compiler_says(generation):
    """The recorded compiler peak and bandwidth match libtpu's cost analysis
    (AOT, no TPU), and stay within 0.8-1.0x of JAX's published numbers."""
    f = tpu_info.facts(generation)
    got = tpu_info.compiler_cross_check(generation)
    assert got["bf16_flops_per_s"] == pytest.approx(f.compiler_bf16_flops_per_s, rel=0.01)
    assert got["hbm_bytes_per_s"] == pytest.approx(f.compiler_hbm_bytes_per_s, rel=0.01)
    assert 0.8 <= f.compiler_bf16_flops_per_s / f.bf16_flops_per_s <= 1.0
    assert 0.8 <= f.compiler_hbm_bytes_per_s / f.hbm_bytes_per_s <= 1.0


# ---------------------------------------------------------------------------
# Every consumer reads tpu_info.


def test_compile_gate_reads_tpu_info():
    assert aot.DEFAULT_GENERATIONS == tpu_info.DEFAULT_GENERATIONS
    assert aot.TOPOLOGIES == {g: tpu_info.topology(g) for g in tpu_info.GENERATIONS}


def test_rmsnorm_tiling_uses_the_shared_budget():
    from rmsnorm_tpu import tiling

    for g in tpu_info.GENERATIONS:
        assert tiling.VMEM_BUDGET[g] == tpu_info.vmem_budget_bytes(g)
        assert tiling.VMEM_LIMIT[g] == tpu_info.vmem_limit_bytes(g)
        cfg = tiling.choose_config(8192, 4096, (2, 2), g)
        assert cfg.vmem_limit_bytes == tpu_info.vmem_limit_bytes(g)


def test_flash_attention_tiling_uses_the_shared_budget():
    from flash_attention_tpu import tiling

    assert set(tiling.GENERATIONS) <= set(tpu_info.GENERATIONS)
    for g in tiling.GENERATIONS:
        assert tiling.VMEM_BUDGET_BYTES[g] == tpu_info.vmem_budget_bytes(g)


def test_ragged_dot_tiling_uses_the_shared_facts_and_budget():
    import jax.numpy as jnp

    from ragged_dot_tpu import tiling

    assert set(tiling.GENERATIONS) == set(tpu_info.GENERATIONS)
    for g, gen in tiling.GENERATIONS.items():
        f = tpu_info.facts(g)
        assert gen.vmem_budget == tpu_info.vmem_budget_bytes(g)
        assert gen.vmem_capacity == f.vmem_capacity_bytes
        assert gen.hbm_bytes_per_s == f.hbm_bytes_per_s
        assert gen.peak_flops == f.bf16_flops_per_s
        assert gen.chunk_m == f.mxu_width
        for cfg in (
            tiling.gmm_config(64, 2048, 1536, 128, jnp.bfloat16, generation=g),
            tiling.tgmm_config(4096, 2048, 1536, 128, jnp.bfloat16, generation=g),
        ):
            assert cfg.vmem_limit_bytes == tpu_info.vmem_limit_bytes(g)
    assert tiling.STEP_OVERHEAD_S == tpu_info.GRID_STEP_OVERHEAD_S


def test_bench_chips_read_tpu_info():
    from bench import model

    assert tuple(model.CHIPS) == tpu_info.DEFAULT_GENERATIONS
    for g, chip in model.CHIPS.items():
        f = tpu_info.facts(g)
        assert chip.peak_flops == f.bf16_flops_per_s
        assert chip.hbm_bytes_per_s == f.hbm_bytes_per_s
        assert chip.step_overhead_s == tpu_info.GRID_STEP_OVERHEAD_S
