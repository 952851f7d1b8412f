"""One autograd path for every kernel: a forward that returns its residuals, a
backward that starts from them.

A kernel package writes two JAX functions once:

    forward(*arrays, **statics) -> (outputs, residuals)
    backward(arrays, outputs, residuals, cotangents, **statics) -> one gradient per array

`residuals` is a tuple of arrays holding only what the inputs and outputs do
not already hold (flash attention's per-row log-sum-exp); both sides keep the
inputs and outputs themselves, so nothing is saved twice. `backward` returns
None for an array that gets no gradient (indices, absent optional tensors).

`differentiable(forward, backward)` makes them a JAX function with a
custom_vjp (what JAX callers get); `OpLibrary.define_differentiable` (op.py)
makes the same two a torch op whose forward op returns the residuals and whose
backward op runs `backward` on what autograd saved. Neither runs the forward
again during the backward.

Both take an optional `primal(*arrays, **statics) -> outputs`: what runs when
no gradient is asked for (JAX outside a vjp; the plain torch op, e.g. under
no_grad). A kernel fuses there what the backward would otherwise need saved
(the MoE layer's activation in its gate/up matmul: the backward needs the
projection, which the fused kernel never writes). It must compute the same
function as forward's outputs.

`split_vjp(fn, diff)` derives such a pair from any differentiable JAX function
(a composite such as the MoE layer, whose kernels carry their own custom_vjps):
the residuals are those of `jax.vjp`, less the ones that are inputs or outputs.

Pure JAX: importable without torch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable


def differentiable(
    forward: Callable, backward: Callable, primal: Callable | None = None
) -> Callable:
    """f(*arrays, **statics) -> outputs, differentiable in the arrays through
    `forward` / `backward` (statics must be hashable); `primal` (default:
    forward's outputs) when not differentiated."""
    import jax

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def core(statics, *arrays):
        if primal is not None:
            return primal(*arrays, **dict(statics))
        return forward(*arrays, **dict(statics))[0]

    def fwd(statics, *arrays):
        outputs, residuals = forward(*arrays, **dict(statics))
        return outputs, (arrays, outputs, tuple(residuals))

    def bwd(statics, saved, cotangents):
        arrays, outputs, residuals = saved
        return tuple(backward(arrays, outputs, residuals, cotangents, **dict(statics)))

    core.defvjp(fwd, bwd)

    @functools.wraps(forward)
    def call(*arrays, **statics):
        return core(tuple(sorted(statics.items())), *arrays)

    return call


def _position(leaf, candidates) -> int | None:
    for i, c in enumerate(candidates):
        if leaf is c:
            return i
    return None


def split_vjp(fn: Callable, diff: tuple[int, ...]) -> tuple[Callable, Callable]:
    """(forward, backward) of `fn(*arrays, **statics)` w.r.t. the arrays at
    positions `diff`, carrying jax.vjp's residuals.

    The backward rebuilds the vjp from an abstract trace of `fn` (jax.eval_shape:
    shapes only, no kernel runs) and the saved residuals, then applies it, so
    what runs is the kernels' own custom_vjp backward rules and the transposes
    of the glue around them.
    """
    import jax

    def vjp_parts(arrays, statics):
        live = tuple(i for i in diff if arrays[i] is not None)

        def f(*values):
            full = list(arrays)
            for i, v in zip(live, values):
                full[i] = v
            return fn(*full, **statics)

        outputs, vjp_fn = jax.vjp(f, *(arrays[i] for i in live))
        leaves, treedef = jax.tree.flatten(vjp_fn)
        out_leaves = jax.tree.leaves(outputs)
        sources, kept = [], []
        for leaf in leaves:
            i = _position(leaf, arrays)
            j = None if i is not None else _position(leaf, out_leaves)
            r = None if i is not None or j is not None else _position(leaf, kept)
            if i is not None:
                sources.append(("in", i))
            elif j is not None:
                sources.append(("out", j))
            else:  # a residual; one appearing twice is kept (and returned) once
                if r is None:
                    r = len(kept)
                    kept.append(leaf)
                sources.append(("res", r))
        return outputs, leaves, treedef, live, sources, kept

    def forward(*arrays, **statics):
        outputs, _, _, _, _, kept = vjp_parts(arrays, statics)
        return outputs, tuple(kept)

    def backward(arrays, outputs, residuals, cotangents, **statics):
        found: dict[str, Any] = {}

        def probe(*a):
            out, _, treedef, live, sources, _ = vjp_parts(a, statics)
            found.update(treedef=treedef, live=live, sources=sources)
            return out

        jax.eval_shape(probe, *arrays)
        pools = {"in": arrays, "out": jax.tree.leaves(outputs), "res": residuals}
        leaves = [pools[kind][i] for kind, i in found["sources"]]
        vjp_fn = jax.tree.unflatten(found["treedef"], leaves)
        grads = dict(zip(found["live"], vjp_fn(cotangents)))
        return tuple(grads.get(i) for i in range(len(arrays)))

    return forward, backward
