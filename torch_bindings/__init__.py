"""The core device backend every kernel of this library builds on.

A kernel package hands `OpLibrary.define` a JAX function that calls its Pallas
kernel and a JAX reference; it gets back a torch op that runs on `tpu` tensors
through TorchTPU, on `cpu` tensors through JAX on the host, and on `meta`/fake
tensors for `torch.compile`. `define_differentiable` wires vjp.py's one autograd
path (a forward that returns residuals, a backward that starts from them);
`validate` holds the torch-only argument rules (the rest are each package's
checks.py, run by the ops), `aot` the ahead-of-time TPU compile gate, `backend`
the CPU-implementation switch and the TPU generation, `tpu_info` every TPU fact
(generations, per-device peaks and bandwidth, VMEM and the scoped-VMEM policy,
clock assumptions, detection).
Torch is imported only when a torch-facing name is used, so the pure-JAX
kernel modules can import `backend`, `aot`, `tpu_info` and `vjp` without it.
"""

from .backend import CPU_IMPLS, cpu_impl, current_cpu_impl, detected_generation
from .namespace import op_namespace, source_hash

__all__ = [
    "CPU_IMPLS",
    "JaxOp",
    "OpLibrary",
    "cpu_impl",
    "current_cpu_impl",
    "detected_generation",
    "op_namespace",
    "source_hash",
    "validate",
]


def __getattr__(name):
    import importlib

    if name in ("JaxOp", "OpLibrary"):
        return getattr(importlib.import_module(".op", __name__), name)
    if name == "validate":
        return importlib.import_module(".validate", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
