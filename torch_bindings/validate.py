"""Argument checks shared by every kernel: one place, one wording.

Errors name the argument and say what was expected, so a user never meets a
Mosaic stack trace for a wrong shape, dtype or device.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    ndim: int | Sequence[int] | None = None,
    min_ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
) -> None:
    """Raises TypeError/ValueError naming `name` if `t` is not what is expected.

    `shape` entries of None are free.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(str(n) for n in allowed)
            raise ValueError(f"{name}: expected {want} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(
            f"{name}: expected at least {min_ndim} dimensions, got shape {tuple(t.shape)}"
        )
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in ({_fmt_dtypes(dtypes)}), got {t.dtype}")
    if shape is not None:
        if t.dim() != len(shape) or any(
            want is not None and have != want for have, want in zip(t.shape, shape)
        ):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise ValueError(
                f"{name}: expected dtype {first.dtype} (same as {first_name}), got {t.dtype}"
            )


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
