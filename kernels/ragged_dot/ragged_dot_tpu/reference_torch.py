"""Torch reference for ragged_dot (independent of JAX; for tests and the torch layer).

Computes each group's rows with torch.mm in float32 and casts to lhs's dtype;
rows past sum(group_sizes) (and rows of groups outside this shard) are zero.
Tolerances: see reference.py (same f32 accumulation, so the same bounds).
"""

from __future__ import annotations

import torch


def ragged_dot_torch(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    group_offset: int = 0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """lhs [M, K], rhs [G_local, K, N], group_sizes [G] -> [M, N]."""
    out_dtype = out_dtype or lhs.dtype
    m, n = lhs.shape[0], rhs.shape[2]
    out = torch.zeros(m, n, dtype=torch.float32, device=lhs.device)
    sizes = [int(s) for s in group_sizes.tolist()]
    start = 0
    for g, size in enumerate(sizes):
        j = g - group_offset
        if size and 0 <= j < rhs.shape[0]:
            out[start : start + size] = torch.mm(lhs[start : start + size].float(), rhs[j].float())
        start += size
    return out.to(out_dtype)
