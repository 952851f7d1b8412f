"""Benchmark points of the non-MoE kernels (the MoE points live in moe.py).

A point names a shape and builds the inputs every implementation of its
kernel takes: shapes only for tracing and compiling (nothing here decides a
grid from values), concrete arrays for timing on a real TPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import model

RMSNORM_HIDDEN = (2048, 2816, 4096, 5120, 8192)
RMSNORM_TOKENS = (1, 8, 64, 512, 2048, 8192)
# plain; gemma: weight offset by one; residual: fused add, x + residual
# normalised and the sum returned too (what a decoder layer's norms do).
RMSNORM_VARIANTS = ("plain", "gemma", "residual")
# fwd; bwd: the backward alone, from what the forward saved (the input, or
# the fused sum) and the output's cotangent (and the sum's, fused).
RMSNORM_DIRECTIONS = ("fwd", "bwd")
ATTENTION_DIRECTIONS = ("fwd", "train")

ATTENTION_SEQS = (512, 2048, 8192)


@dataclasses.dataclass(frozen=True)
class RmsNormPoint:
    hidden: int
    tokens: int
    dtype: str = "bfloat16"
    variant: str = "plain"
    direction: str = "fwd"
    kernel = "rmsnorm"

    def labels(self) -> dict:
        return dict(
            hidden=self.hidden,
            tokens=self.tokens,
            dtype=self.dtype,
            variant=self.variant,
            direction=self.direction,
        )

    @property
    def walk_key(self):
        return ("rmsnorm", self.hidden, self.tokens, self.dtype, self.variant, self.direction)

    compile_key = walk_key

    def compile_args(self):
        """fwd: (x, [residual,] w); bwd: (x or the sum, w, dy, [d sum])."""
        dt = jnp.dtype(self.dtype)
        x = jax.ShapeDtypeStruct((self.tokens, self.hidden), dt)
        w = jax.ShapeDtypeStruct((self.hidden,), dt)
        residual = self.variant == "residual"
        if self.direction == "fwd":
            return (x, x, w) if residual else (x, w)
        return (x, w, x, x) if residual else (x, w, x)

    walker_args = compile_args

    def real_args(self, key=0):
        specs = self.compile_args()
        ks = jax.random.split(jax.random.key(key), len(specs))
        return tuple(
            jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype) for k, a in zip(ks, specs)
        )

    def min_bytes(self) -> int:
        """Every [tokens, hidden] stream read or written once: fwd x in, y out
        (fused: x, residual in, y, sum out); bwd x and dy in, dx out (fused:
        the sum, dy and the sum's cotangent in, dx out)."""
        it = jnp.dtype(self.dtype).itemsize
        residual = self.variant == "residual"
        streams = (4 if residual else 2) if self.direction == "fwd" else (4 if residual else 3)
        return streams * self.tokens * self.hidden * it + self.hidden * it

    def useful_flops(self) -> int:
        # VPU work; never the MXU bound
        return (4 if self.direction == "fwd" else 10) * self.tokens * self.hidden

    def roofline_s(self, generation: str) -> float:
        return self.min_bytes() / model.chip(generation).hbm_bytes_per_s


@dataclasses.dataclass(frozen=True)
class AttentionPoint:
    seq: int
    batch: int = 1
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    # "fwd", or "train": forward then backward (jax.vjp of the implementation,
    # cotangent = the output), what one training step of the layer costs.
    direction: str = "fwd"
    # 0: causal over the whole sequence; w > 0: causal sliding window, each
    # query sees its w latest keys, itself included (flash-attn window_size
    # (w - 1, 0); Mistral, Gemma and GPT-OSS local layers).
    window: int = 0
    kernel = "attention"

    def __post_init__(self):
        if not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"window: expected an int >= 0 (0: causal), got {self.window!r}")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def labels(self) -> dict:
        return dict(
            seq=self.seq,
            batch=self.batch,
            q_heads=self.q_heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            causal=True,
            window=self.window or "-",
            dtype=self.dtype,
            tokens=self.tokens,
            direction=self.direction,
        )

    @property
    def walk_key(self):
        return (
            "attention",
            self.seq,
            self.batch,
            self.q_heads,
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.direction,
            self.window,
        )

    def program(self, fn):
        """The program to time for implementation `fn(q, k, v)`."""
        if self.direction == "fwd":
            return fn

        def train(q, k, v):
            out, vjp = jax.vjp(fn, q, k, v)
            return vjp(out)

        return train

    compile_key = walk_key

    def compile_args(self):
        dt = jnp.dtype(self.dtype)
        q = jax.ShapeDtypeStruct((self.batch, self.q_heads, self.seq, self.head_dim), dt)
        kv = jax.ShapeDtypeStruct((self.batch, self.kv_heads, self.seq, self.head_dim), dt)
        return (q, kv, kv)

    walker_args = compile_args

    def real_args(self, key=0):
        ks = jax.random.split(jax.random.key(key), 3)
        return tuple(
            jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype)
            for k, a in zip(ks, self.compile_args())
        )

    def min_bytes(self) -> int:
        it = jnp.dtype(self.dtype).itemsize
        q = self.batch * self.q_heads * self.seq * self.head_dim * it
        kv = self.batch * self.kv_heads * self.seq * self.head_dim * it
        # forward: q, k, v in, out; backward: q, k, v, out, dout in, dq, dk, dv out
        return 2 * q + 2 * kv if self.direction == "fwd" else 6 * q + 6 * kv

    def visible(self) -> int:
        """(query, key) entries a row sees, summed over rows: seq^2 / 2 causal
        (the diagonal's half left out, as ever), w seq - w^2 / 2 in a window."""
        s, w = self.seq, self.window
        if not w or w >= s:
            return s * s // 2
        return w * s - w * w // 2

    def useful_flops(self) -> int:
        # QK^T and PV over the visible entries; the backward's four products
        # (dV, dP, dQ, dK) are twice that
        fwd = 4 * self.batch * self.q_heads * self.visible() * self.head_dim
        return fwd if self.direction == "fwd" else 3 * fwd

    def roofline_s(self, generation: str) -> float:
        c = model.chip(generation)
        return max(self.min_bytes() / c.hbm_bytes_per_s, self.useful_flops() / c.peak_flops)


# Decode attention over a KV cache: batch x context (issue: 1-512 x 1k-32k).
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXTS = (1024, 4096, 16384)
DECODE_PAGE = 256  # flash-attn's paged caches take multiples of 256


@dataclasses.dataclass(frozen=True)
class DecodeAttentionPoint:
    """One decode step: one new query per sequence attending to `context`
    cached keys of each of `batch` sequences. The cache is paged in flash-attn's
    layout, [pages, page, Hkv, D] with a [batch, pages_per_seq] table whose
    pages are each sequence's in order (so the contiguous [B, S, Hkv, D] view
    is a free reshape); implementations with another native layout get the
    cache in theirs (adapt_args: an input layout, not a copy in the program).
    `capacity` > context: each sequence's cache has room it does not use yet.
    """

    batch: int
    context: int
    capacity: int = 0  # 0: = context
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page: int = DECODE_PAGE
    dtype: str = "bfloat16"
    kernel = "decode_attention"

    @property
    def cache_len(self) -> int:
        return max(self.capacity, self.context)

    @property
    def tokens(self) -> int:
        return self.batch

    def labels(self) -> dict:
        return dict(
            batch=self.batch,
            context=self.context,
            cache_len=self.cache_len,
            q_heads=self.q_heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            page=self.page,
            dtype=self.dtype,
            tokens=self.tokens,
        )

    @property
    def walk_key(self):
        return ("decode_attention",) + tuple(self.labels().values())

    compile_key = walk_key

    def _shapes(self):
        dt = jnp.dtype(self.dtype)
        pps = -(-self.cache_len // self.page)
        q = jax.ShapeDtypeStruct((self.batch, self.q_heads, self.head_dim), dt)
        cache = jax.ShapeDtypeStruct(
            (self.batch * pps, self.page, self.kv_heads, self.head_dim), dt
        )
        return q, cache, pps

    def _table(self):
        pps = self._shapes()[2]
        return jnp.arange(self.batch * pps, dtype=jnp.int32).reshape(self.batch, pps)

    def compile_args(self):
        q, cache, pps = self._shapes()
        return (
            q,
            cache,
            cache,
            jax.ShapeDtypeStruct((self.batch,), jnp.int32),
            jax.ShapeDtypeStruct((self.batch, pps), jnp.int32),
        )

    def walker_args(self):
        """Lengths and the table are concrete: they decide the grid."""
        q, cache, _ = self._shapes()
        lengths = jnp.full((self.batch,), self.context, jnp.int32)
        return (q, cache, cache, lengths, self._table())

    def real_args(self, key=0):
        ks = jax.random.split(jax.random.key(key), 3)
        q, cache, _ = self._shapes()
        rnd = lambda k, a: jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype)  # noqa: E731
        lengths = jnp.full((self.batch,), self.context, jnp.int32)
        return (rnd(ks[0], q), rnd(ks[1], cache), rnd(ks[2], cache), lengths, self._table())

    def min_bytes(self) -> int:
        it = jnp.dtype(self.dtype).itemsize
        kv = 2 * self.batch * self.context * self.kv_heads * self.head_dim * it
        return kv + 2 * self.batch * self.q_heads * self.head_dim * it

    def useful_flops(self) -> int:
        return 4 * self.batch * self.q_heads * self.context * self.head_dim

    def roofline_s(self, generation: str) -> float:
        c = model.chip(generation)
        return max(self.min_bytes() / c.hbm_bytes_per_s, self.useful_flops() / c.peak_flops)
