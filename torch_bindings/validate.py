"""The torch-only argument rules: a tensor where one is expected, and devices.

Every shape, dtype and value rule lives once, in the kernel package's
checks.py (JAX side); the torch ops run it on tensor specs before they
dispatch (op.py). What is left here has no JAX counterpart. Errors name the
argument and say what was expected.
"""

from __future__ import annotations

import torch


def check_tensor(name: str, t, *, optional: bool = False) -> None:
    """Raises TypeError naming `name` if `t` is not a torch.Tensor (or None, if optional)."""
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        want = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"{name}: expected {want}, got {type(t).__name__}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name}: expected a tensor on {first.device} (same device as {first_name}), "
                f"got {t.device}"
            )
    return first.device


_SUPPORTED_DEVICE_TYPES: tuple[str, ...] | None = None


def check_supported_device(name: str, t: torch.Tensor) -> None:
    global _SUPPORTED_DEVICE_TYPES
    if _SUPPORTED_DEVICE_TYPES is None:
        # TorchTPU registers "tpu" as the PrivateUse1 backend name.
        _SUPPORTED_DEVICE_TYPES = ("cpu", "meta", torch._C._get_privateuse1_backend_name())
    if t.device.type not in _SUPPORTED_DEVICE_TYPES:
        raise ValueError(f"{name}: expected a tensor on tpu, cpu or meta, got device {t.device}")


def check_tensors(optional: tuple[str, ...] = (), **tensors) -> torch.device:
    """Every argument a tensor (those named in `optional` may be None), all on one
    supported device; returns that device."""
    for name, t in tensors.items():
        check_tensor(name, t, optional=name in optional)
    first = next(k for k, v in tensors.items() if v is not None)
    check_supported_device(first, tensors[first])
    return check_same_device(**tensors)


def spec(t: torch.Tensor):
    """t's shape and dtype as the kernels' JAX-side checks read arrays."""
    from .convert import TensorSpec

    return TensorSpec.of(t)
