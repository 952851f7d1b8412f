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

Where n is not a multiple of 256 (GPT-OSS's H = 2880: 11 groups and 64
columns) the last group is partial: its halves hold the columns there are,
the rest of its words are zero. Its values are lane-prefix slices of whole
vregs (`widths`), which Mosaic loads and stores under a mask.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

GROUP = 256  # columns whose 128 + 128 halves share 128 words
HALF = GROUP // 2
HIGH = 0xFFFF0000
# A partial group's halves are lane-prefix slices; widths in whole 64-lane
# pieces are the ones compiled (the compile gate: GPT-OSS's 2880, and 3008
# for a partial high half).
PIECE = 64


def packable(n: int) -> bool:
    """Whether [.., n] bf16 can be packed (pack, pack_rows): n a multiple of
    64, its last 256-column group partial where n is not a multiple of 256."""
    return n > 0 and n % PIECE == 0


def groups(n: int) -> int:
    """256-column groups of n columns, a partial last one included: the word
    rows a packed row holds data in."""
    return -(-n // GROUP)


def widths(n: int, g: int) -> tuple[int, int]:
    """Columns of n in group g's low and high halves: (128, 128) but in a
    partial last group."""
    o = g * GROUP
    return min(HALF, n - o), max(0, min(HALF, n - o - HALF))


def pack_halves(low, high):
    """Two same-shaped float arrays -> uint32 words: each value rounded to
    bf16 once, `low`'s in the low half (group_words: the two 128-lane
    halves of a 256-column group)."""

    def bits(x):
        return lax.bitcast_convert_type(x.astype(jnp.bfloat16).astype(jnp.float32), jnp.uint32)

    return lax.shift_right_logical(bits(low), jnp.uint32(16)) | (bits(high) & jnp.uint32(HIGH))


def group_words(y, g):
    """The 128 words of group g of y's columns (y an array or a VMEM ref,
    [rows, n]): its two 128-lane halves packed, whole vregs and no lane
    shuffles; in a partial last group, zeros where n has no column. What
    gmm's packed epilogue, its row staging and kernel_pack store a group at
    a time."""
    rows, n = y.shape
    o = g * GROUP
    lw, hw = widths(n, g)
    low = y[:, o : o + lw]
    if hw == lw:
        high = y[:, o + HALF : o + HALF + hw]
    elif hw:
        high = jnp.concatenate(
            [
                y[:, o + HALF : o + HALF + hw].astype(jnp.float32),
                jnp.zeros((rows, lw - hw), jnp.float32),
            ],
            axis=1,
        )
    else:
        high = jnp.zeros((rows, lw), jnp.float32)
    words = pack_halves(low, high)
    if lw < HALF:
        words = jnp.concatenate([words, jnp.zeros((rows, HALF - lw), jnp.uint32)], axis=1)
    return words


def group_values(words, n, g):
    """Group g's values (of n columns) from its 128 words [rows, 128], as f32
    pieces in column order: its low half and its high half, each cut to the
    columns of n it holds (no piece where it holds none)."""
    lw, hw = widths(n, g)
    low, high = halves(words)
    pieces = [low if lw == HALF else low[:, :lw]]
    if hw:
        pieces.append(high if hw == HALF else high[:, :hw])
    return pieces


def pack(y):
    """[..., n] (n packable, any float dtype) -> uint32 [..., 128 groups(n)]
    (n/2 where n is a multiple of 256): each value rounded to bf16 once,
    paired as the module says, a partial group's missing columns zero."""
    *lead, n = y.shape
    g = groups(n)
    y = jnp.pad(y, [(0, 0)] * len(lead) + [(0, g * GROUP - n)])
    split = y.reshape(*lead, g, 2, HALF)
    return pack_halves(split[..., 0, :], split[..., 1, :]).reshape(*lead, g * HALF)


def row_words(n: int) -> int:
    """Rows of 128 words a token takes in pack_rows' layout: its groups(n)
    word groups, padded to whole (8, 128) tiles."""
    return -(-groups(n) // 8) * 8


def pack_rows(y):
    """[S, n] -> uint32 [S * row_words(n), 128]: row s's word group g (pack's
    words [128g, 128g + 128)) at row s * row_words(n) + g, zero rows after
    its groups(n) groups up to a whole tile. A token's words are then whole
    (8, 128) tiles, contiguous in memory: what the down projection's gmm
    writes (packed=True) and the combine fetches, one DMA a token's row.
    (Gemma 4's H = 2816, 11 groups, pads to 16: 45% more bytes, still one
    copy a row.)"""
    s, n = y.shape
    words = pack(y).reshape(s, groups(n), HALF)
    pad = row_words(n) - groups(n)
    return jnp.pad(words, ((0, 0), (0, pad), (0, 0))).reshape(s * row_words(n), HALF)


def unpack_rows(words, n, dtype=jnp.bfloat16):
    """pack_rows' inverse, [S * row_words(n), 128] -> [S, n]."""
    data = words.reshape(-1, row_words(n), HALF)[:, : groups(n)]
    return unpack(data.reshape(-1, groups(n) * HALF), dtype, n)


def halves(words):
    """uint32 words -> (low, high) values as f32, exactly the packed bf16s."""
    low = lax.bitcast_convert_type(lax.shift_left(words, jnp.uint32(16)), jnp.float32)
    high = lax.bitcast_convert_type(words & jnp.uint32(HIGH), jnp.float32)
    return low, high


def unpack(words, dtype=jnp.bfloat16, n=None):
    """pack's inverse: uint32 [..., 128 groups(n)] -> [..., n] in `dtype` (n
    twice the words if None)."""
    low, high = halves(words)
    *lead, w = words.shape
    g = w // HALF
    both = jnp.stack([low.reshape(*lead, g, HALF), high.reshape(*lead, g, HALF)], axis=-2)
    return both.reshape(*lead, 2 * w)[..., : 2 * w if n is None else n].astype(dtype)
