"""MXFP4 expert weights: the layouts, the decoding rule and the reference.

Checkpoints ship MXFP4 experts as torch Linear weights, [G, N, K/2] bytes
(GPT-OSS's ``*_blocks`` [G, N, K/32, 16] reshaped; transformers' FP4 experts
viewed as uint8) with [G, N, K/32] scales: two FP4 (e2m1) values per byte,
the low nibble the even k, the high nibble the odd k; each nibble
sign | e1 e0 | m (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives); one e8m0 scale
(2^(s - 127), uint8 or float8_e8m0fnu) per 32 consecutive k.

The kernels read the *kernel layout*, the same bytes with K/2 as rows and N
as lanes: weights uint8 [G, K/2, N], scales [G, S, N] with S = K/32 rounded up
to 32 (the uint8 sublane tile, so XLA stores the array row-major rather than
in a permuted layout every per-expert read would have to gather from; the
extra rows are never read as scales). ``to_kernel_layout`` converts once, at
load time. In this layout the two nibbles of a byte are the k rows 2j and
2j + 1, which is exactly how a [K/2, N] int32 array bitcasts to [K, N] bf16
(``decode_pairs``): the kernel decodes a slab piece into bf16 weights in k
order, its scales folded into the decode, and runs one plain MXU contraction.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # values per scale
# The 16 codes' values, for references and tests (the kernel decodes by bit arithmetic).
VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
SCALE_DTYPES = (jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e8m0fnu))
WEIGHT_DTYPE = jnp.dtype(jnp.uint8)


def is_mxfp4(dtype) -> bool:
    return jnp.dtype(dtype) == WEIGHT_DTYPE


def scale_rows(k: int) -> int:
    """Rows of the kernel layout's scales for contraction depth k."""
    nb = k // BLOCK
    return -(-nb // 32) * 32


def scale_bytes(scale):
    """e8m0 scales as uint8 (float8_e8m0fnu is the same bytes)."""
    if jnp.dtype(scale.dtype) == jnp.dtype(jnp.float8_e8m0fnu):
        return lax.bitcast_convert_type(scale, jnp.uint8)
    return scale


def scale_values(s):
    """uint8 e8m0 scales (any shape) as float32 values: 2^(s - 127) is the
    float32 whose exponent field is s (s = 0, 2^-127, is a denormal that TPUs
    read as 0; no checkpoint scales a block that far down)."""
    return lax.bitcast_convert_type(s.astype(jnp.int32) << 23, jnp.float32)


# Both nibbles of a byte decode at once, as the two bf16 halves of one 32-bit
# word: the low half is the even k, the high half the odd k, which is how a
# [R, C] int32 array bitcasts to [2R, C] bf16 (pltpu.bitcast), so the weights
# come out in k order. x * _SPREAD_MAG places the low nibble's e1 e0 m at
# bits 8..6 (bf16 exponent LSBs and mantissa MSB) and the high nibble's at
# 24..22; x * _SPREAD_SIGN the two sign bits at 15 and 31 (x a byte, 0..255:
# the two shifted copies of it never overlap, so the products carry nothing).
_SPREAD_MAG = (1 << 6) | (1 << 18)
_MAG = 0x01C001C0
_SPREAD_SIGN = (1 << 12) | (1 << 24)
_SIGN = -0x7FFF8000  # 0x80008000
_PAIR = 0x10001  # a bf16 exponent field times this: the same field in both halves
_HALF = (126 << 7) * _PAIR  # bf16 exponent bias that makes e = 1 come out as 2^0
# The scales decode_pairs folds exactly: below, a subnormal code's f would
# leave bf16's normal range (s = 0, 1: blocks under 2^-125); above, the
# largest code's exponent field would carry into the sign bit (s = 253, 254:
# blocks over 2^125, whose products bf16 mostly cannot hold). Those decode as
# the nearest of the two; no checkpoint scales a block that far.
FOLDED_SCALES = (2, 252)


def decode_pairs(b, s=None):
    """int32 [R, C] holding one byte each (0..255, uint8 widened) -> bf16 [2R, C]:
    the e2m1 values of their low (even rows) and high (odd rows) nibbles,
    times their e8m0 scales s (uint8 [R/16 or more, C], one row per 16 byte
    rows; None: 1).

    With e1 e0 m placed over the exponent s - 1 (126 unscaled), a code reads
    as f = S 2^(e - 1) (1 + m / 2), S = 2^(s - 127): right for e >= 1, and
    S/2 and 3S/4 for the subnormal codes 0 and S/2. min(f, 2f - S) maps those
    two to 0 and S/2 and leaves the others (f >= S, so 2f - S >= f); exact in
    bf16. The sign is OR-ed in last. Nine VPU ops per pair of values (integer
    ops on the 32-bit words, the min on packed bf16), the scale folded into
    the exponent bias and the subtrahend rather than multiplied (v6e, one
    FP4 GPT-OSS expert: 163,303 -> 149,804 VALU ops); no table lookups, which
    the TPU vector unit lacks. Scales outside FOLDED_SCALES decode as its
    nearest end; a NaN scale (s = 255) makes S infinite and every value of
    its block -inf or NaN."""
    if s is None:
        bias, sub = _HALF, 1.0
    else:
        r, c = b.shape
        nb = r // (BLOCK // 2)
        raw = s[:nb].astype(jnp.int32)
        e = jnp.clip(raw, *FOLDED_SCALES)
        # One row of both per 16 byte rows (32 values), a sublane broadcast.
        spread = lambda v: jnp.broadcast_to(v[:, None, :], (nb, BLOCK // 2, c)).reshape(r, c)  # noqa: E731
        bias = spread(((e - 1) << 7) * _PAIR)
        sub = spread((jnp.where(raw == 255, 255, e) << 7) * _PAIR)  # 255: +inf
        sub = _bitcast_rows(sub, jnp.bfloat16)
    mag = (b * _SPREAD_MAG) & _MAG
    sign = (b * _SPREAD_SIGN) & _SIGN
    f = _bitcast_rows(mag + bias, jnp.bfloat16)
    v = jnp.minimum(f, f + f - sub)
    return _bitcast_rows(_bitcast_rows(v, jnp.int32) | sign, jnp.bfloat16)


def _bitcast_rows(x, dtype):
    """[R, C] <-> [2R, C] between int32 and bf16 words, halves as rows 2r, 2r + 1
    (pltpu.bitcast's rule, which Mosaic lowers to a no-op on packed vregs)."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.bitcast(x, dtype)


# jitted: one program per shape, not one per op (eager mode compiles every op).
@functools.partial(jax.jit, static_argnames="dtype")
def dequantize(w, scale, dtype=jnp.float32):
    """Kernel layout ([G, K/2, N] bytes, [G, S, N] scales) -> [G, K, N] values."""
    b = w.astype(jnp.int32)
    vals = jnp.asarray(VALUES)
    pairs = jnp.stack([vals[b & 15], vals[b >> 4]], axis=-2)  # [G, K/2, 2, N]
    full = pairs.reshape(*w.shape[:-2], 2 * w.shape[-2], w.shape[-1])
    k = full.shape[-2]
    s = jnp.repeat(scale_values(scale_bytes(scale))[..., : k // BLOCK, :], BLOCK, axis=-2)
    return (full * s).astype(dtype)


@jax.jit
def quantize(w):
    """[G, K, N] real weights -> the kernel layout: (uint8 [G, K/2, N], uint8
    e8m0 scales [G, scale_rows(K), N]).

    The smallest power-of-two scale that keeps a block's largest magnitude
    within 6, then round-to-nearest onto the e2m1 grid (ties to the code with
    m = 0). For tests and benches: real checkpoints come quantized."""
    w = jnp.asarray(w, jnp.float32)
    *lead, k, n = w.shape
    blocks = w.reshape(*lead, k // BLOCK, BLOCK, n)
    amax = jnp.max(jnp.abs(blocks), axis=-2)
    e = jnp.where(amax > 0, jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30) / 6.0)), 0.0)
    e = jnp.clip(e, -126, 127)
    q = blocks / jnp.exp2(e)[..., None, :]
    dist = jnp.abs(jnp.abs(q)[..., None] - jnp.asarray(VALUES[:8]))
    code = jnp.argmin(dist * 2 + (jnp.arange(8) % 2) * 1e-6, axis=-1).astype(jnp.int32)
    code = (code | jnp.where(q < 0, 8, 0)).reshape(*lead, k // 2, 2, n)
    packed = (code[..., 0, :] | (code[..., 1, :] << 4)).astype(jnp.uint8)
    scales = (e + 127).astype(jnp.uint8)
    pad = scale_rows(k) - k // BLOCK
    scales = jnp.pad(scales, [(0, 0)] * len(lead) + [(0, pad), (0, 0)], constant_values=127)
    return packed, scales


def to_kernel_layout(w, scale):
    """Checkpoint layout -> kernel layout, once at load time.

    w: uint8 [G, N, K/2] (or GPT-OSS's [G, N, K/32, 16]); scale: [G, N, K/32]
    e8m0 (uint8 or float8_e8m0fnu). Returns (uint8 [G, K/2, N], uint8
    [G, scale_rows(K), N]). Works on JAX and numpy arrays."""
    xp = jnp if isinstance(w, jax.Array) else np
    if w.ndim == 4:
        w = w.reshape(*w.shape[:2], w.shape[2] * w.shape[3])
    g, n, kh = w.shape
    if tuple(scale.shape) != (g, n, 2 * kh // BLOCK):
        raise ValueError(
            f"scale: expected [G, N, K/32] = {(g, n, 2 * kh // BLOCK)} for weights"
            f" {tuple(w.shape)}, got {tuple(scale.shape)}"
        )
    sb = xp.asarray(scale).view(xp.uint8) if xp is np else scale_bytes(scale)
    s = xp.swapaxes(sb, 1, 2)
    pad = scale_rows(2 * kh) - s.shape[1]
    s = xp.pad(s, [(0, 0), (0, pad), (0, 0)], constant_values=127)
    return xp.swapaxes(xp.asarray(w).view(xp.uint8) if xp is np else w, 1, 2), s


def abstract(w_shape):
    """ShapeDtypeStructs of the kernel layout of [G, K, N] weights."""
    *lead, k, n = w_shape
    return (
        jax.ShapeDtypeStruct((*lead, k // 2, n), WEIGHT_DTYPE),
        jax.ShapeDtypeStruct((*lead, scale_rows(k), n), jnp.uint8),
    )
