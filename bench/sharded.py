"""One MoE block of a TP-n or EP-n plan, compiled for a multi-chip TPU topology.

`bench.decode_step` charges the collectives of a plan by formula (ring
all-reduce, all-to-all at the interconnect's bandwidth). This compiles the
per-layer experts block as the plan runs it, with our kernel on every rank,
for the multi-chip topology itself (libtpu's `v6e:2x4`: 8 chips, no TPU
needed), and reads back which collectives the compiler emits and their
bytes, so that the formula's bytes are the compiler's:

- TP-n: every rank holds every expert's n-th slice of the intermediate
  dimension (gate and up sliced alike, as transformers' `packed_colwise`
  does), runs `moe_experts` on all tokens, and the partial outputs are summed
  over ranks (`psum`: one all-reduce of [tokens, H]).
- EP-n: every rank holds E/n whole experts and 1/n of the sequences. Each
  rank sends each of its rows to the rank owning its expert (uniform routing:
  the same number to every rank, `all_to_all`), runs its experts (top-1 over
  its E/n), and sends the results back (a second `all_to_all`).

The routing itself (which rows go where) is an input here: the compile is
about shapes, kernels and collectives, not about routing values. Every model's
weights are given in the op's default layout ([E, 2I, H] gate/up, [E, H, I]
down, SiLU, no biases), whatever the model stores.

    python -m bench.sharded --model qwen3-30b-a3b --plan tp8 --batch 64
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time

_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%[\w.\-]+ = (\(?)(\w+)\[([\d,]*)\][^=]*? "
    r"(all-reduce|all-to-all|all-gather|reduce-scatter|collective-permute)(?:-start)?\(",
    re.M,
)

TOPOLOGIES = {"v6e": "v6e:2x4"}


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int  # of one rank's operand (the first, for a tuple)


@dataclasses.dataclass(frozen=True)
class ShardedCompile:
    ok: bool
    error: str | None
    collectives: tuple  # Collective, in program order
    seconds: float


def collectives(hlo: str) -> tuple:
    from .xla_cost import array_bytes

    return tuple(
        Collective(m.group(4), array_bytes(m.group(2), m.group(3)))
        for m in _COLLECTIVE.finditer(hlo)
    )


def _mesh(generation: str, ranks: int):
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh

    if generation not in TOPOLOGIES:
        raise ValueError(
            f"generation: expected one of {sorted(TOPOLOGIES)} (a multi-chip topology), "
            f"got {generation!r}"
        )
    devices = topologies.get_topology_desc(TOPOLOGIES[generation], platform="tpu").devices
    if len(devices) < ranks:
        raise ValueError(f"ranks: {TOPOLOGIES[generation]} has {len(devices)} chips, not {ranks}")
    return Mesh(np.array(devices[:ranks]), ("x",))


def moe_block_program(cfg, plan, batch: int, generation: str):
    """(fn, args) of one layer's experts block under `plan`, args placed on the mesh."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from ragged_dot_tpu import api

    from .decode_step import rank_shapes

    n = plan.ranks
    mesh = _mesh(generation, n)
    s = cfg.moe_shape
    e, k, h, i = s.experts, s.top_k, s.hidden, s.intermediate
    bf16 = jnp.bfloat16

    def spec(shape, dtype, part):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, part))

    if plan.kind == "tp":

        def block(hidden, ids, weights, gate_up, down):
            out = api.moe_experts(
                hidden, ids, weights, gate_up[0], down[0], num_experts=e, config=generation
            )
            return jax.lax.psum(out, "x")

        args = [
            spec((batch, h), bf16, P()),
            spec((batch, k), jnp.int32, P()),
            spec((batch, k), jnp.float32, P()),
            # rank r's [gate_r; up_r] and down slice, stacked on a leading rank axis
            spec((n, e, 2 * i // n, h), bf16, P("x")),
            spec((n, e, h, i // n), bf16, P("x")),
        ]
        in_specs = (P(), P(), P(), P("x"), P("x"))
        out_specs = P()
    else:
        r = rank_shapes(cfg, plan, batch)
        seqs = r.seqs
        cap = -(-seqs * k // n)  # rows this rank sends to each rank (uniform routing)
        local = e // n

        def block(hidden, send_rows, expert_ids, combine_rows, combine_w, gate_up, down):
            sent = hidden[send_rows[0]]  # [n, cap, H]: row j of block d goes to rank d
            got = jax.lax.all_to_all(sent, "x", 0, 0)
            rows = got.reshape(n * cap, h)
            out = api.moe_experts(
                rows,
                expert_ids[0].reshape(n * cap, 1),
                jnp.ones((n * cap, 1), jnp.float32),
                gate_up,
                down,
                num_experts=local,
                config=generation,
            )
            back = jax.lax.all_to_all(out.reshape(n, cap, h), "x", 0, 0)
            back = back.reshape(n * cap, h).astype(jnp.float32) * combine_w[0][:, None]
            return jax.ops.segment_sum(back, combine_rows[0], seqs).astype(bf16)

        args = [
            spec((n * seqs, h), bf16, P("x")),
            spec((n, n, cap), jnp.int32, P("x")),
            spec((n, n, cap), jnp.int32, P("x")),
            spec((n, n * cap), jnp.int32, P("x")),
            spec((n, n * cap), jnp.float32, P("x")),
            spec((e, 2 * i, h), bf16, P("x")),
            spec((e, h, i), bf16, P("x")),
        ]
        in_specs = (P("x"),) * 7
        out_specs = P("x")

    fn = jax.shard_map(block, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return fn, args


def compile_moe_block(cfg, plan, batch: int, generation: str = "v6e") -> ShardedCompile:
    """Compiles the block for the topology; the collectives from the optimized HLO."""
    import jax

    from . import schedule

    fn, args = moe_block_program(cfg, plan, batch, generation)
    t0 = time.perf_counter()
    try:
        _, dumps = schedule.compile_tagged(
            lambda program: (
                jax.jit(program).trace(*args).lower(lowering_platforms=("tpu",)).compile()
            ),
            fn,
        )
    except Exception as e:  # noqa: BLE001 - the compiler raises many types
        return ShardedCompile(False, f"{type(e).__name__}: {e}"[:400], (), 0.0)
    if dumps.hlo is None:
        raise schedule.Unavailable("the compiler's dumps are off in this process")
    return ShardedCompile(True, None, collectives(dumps.hlo), time.perf_counter() - t0)


def main(argv=None) -> int:
    from . import decode_step

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(decode_step.MODELS))
    p.add_argument("--plan", default="tp8")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--generation", default="v6e", choices=sorted(TOPOLOGIES))
    a = p.parse_args(argv)
    cfg, plan = decode_step.MODELS[a.model], decode_step.parse_plan(a.plan)
    res = compile_moe_block(cfg, plan, a.batch, a.generation)
    want = decode_step.experts_collectives(cfg, plan, a.batch)
    print(f"{a.model} {plan.name} batch {a.batch} on {TOPOLOGIES[a.generation]}: ", end="")
    if not res.ok:
        print(f"does not compile: {res.error}")
        return 1
    print(f"compiles ({res.seconds:.1f} s)")
    for c in res.collectives:
        print(f"  {c.kind}: {c.bytes:,} bytes per rank")
    for kind, b in want:
        print(f"  decode_step's formula: {kind}: {b:,} bytes per rank")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
