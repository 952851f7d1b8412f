"""What a Pallas TPU launch does, read from the launch itself.

No TPU is attached, so nothing here runs a kernel. `trace_launches` traces a
JAX function with concrete inputs and evaluates its jaxpr on the CPU, except
that every `pallas_call` is recorded with its concrete operands (scalar
prefetch values and dynamic grid sizes included) instead of being run.
`walk_launch` then replays the launch's grid in the order Mosaic runs it
(last grid axis fastest) and counts what the pipeline moves and issues:

* HBM bytes: an input block is fetched when its block index differs from
  the previous step's; an output block is written back when its index
  changes and once at the end. Blocks left in HBM (memory space ANY) are not
  moved by the pipeline; the bytes of the kernel's own `dma_start`s are
  counted instead, per step, from the kernel body.
* grid steps.
* MXU flops issued per step: `2*M*K*N` of every `dot_general` in the kernel
  body, whatever the share of real rows in the block.

Index maps and the scalar control flow of the kernel body (program ids,
scalar-prefetch reads, `cond`, `while`, `scan`) are evaluated for all grid
steps at once with numpy, so a 100k-step grid costs milliseconds. Values the
evaluator cannot know (anything read from VMEM, vector math) are "unknown":
a `cond` on an unknown predicate counts its most expensive branch, a loop with
an unknown trip count counts its body once; both are noted in the result.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src import tree_util
from jax._src.pallas import core as pallas_core
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing as state_indexing
from jax._src.state import types as state_types


# --------------------------------------------------------------------------
# Tracing: find the pallas_calls a function makes, with concrete operands.
# --------------------------------------------------------------------------


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
_CALL_JAXPR_PARAM = {
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


def _closed(j) -> tuple[jax_core.Jaxpr, Sequence[Any]]:
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
        if name in _CALL_JAXPR_PARAM and _CALL_JAXPR_PARAM[name]:
            jaxpr, consts = _closed(p[_CALL_JAXPR_PARAM[name]])
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


# --------------------------------------------------------------------------
# A numpy evaluator for scalar code, vectorised over grid steps.
# --------------------------------------------------------------------------


class _Unk:
    """Unknown value inside the vectorised evaluator."""

    __slots__ = ()

    def __repr__(self):
        return "UNK"


UNK = _Unk()


@dataclasses.dataclass
class _V:
    """A known value; `batched` means axis 0 runs over grid steps."""

    arr: np.ndarray
    batched: bool


class EvalError(Exception):
    pass


def _np_dtype(dtype):
    return np.dtype(dtype) if dtype != jnp.bfloat16 else np.dtype(np.float32)


def _int_div(a, b):
    # lax.div on integers truncates toward zero (C semantics).
    b = np.where(b == 0, 1, b)
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q).astype(np.result_type(a, b))


def _int_rem(a, b):
    b = np.where(b == 0, 1, b)
    return np.fmod(a, b)


def _binary(fn):
    def rule(eqn, a, b):
        return fn(a, b)

    return rule


def _div(eqn, a, b):
    if np.issubdtype(np.asarray(a).dtype, np.integer):
        return _int_div(a, b)
    return np.true_divide(a, b)


def _rem(eqn, a, b):
    if np.issubdtype(np.asarray(a).dtype, np.integer):
        return _int_rem(a, b)
    return np.fmod(a, b)


def _select_n(eqn, which, *cases):
    which = np.asarray(which).astype(np.int64)
    return np.choose(np.clip(which, 0, len(cases) - 1), np.broadcast_arrays(*cases))


def _convert(eqn, x):
    return np.asarray(x).astype(_np_dtype(eqn.params["new_dtype"]))


def _clamp(eqn, lo, x, hi):
    return np.clip(x, lo, hi)


def _integer_pow(eqn, x):
    return np.power(x, eqn.params["y"])


def _squeeze(eqn, x):
    return x  # shape bookkeeping happens in _apply via the out aval


def _broadcast_in_dim(eqn, x):
    return x


_ELEMENTWISE = {
    "add": _binary(np.add),
    "sub": _binary(np.subtract),
    "mul": _binary(np.multiply),
    "max": _binary(np.maximum),
    "min": _binary(np.minimum),
    "and": _binary(np.bitwise_and),
    "or": _binary(np.bitwise_or),
    "xor": _binary(np.bitwise_xor),
    "eq": _binary(np.equal),
    "ne": _binary(np.not_equal),
    "lt": _binary(np.less),
    "le": _binary(np.less_equal),
    "gt": _binary(np.greater),
    "ge": _binary(np.greater_equal),
    "shift_left": _binary(np.left_shift),
    "shift_right_arithmetic": _binary(np.right_shift),
    "div": _div,
    "rem": _rem,
    "neg": lambda e, x: np.negative(x),
    "abs": lambda e, x: np.abs(x),
    "sign": lambda e, x: np.sign(x),
    "not": lambda e, x: np.invert(x) if np.asarray(x).dtype != bool else ~np.asarray(x),
    "floor": lambda e, x: np.floor(x),
    "ceil": lambda e, x: np.ceil(x),
    "select_n": _select_n,
    "convert_element_type": _convert,
    "clamp": _clamp,
    "integer_pow": _integer_pow,
    "multiple_of": lambda e, x: x,
}

# Shape-only ops on scalars (or on values whose per-step shape is kept).
_RESHAPES = {"squeeze", "broadcast_in_dim", "reshape"}

_MAX_KNOWN_ELEMS = 64  # per step; anything larger is vector data -> unknown


class _Ref:
    """A scratch SMEM ref whose contents are tracked across the kernel's steps
    (sequential evaluation only: one grid step at a time)."""

    def __init__(self, shape, dtype):
        self.arr = np.zeros(shape, _np_dtype(dtype))
        self.known = np.zeros(shape, bool)  # uninitialised scratch is unknown

    def snapshot(self):
        return self.arr.copy(), self.known.copy()

    def restore(self, snap):
        self.arr, self.known = snap[0].copy(), snap[1].copy()


@dataclasses.dataclass
class _Cost:
    """Per-step costs accumulated while evaluating a kernel body."""

    flops: np.ndarray
    dma_bytes: np.ndarray
    notes: set
    dma_issues: np.ndarray | None = None  # HBM-side dma_starts per step

    def __post_init__(self):
        if self.dma_issues is None:
            self.dma_issues = np.zeros_like(self.flops)


class _VecEval:
    """Evaluates jaxprs for all grid steps at once.

    `program_ids` are the per-step grid indices; `grid` the grid sizes. With
    `cost` set, dot_general / dma_start costs are accumulated per step.
    """

    def __init__(
        self,
        program_ids: Sequence[np.ndarray],
        grid: Sequence[int],
        cost: _Cost | None,
        refs: Sequence[_Ref] = (),
    ):
        self.program_ids = program_ids
        self.grid = grid
        self.n = len(program_ids[0]) if program_ids else 1
        self.cost = cost
        self.refs = list(refs)  # tracked scratch refs (sequential mode)

    def _snapshot(self):
        return [r.snapshot() for r in self.refs]

    def _restore(self, snaps):
        for r, sn in zip(self.refs, snaps):
            r.restore(sn)

    def _merge_states(self, states):
        """Keep what every alternative agrees on; the rest becomes unknown."""
        for i, r in enumerate(self.refs):
            arrs = [st[i][0] for st in states]
            knowns = [st[i][1] for st in states]
            agree = np.logical_and.reduce(knowns)
            for a in arrs[1:]:
                agree &= a == arrs[0]
            r.arr, r.known = arrs[0].copy(), agree

    # -- helpers --
    def _full(self, v: _V) -> np.ndarray:
        if v.batched:
            return v.arr
        return np.broadcast_to(v.arr, (self.n,) + np.shape(v.arr))

    def run(self, jaxpr: jax_core.Jaxpr, consts, args, mask=None) -> list:
        env: dict = {}

        def read(v):
            if isinstance(v, jax_core.Literal):
                return _V(np.asarray(v.val), False)
            return env.get(v, UNK)

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x if isinstance(x, (_V, _Unk, _Ref)) else _V(np.asarray(x), False)
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            outs = self._eqn(eqn, invals, mask)
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _add_cost(self, field: str, amount, mask):
        if self.cost is None:
            return
        amount = np.broadcast_to(np.asarray(amount, dtype=np.float64), (self.n,))
        if mask is not None:
            amount = np.where(mask, amount, 0.0)
        arr = getattr(self.cost, field)
        arr += amount

    def _eqn(self, eqn, invals, mask) -> list:
        name = eqn.primitive.name
        nout = len(eqn.outvars)
        unk = [UNK] * nout

        if name == "program_id":
            return [_V(self.program_ids[eqn.params["axis"]], True)]
        if name == "num_programs":
            return [_V(np.asarray(self.grid[eqn.params["axis"]], np.int32), False)]
        if name == "dot_general":
            self._add_cost("flops", _dot_flops(eqn), mask)
            return unk
        if name == "dma_start":
            nbytes = _dma_hbm_bytes(eqn)
            if nbytes is None:
                if self.cost is not None:
                    self.cost.notes.add("dma_start with unreadable size not counted")
            else:
                self._add_cost("dma_bytes", nbytes, mask)
                if nbytes:
                    self._add_cost("dma_issues", 1, mask)
            return unk
        if name == "get":
            return [self._get(eqn, invals)]
        if name in ("swap", "addupdate"):
            return self._swap(eqn, invals, mask)
        if name in (
            "jit",
            "pjit",
            "closed_call",
            "core_call",
            "custom_jvp_call",
            "custom_vjp_call",
        ):
            key = _CALL_JAXPR_PARAM[name]
            j, consts = _closed(eqn.params[key])
            return self.run(j, consts, invals, mask)
        if name == "run_scoped":
            # The scope's allocations are the jaxpr's invars; what it closes over
            # (the eqn's operands) are its constvars.
            j = eqn.params["jaxpr"]
            scoped = []
            for v in j.invars:
                a = v.aval
                if (
                    self.n == 1
                    and _is_smem(a)
                    and hasattr(a, "shape")
                    and np.issubdtype(_np_dtype(a.dtype), np.number)
                ):
                    scoped.append(_Ref(a.shape, a.dtype))
                else:
                    scoped.append(UNK)
            new_refs = [r for r in scoped if isinstance(r, _Ref)]
            self.refs.extend(new_refs)
            try:
                return self.run(j, invals, scoped, mask)[:nout]
            finally:
                for r in new_refs:
                    self.refs.remove(r)
        if name == "cond":
            return self._cond(eqn, invals, mask)
        if name == "while":
            return self._while(eqn, invals, mask)
        if name == "scan":
            return self._scan(eqn, invals, mask)
        if any(isinstance(x, _Unk) for x in invals):
            return unk
        if name in _ELEMENTWISE or name in _RESHAPES:
            out_aval = eqn.outvars[0].aval
            if math.prod(out_aval.shape) > _MAX_KNOWN_ELEMS:
                return unk
            batched = any(x.batched for x in invals)
            if name in _RESHAPES:
                x = invals[0]
                lead = (self.n,) if x.batched else ()
                out_shape = tuple(out_aval.shape)
                try:
                    if name == "broadcast_in_dim":
                        tmp = [1] * len(out_shape)
                        in_shape = eqn.invars[0].aval.shape
                        for i, d in enumerate(eqn.params["broadcast_dimensions"]):
                            tmp[d] = in_shape[i]
                        arr = np.broadcast_to(x.arr.reshape(lead + tuple(tmp)), lead + out_shape)
                    else:
                        arr = x.arr.reshape(lead + out_shape)
                except ValueError:
                    return unk
                return [_V(np.asarray(arr), x.batched)]
            # numpy broadcasting aligns an unbatched operand with the trailing dims
            args = [x.arr for x in invals]
            try:
                with np.errstate(all="ignore"):
                    res = _ELEMENTWISE[name](eqn, *args)
            except Exception:  # noqa: BLE001 - unsupported dtype combos -> unknown
                return unk
            res = np.asarray(res)
            want = _np_dtype(out_aval.dtype)
            if res.dtype != want:
                res = res.astype(want)
            return [_V(res, batched)]
        if name == "iota":
            p = eqn.params
            if math.prod(p["shape"]) > _MAX_KNOWN_ELEMS:
                return unk
            arr = np.broadcast_to(
                np.arange(p["shape"][p["dimension"]]).reshape(
                    [-1 if d == p["dimension"] else 1 for d in range(len(p["shape"]))]
                ),
                p["shape"],
            ).astype(_np_dtype(p["dtype"]))
            return [_V(arr, False)]
        return unk

    def _ref_keys(self, ref: _Ref, eqn, idx):
        """numpy index into a tracked ref, or None if not computable."""
        transforms = tree_util.tree_unflatten(eqn.params["tree"], idx)
        if len(transforms) != 1 or not isinstance(transforms[0], state_indexing.NDIndexer):
            return None
        keys = []
        for ix in transforms[0].indices:
            if isinstance(ix, state_indexing.Slice):
                vals = []
                for f in (ix.start, ix.size):
                    if isinstance(f, _V):
                        f = f.arr.reshape(-1)[0] if f.arr.size == 1 else None
                    if f is None or isinstance(f, _Unk):
                        return None
                    vals.append(int(f))
                keys.append(slice(vals[0], vals[0] + vals[1] * int(ix.stride), int(ix.stride)))
            elif isinstance(ix, _V):
                if ix.arr.size != 1:
                    return None
                keys.append(int(ix.arr.reshape(-1)[0]))
            elif isinstance(ix, (int, np.integer)):
                keys.append(int(ix))
            else:
                return None
        if len(keys) != ref.arr.ndim:
            return None
        for k, dim in zip(keys, ref.arr.shape):
            if isinstance(k, int) and not 0 <= k < dim:
                return None  # out of bounds on a TPU is undefined; do not guess
        return tuple(keys)

    def _swap(self, eqn, invals, mask):
        ref, val, *idx = invals
        nout = len(eqn.outvars)
        if not isinstance(ref, _Ref):
            return [UNK] * nout
        keys = self._ref_keys(ref, eqn, idx)
        if keys is None:
            ref.known[...] = False  # a write we cannot place may have hit anything
            return [UNK] * nout
        old = (
            _V(np.asarray(ref.arr[keys]).reshape((1,) + np.shape(ref.arr[keys])), True)
            if ref.known[keys].all()
            else UNK
        )
        masked_off = mask is not None and not bool(np.asarray(mask).all())
        if masked_off:  # (sequential mode runs one step: mask is all or nothing)
            return [old] * nout
        if isinstance(val, _Unk):
            ref.known[keys] = False
        else:
            v = val.arr[0] if val.batched else val.arr
            if eqn.primitive.name == "addupdate":
                if ref.known[keys].all():
                    ref.arr[keys] = ref.arr[keys] + v
                else:
                    ref.known[keys] = False
            else:
                ref.arr[keys] = v
                ref.known[keys] = True
        return [old] * nout

    def _get(self, eqn, invals):
        ref, *idx = invals
        if isinstance(ref, _Unk):
            return UNK
        if isinstance(ref, _Ref):
            keys = self._ref_keys(ref, eqn, idx)
            if keys is None or not ref.known[keys].all():
                return UNK
            val = np.asarray(ref.arr[keys])
            return _V(val.reshape((self.n,) + val.shape), True)
        transforms = tree_util.tree_unflatten(eqn.params["tree"], idx)
        arr = ref.arr
        batched = ref.batched
        for t in transforms:
            if not isinstance(t, state_indexing.NDIndexer):
                return UNK
            res = self._index(arr, batched, t)
            if res is None:
                return UNK
            arr, batched = res
        if math.prod(eqn.outvars[0].aval.shape) > _MAX_KNOWN_ELEMS:
            return UNK
        return _V(arr, batched)

    def _index(self, arr, batched, indexer):
        if batched:
            return None  # refs written per step are not tracked
        keys = []
        any_batched = False
        for ix in indexer.indices:
            if isinstance(ix, state_indexing.Slice):
                start, size, stride = ix.start, ix.size, ix.stride
                if isinstance(start, _V):
                    if start.batched:
                        return None
                    start = int(start.arr)
                if isinstance(size, _V):
                    if size.batched:
                        return None
                    size = int(size.arr)
                if isinstance(start, _Unk) or isinstance(size, _Unk):
                    return None
                keys.append(slice(int(start), int(start) + int(size) * int(stride), int(stride)))
            elif isinstance(ix, _V):
                if np.ndim(ix.arr) - (1 if ix.batched else 0) != 0:
                    return None
                any_batched |= ix.batched
                keys.append(ix.arr.astype(np.int64))
            elif isinstance(ix, (int, np.integer)):
                keys.append(int(ix))
            else:
                return None
        if any_batched:
            if any(isinstance(k, slice) for k in keys):
                return None
            full = [np.broadcast_to(k, (self.n,)) for k in keys]
            full = [np.clip(k, 0, s - 1) for k, s in zip(full, arr.shape)]
            return arr[tuple(full)], True
        try:
            return np.asarray(arr[tuple(keys)]), False
        except IndexError:
            return None

    def _cond(self, eqn, invals, mask):
        index, *ops = invals
        branches = eqn.params["branches"]
        nout = len(eqn.outvars)

        def run_branch(b, m):
            br = branches[b]
            return self.run(br.jaxpr, br.consts, ops, m)

        if not isinstance(index, _Unk):
            idx = np.clip(self._full(index).astype(np.int64).reshape(self.n), 0, len(branches) - 1)
            live = idx if mask is None else idx[np.asarray(mask, bool)]
            taken = np.unique(live)
            if len(taken) <= 1:
                # One branch for every (live) step: run just it, side effects included.
                b = int(taken[0]) if len(taken) else int(idx[0])
                return run_branch(b, mask)
            results = []
            for b in range(len(branches)):
                m_b = idx == b
                if mask is not None:
                    m_b = m_b & np.asarray(mask, bool)
                results.append(run_branch(b, m_b) if m_b.any() else [UNK] * nout)
            outs = []
            for k in range(nout):
                col = [r[k] for r in results]
                if any(isinstance(c, _Unk) for c in col):
                    outs.append(UNK)
                    continue
                arrs = [self._full(c) for c in col]
                sel = idx.reshape((self.n,) + (1,) * (arrs[0].ndim - 1))
                outs.append(_V(np.choose(sel, arrs), True))
            return outs

        # Unknown predicate: the costliest branch counts; tracked refs keep only
        # what all branches agree on.
        snap = self._snapshot()
        states, costs = [], []
        saved = self.cost
        for b in range(len(branches)):
            self._restore(snap)
            if saved is not None:
                self.cost = _Cost(np.zeros(self.n), np.zeros(self.n), saved.notes)
            run_branch(b, mask)
            costs.append(self.cost)
            states.append(self._snapshot())
        self.cost = saved
        if self.refs:
            self._merge_states(states)
        if saved is not None:
            saved.notes.add("cond on an unknown predicate: costliest branch counted")
            saved.flops += np.max([c.flops for c in costs], axis=0)
            saved.dma_bytes += np.max([c.dma_bytes for c in costs], axis=0)
            saved.dma_issues += np.max([c.dma_issues for c in costs], axis=0)
        return [UNK] * nout

    _MAX_TRIPS = 100_000

    def _while(self, eqn, invals, mask):
        p = eqn.params
        cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
        active = np.ones(self.n, bool) if mask is None else mask.copy()
        for _ in range(self._MAX_TRIPS):
            (pred,) = self.run(cj.jaxpr, cj.consts, [*cconsts, *carry], active)
            if isinstance(pred, _Unk):
                if self.cost is not None:
                    self.cost.notes.add(
                        "loop with a trip count the walker cannot compute: body counted once"
                    )
                snap = self._snapshot()
                self.run(bj.jaxpr, bj.consts, [*bconsts, *carry], active)
                if self.refs:
                    self._merge_states([snap, self._snapshot()])
                return [UNK] * len(eqn.outvars)
            active = active & self._full(pred).astype(bool)
            if not active.any():
                return carry
            new = self.run(bj.jaxpr, bj.consts, [*bconsts, *carry], active)
            carry = [self._merge(active, n_, o_) for n_, o_ in zip(new, carry)]
        if self.cost is not None:
            self.cost.notes.add(f"loop cut at {self._MAX_TRIPS} trips")
        return [UNK] * len(eqn.outvars)

    def _merge(self, active, new, old):
        if isinstance(new, _Unk) or isinstance(old, _Unk):
            return UNK
        a, b = self._full(new), self._full(old)
        if a.shape != b.shape:
            return UNK
        sel = active.reshape((self.n,) + (1,) * (a.ndim - 1))
        return _V(np.where(sel, a, b), True)

    _MAX_SCAN_UNROLL = 4096

    def _scan(self, eqn, invals, mask):
        p = eqn.params
        j = p["jaxpr"]
        nconsts, ncarry, length = p["num_consts"], p["num_carry"], p["length"]
        consts = invals[:nconsts]
        carry = invals[nconsts : nconsts + ncarry]
        xs = invals[nconsts + ncarry :]
        nys = len(eqn.outvars) - ncarry
        if length > self._MAX_SCAN_UNROLL:
            if self.cost is not None:
                saved = self.cost
                self.cost = _Cost(np.zeros(self.n), np.zeros(self.n), saved.notes)
                self.run(j.jaxpr, j.consts, [*consts, *[UNK] * ncarry, *[UNK] * len(xs)], mask)
                saved.flops += self.cost.flops * length
                saved.dma_bytes += self.cost.dma_bytes * length
                saved.dma_issues += self.cost.dma_issues * length
                saved.notes.add("long scan: body evaluated once with unknown carry")
                self.cost = saved
            return [UNK] * len(eqn.outvars)
        for i in range(length):
            k = length - 1 - i if p["reverse"] else i
            x_i = []
            for x in xs:
                if isinstance(x, _Unk):
                    x_i.append(UNK)
                elif x.batched:
                    x_i.append(_V(x.arr[:, k], True))
                else:
                    x_i.append(_V(x.arr[k], False))
            outs = self.run(j.jaxpr, j.consts, [*consts, *carry, *x_i], mask)
            carry = outs[:ncarry]
        return [*carry, *[UNK] * nys]


def _dot_flops(eqn) -> int:
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    rhs_free = [d for i, d in enumerate(rhs.shape) if i not in rc and i not in rb]
    return 2 * math.prod(lhs.shape) * math.prod(rhs_free)


def _is_hbm(memory_space) -> bool:
    s = str(memory_space).lower()
    return "any" in s or "hbm" in s


def _ref_aval_shape(x):
    """Shape and memory space of a (possibly transformed) ref aval."""
    if isinstance(x, state_types.TransformedRef):
        base = x.ref
        return tuple(x.shape), getattr(base, "memory_space", None), base.dtype
    return tuple(x.shape), getattr(x, "memory_space", None), x.dtype


def _dma_hbm_bytes(eqn) -> int | None:
    """HBM bytes one dma_start moves (0 for VMEM<->VMEM copies)."""
    try:
        avals = [v.aval for v in eqn.invars]
        src, dst, *_ = tree_util.tree_unflatten(eqn.params["tree"], avals)
        s_shape, s_ms, s_dt = _ref_aval_shape(src)
        d_shape, d_ms, _ = _ref_aval_shape(dst)
    except Exception:  # noqa: BLE001
        return None
    if any(not isinstance(d, (int, np.integer)) for d in s_shape):
        return None
    nbytes = math.prod(s_shape) * np.dtype(s_dt).itemsize
    sides = int(_is_hbm(s_ms)) + int(_is_hbm(d_ms))
    return nbytes * sides


# --------------------------------------------------------------------------
# Walking the grid.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class OperandTraffic:
    origin: str
    kind: str  # "input" | "output" | "scalar_prefetch"
    array_shape: tuple
    block_shape: tuple  # per-dim extent of one block (squeezed dims as 1)
    dtype: str
    memory_space: str
    transfers: int  # block fetches (inputs) or write-backs (outputs)
    bytes: int
    counted: bool  # False: left in HBM, moved by the kernel's own DMAs


@dataclasses.dataclass
class LaunchCost:
    name: str
    grid: tuple
    steps: int
    operands: list
    pipeline_bytes: int  # what BlockSpec pipelining moves
    dma_bytes: int  # what the kernel's own dma_starts move (HBM side)
    flops: int  # MXU flops issued over all steps
    notes: list
    dma_issues: int  # HBM-side dma_starts the kernel body executes
    declared_flops: float | None  # the launch's own CostEstimate
    declared_bytes: float | None

    @property
    def hbm_bytes(self) -> int:
        return self.pipeline_bytes + self.dma_bytes

    @property
    def uncounted(self) -> list:
        return [o.origin for o in self.operands if not o.counted]


def _block_dims(bm) -> list:
    dims = []
    for bd in bm.block_shape:
        if isinstance(bd, pallas_core.Squeezed) or bd is None:
            dims.append(("squeezed", 1))
        elif isinstance(bd, pallas_core.Blocked):
            dims.append(("blocked", bd.block_size))
        elif isinstance(bd, pallas_core.Element):
            dims.append(("element", bd.block_size))
        elif isinstance(bd, pallas_core.BoundedSlice):
            dims.append(("bounded", bd.block_size))
        elif isinstance(bd, int):
            dims.append(("blocked", bd))
        else:
            raise EvalError(f"unsupported block dim {bd!r}")
    return dims


def _eval_index_map(bm, program_ids, grid, scalars) -> list[np.ndarray]:
    """Block indices per grid step, one array per array dimension."""
    n = len(program_ids[0]) if program_ids else 1
    ev = _VecEval(program_ids, grid, None)
    closed = bm.index_map_jaxpr
    args = [_V(p, True) for p in program_ids] + [_V(np.asarray(s), False) for s in scalars]
    outs = ev.run(closed.jaxpr, closed.consts, args)
    if len(outs) == len(bm.block_shape) and not any(isinstance(o, _Unk) for o in outs):
        return [
            np.broadcast_to(o.arr, (n,)).astype(np.int64)
            if not o.batched
            else o.arr.astype(np.int64)
            for o in outs
        ]
    # Fall back to JAX itself for index maps the numpy evaluator cannot read.
    dis = state_discharge.discharge_state(closed)
    fun = jax_core.jaxpr_as_fun(dis)
    nd = len(bm.block_shape)
    in_axes = (0,) * len(program_ids) + (None,) * len(scalars)
    res = jax.jit(jax.vmap(lambda *a: fun(*a)[:nd], in_axes=in_axes))(
        *[jnp.asarray(p, jnp.int32) for p in program_ids], *scalars
    )
    if len(res) != nd:
        raise EvalError(
            f"index map of {bm.origin} returns {len(res)} values "
            f"for a rank-{nd} block (pl.Slice indexing is not supported)"
        )
    return [np.asarray(r, np.int64).reshape(n) for r in res]


def _transfers(indices: list[np.ndarray]) -> np.ndarray:
    """Steps at which the block index differs from the previous step's."""
    n = len(indices[0]) if indices else 1
    changed = np.zeros(n, bool)
    changed[0] = True
    for ix in indices:
        changed[1:] |= ix[1:] != ix[:-1]
    return changed


def _moved_bytes(indices, dims, array_shape, itemsize, at: np.ndarray) -> int:
    """Bytes of the blocks moved at the steps `at`, clipped to the array."""
    extent = np.ones(int(at.sum()), np.int64)
    for ix, (kind, size), full in zip(indices, dims, array_shape):
        sel = ix[at]
        if kind == "squeezed":
            e = np.ones_like(sel)
        elif kind == "blocked":
            e = np.clip(full - sel * size, 0, size)
        else:  # element offsets / bounded slices: at most `size` from the offset
            e = np.clip(full - sel, 0, size)
        extent = extent * e
    return int(extent.sum()) * itemsize


# Grids up to this many steps whose kernel keeps scalar state in SMEM scratch
# are evaluated one step at a time, so that state carries from step to step.
SEQUENTIAL_MAX_STEPS = 20_000


def _is_smem(aval) -> bool:
    return "smem" in str(getattr(aval, "memory_space", "")).lower()


def _eval_body(body, gm, scalars, program_ids, grid, cost: _Cost, notes: list):
    """Accumulates the kernel body's per-step MXU flops and DMA bytes."""
    n_scratch = len(gm.scratch_avals)
    n_lead = len(body.invars) - n_scratch
    scratch_avals = [v.aval for v in body.invars[n_lead:]]
    lead = [_V(s, False) for s in scalars] + [UNK] * (n_lead - len(scalars))
    tracked = [
        i
        for i, a in enumerate(scratch_avals)
        if _is_smem(a) and hasattr(a, "shape") and np.issubdtype(_np_dtype(a.dtype), np.number)
    ]
    steps = len(program_ids[0]) if program_ids else 1
    if not tracked or steps > SEQUENTIAL_MAX_STEPS:
        if tracked:
            notes.append(f"{steps} steps: SMEM scratch state not tracked across steps")
        ev = _VecEval(program_ids, grid, cost)
        ev.run(body, (), lead + [UNK] * n_scratch)
        return
    refs = {i: _Ref(scratch_avals[i].shape, scratch_avals[i].dtype) for i in tracked}
    scratch = [refs.get(i, UNK) for i in range(n_scratch)]
    for s in range(steps):
        step_cost = _Cost(np.zeros(1), np.zeros(1), cost.notes)
        ev = _VecEval(
            [p[s : s + 1] for p in program_ids], grid, step_cost, refs=list(refs.values())
        )
        ev.run(body, (), lead + scratch)
        cost.flops[s] += step_cost.flops[0]
        cost.dma_bytes[s] += step_cost.dma_bytes[0]
        cost.dma_issues[s] += step_cost.dma_issues[0]


def walk_launch(launch: Launch) -> LaunchCost:
    """Counts HBM traffic, grid steps and issued MXU flops of one launch."""
    p = launch.params
    gm = p["grid_mapping"]
    ops = launch.operands
    n_dyn = gm.num_dynamic_grid_bounds
    dyn = iter(ops[:n_dyn])
    grid = []
    for g in gm.grid:
        if isinstance(g, pallas_core.DynamicGridDim):
            v = next(dyn)
            if isinstance(v, Unknown):
                raise EvalError("dynamic grid size is not computable from the inputs")
            grid.append(int(np.asarray(v)))
        else:
            grid.append(int(g))
    grid = tuple(grid)
    rest = ops[n_dyn:]
    n_idx = gm.num_index_operands
    scalars = rest[:n_idx]
    for s in scalars:
        if isinstance(s, Unknown):
            raise EvalError("scalar-prefetch operand is not computable from the inputs")
    scalars = [np.asarray(s) for s in scalars]
    steps = math.prod(grid)
    notes: list[str] = []
    if steps == 0:
        program_ids = [np.zeros(0, np.int32) for _ in grid]
    elif not grid:
        program_ids = []  # a single step with no program ids
    else:
        program_ids = [a.reshape(-1).astype(np.int32) for a in np.indices(grid, dtype=np.int32)]

    operands: list[OperandTraffic] = []
    for k, s in enumerate(scalars):
        operands.append(
            OperandTraffic(
                origin=f"scalar_prefetch[{k}]",
                kind="scalar_prefetch",
                array_shape=tuple(s.shape),
                block_shape=tuple(s.shape),
                dtype=str(s.dtype),
                memory_space="smem",
                transfers=1,
                bytes=int(s.nbytes),
                counted=True,
            )
        )

    n_in = gm.num_inputs
    for i, bm in enumerate(gm.block_mappings):
        kind = "input" if i < n_in else "output"
        aval = bm.array_aval
        itemsize = np.dtype(aval.dtype).itemsize
        ms = getattr(bm.transformed_block_aval, "memory_space", None)
        dims = _block_dims(bm)
        block_shape = tuple(s for _, s in dims)
        if _is_hbm(ms):
            operands.append(
                OperandTraffic(
                    origin=str(bm.origin),
                    kind=kind,
                    array_shape=tuple(aval.shape),
                    block_shape=tuple(aval.shape),
                    dtype=str(aval.dtype),
                    memory_space=str(ms),
                    transfers=0,
                    bytes=0,
                    counted=False,
                )
            )
            continue
        if steps == 0:
            operands.append(
                OperandTraffic(
                    str(bm.origin),
                    kind,
                    tuple(aval.shape),
                    block_shape,
                    str(aval.dtype),
                    str(ms),
                    0,
                    0,
                    True,
                )
            )
            continue
        indices = _eval_index_map(bm, program_ids, grid, scalars)
        at = _transfers(indices)
        nbytes = _moved_bytes(indices, dims, aval.shape, itemsize, at)
        operands.append(
            OperandTraffic(
                origin=str(bm.origin),
                kind=kind,
                array_shape=tuple(aval.shape),
                block_shape=block_shape,
                dtype=str(aval.dtype),
                memory_space=str(ms),
                transfers=int(at.sum()),
                bytes=nbytes,
                counted=True,
            )
        )

    cost = _Cost(np.zeros(max(steps, 0)), np.zeros(max(steps, 0)), set())
    if steps:
        _eval_body(p["jaxpr"], gm, scalars, program_ids, grid, cost, notes)
    notes.extend(sorted(cost.notes))
    uncounted = [o.origin for o in operands if not o.counted]
    dma = int(cost.dma_bytes.sum())
    if uncounted:
        if dma:
            notes.append(
                f"{', '.join(uncounted)} left in HBM: counted from the kernel's dma_start sizes"
            )
        else:
            notes.append(f"{', '.join(uncounted)} left in HBM: manual DMA, uncounted")
    ce = p.get("cost_estimate")
    return LaunchCost(
        name=launch.name,
        grid=grid,
        steps=steps,
        operands=operands,
        pipeline_bytes=sum(o.bytes for o in operands if o.counted),
        dma_bytes=dma,
        flops=int(cost.flops.sum()),
        notes=notes,
        dma_issues=int(cost.dma_issues.sum()),
        declared_flops=float(ce.flops) if ce is not None else None,
        declared_bytes=float(ce.bytes_accessed) if ce is not None else None,
    )


def analyze(fn: Callable, *args, **kwargs) -> list[LaunchCost]:
    """`walk_launch` over every pallas_call `fn(*args, **kwargs)` makes."""
    return [walk_launch(l) for l in trace_launches(fn, *args, **kwargs)]


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
