"""The one rule every numeric test uses to compare a kernel with its f32 reference.

The reference is computed in float32 from the *same* values the kernel saw
(bf16/f16 inputs upcast, which is exact), so an element of the kernel's result
can differ from it only through three effects, each bounded per element:

1. The final rounding of the result to its output dtype: at most
   ``u(out) * |expected|`` (u = unit roundoff, half an ulp: 2^-8 for bf16,
   2^-11 for f16, 2^-24 for f32). This is the whole bf16 error of a kernel that
   computes in f32 and rounds once (RMSNorm, grouped matmul: bf16 x bf16
   products are exact in f32).
2. Each rounding of an intermediate to a low-precision dtype inside the kernel
   (attention probabilities cast to bf16 before the PV matmul; dS cast before
   the dQ/dK matmuls; the bf16 forward output feeding the backward's delta):
   at most ``u(dtype) * magnitude`` per rounding, where ``magnitude`` is the sum
   of the absolute values of the terms the rounded values feed (e.g.
   ``sum_j p_ij |v_j|``), not ``|expected|``: the terms may cancel, and the
   rounding errors do not. Tests pass the count as ``roundings``.
3. f32 arithmetic done in another order (sums, exp/log/rsqrt, online softmax
   rescaling): at most ``F32_SLACK * magnitude``. The classical bound for an
   n-term f32 sum is about n * 2^-24 * magnitude; F32_SLACK = 2^-16 covers
   n <= 256 in the worst case, and the sums in these tests (<= 300 terms) stay
   far below the worst case (random rounding errors grow like sqrt(n)).

    bound = u(out) * |expected| + (roundings * u(dtype) + F32_SLACK) * magnitude

``magnitude`` defaults to ``|expected|`` (elementwise results with no
cancellation). An element whose bound is 0 (nothing visible, a row past the
groups) must match exactly; non-finite entries (+inf logsumexp of a row that
sees no key) must be identical.
"""

from __future__ import annotations

import numpy as np

F32_SLACK = 2.0**-16

# Unit roundoff (half an ulp at 1.0) per dtype name.
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}


def _dtype_name(x) -> str:
    name = str(getattr(x, "dtype", x))
    return name.replace("torch.", "")


def unit_roundoff(dtype) -> float:
    return UNIT_ROUNDOFF[_dtype_name(dtype)]


def as_f32(x) -> np.ndarray:
    """numpy float32 copy of a numpy / JAX / torch array (bf16 included)."""
    if hasattr(x, "detach"):  # torch
        return x.detach().float().cpu().numpy()
    return np.asarray(np.asarray(x).astype(np.float32))


def bound(expected, *, out_dtype, dtype=None, magnitude=None, roundings: float = 0):
    """Per-element bound on |actual - expected| (see the module docstring)."""
    e = as_f32(expected)
    mag = np.abs(e) if magnitude is None else as_f32(magnitude)
    u_out = unit_roundoff(out_dtype)
    u = unit_roundoff(dtype if dtype is not None else out_dtype)
    return u_out * np.abs(e) + (roundings * u + F32_SLACK) * mag


def assert_close(
    actual, expected, *, dtype=None, magnitude=None, roundings: float = 0, what: str = ""
) -> float:
    """Asserts the bound element by element; returns the largest error/bound ratio.

    actual: the kernel's result (its dtype is the output dtype); expected: the
    f32 reference on the same inputs; dtype: the low-precision dtype of the
    intermediate roundings (default: actual's dtype); magnitude: sum of
    absolute values of the terms (default |expected|); roundings: how many
    intermediate roundings to that dtype the kernel does.
    """
    out_dtype = _dtype_name(actual)
    a, e = as_f32(actual), as_f32(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    fin = np.isfinite(e)
    assert np.array_equal(np.isfinite(a), fin), f"{what}: non-finite entries differ"
    assert np.array_equal(a[~fin], e[~fin]), f"{what}: infinite entries differ"
    if magnitude is not None:
        magnitude = np.broadcast_to(as_f32(magnitude), e.shape)
        magnitude = np.where(fin, magnitude, 0.0)
    b = bound(
        np.where(fin, e, 0.0),
        out_dtype=out_dtype,
        dtype=dtype,
        magnitude=magnitude,
        roundings=roundings,
    )
    err = np.where(fin, np.abs(a - np.where(fin, e, 0.0)), 0.0)
    bad = err > b
    if bad.any():
        ratio = np.where(b > 0, err / np.where(b > 0, b, 1.0), np.inf)
        i = np.unravel_index(int(np.argmax(np.where(bad, ratio, -1.0))), e.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {e.size} elements exceed the per-element bound "
            f"({out_dtype} out, {roundings} roundings to {_dtype_name(dtype or out_dtype)}); "
            f"worst at {i}: actual {a[i]!r}, expected {e[i]!r}, error {err[i]:.3g}, "
            f"bound {b[i]:.3g}"
        )
    ok = b > 0
    return float(np.max(err[ok] / b[ok])) if ok.any() else 0.0


# -- attention -----------------------------------------------------------------
# bf16 roundings inside the flash-attention kernels, per result: P is cast to
# bf16 before the PV (out) and P^T dO (dV) matmuls: 1. dS is cast before the dQ
# and dK matmuls (1), delta = sum(dO * O) uses the bf16-rounded forward output
# whose own error is up to 2 roundings of P|V| (2), plus the output rounding
# of the result relative to its terms (1): 4. dsinks = -sum p_sink * delta: 3.
# lse: the forward's row sum l is the MXU's f32 sum of the same bf16-rounded P
# the numerator uses (a row of ones below V^T), so log(l) is off by at most
# one rounding of P, relative to 1 (kernel_fwd.py): 1.
ATTENTION_ROUNDINGS = {"out": 1, "lse": 1, "dv": 1, "dq": 4, "dk": 4, "dsinks": 3}


def attention_magnitudes(p, q, k, v, do, dlse, sinks, scale):
    """Sums of absolute terms behind each attention result, layout [B, H, S, D].

    p [B, Hq, Sq, Skv]: the reference's softmax probabilities (the reference
    run with V = identity). dlse [B, Hq, Sq]: the logsumexp cotangent (0 if
    unused). The sink's probability is what P's row leaves: 1 - sum_j p_ij.
    out ~ P|V|; dV ~ P^T|dO|; dQ ~ scale * W|K| and dK ~ scale * W^T|Q| with
    W = P * (2D + |dO||V|^T), D = |dO| . P|V| + |dlse| bounding delta and its
    error scale (|dS| <= P (|dP| + |delta|)); dsinks ~ sum p_sink * D.
    """
    f = lambda x: np.abs(as_f32(x))  # noqa: E731
    p = as_f32(p)
    hq, hkv = q.shape[1], k.shape[1]
    grp = hq // hkv
    qa, doa = f(q), f(do)
    ka, va = np.repeat(f(k), grp, axis=1), np.repeat(f(v), grp, axis=1)
    a = p @ va
    dd = np.sum(doa * a, axis=-1) + (0.0 if dlse is None else f(dlse))
    w = p * (2.0 * dd[..., None] + doa @ np.swapaxes(va, -1, -2))
    fold = lambda x: x.reshape(x.shape[0], hkv, grp, *x.shape[2:]).sum(axis=2)  # noqa: E731
    mags = {
        "out": a,
        "dq": scale * (w @ ka),
        "dk": fold(scale * (np.swapaxes(w, -1, -2) @ qa)),
        "dv": fold(np.swapaxes(p, -1, -2) @ doa),
    }
    if sinks is not None:
        p_sink = np.clip(1.0 - p.sum(axis=-1), 0.0, 1.0)
        mags["dsinks"] = np.sum(p_sink * dd, axis=(0, 2))
    return mags
