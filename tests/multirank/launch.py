"""Runs the multi-rank cases: `python launch.py SPEC.json` (see test_multirank.py).

One interpreter imports torch, JAX, transformers, the four model classes and
our published kernels once, then forks the ranks of each world size
(torch.distributed over gloo, the env:// rendezvous torchrun sets up), so no
rank pays the ~10 s of imports again. Nothing in this parent touches JAX's
backend, gloo or torch's thread pools before forking. The imports overlap
with the test building the models and references: the spec file appears
when they are ready.

Each rank loads every case's model through transformers' own distributed
loading, compares it with the single-process references and writes one JSON
record per case (rank{r}_world{n}.json, rewritten after every case so a
crash keeps what ran).
"""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback

# Read when the ranks first touch JAX's backend. The XLA CPU compiles of our
# ops' reference programs are most of a rank's time (every shape is a compile;
# expert parallelism makes the experts' row count data-dependent): without
# LLVM's optimisation passes they take about half as long, same results, and
# with XLA:CPU's older fusion emitters less again (tests/multirank: 102 ->
# 60 CPU-seconds, 2026-12-06). No rank compiles for a TPU, so libtpu, which
# rejects XLA:CPU flags (tests/conftest.py), never reads these.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    + " --xla_cpu_use_fusion_emitters=false"
)
# torch_tpu (a torch backend entry point) is not needed on CPU and costs ~5 s per import.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import jax  # noqa: E402,F401  (imported only: its backend starts in the ranks)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401
import transformers  # noqa: E402
import transformers.distributed  # noqa: E402,F401

ATTN = "tpu_attention"
EXPERTS = "ragged_dot_tpu"
# f32 everywhere: differences come from summation order (all-reduces of
# partial sums, other matmul blockings), a few f32 ulps of the scale.
RTOL = 1e-4
MODEL_CLASSES = (
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
    "Gemma4ForCausalLM",
)
CALLS = {"experts": 0, "attention": 0}


def _counted(what, fn):
    """fn, counting its calls: a case that never reached our kernels must not pass."""

    def wrapper(*args, **kwargs):
        CALLS[what] += 1
        return fn(*args, **kwargs)

    return wrapper


def register_kernels(spec):
    """get_kernel the published builds (LOCAL_KERNELS) and register them with transformers."""
    os.environ["LOCAL_KERNELS"] = ":".join(f"{r}={p}" for r, p in spec["kernels"].items())
    from kernels import get_kernel
    from transformers import AttentionInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    rd, fa = (get_kernel(r, version=1, trust_remote_code=[r]) for r in spec["kernels"])
    for mod, path in zip((rd, fa), spec["kernels"].values()):
        assert mod.__file__.startswith(path), (mod.__file__, path)
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS, _counted("experts", rd.experts_forward))
    AttentionInterface.register(ATTN, _counted("attention", fa.attention_forward))
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


def distributed_config(plan: str, world: int):
    from transformers.distributed import DistributedConfig

    if plan == "tp":  # the model's tensor-parallel plan over every rank
        return DistributedConfig(tp_plan="auto")
    if plan == "ep":  # experts split over every rank, no dense tensor parallelism
        return DistributedConfig(tp_size=world, ep_size=world, tp_plan={})
    if plan == "tp_ep":  # the model's TP plan for the dense modules, EP for the experts
        return DistributedConfig(tp_plan="auto", ep_size=world)
    raise ValueError(plan)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(got, want):
    """Largest |got - want| over its allowance RTOL * (max|want| + |want|): <= 1 passes."""
    got, want = got.detach().float(), want.detach().float()
    if got.shape != want.shape:
        return math.inf, f"shape {list(got.shape)} != {list(want.shape)}"
    allow = RTOL * (want.abs().max() + want.abs()) + 1e-12
    return ((got - want).abs() / allow).max().item(), ""


def _local_shape(p):
    from torch.distributed.tensor import DTensor

    return list(p.to_local().shape if isinstance(p, DTensor) else p.shape)


def _sharding(model):
    """What the plan did: one expert module's local weights and count, q_proj's local rows."""
    from torch.distributed.tensor import DTensor

    experts = next(m for n, m in model.named_modules() if n.endswith("experts"))
    out = {"num_experts_local": int(experts.num_experts)}
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(experts, name)
        out[name] = {
            "dtensor": isinstance(p, DTensor),
            "placements": [str(x) for x in p.placements] if isinstance(p, DTensor) else [],
            "local_shape": _local_shape(p),
        }
    out["q_proj_local_shape"] = _local_shape(model.model.layers[0].self_attn.q_proj.weight)
    return out


def run_case(case, refs, spec, world):
    from transformers import AutoModelForCausalLM

    family, plan, impl = case["family"], case["plan"], case["impl"]
    ref = refs[family]
    kw = {"distributed_config": distributed_config(plan, world)}
    if impl == "default":  # transformers' own experts and eager attention, same plan
        kw["attn_implementation"] = "eager"
    else:
        kw.update(attn_implementation=ATTN, experts_implementation=EXPERTS)
    # "pallas": the Pallas kernels in interpret mode; "ours": our ops' XLA reference bodies.
    os.environ["TPU_KERNELS_CPU_IMPL"] = "interpret" if impl == "pallas" else "reference"
    model = AutoModelForCausalLM.from_pretrained(spec["models"][family], **kw).eval()
    rec = {
        "sharding": _sharding(model),
        "experts_implementation": model.config._experts_implementation,
        "attn_implementation": model.config._attn_implementation,
    }
    CALLS.update(experts=0, attention=0)
    ids = ref["ids"]
    clock = time.process_time()
    with torch.no_grad():
        logits = model(ids).logits
    rec["logits"] = _compare(logits, ref["logits"])
    rec["cpu_s_logits"] = round(time.process_time() - clock, 2)
    if "generate" in case["checks"]:
        clock = time.process_time()
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=spec["new_tokens"], do_sample=False)
        rec["generate"] = {
            "equal": bool(torch.equal(gen, ref["generate"])),
            "got": gen[:, ids.shape[1] :].tolist(),
            "want": ref["generate"][:, ids.shape[1] :].tolist(),
        }
        rec["cpu_s_generate"] = round(time.process_time() - clock, 2)
    if "grads" in case["checks"]:
        clock = time.process_time()
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        rec["loss"] = _compare(loss, ref["loss"])
        grads = {}
        # Every rank gathers the same parameters in the same order (full_tensor is a collective).
        for name, p in model.named_parameters():
            if p.grad is None:
                grads[name] = (math.inf, "no gradient")
            else:
                grads[name] = _compare(_full(p.grad), ref["grads"][name])
        rec["grads"] = {"per_param": grads, "missing": sorted(set(ref["grads"]) - set(grads))}
        rec["cpu_s_grads"] = round(time.process_time() - clock, 2)
    rec["calls"] = dict(CALLS)
    return rec


def _die_with_parent():
    """This process must not outlive its parent (the test's timeout kills the launcher)."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def rank_main(rank, world, port, spec, refs):
    _die_with_parent()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)  # the ranks share two cores
    # Initialised here, as torchrun users do (transformers then reuses it),
    # with a second group whose short timeout ends a case that left a rank behind.
    dist.init_process_group("gloo")
    between_cases = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
    out = os.path.join(spec["out"], f"rank{rank}_world{world}.json")
    records = []
    for case in spec["cases"]:
        if world not in case["worlds"]:
            continue
        t0 = time.process_time()
        rec = {k: case[k] for k in ("family", "plan", "impl")}
        try:
            rec.update(run_case(case, refs, spec, world))
        except Exception:
            rec["error"] = traceback.format_exc()
        rec["cpu_s"] = round(time.process_time() - t0, 2)
        records.append(rec)
        with open(out, "w") as f:
            json.dump(records, f)
        # A case that raised on every rank at the same point (an argument
        # check) leaves them in step: go on. One that left a rank waiting in a
        # collective does not: exit non-zero and the launcher ends the others.
        try:
            dist.barrier(group=between_cases)
        except Exception:
            os._exit(1)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(ctx, world, spec, refs):
    port = _free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, spec, refs)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + spec["timeout_s"]
    # A rank that died leaves the others waiting in a collective: end them.
    while any(p.is_alive() for p in procs):
        if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.2)
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]


def main(spec_path):
    _die_with_parent()
    for name in MODEL_CLASSES:  # transformers imports model modules lazily: once, here
        getattr(transformers, name)
    waited = time.monotonic()
    while not os.path.exists(spec_path):
        if time.monotonic() - waited > 600:
            raise TimeoutError(f"{spec_path} never appeared")
        time.sleep(0.1)
    with open(spec_path) as f:
        spec = json.load(f)
    register_kernels(spec)
    refs = torch.load(spec["refs"])
    ctx = mp.get_context("fork")
    status = {world: _run_world(ctx, world, spec, refs) for world in spec["worlds"]}
    with open(os.path.join(spec["out"], "status.json"), "w") as f:
        json.dump(status, f)


if __name__ == "__main__":
    main(sys.argv[1])
