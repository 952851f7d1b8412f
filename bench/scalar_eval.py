"""A numpy evaluator for the scalar code of a Pallas kernel, vectorised over
grid steps.

Index maps and the scalar control flow of the kernel body (program ids,
scalar-prefetch reads, `cond`, `while`, `scan`) are evaluated for all grid
steps at once with numpy, so a 100k-step grid costs milliseconds. Values the
evaluator cannot know (anything read from VMEM, vector math) are "unknown":
a `cond` on an unknown predicate counts its most expensive branch, a loop with
an unknown trip count counts its body once; both are noted in the result.

While evaluating a kernel body it also accumulates, per step, the MXU flops
of every `dot_general` (`2*M*K*N`, whatever the share of real rows in the
block) and the HBM bytes of every `dma_start`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src import tree_util
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing as state_indexing
from jax._src.state import types as state_types

from .tracing import CALL_JAXPR_PARAM, closed


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
class Cost:
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
        cost: Cost | None,
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
            key = CALL_JAXPR_PARAM[name]
            j, consts = closed(eqn.params[key])
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
                self.cost = Cost(np.zeros(self.n), np.zeros(self.n), saved.notes)
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
                self.cost = Cost(np.zeros(self.n), np.zeros(self.n), saved.notes)
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


def is_hbm(memory_space) -> bool:
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
    sides = int(is_hbm(s_ms)) + int(is_hbm(d_ms))
    return nbytes * sides


def eval_index_map(bm, program_ids, grid, scalars) -> list[np.ndarray]:
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


# Grids up to this many steps whose kernel keeps scalar state in SMEM scratch
# are evaluated one step at a time, so that state carries from step to step.
SEQUENTIAL_MAX_STEPS = 20_000


def _is_smem(aval) -> bool:
    return "smem" in str(getattr(aval, "memory_space", "")).lower()


def eval_body(body, gm, scalars, program_ids, grid, cost: Cost, notes: list):
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
        step_cost = Cost(np.zeros(1), np.zeros(1), cost.notes)
        ev = _VecEval(
            [p[s : s + 1] for p in program_ids], grid, step_cost, refs=list(refs.values())
        )
        ev.run(body, (), lead + scratch)
        cost.flops[s] += step_cost.flops[0]
        cost.dma_bytes[s] += step_cost.dma_bytes[0]
        cost.dma_issues[s] += step_cost.dma_issues[0]
