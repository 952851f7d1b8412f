"""MoE layer shapes, routing, and the layer as each implementation runs it.

The benchmarked unit is the experts part of one MoE layer for T tokens that
the router already assigned (top-k ids and weights): gather the rows of each
expert, gate_up grouped matmul, SiLU(gate) * up, down grouped matmul, weighted
scatter-add back to the tokens. That is what transformers' `grouped_mm`
experts path does (sort by expert, grouped_mm with offsets, combine); weights
are kept as (E, K, N) so every grouped matmul is `lhs (M, K) @ rhs[e]`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import model


@dataclasses.dataclass(frozen=True)
class MoeShape:
    name: str
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    dtype: str = "bfloat16"

    @property
    def key(self) -> tuple:
        return (self.experts, self.top_k, self.hidden, self.intermediate, self.dtype)


# Public configs (config.json of each model on the Hugging Face Hub).
MODELS = {
    "qwen3-30b-a3b": MoeShape("qwen3-30b-a3b", 128, 8, 2048, 768),
    "gemma-4-26b-a4b": MoeShape("gemma-4-26b-a4b", 128, 8, 2816, 704),
    "mixtral-8x7b": MoeShape("mixtral-8x7b", 8, 2, 4096, 14336),
    "gpt-oss-20b": MoeShape("gpt-oss-20b", 32, 4, 2880, 2880),
}

DECODE_TOKENS = tuple(2**i for i in range(10))  # 1 .. 512
PREFILL_TOKENS = (2048, 8192)
ROUTINGS = ("uniform", "zipf")
ZIPF_EXPONENT = 1.2


def route(tokens: int, experts: int, top_k: int, kind: str, seed: int = 0):
    """(top_k_index int32 (T, k), top_k_weights float32 (T, k)).

    uniform: each token picks k distinct experts uniformly at random.
    zipf: expert popularity ~ 1 / rank**1.2 over a random ranking of the
    experts; each token draws k distinct experts with those probabilities
    (Gumbel top-k), which concentrates rows on a few hot experts.
    """
    if kind not in ROUTINGS:
        raise ValueError(f"routing: expected one of {ROUTINGS}, got {kind!r}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k: expected 1..{experts}, got {top_k}")
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        logp = np.zeros(experts)
    else:
        ranks = rng.permutation(experts) + 1
        logp = -ZIPF_EXPONENT * np.log(ranks)
    gumbel = rng.gumbel(size=(tokens, experts))
    ids = np.argsort(-(logp[None, :] + gumbel), axis=1)[:, :top_k].astype(np.int32)
    logits = rng.normal(size=(tokens, top_k))
    w = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return ids, w.astype(np.float32)


def group_sizes(ids: np.ndarray, experts: int) -> np.ndarray:
    return np.bincount(np.asarray(ids).reshape(-1), minlength=experts).astype(np.int32)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def dispatch(ids, experts: int):
    """Sort (token, slot) pairs by expert: (order, token of each row, sizes)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // top_k
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    return order, token, sizes


def padded_rows(rows: int, row_multiple: int = 1, min_rows: int = 1) -> int:
    """Rows a grouped matmul gets: `rows` rounded up to `row_multiple`, and to
    at least `min_rows`."""
    return max(_round_up(rows, row_multiple), min_rows)


def experts_layer(
    gmm: Callable, x, w_gate_up, w_down, ids, weights, row_multiple: int = 1, min_rows: int = 1
):
    """The experts layer around a grouped matmul `gmm(lhs, rhs, group_sizes)`.

    `row_multiple` pads the sorted rows (with rows of no group) for kernels
    that need M to be a multiple of their row tile; `min_rows` for kernels that
    refuse fewer rows (tokamax's Pallas kernel: 128).
    """
    experts = w_gate_up.shape[0]
    order, token, sizes = dispatch(ids, experts)
    rows = token.shape[0]
    xs = x[token]
    pad = padded_rows(rows, row_multiple, min_rows) - rows
    if pad:
        xs = jnp.pad(xs, ((0, pad), (0, 0)))
    h = gmm(xs, w_gate_up, sizes)
    inter = w_down.shape[1]
    act = (jax.nn.silu(h[:, :inter].astype(jnp.float32)) * h[:, inter:].astype(jnp.float32)).astype(
        x.dtype
    )
    y = gmm(act, w_down, sizes)[:rows]
    wts = weights.reshape(-1)[order].astype(jnp.float32)
    contrib = y.astype(jnp.float32) * wts[:, None]
    return jnp.zeros(x.shape, jnp.float32).at[token].add(contrib).astype(x.dtype)


def dense_layer(x, w_gate_up, w_down, ids, weights):
    """Every expert on every token, then the top-k mixed: what a user without a
    grouped matmul writes (an expert loop costs XLA the same)."""
    experts = w_gate_up.shape[0]
    inter = w_down.shape[1]
    h = jnp.einsum("th,ehn->ten", x, w_gate_up, preferred_element_type=jnp.float32)
    act = (jax.nn.silu(h[..., :inter]) * h[..., inter:]).astype(x.dtype)
    y = jnp.einsum("tei,eih->teh", act, w_down, preferred_element_type=jnp.float32)
    mix = jnp.zeros((x.shape[0], experts), jnp.float32)
    mix = mix.at[jnp.arange(x.shape[0])[:, None], ids].add(weights)
    return jnp.einsum("te,teh->th", mix, y).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class MoePoint:
    shape: MoeShape
    tokens: int
    routing: str
    seed: int = 0
    kernel = "moe"

    def labels(self) -> dict:
        s = self.shape
        return dict(
            model=s.name,
            experts=s.experts,
            top_k=s.top_k,
            hidden=s.hidden,
            intermediate=s.intermediate,
            dtype=s.dtype,
            tokens=self.tokens,
            phase=self.phase,
            routing=self.routing,
            seed=self.seed,
        )

    @property
    def walk_key(self) -> tuple:
        return ("moe", self.shape.key, self.tokens, self.routing, self.seed)

    @property
    def compile_key(self) -> tuple:
        return ("moe", self.shape.key, self.tokens)

    def gmms(self) -> list:
        return [model.GroupedMatmul(gs, k, n) for gs, k, n in self.gmm_problems()]

    def min_bytes(self) -> int:
        return sum(g.min_bytes for g in self.gmms())

    def useful_flops(self) -> int:
        return sum(g.useful_flops for g in self.gmms())

    def roofline_s(self, generation: str) -> float:
        return model.grouped_roofline_s(self.gmms(), generation)

    @property
    def phase(self) -> str:
        return "decode" if self.tokens <= max(DECODE_TOKENS) else "prefill"

    def routing_arrays(self):
        return route(self.tokens, self.shape.experts, self.shape.top_k, self.routing, self.seed)

    def abstract_args(self):
        """x, w_gate_up, w_down as shapes only (they never decide the grid)."""
        s = self.shape
        dt = jnp.dtype(s.dtype)
        return (
            jax.ShapeDtypeStruct((self.tokens, s.hidden), dt),
            jax.ShapeDtypeStruct((s.experts, s.hidden, 2 * s.intermediate), dt),
            jax.ShapeDtypeStruct((s.experts, s.intermediate, s.hidden), dt),
        )

    def walker_args(self):
        ids, w = self.routing_arrays()
        return (*self.abstract_args(), jnp.asarray(ids), jnp.asarray(w))

    def compile_args(self):
        s = self.shape
        return (
            *self.abstract_args(),
            jax.ShapeDtypeStruct((self.tokens, s.top_k), jnp.int32),
            jax.ShapeDtypeStruct((self.tokens, s.top_k), jnp.float32),
        )

    def real_args(self, key=0):
        """Concrete inputs (for timing on a real TPU)."""
        ids, w = self.routing_arrays()
        k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
        x, wgu, wd = self.abstract_args()
        mk = lambda k, a, scale: (jax.random.normal(k, a.shape, jnp.float32) * scale).astype(
            a.dtype
        )
        return (
            mk(k1, x, 1.0),
            mk(k2, wgu, self.shape.hidden**-0.5),
            mk(k3, wd, self.shape.intermediate**-0.5),
            jnp.asarray(ids),
            jnp.asarray(w),
        )

    def gmm_problems(self):
        """(group sizes, K, N) of the two grouped matmuls, for the roofline."""
        ids, _ = self.routing_arrays()
        gs = tuple(int(g) for g in group_sizes(ids, self.shape.experts))
        s = self.shape
        return [(gs, s.hidden, 2 * s.intermediate), (gs, s.intermediate, s.hidden)]
