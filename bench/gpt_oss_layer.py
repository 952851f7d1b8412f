"""GPT-OSS's own experts layer, scheduled: its launches and its XLA part.

The sweep's "gpt-oss-20b" point is a uniform layer at GPT-OSS's shape
(gate and up as halves, no biases, SiLU), the same program every model's
point runs. GPT-OSS itself interleaves its gate and up columns, adds a bias
to both projections and applies its clamped GLU; its checkpoints hold the
experts in MXFP4. This prints that layer, as `api.moe_experts` runs it for
`experts_forward`: each Pallas launch executed from its final bundles with
the routing's real group sizes (as the sweep does), the XLA part fusion by
fusion (bench.xla_fusions), and their sum (the launches and the fusions
run one after another; the sweep's layer figure, which also overlaps
nothing, is the same sum for its program).

    python -m bench.gpt_oss_layer --generation v6e --tokens 8192 --weights mxfp4

Biases are constants of 0.01 (their values do not change the schedule).
"""

from __future__ import annotations

import argparse
import functools


def layer_program(tokens: int, weights: str):
    """(fn, args): GPT-OSS-20B's layer on uniform routing, weights as
    ShapeDtypeStructs (bf16, or MXFP4 in the kernels' layout with e8m0
    scales), hidden states and routing concrete (they set the grid)."""
    import jax
    import jax.numpy as jnp

    from ragged_dot_tpu import mxfp4
    from ragged_dot_tpu.api import moe_experts

    from . import moe

    point = moe.MoePoint(moe.MODELS["gpt-oss-20b"], tokens, "uniform")
    x, gate_up, down, ids, w = point.walker_args()
    e, h, i2 = gate_up.shape
    sds = jax.ShapeDtypeStruct
    if weights == "mxfp4":
        (gate_up, gu_s), (down, dn_s) = mxfp4.abstract((e, h, i2)), mxfp4.abstract((e, i2 // 2, h))
        bias_dtype, scales = jnp.float32, (gu_s, dn_s)
    else:
        gate_up, down = sds((e, h, i2), jnp.bfloat16), sds((e, i2 // 2, h), jnp.bfloat16)
        bias_dtype, scales = jnp.bfloat16, ()
    b1 = jnp.full((e, i2), 0.01, bias_dtype)
    b2 = jnp.full((e, h), 0.01, bias_dtype)
    kw = dict(num_experts=e, is_transposed=True, is_concatenated=False, activation="gpt_oss")

    def fn(x, ids, w, gate_up, down, b1, b2, *scales, config):
        return moe_experts(x, ids, w, gate_up, down, b1, b2, *scales, config=config, **kw)

    return fn, (x, ids, w, gate_up, down, b1, b2, *scales)


def schedule_layer(tokens: int, weights: str, generation: str) -> dict:
    """{launch name: us, ..., "launches": us, "xla": us, "layer": us}."""
    import jax

    from . import schedule, tracing, xla_fusions

    fn, args = layer_program(tokens, weights)
    fn = functools.partial(fn, config=generation)
    out, total = {}, 0.0
    with tracing.pretend_tpu(generation):
        launches = tracing.trace_launches(fn, *args)
    for n, launch in enumerate(launches):
        prog, prog_args = tracing.launch_program(launch)
        text = schedule.final_bundles(prog, prog_args, generation)
        ops = schedule.operand_values(launch.operands)
        us = schedule.run_schedule(text, ops, generation, launch.name).seconds * 1e6
        out[f"{n}: {launch.name}"] = us
        total += us
    specs = [
        a if isinstance(a, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(a.shape, a.dtype)
        for a in args
    ]
    xla = xla_fusions.schedule_xla_parts(fn, specs, generation)
    out.update(launches=total, xla=xla.total_us, layer=total + xla.total_us)
    out["slowest fusions"] = ", ".join(
        f"{f.name} {f.us:.1f}" for f in sorted(xla.fusions, key=lambda f: -f.us)[:4]
    )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generation", default="v6e")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--weights", choices=("bf16", "mxfp4"), default="bf16")
    a = p.parse_args(argv)
    from . import schedule

    schedule.enable_dumps()
    res = schedule_layer(a.tokens, a.weights, a.generation)
    print(f"GPT-OSS-20B layer, {a.weights}, {a.tokens} tokens, {a.generation} (scheduled us):")
    for name, v in res.items():
        print(f"  {name}: {v:.1f}" if isinstance(v, float) else f"  {name}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
