"""Our experts and attention inside transformers' tensor- and expert-parallel plans, 2 and 4 ranks.

What runs
---------
Tiny random Qwen3-MoE, Mixtral, GPT-OSS and Gemma 4 models (tiny_models.py:
hidden 64, 2 layers, 8 experts top-2, GQA 8:4, saved locally) are loaded by
transformers' own distributed loading on 2 and then 4 ranks
(torch.distributed over gloo on the CPU; launch.py forks the ranks after one
import of everything, as `torchrun --nproc-per-node N` would start them, with
the same env:// rendezvous) with our published kernels (built by
scripts/publish.py, loaded with kernels.get_kernel) registered the way the
README says: `experts_forward` as `experts_implementation="ragged_dot_tpu"`
and `attention_forward` as `attn_implementation="tpu_attention"`. Every rank
compares with the single-process model (transformers' default experts
implementation, `grouped_mm`, and eager attention) on the same checkpoint:

- logits of a [2, 8] batch (no_grad: transformers' inference fast paths);
- greedy generation of 2 new tokens (prefill, then one decode step on the
  KV cache), token for token;
- the loss and the gradient of every parameter (sharded ones gathered with
  `full_tensor()`) after `loss.backward()` with grad enabled (transformers'
  DTensor paths, the all-reduces of partial input/router-weight gradients);
- what the plan did (expert weights' local shapes and placements, local
  expert count, q_proj rows) and that our two functions were called, so a
  plan that silently shards nothing, or a model that never reached our
  kernels, cannot pass.

Plans (transformers 5.22.2, `transformers.distributed.DistributedConfig`):

- "tp": `DistributedConfig(tp_plan="auto")` (tp_size = world size): the
  config's `base_model_tp_plan`; experts split on the intermediate dim
  (`packed_colwise` gate_up, `rowwise` down, `moe_tp_experts` all-reduce), so
  our kernels contract over I/N per rank; attention heads split per rank.
- "ep": `DistributedConfig(tp_size=N, ep_size=N, tp_plan={})`: the config's
  `base_model_ep_plan` alone. This is what the deprecated
  `DistributedConfig(tp_size=N, enable_expert_parallel=True)` resolves to
  (test_enable_expert_parallel_flag_resolution). Qwen3-MoE, Mixtral and
  GPT-OSS use token dispatch (`ep_dispatch_experts`: all-to-all, each rank
  runs its E/N experts on a data-dependent number of rows, top-1 with unit
  weights, routing weights applied by transformers after the combine; at 4
  ranks a decode step leaves ranks with no rows). Gemma 4's EP plan is
  router masking (`ep_router` + `moe_tp_experts`: every rank sees every token,
  non-local slots get weight 0 and the sentinel id E/N that our
  `experts_forward` must ignore), and it also splits Gemma 4's dense MLP.

Model/plan support found in transformers 5.22.2 (evidence in the code named):

- Every model/plan pair above runs and matches at 2 ranks, Qwen3-MoE under
  expert parallelism also at 4 (WIDEST; all eight pairs matched at 4 ranks
  too when they all ran there, until 2026-11-30, and Qwen3-MoE under "tp"
  until 2026-12-01).
- GPT-OSS has no tensor-parallel plan: `GptOssConfig.base_model_tp_plan` is
  None and `GptOssForCausalLM._tp_plan` is only `{"lm_head":
  "colwise_gather_output"}` (test_gpt_oss_has_no_tensor_parallel_plan), so
  `tp_plan="auto"` splits only the LM head; the experts and attention run
  whole on every rank. The "tp" GPT-OSS case runs that and asserts it.
  transformers' TP styles could not express one either (from reading
  distributed/tensor_parallel.py): `moe_tp_experts` all-reduces each rank's
  expert output, so a per-rank `down_proj_bias` would be added N times, and
  `packed_colwise` splits dim 1 of a 3-D weight into [gate; up] halves
  ([E, 2I, H]), while GPT-OSS stores [E, H, 2I] with gate and up interleaved.
- `DistributedConfig(enable_expert_parallel=True)` without `tp_size` (or
  `tp_plan`) resolves to ep_size = tp_size = 1: from_pretrained then builds no
  mesh and loads the whole model on every rank, with no error. A comparison
  run that way passes without testing any parallelism.
- Both plans at once (`DistributedConfig(tp_plan="auto", ep_size=N)`, plan
  "tp_ep" in launch.py) is not in the matrix, for time; run by hand on 2
  ranks (2026-11-30) all four models matched there too.
- Gemma 4's config default `global_head_dim` is 512, which our attention does
  not take (head dims 64-256): the tiny Gemma 4 uses 128 for its global layer.

Our kernels' CPU path: the matrix runs our ops with
TPU_KERNELS_CPU_IMPL=reference (our experts_forward / attention_forward, the
torch ops, their bindings and autograd, with the XLA reference programs in
place of the Pallas kernels). Every distinct op shape is a compile, expert
parallelism makes the experts' row count data-dependent, and Pallas
interpret mode costs several times the reference per shape (17 CPU-s per
rank for the one case below against 3-5 for a whole reference case). The
Pallas kernels themselves (interpret mode) run in that one case: Qwen3-MoE
logits, loss and gradients under "tp" on 2 ranks, i.e. forward and backward
kernels at the sharded shapes (the down projection contracting over I/2, 4
query and 2 KV heads per rank). The kernels' numerics at every other shape
are the single-process tests' job.

Cost: one launcher, ranks forked twice (2, then 4).
To see whether a failure is ours or transformers', rerun the case with
impl="default" in the spec (transformers' own experts and eager attention
under the same plan).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gate_worker import env_without_dumps
from multirank import tiny_models as tm

HERE = Path(__file__).resolve().parent
WORLDS = (2, 4)
PLANS = ("tp", "ep")
NEW_TOKENS = 2
KERNELS = ("ragged-dot-tpu", "flash-attention-tpu")
# Plan-major order: consecutive cases with the same shapes reuse a rank's compiles.
MATRIX = [(plan, family) for plan in PLANS for family in tm.FAMILIES]
# At 4 ranks only Qwen3-MoE under expert parallelism, where a decode step
# leaves ranks with no rows (a path 2 ranks never take). The other pairs take
# the same paths there as at 2 ranks (token dispatch, router masking; under
# TP one KV head per rank is the single-process MQA case), and the 4-rank
# world is most of the launcher's CPU time (four ranks per case) in a suite
# held to 25 minutes on 2 cores.
WIDEST = [("ep", "qwen3_moe")]
PALLAS = ("tp", "qwen3_moe", 2)


def _worlds(plan, family) -> list[int]:
    return [w for w in WORLDS if w == min(WORLDS) or (plan, family) in WIDEST]


def _references(models: dict, path: Path):
    """The single-process eager model's logits, greedy tokens, loss and gradients."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, tm.VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    refs = {}
    for family, model_dir in models.items():
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
        model.eval()
        assert model.config._experts_implementation == "grouped_mm"  # transformers' default
        with torch.no_grad():
            logits = model(ids).logits
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        loss = model(ids, labels=ids).loss
        loss.backward()
        refs[family] = dict(
            ids=ids,
            logits=logits,
            generate=gen,
            loss=loss.detach(),
            grads={n: p.grad for n, p in model.named_parameters()},
        )
    torch.save(refs, path)


@pytest.fixture(scope="module")
def runs(published, tmp_path_factory):
    """Runs every case; {(world, plan, family, impl): {rank: record}} plus launch info."""
    d = tmp_path_factory.mktemp("multirank")
    spec_path = d / "spec.json"
    env = dict(os.environ)
    # The test session's compiler-dump flags (bench) are not for the ranks; its
    # other XLA flags (conftest.py's CPU optimisation level) are.
    env.update(env_without_dumps(env))
    env["JAX_COMPILATION_CACHE_DIR"] = str(d / "jax-cache")  # shared by the ranks' compiles
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    # Started first: its imports overlap with building the models and references below.
    launcher = subprocess.Popen(
        [sys.executable, str(HERE / "launch.py"), str(spec_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        models = {}
        for family in tm.FAMILIES:
            models[family] = str(d / family)
            tm.save(family, models[family])
        _references(models, d / "refs.pt")
        cases = [
            dict(family=f, plan=p, impl="ours", worlds=_worlds(p, f), checks=["generate", "grads"])
            for p, f in MATRIX
        ]
        plan, family, world = PALLAS
        cases.append(
            dict(family=family, plan=plan, impl="pallas", worlds=[world], checks=["grads"])
        )
        spec = dict(
            kernels={f"tpu-kernels/{k}": str(published[k]) for k in KERNELS},
            models=models,
            refs=str(d / "refs.pt"),
            out=str(d),
            worlds=list(WORLDS),
            timeout_s=600,
            new_tokens=NEW_TOKENS,
            cases=cases,
        )
        tmp = d / "spec.json.tmp"
        tmp.write_text(json.dumps(spec))
        tmp.rename(spec_path)  # atomic: the launcher never reads half a spec
        output, _ = launcher.communicate(timeout=len(WORLDS) * spec["timeout_s"] + 120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    records = {}
    for world in WORLDS:
        for rank in range(world):
            f = d / f"rank{rank}_world{world}.json"
            for rec in json.loads(f.read_text()) if f.exists() else []:
                key = (world, rec["plan"], rec["family"], rec["impl"])
                records.setdefault(key, {})[rank] = rec
    status_file = d / "status.json"
    status = json.loads(status_file.read_text()) if status_file.exists() else None
    return dict(records=records, status=status, returncode=launcher.returncode, output=output)


def _ranks(runs, world, plan, family, impl="ours"):
    """Every rank's record of one case; fails with why when a rank has none or raised."""
    got = runs["records"].get((world, plan, family, impl), {})
    if len(got) < world:
        errors = [
            f"{k}, rank {r}:\n{rec['error']}"
            for k, by_rank in runs["records"].items()
            for r, rec in by_rank.items()
            if k[0] == world and "error" in rec
        ]
        pytest.fail(
            f"case did not run on ranks {sorted(set(range(world)) - set(got))} of {world}; "
            f"rank exit codes {runs['status']}, launcher exit {runs['returncode']}\n"
            + "\n".join(errors)
            + f"\nlauncher output tail:\n{runs['output'][-3000:]}"
        )
    for rank, rec in sorted(got.items()):
        assert "error" not in rec, f"rank {rank} raised:\n{rec['error']}"
    return [got[r] for r in range(world)]


PARAMS = [
    pytest.param(world, plan, family, id=f"{plan}-{family}-{world}ranks")
    for world in WORLDS
    for plan, family in MATRIX
    if world in _worlds(plan, family)
]


def _ratio_msg(rank, what, value):
    ratio, why = value
    return f"rank {rank} {what}: error/allowance {ratio:.3g} {why}"


@pytest.mark.parametrize("world, plan, family", PARAMS)
def test_plan_shards_and_reaches_our_kernels(runs, world, plan, family):
    for rank, rec in enumerate(_ranks(runs, world, plan, family)):
        assert rec["experts_implementation"] == "ragged_dot_tpu"
        assert rec["attn_implementation"] == "tpu_attention"
        assert rec["calls"]["experts"] > 0 and rec["calls"]["attention"] > 0, rec["calls"]
        assert rec["sharding"] == _expected_sharding(plan, family, world), f"rank {rank}"


def _expected_sharding(plan, family, world):
    e, i, h = tm.NUM_EXPERTS, tm.MOE_INTERMEDIATE, tm.HIDDEN
    transposed = family == "gpt_oss"  # [E, in, out]
    gate_up = [e, h, 2 * i] if transposed else [e, 2 * i, h]
    down = [e, i, h] if transposed else [e, h, i]
    q_rows = tm.HEADS * tm.HEAD_DIM
    placements = []
    tensor_parallel = plan in ("tp", "tp_ep") and family != "gpt_oss"  # GPT-OSS: no TP plan
    if tensor_parallel:
        q_rows //= world
    if plan in ("ep", "tp_ep"):  # expert rules take precedence over the TP plan's
        gate_up[0] //= world
        down[0] //= world
        e //= world
        placements = [["S(0)"], ["S(0)"]]
    elif tensor_parallel:
        gate_up[1] //= world
        down[2] //= world
        placements = [["_S(1, 2)"], ["S(2)"]]  # gate and up halves split separately

    def entry(shape, placement):
        return {"dtensor": bool(placement), "placements": placement, "local_shape": shape}

    return {
        "num_experts_local": e,
        "gate_up_proj": entry(gate_up, placements[0] if placements else []),
        "down_proj": entry(down, placements[1] if placements else []),
        "q_proj_local_shape": [q_rows, tm.HIDDEN],
    }


@pytest.mark.parametrize("world, plan, family", PARAMS)
def test_logits_match_single_process(runs, world, plan, family):
    for rank, rec in enumerate(_ranks(runs, world, plan, family)):
        assert rec["logits"][0] <= 1.0, _ratio_msg(rank, "logits", rec["logits"])


@pytest.mark.parametrize("world, plan, family", PARAMS)
def test_greedy_generation_matches_single_process(runs, world, plan, family):
    for rank, rec in enumerate(_ranks(runs, world, plan, family)):
        g = rec["generate"]
        assert g["equal"], f"rank {rank}: new tokens {g['got']} != single process {g['want']}"


@pytest.mark.parametrize("world, plan, family", PARAMS)
def test_gradients_match_single_process(runs, world, plan, family):
    for rank, rec in enumerate(_ranks(runs, world, plan, family)):
        _assert_gradients(rank, rec)


def _assert_gradients(rank, rec):
    assert rec["loss"][0] <= 1.0, _ratio_msg(rank, "loss", rec["loss"])
    grads = rec["grads"]
    assert not grads["missing"], f"rank {rank}: no gradient entry for {grads['missing']}"
    bad = {n: v for n, v in grads["per_param"].items() if not v[0] <= 1.0}
    assert not bad, "; ".join(_ratio_msg(rank, n, v) for n, v in sorted(bad.items()))


def test_pallas_kernels_at_tensor_parallel_shapes(runs):
    """The Pallas kernels (interpret mode), not the reference programs, inside the TP plan."""
    plan, family, world = PALLAS
    for rank, rec in enumerate(_ranks(runs, world, plan, family, impl="pallas")):
        assert rec["calls"]["experts"] > 0 and rec["calls"]["attention"] > 0, rec["calls"]
        assert rec["sharding"] == _expected_sharding(plan, family, world)
        assert rec["logits"][0] <= 1.0, _ratio_msg(rank, "logits", rec["logits"])
        _assert_gradients(rank, rec)


def test_enable_expert_parallel_flag_resolution():
    """The deprecated flag: with tp_size it is the "ep" plan; alone it distributes nothing."""
    from transformers import PreTrainedModel
    from transformers.distributed import DistributedConfig

    with pytest.warns(FutureWarning):
        flag = DistributedConfig(tp_size=4, enable_expert_parallel=True)
    explicit = DistributedConfig(tp_size=4, ep_size=4, tp_plan={})
    assert flag.to_dict() == explicit.to_dict()

    with pytest.warns(FutureWarning):
        alone = DistributedConfig(enable_expert_parallel=True)
    assert (alone.tp_size, alone.ep_size, alone.enable_expert_parallel) == (1, 1, False)
    _, _, mesh = PreTrainedModel.prepare_distribute_model(alone)
    assert mesh is None  # from_pretrained shards nothing


def test_gpt_oss_has_no_tensor_parallel_plan():
    """Evidence for the GPT-OSS "tp" case: transformers only splits its LM head."""
    import transformers as tf

    assert not tf.GptOssConfig.base_model_tp_plan
    assert tf.GptOssForCausalLM._tp_plan == {"lm_head": "colwise_gather_output"}
    assert tf.GptOssConfig.base_model_ep_plan  # expert parallelism is defined
