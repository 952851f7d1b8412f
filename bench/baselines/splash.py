"""Splash attention baselines: JAX's kernel called as a JAX user does, and
torch_tpu's built-in `splash_sdpa` op, both causal, forward.

Inputs are the bench's q [B, Hq, S, D], k / v [B, Hkv, S, D].

* `jax_splash(...)`: `jax.experimental.pallas.ops.tpu.splash_attention`,
  `make_splash_mha` over a causal `MultiHeadMask` (one `CausalMask` per q
  head), vmapped over the batch, q pre-scaled by D**-0.5 (the kernel does not
  scale). GQA is native (the kernel maps q head h to kv head h // (Hq/Hkv)),
  so K/V are read once per kv head. Block sizes 512 (q, kv, kv_compute; capped
  at S): MaxText's defaults and torch_tpu's; the library's own default
  (`BlockSizes.get_default()`) is 128.
* `torch_tpu_splash(...)`: torch_tpu 0.2.0's `torch.tpu.splash_sdpa(q, k, v,
  is_causal=True, enable_gqa=...)` (`torch_tpu/_internal/ops/splash_attention.py`)
  is a JAX function underneath: the torch side `repeat_interleave`s K/V to
  Hq heads for GQA (squeezes them for MQA), then calls the jitted
  `splash_fn` built by `_make_splash_attention_fn` (blocks 512, fused
  backward blocks, `save_residuals=True`: it also writes the logsumexp). We
  call that same JAX function after the same repeat.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BLOCK = 512
# Pallas interpret mode for CPU tests (TPU interpret mode, the
# `force_tpu_interpret_mode` one, cannot run a vmapped splash kernel in jax
# 0.10.2: its grid gains the batch axis, its dimension semantics do not).
INTERPRET = False


def _splash_modules():
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
        splash_attention_mask as sm,
    )

    return sk, sm


@functools.lru_cache(maxsize=None)
def _jax_kernel(seq: int, q_heads: int, block: int, interpret: bool, window: int = 0):
    sk, sm = _splash_modules()
    b = min(block, seq)
    # backward blocks as MaxText sets them (fused dK/dV+dQ kernel), so the
    # training direction runs too
    sizes = sk.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        use_fused_bwd_kernel=True,
    )
    if window:
        one = sm.LocalMask((seq, seq), window_size=(window - 1, 0), offset=0)
    else:
        one = sm.CausalMask((seq, seq))
    mask = sm.MultiHeadMask(tuple(one for _ in range(q_heads)))
    # concrete mask tables even when first called under a trace (cached here)
    with jax.ensure_compile_time_eval():
        return sk.make_splash_mha(
            mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret
        )


def jax_splash(q, k, v, *, block: int = BLOCK, window: int = 0):
    """Causal GQA splash attention forward, [B, H, S, D] in and out; window > 0:
    each query sees its `window` latest keys (LocalMask (window - 1, 0))."""
    _, hq, s, d = q.shape
    kernel = _jax_kernel(s, hq, block, INTERPRET, window)
    qs = q * jnp.asarray(d**-0.5, q.dtype)
    return jax.vmap(kernel)(qs, k, v)


def torch_tpu_version() -> str:
    import importlib.metadata as md

    return md.version("torch-tpu")


@functools.lru_cache(maxsize=None)
def _torch_tpu_fn(seq: int, q_heads: int, kv_heads: int, interpret: bool, causal: bool = True):
    from torch_tpu._internal.ops import splash_attention as ts

    sk = ts.splash_attention_kernel
    make = sk.make_splash_mha, sk.make_splash_mqa
    if interpret:  # torch_tpu has no switch: its kernel factory gets one
        sk.make_splash_mha = functools.partial(make[0], interpret=True)
        sk.make_splash_mqa = functools.partial(make[1], interpret=True)
    try:
        # splash_sdpa's defaults (blocks 512, fused bwd, HEAD_DIM_MINOR layouts);
        # concrete mask tables even when first called under a trace (cached here)
        with jax.ensure_compile_time_eval():
            fwd, _ = ts._make_splash_attention_fn(  # pylint: disable=protected-access
                seq_len=seq,
                n_heads=q_heads,
                n_kv_heads=kv_heads,
                scale=None,
                is_causal=causal,
                local_window_size=None,
            )
    finally:
        sk.make_splash_mha, sk.make_splash_mqa = make
    return fwd


def torch_tpu_splash(q, k, v, causal: bool = True):
    """What `torch.tpu.splash_sdpa(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)`
    runs on the TPU, [B, H, S, D] in and out. Like splash_sdpa, it builds the
    kernel for q's length (`seq_len=q.shape[2]`), so K/V longer than q (decode)
    get blocks of q's length."""
    _, hq, s, _ = q.shape
    hkv = k.shape[1]
    if hkv == 1:  # MQA: the kernel takes squeezed K/V
        k, v = k[:, 0], v[:, 0]
    elif hkv != hq:  # GQA: k.repeat_interleave(group, dim=1)
        k = jnp.repeat(k, hq // hkv, axis=1)
        v = jnp.repeat(v, hq // hkv, axis=1)
        hkv = hq
    out, _lse = _torch_tpu_fn(s, hq, hkv, INTERPRET, causal)(q, k, v)
    return out.astype(q.dtype)
