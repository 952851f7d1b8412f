"""bf16 rows packed two values a 32-bit word: the layout the down projection's
gmm writes for the combine kernel (kernel_combine) to fetch row by row.

Why: a row of a [S, H] bf16 array is not its own memory: bf16 packs two rows
into each 32-bit sublane word, so one row cannot be copied by a DMA without
its neighbour. Packed, a row's words are its own; laid out by `pack_rows`
they are whole (8, 128) tiles, one contiguous DMA, and the combine can fetch
any token's rows where XLA would gather them.

The pairing keeps packing and unpacking free of lane shuffles: word 128g + c
of a row holds column 256g + c in its low half and column 256g + 128 + c in
its high half (g a 256-column group, c < 128). Packing a 256-column piece is
then two whole-vreg bit operations on its two 128-lane halves; unpacking is a
shift and a mask, each giving an f32 vreg (a bf16 is the top half of the f32
of the same value).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

GROUP = 256  # columns whose 128 + 128 halves share 128 words
HIGH = 0xFFFF0000


def packable(n: int) -> bool:
    """Whether [.., n] bf16 can be packed (pack, pack_rows): whole 256-column
    groups."""
    return n > 0 and n % GROUP == 0


def pack_halves(low, high):
    """Two same-shaped float arrays -> uint32 words: each value rounded to
    bf16 once, `low`'s in the low half (group_words: the two 128-lane
    halves of a 256-column group)."""

    def bits(x):
        return lax.bitcast_convert_type(x.astype(jnp.bfloat16).astype(jnp.float32), jnp.uint32)

    return lax.shift_right_logical(bits(low), jnp.uint32(16)) | (bits(high) & jnp.uint32(HIGH))


def group_words(y, g):
    """The words of y's 256-column group g (y an array or a VMEM ref, [rows,
    >= 256 (g + 1)]): its two 128-lane halves packed, whole vregs and no lane
    shuffles. What gmm's packed epilogue and kernel_pack store a group at a
    time."""
    o = g * GROUP
    return pack_halves(y[:, o : o + GROUP // 2], y[:, o + GROUP // 2 : o + GROUP])


def pack(y):
    """[..., n] (n a multiple of 256, any float dtype) -> uint32 [..., n/2]:
    each value rounded to bf16 once, paired as the module says."""
    *lead, n = y.shape
    groups = y.reshape(*lead, n // GROUP, 2, GROUP // 2)
    return pack_halves(groups[..., 0, :], groups[..., 1, :]).reshape(*lead, n // 2)


def row_words(n: int) -> int:
    """Rows of 128 words a token takes in pack_rows' layout: its n/256 word
    groups, padded to whole (8, 128) tiles."""
    groups = n // GROUP
    return -(-groups // 8) * 8


def pack_rows(y):
    """[S, n] -> uint32 [S * row_words(n), 128]: row s's word group g (pack's
    words [128g, 128g + 128)) at row s * row_words(n) + g, zero rows after
    its n/256 groups up to a whole tile. A token's words are then whole
    (8, 128) tiles, contiguous in memory: what the down projection's gmm
    writes (packed=True) and the combine fetches, one DMA a token's row.
    (Gemma 4's H = 2816, 11 groups, pads to 16: 45% more bytes, still one
    copy a row.)"""
    s, n = y.shape
    groups = pack(y).reshape(s, n // GROUP, GROUP // 2)
    pad = row_words(n) - n // GROUP
    return jnp.pad(groups, ((0, 0), (0, pad), (0, 0))).reshape(s * row_words(n), GROUP // 2)


def unpack_rows(words, n, dtype=jnp.bfloat16):
    """pack_rows' inverse, [S * row_words(n), 128] -> [S, n]."""
    groups = words.reshape(-1, row_words(n), GROUP // 2)[:, : n // GROUP]
    return unpack(groups.reshape(-1, n // 2), dtype)


def halves(words):
    """uint32 words -> (low, high) values as f32, exactly the packed bf16s."""
    low = lax.bitcast_convert_type(lax.shift_left(words, jnp.uint32(16)), jnp.float32)
    high = lax.bitcast_convert_type(words & jnp.uint32(HIGH), jnp.float32)
    return low, high


def unpack(words, dtype=jnp.bfloat16):
    """pack's inverse: uint32 [..., n/2] -> [..., n] in `dtype`."""
    low, high = halves(words)
    *lead, w = words.shape
    g = w // (GROUP // 2)
    both = jnp.stack(
        [low.reshape(*lead, g, GROUP // 2), high.reshape(*lead, g, GROUP // 2)], axis=-2
    )
    return both.reshape(*lead, 2 * w).astype(dtype)
