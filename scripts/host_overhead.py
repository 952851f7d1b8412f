#!/usr/bin/env python3
"""Per-call host overhead of a torch_bindings op on CPU tensors.

Compares, for the same small input, (a) calling the cached jitted JAX
function directly on JAX arrays and waiting for the result with
(b) calling the torch op on torch tensors (dispatcher, NumPy view in,
DLPack out, cache lookup, the same jitted function), and (c) the public
function (argument checks on top). The difference is what the
bindings cost per call. A benchmark, not a test: timings depend on the
machine. Run: `bash scripts/setup.sh && source scripts/env.sh &&
python scripts/host_overhead.py`.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _time_per_call(fn, calls: int, repeats: int) -> float:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)

    import torch

    import rmsnorm_tpu
    from torch_bindings import convert

    op = rmsnorm_tpu.ops._rms_norm
    x, w = torch.randn(8, 128), torch.randn(128)
    for impl in ("reference", "interpret"):
        with torch_bindings_impl(impl):
            jitted = op._jitted(impl, (1e-6, False))
            xj, wj = convert.to_jax(x), convert.to_jax(w)
            direct = _time_per_call(
                lambda: jitted(xj, wj).block_until_ready(), args.calls, args.repeats
            )
            via_op = _time_per_call(lambda: op(x, w, 1e-6, False), args.calls, args.repeats)
            public = _time_per_call(
                lambda: rmsnorm_tpu.rms_norm(x, w, 1e-6), args.calls, args.repeats
            )
        print(
            f"{impl:9s}  jitted JAX direct {direct:6.1f} us | torch op {via_op:6.1f} us "
            f"(+{via_op - direct:5.1f}) | public rms_norm {public:6.1f} us (+{public - direct:5.1f})"
        )
    return 0


def torch_bindings_impl(impl):
    from rmsnorm_tpu._torch_bindings import cpu_impl

    return cpu_impl(impl)


if __name__ == "__main__":
    raise SystemExit(main())
