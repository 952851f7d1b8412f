#!/usr/bin/env python3
"""The README's main job, end to end on the machine at hand.

1. build every Hub kernel with publish.py into dist/;
2. load each one the way a user does, `get_kernel("org/name", version=1)`
   (LOCAL_KERNELS points the loader at dist/, no network);
3. run a tiny random MoE model (Qwen3-MoE layout) with transformers' default
   experts path and with `experts_implementation="ragged_dot_tpu"` from the
   loaded kernel, and check that greedy generation agrees; kernelize its
   RMSNorm layers with rmsnorm-tpu and check the logits agree;
4. run the short batch-size sweep of the TPU performance model (bench/);
5. model a whole Qwen3-30B-A3B decode step on a v6e-8 under tensor
   parallelism (bench/decode_step.py: tokens/s against batch size, ours
   against transformers' grouped_mm), its experts block compiled for the
   8-chip topology.

On a TPU host the kernels run on the TPU; elsewhere they run through JAX on
the CPU (Pallas interpret mode) and the job says so.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _say(msg: str) -> None:
    print(f"[main] {msg}", flush=True)


def device() -> str:
    """ "tpu" when torch has a TPU accelerator (torch_tpu allows only the public
    `torch.accelerator` API: `torch.tpu.is_available()` raises even on a TPU host)."""
    import torch

    try:
        acc = torch.accelerator.current_accelerator(check_available=True)
    except Exception:  # noqa: BLE001 - no usable accelerator runtime
        acc = None
    return "tpu" if acc is not None and acc.type == "tpu" else "cpu"


def quiet_libraries() -> None:
    """Progress bars of tiny local models and kernelize's expected notices are not news here."""
    import logging

    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as tf_logging

    disable_progress_bars()
    tf_logging.disable_progress_bar()
    # kernelize logs, for every hub layer we did not map (rotary_pos_emb, SiLU), that it keeps
    # the original forward: expected, since only RMSNorm is mapped.
    logging.getLogger("kernels.layer.layer").setLevel(logging.ERROR)


_BAR = re.compile(rb"bench( x\d+)?:[^\]]*\]")


def run_sweep(cmd: list[str], log_path: Path) -> None:
    """Run the sweep with its stderr in `log_path`; only its progress bar reaches the terminal.

    The sweep's workers compile for TPUs that are not attached: libtpu logs
    its host probing, and the compiler logs internal errors with stack traces
    for programs it still compiles; none of that is a failure (the sweep's
    exit status is). On failure the log's tail is printed.
    """
    import threading

    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # Its own report (stdout) is printed after the progress bar, not into its line.
    out_lines: list[bytes] = []
    reader = threading.Thread(target=lambda: out_lines.extend(proc.stdout), daemon=True)
    reader.start()
    shown, pending = False, b""
    with open(log_path, "wb") as log:
        for chunk in iter(lambda: proc.stderr.read1(65536), b""):
            log.write(chunk)
            *parts, pending = re.split(rb"[\r\n]", pending + chunk)
            # tqdm's line ("bench x2:  50%|...| 14/28 [03:35<05:37, 24.09s/pt]"), without whatever
            # a worker wrote right after it on the same line.
            bars = [m.group(0) for m in map(_BAR.match, parts) if m]
            if bars:
                sys.stderr.write("\r" + bars[-1].decode(errors="replace"))
                sys.stderr.flush()
                shown = True
        log.write(pending)
    if shown:
        sys.stderr.write("\n")
        sys.stderr.flush()
    rc = proc.wait()
    reader.join()
    sys.stdout.write(b"".join(out_lines).decode(errors="replace"))
    sys.stdout.flush()
    lines = log_path.read_bytes().decode(errors="replace").splitlines()
    if rc != 0:
        sys.stderr.write("\n".join(lines[-60:]) + "\n")
        raise SystemExit(f"the sweep failed (exit {rc}); its full log: {log_path}")
    _say(f"sweep log (compiler and worker messages, {len(lines)} lines): {log_path}")


def build(out: Path) -> dict[str, Path]:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "publish.py"), "build", "--out", str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    lib = tomllib.loads((ROOT / "build.toml").read_text())["library"]
    repos = {}
    for folder in lib["kernels"]:
        general = tomllib.loads((ROOT / "kernels" / folder / "build.toml").read_text())["general"]
        repo_id = f"{lib['org']}/{general['name']}"
        repos[repo_id] = out / general["name"]
    return repos


def load_all(repos: dict[str, Path]):
    os.environ["LOCAL_KERNELS"] = ":".join(f"{r}={p}" for r, p in repos.items())
    from kernels import get_kernel

    loaded = {}
    for repo_id, path in repos.items():
        k = get_kernel(repo_id, version=1, trust_remote_code=[repo_id])
        loaded[repo_id.split("/", 1)[1]] = k
        _say(
            f"built {path}; get_kernel({repo_id!r}, version=1) -> {k.__name__} "
            f"({', '.join(k.__all__)})"
        )
    return loaded


def tiny_moe(save_dir: Path):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).float()
    model.save_pretrained(save_dir)
    return save_dir


def run_moe(loaded, dev: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    rd = loaded.get("ragged-dot-tpu")
    if rd is None:
        _say("ragged-dot-tpu is not built yet: skipping the MoE model")
        return
    ALL_EXPERTS_FUNCTIONS.register("ragged_dot_tpu", rd.experts_forward)
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_moe(Path(tmp))
        ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0)).to(dev)
        outs = {}
        for impl in ("grouped_mm", "ragged_dot_tpu"):
            model = (
                AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl)
                .to(dev)
                .eval()
            )
            with torch.no_grad():
                outs[impl] = model.generate(ids, max_new_tokens=8, do_sample=False)
            _say(f"tiny Qwen3-MoE, experts_implementation={impl!r}: {outs[impl][0, -8:].tolist()}")
        same = torch.equal(outs["grouped_mm"], outs["ragged_dot_tpu"])
        _say(f"greedy tokens identical: {same}")
        if not same:
            raise SystemExit("ragged_dot_tpu disagrees with transformers' grouped_mm")


def run_rmsnorm(loaded, repos, dev: str) -> None:
    import torch
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
    from transformers import LlamaConfig, LlamaForCausalLM

    if "rmsnorm-tpu" not in loaded:
        return
    torch.manual_seed(0)
    ref = (
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=128,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        )
        .float()
        .to(dev)
        .eval()
    )
    model = copy.deepcopy(ref)
    repo_path = next(p for r, p in repos.items() if r.endswith("/rmsnorm-tpu"))
    mapping = {"RMSNorm": {dev: LocalLayerRepository(repo_path=repo_path, layer_name="RMSNorm")}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        model = kernelize(model, device=dev, mode=Mode.INFERENCE)
    ids = torch.randint(0, 128, (2, 9)).to(dev)
    with torch.no_grad():
        err = (model(ids).logits - ref(ids).logits).abs().max().item()
    _say(f"tiny Llama with kernelized rmsnorm-tpu: max |logits - reference| = {err:.2e}")
    if err > 1e-3:
        raise SystemExit("kernelized RMSNorm disagrees with transformers")


MAIN_JOB_IMPLS = (
    "ours_moe_experts",
    "hf_grouped_mm",
    "ours_rmsnorm",
    "xla_rmsnorm",
    "ours_flash_attention",
    "jax_splash_attention",
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", default=str(ROOT / "results"), help="where the sweep report and plots go"
    )
    p.add_argument(
        "--dist", default=str(ROOT / "dist"), help="where publish.py writes the Hub repos"
    )
    p.add_argument("--full", action="store_true", help="full sweep instead of the quick one")
    args = p.parse_args(argv)

    quiet_libraries()
    dev = device()
    if dev == "cpu":
        _say(
            "no TPU on this machine: kernels run through JAX on the CPU (Pallas interpret mode); "
            "TPU performance comes from the model in bench/, not from timings"
        )
    else:
        _say("TPU found: kernels run on the TPU")
    repos = build(Path(args.dist))
    loaded = load_all(repos)
    run_rmsnorm(loaded, repos, dev)
    run_moe(loaded, dev)
    sweep = [sys.executable, "-m", "bench", "--out", args.out]
    if not args.full:
        # The short sweep: our kernels against what a user runs without them
        # (transformers' grouped_mm, XLA RMSNorm, JAX's splash attention), on
        # v6e and tpu7x. `python -m bench --quick` adds every other baseline;
        # --full, every model, batch and generation.
        sweep += ["--quick", "--impls", ",".join(MAIN_JOB_IMPLS)]
    _say("sweep: " + " ".join(sweep[1:]))
    run_sweep(sweep, Path(args.out) / "sweep.log")
    _say(
        f"report: {Path(args.out) / 'results.md'}; plots: {Path(args.out)}/*.png; data: {Path(args.out)}/*.json"
    )
    decode_out = Path(args.out) / "decode_step"
    decode = [sys.executable, "-m", "bench.decode_step", "--out", str(decode_out)]
    if not args.full:
        # One model and plan: the announcement's Qwen3-30B-A3B on a v6e-8 under
        # tensor parallelism. --full: the README's whole table (four models, both
        # plans, KV 1k and 8k; about 20 minutes).
        # Batches as the quick sweep's (3.5 min with 1, 8, 64, 512; the job is
        # held to 10 minutes on 2 cores).
        decode += ["--models", "qwen3-30b-a3b", "--parallel", "tp8", "--kv", "1024"]
        decode += ["--batches", "1,64,512"]
    else:
        decode += ["--models", "qwen3-30b-a3b,gemma-4-26b-a4b,gpt-oss-20b,mixtral-8x7b"]
    _say("decode step: " + " ".join(decode[1:]))
    run_sweep(decode, decode_out / "decode_step.log")
    _say(
        f"decode-step report: {decode_out / 'results.md'}; plot: {decode_out / 'decode_tokens_per_s.png'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
