"""Finding the Pallas launches a JAX function makes, with concrete operands.

No TPU is attached, so nothing here runs a kernel. `trace_launches` traces a
JAX function with concrete inputs and evaluates its jaxpr on the CPU, except
that every `pallas_call` is recorded as a `Launch` with its concrete operands
(scalar prefetch values and dynamic grid sizes included) instead of being run.
`bench.grid_walk` replays those launches; `launch_program` rebuilds one launch
on its own for the Mosaic compile gate.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core


@dataclasses.dataclass(frozen=True)
class Unknown:
    """A value the outer interpreter does not materialise (shape only)."""

    aval: Any

    @property
    def shape(self):
        return self.aval.shape

    @property
    def dtype(self):
        return self.aval.dtype


@dataclasses.dataclass
class Launch:
    """One pallas_call as the program would issue it."""

    params: dict
    operands: list  # concrete arrays, or Unknown for values we did not compute

    @property
    def name(self) -> str:
        nsi = self.params.get("name_and_src_info") or self.params.get("name")
        if nsi is not None:
            return str(getattr(nsi, "name", nsi))
        jaxpr = self.params["jaxpr"]
        dbg = getattr(jaxpr, "debug_info", None)
        return str(getattr(dbg, "func_name", None) or "pallas_call")


# Primitives whose sub-jaxpr runs exactly once with the eqn's operands.
CALL_JAXPR_PARAM = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_lin": None,
}


def _sub_jaxprs(params: dict):
    for v in params.values():
        if isinstance(v, jax_core.ClosedJaxpr):
            yield v.jaxpr
        elif isinstance(v, jax_core.Jaxpr):
            yield v
        elif isinstance(v, (tuple, list)):
            for x in v:
                if isinstance(x, jax_core.ClosedJaxpr):
                    yield x.jaxpr
                elif isinstance(x, jax_core.Jaxpr):
                    yield x


_CONTAINS_CACHE: dict[int, bool] = {}


def _contains_pallas(jaxpr: jax_core.Jaxpr) -> bool:
    key = id(jaxpr)
    if key in _CONTAINS_CACHE:
        return _CONTAINS_CACHE[key]
    found = False
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found = True
            break
        if any(_contains_pallas(j) for j in _sub_jaxprs(eqn.params)):
            found = True
            break
    _CONTAINS_CACHE[key] = found
    return found


def closed(j) -> tuple[jax_core.Jaxpr, Sequence[Any]]:
    if isinstance(j, jax_core.ClosedJaxpr):
        return j.jaxpr, j.consts
    return j, ()


class _Tracer:
    """Evaluates a jaxpr on CPU, recording pallas_calls instead of running them."""

    def __init__(self, materialize_outputs: bool):
        self.launches: list[Launch] = []
        self.materialize_outputs = materialize_outputs

    def run(self, jaxpr: jax_core.Jaxpr, consts, args) -> list:
        env: dict = {}

        def read(v):
            return v.val if isinstance(v, jax_core.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            outs = self._eqn(eqn, invals)
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _unknown_outs(self, eqn):
        return [Unknown(v.aval) for v in eqn.outvars]

    def _eqn(self, eqn, invals) -> list:
        name = eqn.primitive.name
        if name == "pallas_call":
            self.launches.append(Launch(dict(eqn.params), list(invals)))
            if self.materialize_outputs:
                return [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
            return self._unknown_outs(eqn)
        subs = list(_sub_jaxprs(eqn.params))
        if subs and any(_contains_pallas(j) for j in subs):
            return self._control(eqn, invals)
        if any(isinstance(x, Unknown) for x in invals):
            return self._unknown_outs(eqn)
        bind_params = eqn.primitive.get_bind_params(eqn.params)
        ans = eqn.primitive.bind(*invals, **bind_params)
        return list(ans) if eqn.primitive.multiple_results else [ans]

    def _control(self, eqn, invals) -> list:
        name = eqn.primitive.name
        p = eqn.params
        if name in CALL_JAXPR_PARAM and CALL_JAXPR_PARAM[name]:
            jaxpr, consts = closed(p[CALL_JAXPR_PARAM[name]])
            if name == "custom_jvp_call" or name == "custom_vjp_call":
                # num_consts operands come first and are ordinary inputs here.
                pass
            return self.run(jaxpr, consts, invals)
        if name == "cond":
            index, *ops = invals
            if isinstance(index, Unknown):
                raise NotImplementedError(
                    "cond around a pallas_call with an index the walker cannot compute"
                )
            branch = p["branches"][int(np.asarray(index))]
            return self.run(branch.jaxpr, branch.consts, ops)
        if name == "while":
            cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
            nc, nb = p["cond_nconsts"], p["body_nconsts"]
            cconsts, bconsts, carry = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
            while True:
                (pred,) = self.run(cj.jaxpr, cj.consts, [*cconsts, *carry])
                if isinstance(pred, Unknown):
                    raise NotImplementedError("while predicate not computable")
                if not bool(np.asarray(pred)):
                    return carry
                carry = self.run(bj.jaxpr, bj.consts, [*bconsts, *carry])
        if name == "scan":
            j = p["jaxpr"]
            n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
            consts, carry, xs = (
                invals[:n_consts],
                invals[n_consts : n_consts + n_carry],
                invals[n_consts + n_carry :],
            )
            ys_acc = []
            order = range(length - 1, -1, -1) if p["reverse"] else range(length)
            for i in order:
                x_i = [
                    Unknown(jax_core.ShapedArray(x.shape[1:], x.dtype))
                    if isinstance(x, Unknown)
                    else x[i]
                    for x in xs
                ]
                outs = self.run(j.jaxpr, j.consts, [*consts, *carry, *x_i])
                carry, ys = outs[:n_carry], outs[n_carry:]
                ys_acc.append(ys)
            if p["reverse"]:
                ys_acc.reverse()
            stacked = []
            for k, v in enumerate(eqn.outvars[n_carry:]):
                col = [y[k] for y in ys_acc]
                if any(isinstance(c, Unknown) for c in col):
                    stacked.append(Unknown(v.aval))
                else:
                    stacked.append(jnp.stack(col))
            return [*carry, *stacked]
        raise NotImplementedError(
            f"the walker does not know how to run {name!r} around a pallas_call"
        )


def trace_launches(
    fn: Callable, *args, materialize_outputs: bool = False, **kwargs
) -> list[Launch]:
    """Every pallas_call `fn(*args, **kwargs)` makes, with concrete operands.

    Arguments may be concrete arrays or `jax.ShapeDtypeStruct`s; the latter
    stay symbolic, which is enough for operands that only feed kernels (e.g.
    expert weights) and keeps big shapes cheap. Whatever decides the grid or
    the scalar prefetch (group sizes, routing) must be concrete.
    """
    closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    vals = [
        Unknown(jax_core.ShapedArray(a.shape, a.dtype))
        if isinstance(a, jax.ShapeDtypeStruct)
        else a
        for a in jax.tree_util.tree_leaves(args)
    ]
    tracer = _Tracer(materialize_outputs)
    tracer.run(closed.jaxpr, closed.consts, vals)
    return tracer.launches


def launch_program(launch: Launch):
    """(fn, args) compiling this one pallas_call on its own: the Mosaic compile
    gate of a kernel, without the XLA program around it."""
    from jax._src.pallas import pallas_call as pallas_call_mod

    params = launch.params
    args = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in launch.operands]

    def fn(*ops):
        return pallas_call_mod.pallas_call_p.bind(*ops, **params)

    return fn, args


def launch_signature(launch: Launch) -> str:
    """A stable digest of what Mosaic compiles for this launch."""
    import hashlib

    p = launch.params
    text = "|".join(
        [
            str(p["jaxpr"]),
            str(p["grid_mapping"]),
            str(p.get("compiler_params")),
            str(p.get("input_output_aliases")),
            ";".join(f"{o.shape}{o.dtype}" for o in launch.operands),
        ]
    )
    return hashlib.sha1(text.encode()).hexdigest()


class pretend_tpu:
    """Context manager: Pallas' `get_tpu_info()` answers for `generation`
    (one JAX device, as torch_bindings.tpu_info describes it) while tracing on a
    host without a TPU, for kernels and pipelines (emit_pipeline) that size
    tiles from the attached chip."""

    def __init__(self, generation: str):
        from torch_bindings import tpu_info

        self.facts = tpu_info.facts(generation)  # raises for an unknown name
        self.generation = generation

    def __enter__(self):
        from jax._src.pallas.mosaic import tpu_info as ti

        chip = ti.ChipVersion(self.facts.chip_version)
        info = ti.get_tpu_info_for_chip(chip, self.facts.tensor_cores_per_device)
        from jax.experimental.pallas import tpu as pltpu

        fake = lambda: info
        # the private module (used by Pallas' own pipeline code) and the public
        # re-export (used by kernels)
        self._saved = [(m, m.get_tpu_info) for m in (ti, pltpu) if hasattr(m, "get_tpu_info")]
        for m, _ in self._saved:
            m.get_tpu_info = fake
        return info

    def __exit__(self, *exc):
        for m, f in self._saved:
            m.get_tpu_info = f
        return False
