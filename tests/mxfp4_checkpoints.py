"""MXFP4 checkpoints written by the tests' own code table (not the library's
quantizer): the e2m1 rounding, and GPT-OSS's `*_blocks` / `*_scales` format.
Plain numpy and torch, so the README's snippet runner can import it too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def e2m1(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """f64 weights [..., K] as MXFP4: bytes [..., K/2] uint8 (the even input in
    the low nibble) and e8m0 scale bytes [..., K/32], each block's largest
    magnitude scaled to fit 6, every value rounded to the nearest code."""
    blocks = w.reshape(*w.shape[:-1], -1, 32)
    exp = np.ceil(np.log2(np.abs(blocks).max(-1) / 6.0))
    q = blocks / np.exp2(exp)[..., None]
    code = np.abs(np.abs(q)[..., None] - _GRID).argmin(-1) | np.where(q < 0, 8, 0)
    code = code.reshape(*w.shape[:-1], -1, 2).astype(np.uint8)
    packed = np.ascontiguousarray(code[..., 0] | (code[..., 1] << 4))
    scales = np.ascontiguousarray(exp + 127).astype(np.uint8)
    return torch.from_numpy(packed), torch.from_numpy(scales)


def as_gpt_oss_mxfp4(path: Path) -> None:
    """Rewrites the GPT-OSS checkpoint saved at `path` as OpenAI ships GPT-OSS:
    experts' `*_blocks` [E, out, in/32, 16] and `*_scales` [E, out, in/32]
    uint8, `quant_method: mxfp4`; everything else as saved."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    sd = load_file(path / "model.safetensors")
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = sd.pop(name).double().numpy().transpose(0, 2, 1)  # [E, in, out] -> [E, out, in]
        packed, scales = e2m1(w)
        sd[name + "_blocks"] = packed.reshape(*scales.shape, 16)
        sd[name + "_scales"] = scales
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (path / "config.json").write_text(json.dumps(config))
