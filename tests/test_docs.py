"""Every Python snippet of the README and of the kernel cards runs as written.

The cards are read as published: `scripts/publish.py build` fills their
`{repo_id}`/`{version}` placeholders. Each document's snippets run in a fresh
Python process (this file run as a script), in order, each in its own
namespace, the way a user pastes them; after each snippet its check (below)
asserts on what the snippet produced. Nothing else in a snippet is changed
than the substitutions declared in SUBSTITUTIONS.

No network: `FakeKernelHub` stands in for the Hugging Face Hub API that
`kernels` calls (publisher trust, version branches, file tree, downloads) and
serves the built repositories under their published ids. It answers, like the
real Hub for an organisation without the trusted-publisher flag, that the
publisher is not trusted: `kernels`' own trust check runs unchanged, so a
snippet passes only with the trust it documents. `test_snippets_need_their_trust`
runs each kernel-loading snippet with its trust argument removed and expects
"not from a trusted publisher".
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------------------------
# The only changes made to a documented snippet before it runs.
# --------------------------------------------------------------------------------------------
# 1. Hub model ids -> tiny random models of the same family, saved locally (`_save_tiny`).
TINY_MODELS = {
    "Qwen/Qwen3-30B-A3B": "qwen3_moe",
    "Qwen/Qwen3-8B": "qwen3",
    "meta-llama/Llama-3.1-8B": "llama",
    "openai/gpt-oss-20b": "gpt_oss",
    "openai/gpt-oss-120b": "gpt_oss_mxfp4",  # GPT-OSS's own MXFP4 checkpoint format
}
# 2. The device string literal "tpu" -> "cpu" where no TPU is attached (torch has no "tpu" device then).
DEVICE_LITERAL = '"tpu"'
# Kernel repo ids are not substituted: FakeKernelHub serves the built repositories under them.
SUBSTITUTIONS = (TINY_MODELS, DEVICE_LITERAL)


def substitute(code: str, tiny_paths: dict[str, str], device: str) -> str:
    for model_id, path in tiny_paths.items():
        code = code.replace(json.dumps(model_id), repr(path))
    if device != "tpu":
        code = code.replace(DEVICE_LITERAL, json.dumps(device))
    return code


# What each snippet must produce: one check per ```python block, in document order.
CHECKS = {
    "README.md": [
        "check_experts",
        "check_string_attention",
        "check_registered_attention",
        "check_mxfp4",
        "check_gpt_oss_mxfp4",
    ],
    "rmsnorm-tpu": ["check_rmsnorm_functions", "check_kernelize"],
    "ragged-dot-tpu": ["check_experts"],
    "flash-attention-tpu": ["check_string_attention", "check_registered_attention"],
}

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_TRUST = re.compile(r",\s*(trust_remote_code=\[[^\]]*\]|allow_all_kernels=True)")
_QUOTED_REPO = re.compile(r'"([\w.-]+/[\w.-]+)"')


def python_blocks(text: str) -> list[str]:
    return _BLOCK.findall(text)


def strip_trust(code: str) -> tuple[str, int]:
    return _TRUST.subn("", code)


# --------------------------------------------------------------------------------------------
# Tiny random models (f32, 2 layers; norm weights away from 1 so a wrong weight use shows).
# --------------------------------------------------------------------------------------------
def _save_tiny(family: str, path: Path) -> None:
    import torch
    import transformers as tf

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    if family == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(
            tf.Qwen3MoeConfig(
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                **common,
            )
        )
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common))
    elif family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif family in ("gpt_oss", "gpt_oss_mxfp4"):  # attention sinks + sliding window
        model = tf.GptOssForCausalLM(
            tf.GptOssConfig(
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=4,
                layer_types=["sliding_attention", "full_attention"],
                **common,
            )
        )
        for layer in model.model.layers:
            layer.self_attn.sinks.data.normal_(0.0, 1.0)
    else:
        raise ValueError(family)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.uniform_(0.5, 1.5)
    model.float().save_pretrained(path)
    if family == "gpt_oss_mxfp4":
        from mxfp4_checkpoints import as_gpt_oss_mxfp4

        as_gpt_oss_mxfp4(path)


# --------------------------------------------------------------------------------------------
# The Hub, as `kernels` 0.17.2 calls it, serving the built repositories.
# --------------------------------------------------------------------------------------------
class FakeKernelHub:
    """The HfApi methods `kernels` uses, answered from local repos; the publisher is never trusted."""

    def __init__(self, repos: dict[str, str]):
        self.repos = {rid: Path(p) for rid, p in repos.items()}
        self.trust_queries: list[str] = []

    def _repo(self, repo_id, repo_type, revision=None) -> Path:
        assert repo_type == "kernel", repo_type
        if repo_id not in self.repos:
            raise FileNotFoundError(f"fake hub: no repository {repo_id}")
        if revision is not None and revision not in (
            self._commit(repo_id),
            f"v{self._version(repo_id)}",
        ):
            raise FileNotFoundError(f"fake hub: {repo_id} has no revision {revision}")
        return self.repos[repo_id]

    def _version(self, repo_id) -> int:
        return tomllib.loads((self.repos[repo_id] / "build.toml").read_text())["general"]["version"]

    @staticmethod
    def _commit(repo_id) -> str:
        return hashlib.sha1(repo_id.encode()).hexdigest()

    def get_organization_overview(self, organization):
        from types import SimpleNamespace

        self.trust_queries.append(organization)
        return SimpleNamespace(name=organization, trustedKernelPublisher=False)

    def list_repo_refs(self, repo_id, *, repo_type=None, **_):
        from huggingface_hub.hf_api import GitRefInfo, GitRefs

        self._repo(repo_id, repo_type)
        v = f"v{self._version(repo_id)}"
        return GitRefs(
            branches=[
                GitRefInfo(name=v, ref=f"refs/heads/{v}", target_commit=self._commit(repo_id))
            ],
            converts=[],
            tags=[],
        )

    def list_repo_tree(self, repo_id, path_in_repo=None, *, repo_type=None, revision=None, **_):
        from huggingface_hub.hf_api import RepoFolder

        base = self._repo(repo_id, repo_type, revision) / (path_in_repo or "")
        return [
            RepoFolder(path=p.relative_to(self.repos[repo_id]).as_posix(), oid="0" * 40)
            for p in sorted(base.iterdir())
            if p.is_dir()
        ]

    def hf_hub_download(self, repo_id, filename, *, repo_type=None, revision=None, **_):
        path = self._repo(repo_id, repo_type, revision) / filename
        if not path.is_file():
            raise FileNotFoundError(f"fake hub: {repo_id} has no {filename}")
        return str(path)

    def snapshot_download(self, repo_id, *, repo_type=None, revision=None, **_):
        return str(self._repo(repo_id, repo_type, revision))

    def __getattr__(self, name):
        raise AssertionError(
            f"fake hub: kernels called HfApi.{name}, which the stand-in does not serve"
        )


def install_fake_hub(hub: FakeKernelHub) -> None:
    """Every `kernels` module that holds `_get_hf_api` gets the stand-in; nothing else is patched."""
    import importlib

    for name in (
        "kernels.hf_hub",
        "kernels.load",
        "kernels.install",
        "kernels.layer.layer",
        "kernels.layer.func",
    ):
        importlib.import_module(name)
    patched = 0
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] == "kernels" and hasattr(mod, "_get_hf_api"):
            mod._get_hf_api = lambda *a, **k: hub
            patched += 1
    assert patched >= 5, patched


# --------------------------------------------------------------------------------------------
# Checks: what each snippet must have produced (run after it, in its namespace).
# --------------------------------------------------------------------------------------------
def _ids(n=2, seq=8):
    import torch

    return torch.randint(0, 96, (n, seq), generator=torch.Generator().manual_seed(3))


def _counting(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapped


def _reference_logits(model, ids, mask=None, **load_kwargs):
    import torch
    from transformers import AutoModelForCausalLM

    ref = (
        AutoModelForCausalLM.from_pretrained(model.name_or_path, **load_kwargs)
        .to(model.device)
        .eval()
    )
    with torch.no_grad():
        return ref(ids, attention_mask=mask).logits


def check_experts(ns, ctx):
    import torch
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model, kernel = ns["model"], ns["kernel"]
    assert model.device.type == ctx["device"], model.device
    assert kernel.__file__.startswith(ctx["repos"][ctx["org"] + "/ragged-dot-tpu"]), kernel.__file__
    assert model.config._experts_implementation == "ragged_dot_tpu"
    calls = []
    ALL_EXPERTS_FUNCTIONS.register("ragged_dot_tpu", _counting(kernel.experts_forward, calls))
    ids = _ids().to(model.device)
    with torch.no_grad():
        logits = model(ids).logits
    assert len(calls) == model.config.num_hidden_layers, calls  # our experts ran in every MoE layer
    want = _reference_logits(model, ids, experts_implementation="eager")
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def check_mxfp4(ns, ctx):
    import numpy as np

    # The checkpoint's bytes decoded by the OCP table, independently of the kernel.
    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    blocks, scales = ns["blocks"], ns["scales"]
    vals = np.stack([table[blocks & 15], table[blocks >> 4]], -1).reshape(*blocks.shape[:2], -1)
    w = vals * np.exp2(scales.astype(np.float64) - 127).repeat(32, -1)  # [G, N, K]
    x, out = ns["x"].float().cpu().numpy(), ns["out"]
    assert out.shape == (10, w.shape[1]) and out.dtype == ns["torch"].bfloat16
    groups = np.repeat(np.arange(4), [3, 0, 5, 2])
    want = np.einsum("mk,mnk->mn", x, w[groups])
    np.testing.assert_allclose(out.float().cpu().numpy(), want, rtol=2**-7, atol=1e-2)


def check_gpt_oss_mxfp4(ns, ctx):
    import torch

    model, kernel = ns["model"], ns["kernel"]
    assert model.device.type == ctx["device"], model.device
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert type(experts).__name__ == "Mxfp4Experts", type(experts)
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.uint8
    ids = _ids().to(model.device)
    with torch.no_grad():
        logits = model(ids).logits.float()
    # transformers' own loader (bf16 experts dequantized by its code table), eager experts.
    kernel.use_mxfp4_quantizer(False)
    want = _reference_logits(
        model, ids, experts_implementation="eager", dtype=torch.bfloat16
    ).float()
    torch.testing.assert_close(logits, want, atol=5e-2 * want.abs().max().item(), rtol=5e-2)


def check_string_attention(ns, ctx):
    import torch
    import transformers.modeling_flash_attention_utils as fau

    model, repo_id = ns["model"], ctx["org"] + "/flash-attention-tpu"
    assert model.device.type == ctx["device"], model.device
    assert model.config._attn_implementation == repo_id
    ids = _ids().to(model.device)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: the unpad -> varlen path
    with torch.no_grad():
        for m in (None, mask):
            got = model(ids, attention_mask=m).logits
            want = _reference_logits(model, ids, m, attn_implementation="eager")
            keep = slice(None) if m is None else m.bool()
            torch.testing.assert_close(got[keep], want[keep], atol=1e-4, rtol=1e-4)
    # transformers' flash wrapper called the served build's functions (bound at the first forward).
    for fn in (fau._flash_fn, fau._flash_varlen_fn):
        assert fn.__code__.co_filename.startswith(ctx["repos"][repo_id]), fn


def check_registered_attention(ns, ctx):
    import torch
    from transformers import AttentionInterface

    model = ns["model"]
    fa = ns["fa"] if "fa" in ns else ns["kernel"]
    assert model.device.type == ctx["device"], model.device
    assert fa.__file__.startswith(ctx["repos"][ctx["org"] + "/flash-attention-tpu"]), fa.__file__
    assert model.config._attn_implementation == "tpu_attention"
    calls = []
    AttentionInterface.register("tpu_attention", _counting(fa.attention_forward, calls))
    ids = _ids().to(model.device)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    assert len(calls) == model.config.num_hidden_layers, calls
    want = _reference_logits(model, ids, mask, attn_implementation="eager")
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-4, rtol=1e-4)


def check_rmsnorm_functions(ns, ctx):
    import torch

    x, r, w = ns["x"], ns["r"], ns["w"]
    assert ns["rmsnorm"].__file__.startswith(ctx["repos"][ctx["org"] + "/rmsnorm-tpu"])

    def ref(v, weight):  # f32 math on the bf16 inputs, as documented
        v = v.float()
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()

    s_want = (x.float() + r.float()).to(torch.bfloat16)
    for name, got, want in (
        ("y", ns["y"], ref(x, w)),
        ("y_gemma", ns["y_gemma"], ref(x, 1 + w.float())),
        ("out", ns["out"], ref(s_want, w)),
    ):
        assert got.shape == x.shape and got.dtype == torch.bfloat16 and got.device == x.device, name
        # one bf16 rounding of the f32 result: within one bf16 step (2^-8 relative)
        torch.testing.assert_close(got.float(), want, atol=1e-6, rtol=2.0**-8, msg=name)
    assert torch.equal(ns["s"], s_want)  # the residual output is x + r in x's dtype


def check_kernelize(ns, ctx):
    import torch

    model = ns["model"]
    assert model.device.type == ctx["device"], model.device
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    mods = {m.forward.__func__.__module__ for m in norms}
    assert norms and all(n.startswith("_rmsnorm_tpu_") and n.endswith(".layers") for n in mods), (
        mods
    )
    layers = sys.modules[next(iter(mods))]
    assert layers.__file__.startswith(ctx["repos"][ctx["org"] + "/rmsnorm-tpu"]), layers.__file__
    ids = _ids().to(model.device)
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, _reference_logits(model, ids), atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# The runner (this file as a script, in a fresh process per document).
# --------------------------------------------------------------------------------------------
def _device() -> str:
    import torch

    try:
        acc = torch.accelerator.current_accelerator(check_available=True)
    except Exception:  # noqa: BLE001
        acc = None
    return "tpu" if acc is not None and acc.type == "tpu" else "cpu"


def run_document(spec: dict) -> list[dict]:
    """Run a document's snippets as documented (mode "documented"), or each kernel-loading one
    with its trust argument removed (mode "untrusted"). Separate processes: transformers 5.22.2
    marks a Hub attention implementation as loaded before loading it, so after a failed load a
    trusted retry in the same process gets a model whose attention is not registered."""
    import traceback

    ctx = dict(spec, device=_device())
    install_fake_hub(FakeKernelHub(spec["repos"]))
    results = []
    for i, (code, check) in enumerate(zip(spec["snippets"], spec["checks"])):
        code = substitute(code, spec["tiny"], ctx["device"])
        if spec["mode"] == "untrusted":
            code, n = strip_trust(code)
            if n == 0:
                continue
        ns = {"__name__": "__main__"}
        try:
            exec(compile(code, f"<{spec['doc']} snippet {i}, {spec['mode']}>", "exec"), ns)
            if spec["mode"] == "documented":
                globals()[check](ns, ctx)
            results.append(dict(snippet=i, ok=True))
        except Exception as e:  # noqa: BLE001
            results.append(
                dict(
                    snippet=i,
                    ok=False,
                    error=f"{type(e).__name__}: {e}",
                    trace=traceback.format_exc()[-4000:],
                )
            )
    return results


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    print("RESULTS " + json.dumps(run_document(spec)), flush=True)
    sys.exit(0)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------
import pytest  # noqa: E402


def _org() -> str:
    return tomllib.loads((ROOT / "build.toml").read_text())["library"]["org"]


def _doc_text(doc: str, published: dict) -> str:
    return (
        (ROOT / doc).read_text()
        if doc == "README.md"
        else (published[doc] / "README.md").read_text()
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_models")
    paths = {}
    for model_id, family in TINY_MODELS.items():
        _save_tiny(family, out / family)
        paths[model_id] = str(out / family)
    return paths


@pytest.fixture(scope="module")
def served(published):
    return {f"{_org()}/{name}": str(path) for name, path in published.items()}


def test_every_snippet_is_declared_and_uses_only_substituted_or_served_ids(published):
    org = _org()
    for doc, checks in CHECKS.items():
        blocks = python_blocks(_doc_text(doc, published))
        assert len(blocks) == len(checks), (
            f"{doc}: {len(blocks)} python snippets, {len(checks)} checks declared"
        )
        for code in blocks:
            assert "{repo_id}" not in code and "{version}" not in code  # publish.py filled the card
            for quoted in _QUOTED_REPO.findall(code):
                assert quoted in TINY_MODELS or quoted.startswith(org + "/"), (
                    f"{doc}: {quoted!r} is neither"
                )


def _run(doc, mode, published, tiny, served, tmp_path) -> tuple[list[str], list[dict]]:
    snippets = python_blocks(_doc_text(doc, published))
    spec = dict(
        doc=doc,
        mode=mode,
        snippets=snippets,
        checks=CHECKS[doc],
        tiny=tiny,
        repos=served,
        org=_org(),
    )
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LOCAL_KERNELS", "HF_HUB_OFFLINE", "PYTHONPATH")
    }
    env.update(
        JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HOME=str(tmp_path / "hf_home"),
    )
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path / "spec.json")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULTS ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return snippets, json.loads(line[len("RESULTS ") :])


@pytest.mark.parametrize("doc", list(CHECKS))
def test_snippets_run_as_documented(doc, published, tiny, served, tmp_path):
    snippets, results = _run(doc, "documented", published, tiny, served, tmp_path)
    assert [r["snippet"] for r in results] == list(range(len(snippets)))
    failed = [f"{doc} snippet {r['snippet']}:\n{r['trace']}" for r in results if not r["ok"]]
    assert not failed, "\n\n".join(failed)


@pytest.mark.parametrize("doc", list(CHECKS))
def test_snippets_need_their_trust(doc, published, tiny, served, tmp_path):
    """Against a Hub where the publisher is not trusted, each kernel-loading snippet fails
    without the trust argument it documents (so the documented one is what makes it pass)."""
    snippets, results = _run(doc, "untrusted", published, tiny, served, tmp_path)
    loaders = [i for i, c in enumerate(snippets) if any(r in c for r in served)]
    assert loaders, doc
    assert [r["snippet"] for r in results] == loaders, (
        "a kernel-loading snippet documents no trust argument"
    )
    for r in results:
        assert not r["ok"] and "not from a trusted publisher" in r["error"], (doc, r)


def test_substitutions_are_the_declared_ones(tiny):
    code = 'm = f("Qwen/Qwen3-8B", device_map="tpu")\nx = g(device="tpu", repo="tpu-kernels/rmsnorm-tpu")'
    out = substitute(code, tiny, "cpu")
    assert out == (
        f'm = f({tiny["Qwen/Qwen3-8B"]!r}, device_map="cpu")\n'
        'x = g(device="cpu", repo="tpu-kernels/rmsnorm-tpu")'
    )
    assert substitute(code, {}, "tpu") == code
    assert strip_trust('get_kernel("a/b", version=1, trust_remote_code=["a/b"])') == (
        'get_kernel("a/b", version=1)',
        1,
    )


def test_cards_declare_library_name_kernels(published):
    import yaml

    for name, repo in published.items():
        for text in ((repo / "README.md").read_text(),):
            assert text.startswith("---\n"), name
            front = yaml.safe_load(text.split("---\n", 2)[1])
            assert front["library_name"] == "kernels", name
            assert "kernels" in front["tags"], name
            want = tomllib.loads((repo / "build.toml").read_text())["general"]["license"]
            assert front["license"] == want, name
