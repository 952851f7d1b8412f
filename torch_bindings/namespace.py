"""Per-build op namespaces, kernel-builder style: `_<python_name>_<source hash>`.

The hash covers every source file of the kernel package (vendored bindings
included), so two different builds of a kernel get different namespaces and
load side by side in one process, while the same source always maps to the
same name (publish.py writes it into metadata.json as the kernel `id`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


def package_files(package_dir: str | os.PathLike) -> list[tuple[str, Path]]:
    """(relative posix path, real path) of every source file, sorted; symlinks followed."""
    root = Path(package_dir)
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for f in filenames:
            if f.endswith(_SKIP_SUFFIXES):
                continue
            p = Path(dirpath) / f
            out.append((p.relative_to(root).as_posix(), p))
    return sorted(out)


def source_hash(package_dir: str | os.PathLike, length: int = 10) -> str:
    h = hashlib.sha256()
    for rel, path in package_files(package_dir):
        h.update(rel.encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:length]


def op_namespace(python_name: str, package_dir: str | os.PathLike) -> str:
    return f"_{python_name}_{source_hash(package_dir)}"
