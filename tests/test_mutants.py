"""scripts/mutants.py's list stays in step with the code (no test is run here).

Every mutant's original text must occur exactly once in its file, differ from
its replacement, and name test files that exist; the list must plant at least
25 bugs and reach every kernel's forward and backward, the MoE glue and the
bindings. When code changes under a mutant, update its text so the same bug is
still planted (`python scripts/mutants.py --only ID` checks it is caught).
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("_mutants", ROOT / "scripts" / "mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_mutant_list_is_well_formed():
    mod = _load()
    problems = mod.check_mutants(ROOT)
    assert not problems, "\n".join(problems)


def test_mutants_reach_every_kernel_direction_glue_and_bindings():
    mod = _load()
    files = {m.file for m in mod.MUTANTS}
    assert len(mod.MUTANTS) >= 25
    for required in (
        "kernels/rmsnorm/rmsnorm_tpu/kernel.py",
        "kernels/ragged_dot/ragged_dot_tpu/kernel_gmm.py",
        "kernels/ragged_dot/ragged_dot_tpu/kernel_tgmm.py",
        "kernels/flash_attention/flash_attention_tpu/kernel_fwd.py",
        "kernels/ragged_dot/ragged_dot_tpu/moe.py",
        "kernels/ragged_dot/ragged_dot_tpu/layers.py",
    ):
        assert required in files, f"no mutant in {required}"
    assert any(f.startswith("torch_bindings/") for f in files), "no mutant in torch_bindings/"
    # Forward and backward of every kernel: the original text's function.
    texts = {m.id: m.original for m in mod.MUTANTS}
    fa = [m for m in mod.MUTANTS if m.file.endswith(("kernel_fwd.py", "kernel_bwd.py"))]
    assert any("dq_" in m.original for m in fa) and any("dk" in m.original for m in fa)
    assert any(m.id.startswith("fa-fwd") for m in fa)
    assert any("dw_ref" in t or "ds_ref" in t for t in texts.values())  # rmsnorm backward
    assert any(m.file.endswith("kernel_tgmm.py") for m in mod.MUTANTS)  # ragged_dot d_rhs


def test_a_mutant_naming_a_missing_test_function_is_a_problem():
    import dataclasses

    mod = _load()
    renamed = dataclasses.replace(
        mod.MUTANTS[0], tests=(mod.MUTANTS[0].tests[0].split("::")[0] + "::test_renamed_away",)
    )
    problems = mod.check_mutants(ROOT, (renamed,))
    assert any("no test function test_renamed_away" in p for p in problems), problems
