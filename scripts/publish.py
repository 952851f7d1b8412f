#!/usr/bin/env python3
"""Build Hub-ready kernel repositories and upload them to the Kernels Hub.

    python scripts/publish.py build --out DIR [--org ORG] [--kernel NAME]
    python scripts/publish.py upload --out DIR --org ORG [--kernel NAME] [--dry-run] [--allow-dirty]

`build` writes, for every kernel folder listed in the top-level build.toml,
`DIR/<name>/` with the kernel card (README.md), the kernel's build.toml,
`build/<variant>/<python_name>/` (the package with torch_bindings vendored as
`_torch_bindings`, symlinks resolved) plus `build/<variant>/metadata.json`,
and `benchmarks/benchmark.py`. The output is a pure function of the sources:
files are written in sorted order with fixed JSON formatting, so the same
source gives byte-identical repositories.

`upload` follows kernel-builder's conventions: a `kernel`-type repo, the card
on `main`, `build/**` and `benchmarks/` on branch `v<version>`, stale files of
uploaded variants deleted; then every file is downloaded again and its digest
checked against metadata.json.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import json
import shutil
import subprocess
import tomllib
from pathlib import Path

from torch_bindings.namespace import op_namespace, package_files

ROOT = Path(__file__).resolve().parent.parent

DIGEST_EXCLUDE = ("metadata.json", "metadata.json.sigstore")


@dataclasses.dataclass(frozen=True)
class KernelSource:
    folder: Path
    name: str  # hub name, e.g. rmsnorm-tpu
    version: int
    license: str
    repo_id: str

    @property
    def python_name(self) -> str:
        return self.name.replace("-", "_")

    @property
    def package_dir(self) -> Path:
        return self.folder / self.python_name


def read_library(root: Path = ROOT) -> dict:
    return tomllib.loads((root / "build.toml").read_text())["library"]


def read_kernel(folder: Path, org: str | None) -> KernelSource:
    general = tomllib.loads((folder / "build.toml").read_text())["general"]
    repo_id = general["hub"]["repo-id"]
    if org:
        repo_id = f"{org}/{repo_id.split('/', 1)[1]}"
    return KernelSource(
        folder, general["name"], int(general["version"]), general["license"], repo_id
    )


def selected_kernels(org: str | None, only: str | None, root: Path = ROOT) -> list[KernelSource]:
    lib = read_library(root)
    org = org or lib["org"]
    kernels = [read_kernel(root / "kernels" / k, org) for k in lib["kernels"]]
    if only:
        kernels = [k for k in kernels if only in (k.name, k.folder.name, k.python_name)]
        if not kernels:
            raise SystemExit(f"--kernel: no kernel named {only!r} in build.toml")
    return kernels


def file_digest(path: Path) -> str:
    return base64.b64encode(hashlib.sha256(path.read_bytes()).digest()).decode()


def variant_digest(variant_dir: Path) -> dict[str, str]:
    files = {}
    for rel, path in package_files(variant_dir):
        if rel in DIGEST_EXCLUDE:
            continue
        files[rel] = file_digest(path)
    return files


def _copy_package(src: Path, dst: Path) -> None:
    for rel, path in package_files(src):
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())


def build_variant(kernel: KernelSource, variant_dir: Path, backend: str) -> dict:
    pkg = variant_dir / kernel.python_name
    _copy_package(kernel.package_dir, pkg)
    metadata = {
        "name": kernel.name,
        "id": op_namespace(kernel.python_name, pkg),
        "version": kernel.version,
        "license": kernel.license,
        # jax/jaxlib are not in kernels' allowed list: the card documents them.
        "python-depends": [],
        "backend": {"type": backend},
    }
    metadata["digest"] = {"algorithm": "sha256", "files": variant_digest(variant_dir)}
    (variant_dir / "metadata.json").write_text(
        json.dumps(metadata, indent=2, sort_keys=True) + "\n"
    )
    return metadata


def build_kernel(kernel: KernelSource, out: Path, variants: list[str]) -> Path:
    repo = out / kernel.name
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    namespaces = set()
    for variant in variants:
        backend = variant.split("-", 1)[1]
        namespaces.add(build_variant(kernel, repo / "build" / variant, backend)["id"])
    assert len(namespaces) == 1, "variants must carry identical code"
    card = (kernel.folder / "CARD.md").read_text()
    card = card.replace("{repo_id}", kernel.repo_id).replace("{version}", str(kernel.version))
    (repo / "README.md").write_text(card)
    (repo / "build.toml").write_bytes((kernel.folder / "build.toml").read_bytes())
    bench = kernel.folder / "benchmarks"
    if bench.is_dir():
        _copy_package(bench, repo / "benchmarks")
    return repo


def cmd_build(args) -> int:
    lib = read_library()
    out = Path(args.out).resolve()
    for kernel in selected_kernels(args.org, args.kernel):
        repo = build_kernel(kernel, out, lib["variants"])
        print(f"built {kernel.repo_id} -> {repo}")
    return 0


# -- upload -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Operation:
    kind: str  # create_repo | upload_card | create_branch | upload_build | delete_stale | verify
    repo_id: str
    detail: str


def upload_plan(kernel: KernelSource, repo: Path) -> list[Operation]:
    branch = f"v{kernel.version}"
    variants = sorted(p.name for p in (repo / "build").iterdir())
    build_files = sorted(
        rel for rel, _ in package_files(repo) if rel.startswith(("build/", "benchmarks/"))
    )
    return [
        Operation("create_repo", kernel.repo_id, "repo_type=kernel, exist_ok"),
        Operation("upload_card", kernel.repo_id, "main: README.md, build.toml"),
        Operation("create_branch", kernel.repo_id, f"{branch} (exist_ok)"),
        Operation(
            "upload_build",
            kernel.repo_id,
            f"{branch}: {len(build_files)} files: " + ", ".join(build_files),
        ),
        Operation(
            "delete_stale",
            kernel.repo_id,
            f"{branch}: files under build/{{{','.join(variants)}}}/ and benchmarks/ not in this build",
        ),
        Operation(
            "verify",
            kernel.repo_id,
            f"{branch}: download every build file and check metadata.json digests",
        ),
    ]


def git_is_dirty(root: Path = ROOT) -> bool:
    out = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
    return out.returncode != 0 or bool(out.stdout.strip())


def _execute(op: Operation, kernel: KernelSource, repo: Path, api) -> None:
    branch = f"v{kernel.version}"
    if op.kind == "create_repo":
        api.create_repo(kernel.repo_id, repo_type="kernel", exist_ok=True)
    elif op.kind == "upload_card":
        for name in ("README.md", "build.toml"):
            api.upload_file(
                path_or_fileobj=str(repo / name),
                path_in_repo=name,
                repo_id=kernel.repo_id,
                repo_type="kernel",
                revision="main",
            )
    elif op.kind == "create_branch":
        api.create_branch(kernel.repo_id, branch=branch, repo_type="kernel", exist_ok=True)
    elif op.kind == "upload_build":
        variants = sorted(p.name for p in (repo / "build").iterdir())
        api.upload_folder(
            folder_path=str(repo),
            repo_id=kernel.repo_id,
            repo_type="kernel",
            revision=branch,
            allow_patterns=["build/**", "benchmarks/**"],
            # kernel-builder convention: an uploaded variant replaces the old one whole.
            delete_patterns=[f"build/{v}/**" for v in variants] + ["benchmarks/**"],
            commit_message=f"Build {kernel.name} v{kernel.version}",
        )
    elif op.kind == "delete_stale":
        pass  # done atomically by upload_build's delete_patterns
    elif op.kind == "verify":
        verify_remote(kernel, repo, api)


def verify_remote(kernel: KernelSource, repo: Path, api) -> None:
    from huggingface_hub import hf_hub_download

    branch = f"v{kernel.version}"
    for meta_path in sorted((repo / "build").glob("*/metadata.json")):
        variant = meta_path.parent.name
        meta = json.loads(meta_path.read_text())
        for rel, digest in meta["digest"]["files"].items():
            local = hf_hub_download(
                kernel.repo_id, f"build/{variant}/{rel}", repo_type="kernel", revision=branch
            )
            if file_digest(Path(local)) != digest:
                raise SystemExit(f"digest mismatch after upload: build/{variant}/{rel}")


def cmd_upload(args) -> int:
    if not args.allow_dirty and git_is_dirty():
        raise SystemExit(
            "refusing to upload from a dirty git tree (commit first, or pass --allow-dirty)"
        )
    lib = read_library()
    out = Path(args.out).resolve()
    api = None
    if not args.dry_run:
        from huggingface_hub import HfApi

        api = HfApi()  # token from the environment/cache; never printed
    for kernel in selected_kernels(args.org, args.kernel):
        repo = build_kernel(kernel, out, lib["variants"])
        for op in upload_plan(kernel, repo):
            if args.dry_run:
                print(f"[dry-run] {op.kind} {op.repo_id}: {op.detail}")
            else:
                print(f"{op.kind} {op.repo_id}")
                _execute(op, kernel, repo, api)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write Hub-ready kernel repos")
    u = sub.add_parser("upload", help="build, then upload to the Kernels Hub")
    for s in (b, u):
        s.add_argument("--out", default=str(ROOT / "dist"), help="output folder (default: dist/)")
        s.add_argument("--org", default=None, help="Hub organisation (default: build.toml's)")
        s.add_argument("--kernel", default=None, help="only this kernel (name or folder)")
    u.add_argument("--dry-run", action="store_true", help="print every operation; no network")
    u.add_argument(
        "--allow-dirty", action="store_true", help="upload even with uncommitted changes"
    )
    args = p.parse_args(argv)
    return {"build": cmd_build, "upload": cmd_upload}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
