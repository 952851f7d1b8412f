"""The environment a compile-gate worker process starts with (stdlib only).

A spawned worker inherits the test session's environment, and the session
switches libtpu's and XLA's dump flags on (bench.schedule reads the dumps),
so every gate compile would also write its final LLO bundles as text: 24x
the CPU time of Mixtral's down-projection kernel (166 s against 7 s). The
flags are read when libtpu loads, and `import torch` loads it (torch_tpu), so
the worker drops them in its pool initializer: this module, which imports
nothing that loads libtpu.
"""

from __future__ import annotations

import os
import re

# Flags that make the TPU compiler or XLA write files; a gate only needs the verdict.
_DUMP_FLAG = re.compile(r"--xla_(jf_)?dump\S*")


def env_without_dumps(environ=None) -> dict[str, str]:
    """The variables of `environ` (default: this process's) whose dump flags differ."""
    environ = os.environ if environ is None else environ
    out = {}
    for name in ("LIBTPU_INIT_ARGS", "XLA_FLAGS"):
        value = environ.get(name)
        if value is not None:
            cleaned = " ".join(_DUMP_FLAG.sub("", value).split())
            if cleaned != value:
                out[name] = cleaned
    return out


def init(env: dict[str, str], path: list[str]) -> None:
    """Pool initializer: runs in the worker before anything loads libtpu."""
    import sys

    os.environ.update(env)
    for p in path:
        if p not in sys.path:
            sys.path.append(p)
