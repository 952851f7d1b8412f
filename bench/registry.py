"""Implementations benchmarked side by side: name -> builder of a JAX callable.

A builder gets the point (shape + routing) and the TPU generation and returns
a `Built`: the function to trace/compile (same positional inputs for every
implementation of a kernel, see `bench.points`) and a key naming the program
for the caches. It raises `Skip(reason)` when the implementation is not
available (module not importable yet, tokamax not installed, ...); the sweep
records the reason instead of failing.

Our own kernels are reached through the package contract (README, "Layout"):
`<package>.api.<entry>`, every entry taking `config=None | generation name |
Config`, so each builder names the entry and passes the generation as config.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Callable

import jax
import jax.numpy as jnp

from . import moe


class Skip(Exception):
    """The implementation cannot run at this point; the message says why."""


@dataclasses.dataclass
class Built:
    fn: Callable
    key: tuple  # names the program: same key -> same walk / compile
    notes: tuple = ()
    # Programs whose XLA part (everything but the Pallas launches) is the same
    # share this key, so that part is compiled once for all of them.
    glue_key: tuple | None = None
    # For programs whose inputs are laid out differently from the point's
    # (transformers' weight storage): maps the point's arguments (arrays or
    # ShapeDtypeStructs, same layer) to fn's. Use `program_args`.
    adapt_args: Callable | None = None


def program_args(built: Built, args) -> tuple:
    """The arguments `built.fn` takes, from the point's `walker_args()`,
    `compile_args()` or `real_args()`."""
    args = tuple(args)
    return tuple(built.adapt_args(*args)) if built.adapt_args else args


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    kernel: str  # "moe" | "rmsnorm" | "attention"
    description: str
    build: Callable  # (point, generation, ctx) -> Built
    baseline: bool = False  # the "default path" speedups are measured against
    ours: bool = False


REGISTRY: dict[str, Impl] = {}


def register(impl: Impl) -> Impl:
    REGISTRY[impl.name] = impl
    return impl


def impls_for(kernel: str) -> list[Impl]:
    return [i for i in REGISTRY.values() if i.kernel == kernel]


def _import(module: str):
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure is a skip
        raise Skip(f"import {module} failed: {type(e).__name__}: {e}") from None


def _import_attr(module: str, name: str):
    """module.name, or Skip when the module does not import or lacks it."""
    mod = _import(module)
    if not hasattr(mod, name):
        raise Skip(f"{module} has no {name}")
    return getattr(mod, name)


def _contract_entry(package: str, entry: str, generation: str, **fixed) -> Callable:
    """`<package>.api.<entry>` with the generation as its `config` (the package
    contract: every JAX entry takes config=None | generation name | Config)."""
    return functools.partial(_import_attr(f"{package}.api", entry), config=generation, **fixed)


# --------------------------------------------------------------------------
# MoE experts layer. Inputs: x (T,H), w_gate_up (E,H,2I), w_down (E,I,H),
# top_k_index (T,k) int32, top_k_weights (T,k) f32 -> (T,H).
# --------------------------------------------------------------------------


def _ours_moe(point, generation, ctx) -> Built:
    """The weights as the model stores them (hf_is_transposed), which is what
    experts_forward hands the kernels. Qwen3, Mixtral and Gemma 4 store
    [E, out, in]; on tpu7x their prefill gmm passes of fewer than 256 rows
    then transpose each weight piece on the XLU (Mosaic pushes transposed
    weights only for 256-row operands): 8,192 Qwen3 tokens, gate/up 546.9 ->
    659.5 us and down 309.2 -> 365.5 against [E, in, out] (2026-12-05; v6e,
    bound by its weight copies, within 1.1 us). Until then the bench gave the
    kernels [E, in, out]."""
    from .baselines import hf_grouped_mm as hf

    is_t = hf_is_transposed(point)
    op = _contract_entry("ragged_dot_tpu", "moe_experts", generation, is_transposed=is_t)

    def fn(x, w_gate_up, w_down, ids, weights):
        # moe_experts' argument order; the weights in the model's storage (adapt_args).
        return op(x, ids, weights, w_gate_up, w_down, num_experts=w_gate_up.shape[0])

    return Built(
        fn,
        ("ours_moe_experts", generation, is_t),
        glue_key=("ours_moe_experts", is_t),
        adapt_args=functools.partial(hf.storage_args, is_transposed=is_t),
    )


QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def _quantize(w, dtype: str, blocks: bool):
    """Symmetric weight-only quantization of [E, in, out] weights: (quantized,
    scales [E, out] per output channel, or [E, in/128, out/128] per block).
    ShapeDtypeStructs give ShapeDtypeStructs of the same."""
    e, k, n = w.shape
    s_shape = (e, k // 128, n // 128) if blocks else (e, n)
    if isinstance(w, jax.ShapeDtypeStruct):
        return (
            jax.ShapeDtypeStruct(w.shape, jnp.dtype(dtype)),
            jax.ShapeDtypeStruct(s_shape, jnp.float32),
        )
    w = w.astype(jnp.float32)
    if blocks:
        amax = jnp.abs(w.reshape(e, k // 128, 128, n // 128, 128)).max(axis=(2, 4))
        full = jnp.repeat(jnp.repeat(amax, 128, 1), 128, 2)
    else:
        amax = jnp.abs(w).max(axis=1)
        full = amax[:, None, :]
    scale = jnp.where(amax > 0, amax / QMAX[dtype], 1.0)
    q = w / jnp.where(full > 0, full / QMAX[dtype], 1.0)
    q = jnp.clip(jnp.round(q), -127, 127) if dtype == "int8" else q
    return q.astype(dtype), scale


def _ours_moe_quantized(dtype: str, blocks: bool, w8a8: bool = False):
    """moe_experts on weight-only quantized weights (same [E, in, out] layout as
    ours_moe_experts): the bytes the kernels read shrink, the layer's program is
    otherwise the same. w8a8: the activations quantized in the kernel too."""
    name = f"ours_moe_experts_{'w8a8_' if w8a8 else ''}{dtype}" + ("_blocks" if blocks else "")
    fixed = {"quantize_activations": True} if w8a8 else {}
    return _ours_moe_on(name, functools.partial(_quantize, dtype=dtype, blocks=blocks), **fixed)


def _mxfp4_quantize(w):
    """[E, in, out] weights in MXFP4's kernel layout ([E, in/2, out] bytes, e8m0
    scales per 32 inputs): a quarter of bf16's bytes plus 1/64 for scales."""
    # The build's _contract_entry already imported the package (api imports mxfp4).
    mx = _import("ragged_dot_tpu.mxfp4")
    return mx.abstract(w.shape) if isinstance(w, jax.ShapeDtypeStruct) else mx.quantize(w)


def _ours_moe_on(name: str, quantize: Callable, **fixed):
    """A builder of moe_experts on the bench's weights quantized by
    `quantize(w) -> (weights, scales)` (ShapeDtypeStructs give
    ShapeDtypeStructs), with `fixed` keyword arguments."""

    def build(point, generation, ctx) -> Built:
        op = _contract_entry("ragged_dot_tpu", "moe_experts", generation, is_transposed=True)

        def fn(x, w_gate_up, w_down, ids, weights, gate_up_scale, down_scale):
            return op(
                x,
                ids,
                weights,
                w_gate_up,
                w_down,
                None,
                None,
                gate_up_scale,
                down_scale,
                num_experts=w_gate_up.shape[0],
                **fixed,
            )

        def adapt_args(x, w_gate_up, w_down, ids, weights):
            gu, gu_s = quantize(w_gate_up)
            dn, dn_s = quantize(w_down)
            return x, gu, dn, ids, weights, gu_s, dn_s

        return Built(fn, (name, generation), glue_key=(name,), adapt_args=adapt_args)

    return build


def _ours_ragged_dot(point, generation, ctx) -> Built:
    gmm = _contract_entry("ragged_dot_tpu", "ragged_dot", generation)

    def fn(x, w_gate_up, w_down, ids, weights):
        return moe.experts_layer(gmm, x, w_gate_up, w_down, ids, weights)

    rows = point.tokens * point.shape.top_k
    return Built(fn, ("ours_ragged_dot", generation), glue_key=("experts_layer", rows))


def _megablox_module():
    # jax.experimental.pallas.ops.tpu.megablox re-exports the custom_vjp `gmm`
    # under the module's own name; the ops module holds it unambiguously.
    return _import("jax.experimental.pallas.ops.tpu.megablox.ops")


def _megablox_layer(tilings: tuple, row_multiple: int):
    ops = _megablox_module()

    def fn(x, w_gate_up, w_down, ids, weights):
        it = iter(tilings)  # gate_up first, then down

        def gmm(lhs, rhs, sizes):
            return ops.gmm(lhs, rhs, sizes, preferred_element_type=lhs.dtype, tiling=next(it))

        return moe.experts_layer(gmm, x, w_gate_up, w_down, ids, weights, row_multiple=row_multiple)

    return fn


def megablox_rows(rows: int) -> int:
    """Rows padded the way megablox needs them: to 8, then to the 128 tile."""
    r8 = -(-rows // 8) * 8
    return r8 if r8 <= 128 else -(-rows // 128) * 128


def _megablox_default(point, generation, ctx) -> Built:
    rows = point.tokens * point.shape.top_k
    padded = megablox_rows(rows)
    tm = min(128, padded)  # gmm needs M % tm == 0; smaller M uses one tile
    tilings = ((tm, 128, 128), (tm, 128, 128))
    return Built(
        _megablox_layer(tilings, tm),
        ("megablox", tilings, tm),
        glue_key=("experts_layer", -(-rows // tm) * tm),
    )


# Default scoped-VMEM limit Mosaic gives a kernel that does not raise it
# (megablox does not): XLA TPU flags' defaults per generation.
_SCOPED_VMEM = {"v5e": 16 << 20, "v6e": 32 << 20, "tpu7x": 32 << 20, "v5p": 16 << 20}


def _divisors_128(n: int) -> list[int]:
    """n itself, then multiples of 128 dividing n, largest first; when none
    divides (e.g. 2880), a few multiples of 128 below n (megablox masks the
    remainder tile)."""
    out = [n] + [d for d in range(n - n % 128, 127, -128) if d != n and n % d == 0]
    if len(out) == 1:
        out += [d for d in (2048, 1536, 1024, 768, 512, 256, 128) if d < n]
    return out


def _megablox_candidates(rows: int, k: int, n: int, generation: str) -> list:
    """Tilings in order of preference: full K and N, largest row tile first."""
    padded = megablox_rows(rows)
    tms = sorted(
        {t for t in (padded, 1024, 512, 256, 128) if t <= padded and t <= 1024 and padded % t == 0},
        reverse=True,
    )
    cands = []
    for tk in _divisors_128(k)[:4]:
        for tn in _divisors_128(n)[:6]:
            for tm in tms:
                # double-buffered lhs, rhs, out tiles (bf16) + f32 accumulator
                need = 2 * 2 * (tm * tk + tk * tn + tm * tn) + 4 * tm * tn
                if need <= _SCOPED_VMEM.get(generation, 16 << 20):
                    cands.append((tm, tk, tn))
    # full K first, then widest N, then tallest M
    cands.sort(key=lambda t: (-(t[1] == k), -t[2] * t[1], -t[0]))
    return cands


def _megablox_best(point, generation, ctx) -> Built:
    """Per grouped matmul, the tiling with the lower modeled time of the first
    two (in the order: full K and N, widest N, tallest row tile) that compile
    for this generation (at most six tried: each failing compile costs
    seconds)."""
    from . import model as model_mod

    ops = _megablox_module()
    s = point.shape
    rows = point.tokens * s.top_k
    ids, _ = point.routing_arrays()
    sizes = jnp.asarray(moe.group_sizes(ids, s.experts))
    chosen = []
    for k, n in ((s.hidden, 2 * s.intermediate), (s.intermediate, s.hidden)):
        best = None
        compiled = 0
        for tiling in _megablox_candidates(rows, k, n, generation)[:6]:
            tm = tiling[0]
            m = -(-rows // tm) * tm
            lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
            rhs = jax.ShapeDtypeStruct((s.experts, k, n), jnp.bfloat16)
            f = functools.partial(_gmm_only, ops.gmm, tiling=tiling)
            res = ctx.compile_kernels(
                f, (lhs, rhs, jax.ShapeDtypeStruct((s.experts,), jnp.int32)), generation
            )
            if not res.ok:
                continue
            _, costs = ctx.walk(
                ("megablox_gmm", tiling, m, k, n, point.walk_key), f, (lhs, rhs, sizes)
            )
            t = sum(
                model_mod.kernel_time_s(c.hbm_bytes, c.flops, c.steps, generation) for c in costs
            )
            if best is None or t < best[0]:
                best = (t, tiling)
            compiled += 1
            if compiled == 2:
                break
        if best is None:
            raise Skip(f"no megablox tiling compiles on {generation} for K={k} N={n}")
        chosen.append(best[1])
    row_multiple = math.lcm(chosen[0][0], chosen[1][0])
    tilings = tuple(chosen)
    return Built(
        _megablox_layer(tilings, row_multiple),
        ("megablox", tilings, row_multiple),
        notes=(f"tilings gate_up={chosen[0]} down={chosen[1]}",),
        glue_key=("experts_layer", -(-rows // row_multiple) * row_multiple),
    )


def _gmm_only(gmm, lhs, rhs, sizes, *, tiling):
    return gmm(lhs, rhs, sizes, preferred_element_type=lhs.dtype, tiling=tiling)


def _xla_ragged_dot(point, generation, ctx) -> Built:
    def gmm(lhs, rhs, sizes):
        return jax.lax.ragged_dot(lhs, rhs, sizes)

    def fn(x, w_gate_up, w_down, ids, weights):
        return moe.experts_layer(gmm, x, w_gate_up, w_down, ids, weights)

    return Built(fn, ("xla_ragged_dot",))


def _xla_dense(point, generation, ctx) -> Built:
    if point.phase != "decode":
        # Every expert on every prefill token: E/top_k times the useful work and
        # an [T, E, 2I] f32 intermediate; compiling it costs more than it tells.
        raise Skip("dense all-experts layer is only benchmarked at decode sizes")
    return Built(moe.dense_layer, ("xla_dense",))


def _tokamax(point, generation, ctx, qdtype: str | None = None) -> Built:
    """tokamax.ragged_dot x2 with its Pallas TPU kernel forced (off a TPU it
    would silently run XLA), config as tokamax picks it on `generation`.

    qdtype: weight-only quantized weights as tokamax takes them, qwix QArrays
    with one scale per expert and output channel ([E, 1, N], bf16 so that the
    output stays bf16), quantized as ours are (`_quantize`)."""
    from . import tracing
    from .baselines import tokamax_gmm as tk

    try:
        ver = tk.version()
    except tk.Unavailable as e:
        raise Skip(str(e)) from None
    s = point.shape
    rows = point.tokens * s.top_k
    m = moe.padded_rows(rows, 1, tk.MIN_ROWS)
    dt = jnp.dtype(s.dtype)
    picked = []
    for k, n in ((s.hidden, 2 * s.intermediate), (s.intermediate, s.hidden)):
        if min(k, n) < tk.MIN_ROWS:
            raise Skip(
                f"tokamax's Pallas TPU ragged_dot rejects dims < {tk.MIN_ROWS} "
                f"(K={k}, N={n}); tokamax.ragged_dot runs XLA there"
            )
        picked.append(tk.config_for(m, k, n, s.experts, dt, generation))
    ops = [tk.forced_op(cfg) for cfg, _ in picked]

    def fn(x, w_gate_up, w_down, ids, weights, *scales):
        if scales:
            import qwix

            w_gate_up, w_down = (
                qwix.QArray(w, sc[:, None, :].astype(x.dtype))
                for w, sc in zip((w_gate_up, w_down), scales)
            )
        it = iter(ops)  # gate_up first, then down

        def gmm(lhs, rhs, sizes):
            return tk.ragged_dot(lhs, rhs, sizes, op=next(it))

        # emit_pipeline may size itself from the attached chip: answer for the target
        with tracing.pretend_tpu(generation):
            return moe.experts_layer(gmm, x, w_gate_up, w_down, ids, weights, min_rows=tk.MIN_ROWS)

    tiles = tuple((c.tile_m, c.tile_k, c.tile_n, c.input_buffer_count) for c, _ in picked)
    notes = [
        f"tokamax {ver} Pallas Mosaic TPU forced; (tile_m, tile_k, tile_n, "
        f"buffers) gate_up={tiles[0]} ({picked[0][1]}), down={tiles[1]} "
        f"({picked[1][1]})"
    ]
    if m > rows:
        notes.append(
            f"rows padded {rows} -> {m}: the Pallas kernel rejects M < "
            f"{tk.MIN_ROWS}; unpadded, tokamax.ragged_dot falls back to XLA"
        )
    adapt_args = None
    if qdtype is not None:
        notes.append(f"{qdtype} weights as qwix QArrays, per-output-channel scales [E, 1, N]")

        def adapt_args(x, w_gate_up, w_down, ids, weights):
            gu, gu_s = _quantize(w_gate_up, qdtype, blocks=False)
            dn, dn_s = _quantize(w_down, qdtype, blocks=False)
            return x, gu, dn, ids, weights, gu_s, dn_s

    return Built(
        fn,
        ("tokamax_ragged_dot", tiles, m, qdtype),
        notes=tuple(notes),
        glue_key=("experts_layer", m) + ((qdtype,) if qdtype else ()),
        adapt_args=adapt_args,
    )


# transformers' experts weight storage per model: is_transposed=False stores
# gate_up_proj [E, 2I, H] / down_proj [E, H, I] (Qwen3-MoE, Mixtral, Gemma 4,
# and the decorator's default); GPT-OSS stores [E, in, out].
HF_IS_TRANSPOSED = {"gpt-oss-20b": True}


def hf_is_transposed(point) -> bool:
    return HF_IS_TRANSPOSED.get(point.shape.name, False)


def _hf_grouped_mm(point, generation, ctx) -> Built:
    """transformers' default grouped_mm experts path as TorchTPU runs it."""
    from .baselines import hf_grouped_mm as hf

    is_t = hf_is_transposed(point)
    notes = [
        "transformers 5.22.2 grouped_mm_experts_forward; torch._grouped_mm "
        "-> chlo.ragged_dot (TorchTPU 0.2.0); one XLA program (torch.compile "
        "form; eager runs each aten op as its own executable)"
    ]
    if not is_t:
        notes.append(
            "weights in transformers' storage [E, 2I, H] / [E, H, I], "
            "passed as .transpose(-2, -1) views"
        )
    return Built(
        hf.bench_program(is_transposed=is_t),
        ("hf_grouped_mm", is_t),
        notes=tuple(notes),
        adapt_args=functools.partial(hf.storage_args, is_transposed=is_t),
    )


register(
    Impl(
        "ours_moe_experts",
        "moe",
        "ragged_dot_tpu.api.moe_experts (fused experts op, this library)",
        _ours_moe,
        ours=True,
    )
)
for _dtype, _blocks, _what in (
    ("int8", False, "int8 weights, per-output-channel scales"),
    ("float8_e4m3fn", False, "float8_e4m3fn weights, per-output-channel scales"),
    ("float8_e4m3fn", True, "float8_e4m3fn weights, 128 x 128 block scales (FP8 checkpoints)"),
):
    register(
        Impl(
            f"ours_moe_experts_{_dtype}" + ("_blocks" if _blocks else ""),
            "moe",
            f"ragged_dot_tpu.api.moe_experts, weight-only quantized: {_what}",
            _ours_moe_quantized(_dtype, _blocks),
            ours=True,
        )
    )
for _dtype, _gens in (("int8", "v5e, v6e"), ("float8_e4m3fn", "tpu7x")):
    register(
        Impl(
            f"ours_moe_experts_w8a8_{_dtype}",
            "moe",
            f"ragged_dot_tpu.api.moe_experts, w8a8: {_dtype} weights (per channel) and"
            f" activations quantized per row in the kernel ({_gens}'s MXU rate)",
            _ours_moe_quantized(_dtype, False, w8a8=True),
            ours=True,
        )
    )
register(
    Impl(
        "ours_moe_experts_mxfp4",
        "moe",
        "ragged_dot_tpu.api.moe_experts, weight-only MXFP4 (e2m1 weights, e8m0 scales per 32)",
        _ours_moe_on("ours_moe_experts_mxfp4", _mxfp4_quantize),
        ours=True,
    )
)
register(
    Impl(
        "ours_ragged_dot",
        "moe",
        "ragged_dot_tpu.api.ragged_dot x2 + XLA dispatch/combine",
        _ours_ragged_dot,
        ours=True,
    )
)
register(
    Impl(
        "megablox_default",
        "moe",
        "JAX megablox gmm, default tiling (128,128,128) (M<128: one row tile)",
        _megablox_default,
    )
)
register(
    Impl(
        "megablox_best",
        "moe",
        "JAX megablox gmm, best tiling that compiles (full K,N; largest row tile)",
        _megablox_best,
    )
)
register(
    Impl(
        "hf_grouped_mm",
        "moe",
        "transformers' default grouped_mm experts path as TorchTPU lowers it "
        "(torch._grouped_mm -> chlo.ragged_dot, weights in transformers' "
        "layout) -- the default path",
        _hf_grouped_mm,
        baseline=True,
    )
)
register(
    Impl(
        "xla_ragged_dot",
        "moe",
        "jax.lax.ragged_dot x2 with this bench's XLA dispatch/combine, "
        "weights [E, in, out] (what a JAX user writes)",
        _xla_ragged_dot,
    )
)
register(
    Impl("xla_dense", "moe", "all experts on all tokens (einsum), then mix the top-k", _xla_dense)
)
register(
    Impl(
        "tokamax_ragged_dot",
        "moe",
        "tokamax 0.0.12 ragged_dot x2, Pallas Mosaic TPU kernel forced "
        "(gmm_megablox in an emit_pipeline), tokamax's config for the generation",
        _tokamax,
    )
)
register(
    Impl(
        "tokamax_ragged_dot_int8",
        "moe",
        "tokamax 0.0.12 ragged_dot x2 as tokamax_ragged_dot, weight-only int8 (qwix "
        "QArray, per-output-channel scales)",
        functools.partial(_tokamax, qdtype="int8"),
    )
)


# --------------------------------------------------------------------------
# RMSNorm: x (T,H) bf16[, residual (T,H)], weight (H,) -> (T,H)[, sum (T,H)];
# backward from the saved input (fused: the sum) and the cotangents.
# --------------------------------------------------------------------------


def _ours_rmsnorm(point, generation, ctx) -> Built:
    gemma, key = point.variant == "gemma", ("ours_rmsnorm", generation, point.variant)
    if point.direction == "bwd":
        # What the op's autograd rule runs: the backward kernel alone.
        bwd = functools.partial(
            _import_attr("rmsnorm_tpu.kernel", "rms_norm_bwd"),
            eps=1e-6,
            gemma=gemma,
            config=generation,
        )

        def fn(s, w, dy, ds=None):
            return bwd(dy, ds, s, w)

        return Built(fn, key + ("bwd",), glue_key=("ours_rmsnorm",))
    if point.variant == "residual":
        fn = _contract_entry("rmsnorm_tpu", "fused_add_rms_norm", generation, eps=1e-6)
    else:
        fn = _contract_entry("rmsnorm_tpu", "rms_norm", generation, eps=1e-6, gemma=gemma)
    return Built(fn, key, glue_key=("ours_rmsnorm",))


def _xla_rmsnorm(point, generation, ctx) -> Built:
    def norm(x, w):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
        wf = w.astype(jnp.float32)
        return (y * (1.0 + wf if point.variant == "gemma" else wf)).astype(x.dtype)

    def fused(x, r, w):
        s = (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(x.dtype)
        return norm(s, w), s

    def bwd(s, w, dy, ds=None):
        _, vjp = jax.vjp(norm, s, w)
        dx, dw = vjp(dy)
        return (dx if ds is None else dx + ds), dw

    key = ("xla_rmsnorm", point.variant, point.direction)
    if point.direction == "bwd":
        return Built(bwd, key)
    return Built(fused if point.variant == "residual" else norm, key)


register(Impl("ours_rmsnorm", "rmsnorm", "rmsnorm_tpu.api.rms_norm", _ours_rmsnorm, ours=True))
register(Impl("xla_rmsnorm", "rmsnorm", "jnp RMSNorm compiled by XLA", _xla_rmsnorm, baseline=True))


# --------------------------------------------------------------------------
# Attention: q (B,Hq,S,D), k/v (B,Hkv,S,D) bf16, causal -> (B,Hq,S,D).
# --------------------------------------------------------------------------


def _window_size(point):
    """flash-attn's window_size for the point: (w - 1, 0), or None (causal)."""
    return (point.window - 1, 0) if point.window else None


def _full_causal_only(point, name):
    if point.window:
        raise Skip(f"{name}: causal over the whole sequence only (no sliding window here)")


def _ours_attention(point, generation, ctx) -> Built:
    window = {"window_size": _window_size(point)} if point.window else {}
    fn = _contract_entry(
        "flash_attention_tpu", "flash_attention", generation, causal=True, **window
    )
    return Built(fn, ("ours_flash_attention", generation), glue_key=("ours_flash_attention",))


def _jax_flash(point, generation, ctx) -> Built:
    _full_causal_only(point, "JAX's Pallas flash attention")
    fa = _import("jax.experimental.pallas.ops.tpu.flash_attention")
    d = point.head_dim

    def fn(q, k, v):
        rep = q.shape[1] // k.shape[1]
        if rep > 1:  # the JAX kernel wants as many kv heads as q heads
            k = jnp.repeat(k, rep, axis=1)
            v = jnp.repeat(v, rep, axis=1)
        return fa.flash_attention(q, k, v, causal=True, sm_scale=d**-0.5)

    return Built(fn, ("jax_pallas_flash_attention",))


def _xla_attention(point, generation, ctx) -> Built:
    _full_causal_only(point, "the XLA reference")
    d = point.head_dim

    def fn(q, k, v):
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = jnp.repeat(k, rep, axis=1)
            v = jnp.repeat(v, rep, axis=1)
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32)
        s = s * d**-0.5
        n = q.shape[2]
        mask = jnp.tril(jnp.ones((n, n), bool))
        s = jnp.where(mask, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
        return jnp.einsum("bhqk,bhkd->bhqd", p, v)

    return Built(fn, ("xla_attention",))


def _jax_splash(point, generation, ctx) -> Built:
    return _jax_splash_block(point, _import("bench.baselines.splash").BLOCK)


SPLASH_BLOCKS = (2048, 1024, 512)


def _splash_block_time(point, generation, ctx, block):
    """(seconds, how) of splash with `block`-position blocks at this point, or
    None where one of its kernels does not compile for the generation:
    scheduled where every launch has a schedule, else the ideal model."""
    from . import model as model_mod

    built = _jax_splash_block(point, block)
    # The sweep's own walk key for the winner (see sweep.evaluate), so its
    # walk, compiles and schedules are the ones measured here.
    key = (built.key + (point.walk_key[-1],), point.walk_key)
    launches, costs = ctx.walk(key, point.program(built.fn), point.walker_args())
    ideal = sum(model_mod.kernel_time_s(c.hbm_bytes, c.flops, c.steps, generation) for c in costs)
    if not ctx.do_compile:
        return ideal, "ideal model"
    scheduled = 0.0
    for launch in launches:
        comp, sch, _ = ctx.gate_and_schedule(launch, generation)
        if not comp.ok:
            return None
        if sch is None:
            scheduled = None
        elif scheduled is not None:
            scheduled += sch.seconds
    return (scheduled, "scheduled") if scheduled is not None else (ideal, "ideal model")


def _jax_splash_best(point, generation, ctx) -> Built:
    """JAX's splash at the block size that runs fastest at this point and
    generation, of 2048, 1024 and 512 positions (capped at the sequence): the
    sweep's jax_splash_attention keeps MaxText's 512, where each of its many
    grid steps pays a DMA wait and its pipeline work; a user tuning splash
    would pick the block. Larger blocks first; the search stops at the first
    size slower than the one before it (the time falls and then rises as the
    block shrinks: fewer steps against more masked work on the diagonal)."""
    if ctx is None:
        raise Skip("needs the sweep's compile and walk caches to pick a block size")
    tried = []
    best = None
    for block in dict.fromkeys(min(b, point.seq) for b in SPLASH_BLOCKS):
        res = _splash_block_time(point, generation, ctx, block)
        if res is None:
            tried.append(f"{block}: does not compile")
            continue
        t, how = res
        tried.append(f"{block}: {t * 1e6:,.1f} us {how}")
        if best is not None and t > best[0]:
            break
        if best is None or t < best[0]:
            best = (t, block)
    if best is None:
        raise Skip(f"no splash block size compiles on {generation}: {'; '.join(tried)}")
    built = _jax_splash_block(point, best[1])
    return dataclasses.replace(
        built, notes=built.notes + (f"block sizes tried: {'; '.join(tried)}",)
    )


def _jax_splash_block(point, block) -> Built:
    sp = _import("bench.baselines.splash")
    _import("jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel")
    b = min(block, point.seq)

    def fn(q, k, v):
        return sp.jax_splash(q, k, v, block=b, window=point.window)

    mask = f"LocalMask window ({point.window - 1}, 0)" if point.window else "CausalMask"
    return Built(
        fn,
        ("jax_splash_attention", b, point.window),
        notes=(f"make_splash_mha, {mask}, native GQA, blocks q=kv=kv_compute={b}, q pre-scaled",),
    )


def _torch_tpu_splash(point, generation, ctx) -> Built:
    _full_causal_only(point, "torch_tpu's splash_sdpa")
    sp = _import("bench.baselines.splash")
    _import("torch_tpu._internal.ops.splash_attention")

    def fn(q, k, v):
        return sp.torch_tpu_splash(q, k, v)

    notes = [
        f"torch_tpu {sp.torch_tpu_version()} splash_sdpa's JAX function "
        "(_make_splash_attention_fn: blocks 512, saves logsumexp)"
    ]
    if point.kv_heads not in (1, point.q_heads):
        notes.append(
            f"GQA: K/V repeat_interleave'd {point.kv_heads} -> "
            f"{point.q_heads} heads before the kernel, as splash_sdpa does"
        )
    return Built(fn, ("torch_tpu_splash",), notes=tuple(notes))


register(
    Impl(
        "ours_flash_attention",
        "attention",
        "flash_attention_tpu.api.flash_attention",
        _ours_attention,
        ours=True,
    )
)
register(
    Impl(
        "jax_pallas_flash_attention",
        "attention",
        "jax.experimental.pallas.ops.tpu.flash_attention (default blocks)",
        _jax_flash,
    )
)
register(
    Impl(
        "jax_splash_attention",
        "attention",
        "JAX's splash attention (make_splash_mha, causal mask, native GQA, blocks 512)",
        _jax_splash,
    )
)
register(
    Impl(
        "jax_splash_best",
        "attention",
        "JAX's splash attention at its fastest block size here (2048, 1024 or 512)",
        _jax_splash_best,
    )
)
register(
    Impl(
        "torch_tpu_splash",
        "attention",
        "torch_tpu's splash_sdpa op (its JAX splash function; GQA by repeat_interleave of K/V)",
        _torch_tpu_splash,
    )
)
register(
    Impl(
        "xla_attention",
        "attention",
        "softmax(QK^T)V compiled by XLA",
        _xla_attention,
        baseline=True,
    )
)


# --------------------------------------------------------------------------
# Decode attention: q (B,Hq,D), paged cache (P,page,Hkv,D) x2, lengths (B,),
# table (B,pages) -> (B,Hq,D). See points.DecodeAttentionPoint.
# --------------------------------------------------------------------------


def _ours_decode_paged(point, generation, ctx) -> Built:
    kv = _import("flash_attention_tpu.kvcache")

    def fn(q, k, v, lengths, table):
        out = kv.flash_attention_kvcache(
            q[:, None], k, v, lengths, block_table=table, config=generation
        )
        return out[:, 0]

    return Built(fn, ("ours_decode_paged", generation))


def _ours_decode_contiguous(point, generation, ctx) -> Built:
    kv = _import("flash_attention_tpu.kvcache")

    def adapt(q, k, v, lengths, table):
        b = point.batch
        shape = (b, -1) + tuple(k.shape[2:])
        if isinstance(k, jax.ShapeDtypeStruct):
            rows = k.shape[0] * k.shape[1] // b
            view = jax.ShapeDtypeStruct((b, rows) + tuple(k.shape[2:]), k.dtype)
            return q, view, view, lengths
        return q, k.reshape(shape), v.reshape(shape), lengths

    def fn(q, k, v, lengths):
        return kv.flash_attention_kvcache(q[:, None], k, v, lengths, config=generation)[:, 0]

    return Built(fn, ("ours_decode_contiguous", generation), adapt_args=adapt)


def _ours_decode_heads_major(point, generation, ctx) -> Built:
    """transformers' cache layout [B, Hkv, S, D] (StaticCache; attention_forward's
    decode route), no mask."""
    kv = _import("flash_attention_tpu.kvcache")

    def fn(q, k, v, lengths):
        out = kv.flash_attention_kvcache(
            q[:, None], k, v, lengths, cache_layout="bhsd", config=generation
        )
        return out[:, 0]

    return Built(fn, ("ours_decode_heads_major", generation), adapt_args=_heads_major_view(point))


def _heads_major_view(point):
    """adapt_args: the point's paged cache as transformers' [B, Hkv, S, D]."""

    def adapt(q, k, v, lengths, table):
        b = point.batch
        if isinstance(k, jax.ShapeDtypeStruct):
            p, page, h, d = k.shape
            view = jax.ShapeDtypeStruct((b, h, p * page // b, d), k.dtype)
            return q, view, view, lengths
        to = lambda x: x.reshape(b, -1, *x.shape[2:]).transpose(0, 2, 1, 3)  # noqa: E731
        return q, to(k), to(v), lengths

    return adapt


def _jax_paged_attention(point, generation, ctx) -> Built:
    pa = _import("jax.experimental.pallas.ops.tpu.paged_attention")
    pages = -(-point.cache_len // point.page)
    # its compute block: the pages-per-step divisor of the table closest to
    # our kernel's ~256-position x 8-head steps (1024 positions of one head)
    ppcb = max(c for c in range(1, pages + 1) if pages % c == 0 and c * point.page <= 1024)

    def adapt(q, k, v, lengths, table):
        if isinstance(k, jax.ShapeDtypeStruct):
            p, page, h, d = k.shape
            k = v = jax.ShapeDtypeStruct((h, p, page, d), k.dtype)
        else:
            k, v = k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3)
        return q, k, v, lengths, table

    def fn(q, k, v, lengths, table):
        scale = point.head_dim**-0.5
        return pa.paged_attention(
            q * jnp.asarray(scale, q.dtype), k, v, lengths, table, pages_per_compute_block=ppcb
        )

    note = f"its own cache layout [Hkv, pages, page, D]; pages_per_compute_block={ppcb}"
    return Built(fn, ("jax_paged_attention", ppcb), notes=(note,), adapt_args=adapt)


def _torch_tpu_splash_decode(point, generation, ctx) -> Built:
    """torch_tpu's splash_sdpa as a decode user would call it: q [B, Hq, 1, D]
    against the whole cache [B, Hkv, S, D] (every cache full in the sweep:
    splash takes no per-sequence lengths), not causal."""
    sp = _import("bench.baselines.splash")
    _import("torch_tpu._internal.ops.splash_attention")

    def fn(q, k, v, lengths):
        return sp.torch_tpu_splash(q[:, :, None], k, v, causal=False)[:, :, 0]

    notes = (
        f"torch_tpu {sp.torch_tpu_version()} splash_sdpa(q, k, v, is_causal=False, enable_gqa): "
        "q of one position against the whole cache",
    )
    return Built(fn, ("torch_tpu_splash_decode",), notes=notes, adapt_args=_heads_major_view(point))


def _tpu_inference_rpa(point, generation, ctx) -> Built:
    rpa = _import("bench.baselines.rpa")
    try:
        kernel = rpa.load()
    except Exception as e:  # noqa: BLE001 - any load failure is a skip
        raise Skip(f"tpu-inference's ragged paged attention: {type(e).__name__}: {e}") from None

    def adapt(q, k, v, lengths, table):
        new = rpa.new_token(q, k)  # inputs of the program, as in vLLM's step
        return q, new, new, rpa.merge(kernel, k, v), lengths, table

    def fn(q, k_new, v_new, kv, lengths, table):
        return rpa.decode(
            kernel,
            q,
            k_new,
            v_new,
            kv,
            lengths,
            table,
            generation=generation,
            scale=point.head_dim**-0.5,
        )

    # The kernel's second output aliases the cache (it updates it in place):
    # vLLM's step donates the cache and gets it back; undonated, XLA would copy
    # the whole cache first.
    fn.donate_argnums = (3,)
    note = (
        "its merged cache layout [pages, page, 2 Hkv / 2, 2, D]; its default decode blocks; "
        "the cache donated, as vLLM's step does"
    )
    return Built(fn, ("tpu_inference_rpa", generation), notes=(note,), adapt_args=adapt)


def _xla_decode_attention(point, generation, ctx) -> Built:
    def fn(q, k, v, lengths, table):
        b, hq, d = q.shape
        kc = k[table].reshape(b, -1, k.shape[2], d)
        vc = v[table].reshape(b, -1, v.shape[2], d)
        grp = hq // kc.shape[2]
        s = jnp.einsum(
            "bhgd,bkhd->bhgk", q.reshape(b, -1, grp, d), kc, preferred_element_type=jnp.float32
        ) * (d**-0.5)
        valid = jnp.arange(kc.shape[1])[None, None, None, :] < lengths[:, None, None, None]
        p = jax.nn.softmax(jnp.where(valid, s, -jnp.inf), axis=-1)
        out = jnp.einsum("bhgk,bkhd->bhgd", p.astype(vc.dtype), vc)
        return out.reshape(b, hq, d)

    return Built(fn, ("xla_decode_attention",))


register(
    Impl(
        "ours_decode_paged",
        "decode_attention",
        "flash_attention_tpu.kvcache.flash_attention_kvcache, paged cache (block_table)",
        _ours_decode_paged,
        ours=True,
    )
)
register(
    Impl(
        "ours_decode_contiguous",
        "decode_attention",
        "flash_attention_tpu.kvcache.flash_attention_kvcache, contiguous [B, S, Hkv, D] cache",
        _ours_decode_contiguous,
        ours=True,
    )
)
register(
    Impl(
        "ours_decode_heads_major",
        "decode_attention",
        "flash_attention_tpu.kvcache.flash_attention_kvcache, transformers' [B, Hkv, S, D] cache",
        _ours_decode_heads_major,
        ours=True,
    )
)
register(
    Impl(
        "jax_paged_attention",
        "decode_attention",
        "jax.experimental.pallas.ops.tpu.paged_attention (its layout, ~1k-position blocks)",
        _jax_paged_attention,
    )
)
register(
    Impl(
        "torch_tpu_splash_decode",
        "decode_attention",
        "torch_tpu 0.2.0 splash_sdpa, q of one position against the cache [B, Hkv, S, D]",
        _torch_tpu_splash_decode,
    )
)
register(
    Impl(
        "tpu_inference_rpa",
        "decode_attention",
        "tpu-inference 0.32.0 ragged_paged_attention v3 (vLLM's TPU decode kernel), its layout",
        _tpu_inference_rpa,
    )
)
register(
    Impl(
        "xla_decode_attention",
        "decode_attention",
        "gather the pages, softmax(qK^T)V compiled by XLA",
        _xla_decode_attention,
        baseline=True,
    )
)
