"""Each baseline in the bench registry computes the layer it claims to, on
tiny shapes on the CPU (Pallas kernels in TPU interpret mode, XLA on the
host): a baseline that silently computed something else (wrong weight
layout, wrong mask, a dropped scale, XLA in place of the kernel) would time
the wrong program."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from bench import moe, points, registry, tracing

TINY = moe.MoeShape("tiny", experts=4, top_k=2, hidden=256, intermediate=128)
# H != 2I, so a transposed weight cannot pass for the untransposed one.
TINY_I = moe.MoeShape("tiny-i", experts=4, top_k=2, hidden=256, intermediate=384)
# GPT-OSS's name selects transformers' is_transposed=True storage.
TINY_T = moe.MoeShape("gpt-oss-20b", experts=4, top_k=2, hidden=256, intermediate=128)


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def moe_reference(x, w_gate_up, w_down, ids, weights):
    """Per token, per routed expert: down(silu(gate) * up), weighted sum."""
    x, wgu, wd, w = map(_f64, (x, w_gate_up, w_down, weights))
    ids = np.asarray(ids)
    inter = wd.shape[1]
    out = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = x[t] @ wgu[e]
            g = h[:inter] / (1 + np.exp(-h[:inter]))
            out[t] += w[t, j] * ((g * h[inter:]) @ wd[e])
    return out


def _close(out, ref, rel=3e-2):
    out = _f64(out)
    scale = np.abs(ref).max()
    assert scale > 0
    err = np.abs(out - ref).max() / scale
    assert err < rel, f"max error {err:.3g} of max |ref| {scale:.3g}"


def _run(name, point, generation="v6e", tpu_interpret=True):
    """The registered program on the point's concrete inputs; Pallas kernels in
    TPU interpret mode unless the test switched the module's own interpret
    flag (splash)."""
    built = registry.REGISTRY[name].build(point, generation, None)
    args = registry.program_args(built, point.real_args())
    if not tpu_interpret:
        return built, jax.jit(built.fn)(*args)
    with pltpu.force_tpu_interpret_mode():
        return built, jax.jit(built.fn)(*args)


# (xla_dense is left out: the CPU runtime of this jaxlib cannot run its
# bf16 x bf16 -> f32 einsum, "Unsupported element type for DotThunk".)
@pytest.mark.parametrize("impl", ["hf_grouped_mm", "xla_ragged_dot", "megablox_default"])
@pytest.mark.parametrize("shape,tokens", [(TINY, 8), (TINY_I, 48)])
def test_moe_baseline_matches_reference(impl, shape, tokens):
    point = moe.MoePoint(shape, tokens, "zipf")
    _, out = _run(impl, point)
    _close(out, moe_reference(*point.real_args()))


def test_hf_grouped_mm_transposed_storage_model():
    """GPT-OSS stores [E, in, out]: the buffers are used as they are."""
    point = moe.MoePoint(TINY_T, 8, "uniform")
    built, out = _run("hf_grouped_mm", point)
    assert built.key == ("hf_grouped_mm", True)
    _close(out, moe_reference(*point.real_args()))


def test_hf_experts_forward_in_transformers_layout():
    """The transformers-layout function itself, on weights stored [E, out, in]."""
    from bench.baselines import hf_grouped_mm as hf

    point = moe.MoePoint(TINY, 16, "uniform")
    x, wgu, wd, ids, w = point.real_args()
    out = jax.jit(hf.experts_forward)(x, jnp.swapaxes(wgu, 1, 2), jnp.swapaxes(wd, 1, 2), ids, w)
    _close(out, moe_reference(x, wgu, wd, ids, w))
    out_t = jax.jit(lambda *a: hf.experts_forward(*a, is_transposed=True))(x, wgu, wd, ids, w)
    _close(out_t, moe_reference(x, wgu, wd, ids, w))


@pytest.mark.parametrize(
    "shape,stored",
    [(TINY_I, [(4, 768, 256), (4, 256, 384)]), (TINY_T, [(4, 256, 256), (4, 128, 256)])],
    ids=["out-in", "in-out"],
)
def test_ours_gets_the_weights_as_the_model_stores_them(shape, stored):
    """What experts_forward hands the kernels: [E, out, in] for Qwen3, Mixtral
    and Gemma 4, [E, in, out] for GPT-OSS (on tpu7x the first is slower at
    prefill: timing the other would flatter ours)."""
    point = moe.MoePoint(shape, 8, "uniform")
    built, out = _run("ours_moe_experts", point)
    args = registry.program_args(built, point.compile_args())
    assert [a.shape for a in args[1:3]] == stored
    _close(out, moe_reference(*point.real_args()))


def test_hf_grouped_mm_has_transformers_parameter_layout():
    """The weights enter the program as transformers' [E, out, in] arrays and
    are transposed once each (no transpose pair that XLA could cancel); the
    point's own [E, in, out] arguments are refused rather than mis-timed."""
    point = moe.MoePoint(TINY_I, 8, "uniform")
    built = registry.REGISTRY["hf_grouped_mm"].build(point, "v6e", None)
    args = registry.program_args(built, point.compile_args())
    assert [a.shape for a in args[1:3]] == [(4, 768, 256), (4, 256, 384)]
    text = jax.jit(built.fn).lower(*args).as_text()
    assert text.count("stablehlo.transpose") == 2
    assert "tensor<4x768x256xbf16>" in text and "tensor<4x256x384xbf16>" in text
    with pytest.raises(ValueError, match="program_args"):
        jax.eval_shape(built.fn, *point.compile_args())


def test_tokamax_forced_pallas_matches_reference():
    pytest.importorskip("tokamax")
    point = moe.MoePoint(TINY, 8, "zipf")
    built, out = _run("tokamax_ragged_dot", point)
    assert any("rows padded 16 -> 128" in n for n in built.notes)
    _close(out, moe_reference(*point.real_args()))


def test_tokamax_runs_its_pallas_kernel_not_xla():
    pytest.importorskip("tokamax")
    point = moe.MoePoint(TINY, 8, "uniform")
    built = registry.REGISTRY["tokamax_ragged_dot"].build(point, "tpu7x", None)
    launches = tracing.trace_launches(built.fn, *point.walker_args())
    assert [l.name for l in launches] == ["gmm_megablox", "gmm_megablox"]


def test_tokamax_int8_peer_runs_quantized_weights_in_its_pallas_kernel():
    """The quantized peer: int8 QArrays reach tokamax's Pallas kernel (not a
    dequantized copy through XLA) and compute the layer within int8's
    quantization error."""
    pytest.importorskip("tokamax")
    point = moe.MoePoint(TINY, 8, "zipf")
    built, out = _run("tokamax_ragged_dot_int8", point)
    _close(out, moe_reference(*point.real_args()), rel=5e-2)
    args = registry.program_args(built, point.compile_args())
    assert [a.dtype for a in args[1:3]] == [jnp.int8, jnp.int8]
    launches = tracing.trace_launches(built.fn, *args)
    assert [l.name for l in launches] == ["gmm_megablox", "gmm_megablox"]
    for launch, shape in zip(launches, [(4, 256, 256), (4, 128, 256)]):
        # The int8 weights themselves are a kernel operand: no dequantized copy.
        assert any(
            getattr(o, "shape", None) == shape and getattr(o, "dtype", None) == jnp.int8
            for o in launch.operands
        ), [(getattr(o, "shape", None), getattr(o, "dtype", None)) for o in launch.operands]


def attention_reference(q, k, v, window=0):
    q, k, v = map(_f64, (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k = np.repeat(k, rep, axis=1)
    v = np.repeat(v, rep, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    n = q.shape[2]
    row, col = np.arange(n)[:, None], np.arange(n)[None, :]
    seen = (col <= row) & ((col > row - window) if window else True)
    s = np.where(seen, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", p, v)


@pytest.mark.parametrize("impl", ["jax_splash_attention", "torch_tpu_splash", "xla_attention"])
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_attention_baseline_matches_reference(impl, kv_heads, monkeypatch):
    if impl == "torch_tpu_splash":
        pytest.importorskip("torch_tpu")
    from bench.baselines import splash

    monkeypatch.setattr(splash, "INTERPRET", True)
    point = points.AttentionPoint(seq=256, batch=2, q_heads=4, kv_heads=kv_heads, head_dim=128)
    _, out = _run(impl, point, tpu_interpret=False)
    assert out.shape == (2, 4, 256, 128)
    _close(out, attention_reference(*point.real_args()))


def test_splash_at_a_block_under_the_sequence_matches_reference(monkeypatch):
    """The block size the best-block baseline picks reaches the kernel: 128
    positions over 256 (diagonal, full and skipped blocks; q and kv blocks
    of 512 would cover the whole sequence at once)."""
    from bench.baselines import splash

    monkeypatch.setattr(splash, "INTERPRET", True)
    point = points.AttentionPoint(seq=256, batch=1, q_heads=4, kv_heads=2, head_dim=128)
    built = registry._jax_splash_block(point, 128)
    assert built.key == ("jax_splash_attention", 128, 0)
    out = jax.jit(built.fn)(*point.real_args())
    _close(out, attention_reference(*point.real_args()))


def _pick_splash_block(monkeypatch, times, seq=8192):
    """jax_splash_best's choice when block b takes times[b] seconds (None:
    does not compile), and the blocks it asked about, in order."""
    asked = []

    def timed(point, generation, ctx, block):
        asked.append(block)
        t = times[block]
        return None if t is None else (t, "scheduled")

    monkeypatch.setattr(registry, "_splash_block_time", timed)
    point = points.AttentionPoint(seq=seq)
    return registry.REGISTRY["jax_splash_best"].build(point, "tpu7x", object()), asked


def test_splash_best_takes_the_fastest_block_size(monkeypatch):
    built, asked = _pick_splash_block(monkeypatch, {2048: 3e-3, 1024: 2e-3, 512: 2.5e-3})
    assert built.key == ("jax_splash_attention", 1024, 0)
    assert asked == [2048, 1024, 512]
    assert "1024: 2,000.0 us scheduled" in built.notes[-1]
    # a size that does not compile is passed over, not taken for a time
    built, asked = _pick_splash_block(monkeypatch, {2048: None, 1024: 2e-3, 512: 1e-3})
    assert built.key == ("jax_splash_attention", 512, 0)
    assert "2048: does not compile" in built.notes[-1]


def test_splash_best_stops_once_a_smaller_block_is_slower(monkeypatch):
    built, asked = _pick_splash_block(monkeypatch, {2048: 1e-3, 1024: 2e-3, 512: 0.5e-3})
    assert built.key == ("jax_splash_attention", 2048, 0)
    assert asked == [2048, 1024]


def test_splash_best_caps_blocks_at_the_sequence_and_skips_when_none_compiles(monkeypatch):
    built, asked = _pick_splash_block(monkeypatch, {1024: 2e-3, 512: 1e-3}, seq=1024)
    assert asked == [1024, 512] and built.key == ("jax_splash_attention", 512, 0)
    with pytest.raises(registry.Skip, match="no splash block size compiles"):
        _pick_splash_block(monkeypatch, dict.fromkeys(registry.SPLASH_BLOCKS))


def test_splash_best_times_its_winner_with_the_walk_the_sweep_reuses():
    """Without the compiler the choice falls back to the ideal model; the
    winner's walk is the one the sweep then reports (no second walk)."""
    from bench import sweep, xla_cost

    ctx = sweep.Context(("v6e",), xla_cost.CompileCache(None), do_compile=False, scheduled=False)
    point = points.AttentionPoint(seq=2048, q_heads=4, kv_heads=2)
    rec = sweep.evaluate(registry.REGISTRY["jax_splash_best"], point, ctx)
    g = rec["per_generation"]["v6e"]
    assert g["status"] == "ok", g["reason"]
    tried = g["notes"][-1]
    assert tried.startswith("block sizes tried: 2048: ") and "ideal model" in tried
    assert len(ctx.walks) == tried.count(" us ")
    # fewer, larger blocks: fewer grid steps for the same flops in the ideal model
    assert "blocks q=kv=kv_compute=2048" in g["notes"][0]


@pytest.mark.parametrize("impl", ["ours_flash_attention", "jax_splash_attention"])
def test_windowed_attention_points_match_reference(impl, monkeypatch):
    # A 96-key window over 256 positions: each query sees its 96 latest keys.
    from bench.baselines import splash

    monkeypatch.setattr(splash, "INTERPRET", True)
    point = points.AttentionPoint(seq=256, batch=1, q_heads=4, kv_heads=2, window=96)
    _, out = _run(impl, point, tpu_interpret=impl == "ours_flash_attention")
    _close(out, attention_reference(*point.real_args(), window=96))


def test_windowed_attention_point_counts_its_band_and_skips_whole_prefix_impls():
    p = points.AttentionPoint(seq=8192, window=4096)
    # rows 0..4095 see 1..4096 keys, the rest 4096: 4096^2 / 2 + 4096 * 4096
    assert p.visible() == 4096 * 4096 // 2 + 4096 * 4096
    assert p.useful_flops() == 4 * 32 * p.visible() * 128
    assert points.AttentionPoint(seq=8192).visible() == 8192 * 8192 // 2
    assert p.walk_key != points.AttentionPoint(seq=8192).walk_key
    from bench import report  # a windowed point gets its own table row

    keys = {
        report._point_key(dict(kernel="attention", **q.labels()))
        for q in (p, points.AttentionPoint(seq=8192))
    }
    assert len(keys) == 2
    for impl in ("torch_tpu_splash", "xla_attention", "jax_pallas_flash_attention"):
        with pytest.raises(registry.Skip, match="sliding window"):
            registry.REGISTRY[impl].build(p, "v6e", None)
    with pytest.raises(ValueError, match="window"):
        points.AttentionPoint(seq=8192, window=-1)


def decode_reference(q, k_pages, v_pages, lengths, table):
    """One query per sequence over its first lengths[b] cached keys (f64)."""
    q, kp, vp = map(_f64, (q, k_pages, v_pages))
    b, hq, d = q.shape
    hkv = kp.shape[2]
    out = np.zeros(q.shape)
    for i in range(b):
        k = kp[np.asarray(table[i])].reshape(-1, hkv, d)[: int(lengths[i])]
        v = vp[np.asarray(table[i])].reshape(-1, hkv, d)[: int(lengths[i])]
        for h in range(hq):
            s = k[:, h // (hq // hkv)] @ q[i, h] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[:, h // (hq // hkv)]
    return out


@pytest.mark.parametrize(
    "impl",
    [
        "ours_decode_paged",
        "ours_decode_contiguous",
        "ours_decode_heads_major",
        "jax_paged_attention",
        "xla_decode_attention",
    ],
)
def test_decode_attention_impls_match_reference(impl):
    # context < capacity: pages past each sequence's length hold keys no one may see
    point = points.DecodeAttentionPoint(
        batch=2, context=200, capacity=384, q_heads=4, kv_heads=2, head_dim=128, page=128
    )
    _, out = _run(impl, point)
    _close(out, decode_reference(*point.real_args()))


def test_tpu_inference_rpa_arguments_give_the_reference_attention():
    """tpu-inference's kernel runs here only compiled (jax 0.10.2's TPU
    interpret mode cannot run it: a reshaped ref). The arguments the bench
    builds for it (merged cache layout, lengths, page table, query offsets,
    scale) go through tpu-inference's own reference, which takes the same ones
    and writes the new token into the cache first: given each sequence's last
    cached K/V as the new token, it must give our reference's attention."""
    from bench.baselines import rpa

    kernel = rpa.load()
    point = points.DecodeAttentionPoint(
        batch=2, context=200, capacity=384, q_heads=4, kv_heads=2, head_dim=128, page=128
    )
    q, k, v, lengths, table = point.real_args()
    last = lengths - 1
    pages = table[jnp.arange(point.batch), last // point.page]
    k_new, v_new = k[pages, last % point.page], v[pages, last % point.page]
    args, kwargs = rpa.call_args(
        q, k_new, v_new, rpa.merge(kernel, k, v), lengths, table, scale=point.head_dim**-0.5
    )
    # the reference slices with Python ints: its integer arguments as numpy
    args = [np.asarray(a) if a.dtype == jnp.int32 else a for a in args]
    out, _ = kernel.ref_ragged_paged_attention(*args, **kwargs)
    _close(out, decode_reference(q, k, v, lengths, table))


def test_torch_tpu_splash_cannot_decode():
    """torch_tpu's splash_sdpa builds its kernel for q's length: one decode
    position against a 256-position cache gets 1-position kv blocks, which
    splash rejects (the decode sweep records this peer as failing, not as
    missing). If torch_tpu learns to decode, this fails and the peer's figures
    belong in the table."""
    point = points.DecodeAttentionPoint(batch=1, context=256, q_heads=4, kv_heads=2, page=128)
    built = registry.REGISTRY["torch_tpu_splash_decode"].build(point, "v6e", None)
    args = registry.program_args(built, point.compile_args())
    with pytest.raises(ValueError, match="multiple of 128"):
        jax.eval_shape(built.fn, *args)
