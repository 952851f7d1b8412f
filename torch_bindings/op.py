"""Turn a JAX function that calls a Pallas kernel into a torch custom op.

One op, three homes:
- `tpu` tensors: through TorchTPU's official `jax_op` route (created lazily,
  only when a TPU tensor first arrives, so hosts without torch_tpu never import it);
- `cpu` tensors: the same JAX function on the host, tensors exchanged by DLPack
  without copies, the Pallas kernel in interpret mode or the XLA reference
  (see backend.py);
- `meta`/fake tensors: output shapes from `jax.eval_shape`, so
  `torch.compile(fullgraph=True)` traces through with no graph break.

Compiled JAX functions are cached per (implementation, static arguments), so a
repeated call does no retracing and costs a dictionary lookup plus the jit
dispatch.
"""

from __future__ import annotations

import inspect
import os
import threading
from typing import Any, Callable

import jax
import torch

from . import backend, convert
from .namespace import op_namespace

_PY_TYPES = {"float": float, "int": int, "bool": bool, "str": str}


def _arg_kind(arg) -> str:
    t = str(arg.type)
    if t == "Tensor":
        return "tensor"
    if t in ("Tensor?", "Optional[Tensor]"):
        return "optional_tensor"
    if t in _PY_TYPES:
        return t
    raise ValueError(f"schema argument {arg.name}: unsupported type {t}")


class JaxOp:
    """A torch op backed by `kernel(*args, interpret=bool)` and `reference(*args)`.

    Both JAX callables take the op's arguments positionally, in schema order.
    """

    def __init__(
        self,
        library: "OpLibrary",
        name: str,
        schema: str,
        kernel: Callable[..., Any],
        reference: Callable[..., Any],
    ):
        self.library = library
        self.name = name
        self.qualname = f"{library.namespace}::{name}"
        self.kernel = kernel
        self.reference = reference
        parsed = torch._C.parse_schema(f"{self.qualname}{schema}")
        self._arg_names = [a.name for a in parsed.arguments]
        self._kinds = [_arg_kind(a) for a in parsed.arguments]
        self._num_returns = len(parsed.returns)
        self._tensor_idx = tuple(i for i, k in enumerate(self._kinds) if k.endswith("tensor"))
        self._jit_cache: dict = {}
        self._shape_cache: dict = {}
        self._tpu_op = None
        self._lock = threading.Lock()

        ns_ops = getattr(torch.ops, library.namespace)
        # False when the identical build (same source hash) was already loaded in
        # this process: its registrations compute exactly what ours would.
        self.registered_here = not hasattr(ns_ops, name)
        if self.registered_here:
            library.lib.define(f"{name}{schema}")
            library.lib.impl(name, self._cpu_impl, "CPU")
            library.lib.impl(name, self._tpu_impl, "PrivateUse1")
            torch.library.register_fake(self.qualname, self._fake_impl, lib=library.lib)
        self.op = getattr(ns_ops, name).default

    def __call__(self, *args):
        if (
            torch.is_grad_enabled()
            and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            or torch.compiler.is_compiling()
        ):
            return self.op(*args)
        # Nothing to differentiate: skip the Python autograd kernel that
        # register_autograd installs (~25 us per call of redispatch overhead).
        with torch._C._AutoDispatchBelowAutograd():
            return self.op(*args)

    # -- JAX side -----------------------------------------------------------
    def jax_function(self, impl: str) -> Callable[..., Any]:
        """The JAX callable behind `impl`: "interpret", "reference" or "tpu"."""
        if impl == "reference":
            return self.reference
        if impl == "interpret":
            return lambda *a: self.kernel(*a, interpret=True)
        if impl == "tpu":
            return lambda *a: self.kernel(*a, interpret=False)
        raise ValueError(f"impl: expected interpret, reference or tpu, got {impl!r}")

    def _split(self, args):
        tensors = tuple(args[i] for i in self._tensor_idx)
        statics = tuple(a for i, a in enumerate(args) if i not in self._tensor_idx)
        return tensors, statics

    def _merge(self, tensors, statics):
        it_t, it_s = iter(tensors), iter(statics)
        return [
            next(it_t) if i in self._tensor_idx else next(it_s) for i in range(len(self._kinds))
        ]

    def _jitted(self, impl: str, statics: tuple):
        key = (impl, statics)
        fn = self._jit_cache.get(key)
        if fn is None:
            base = self.jax_function(impl)
            fn = jax.jit(lambda *tensors: base(*self._merge(tensors, statics)))
            self._jit_cache[key] = fn
        return fn

    # -- torch kernels ------------------------------------------------------
    def _cpu_impl(self, *args):
        tensors, statics = self._split(args)
        fn = self._jitted(backend.current_cpu_impl(), statics)
        out = fn(*(None if t is None else convert.to_jax(t) for t in tensors))
        return convert.to_torch(out)

    def _fake_impl(self, *args):
        tensors, statics = self._split(args)
        device = next(t.device for t in tensors if t is not None)
        key = (statics, tuple(None if t is None else (tuple(t.shape), t.dtype) for t in tensors))
        avals = self._shape_cache.get(key)
        if avals is None:
            specs = [
                None
                if t is None
                else jax.ShapeDtypeStruct(tuple(t.shape), convert.TORCH_TO_JAX_DTYPE[t.dtype])
                for t in tensors
            ]
            avals = jax.eval_shape(lambda *ts: self.reference(*self._merge(ts, statics)), *specs)
            self._shape_cache[key] = avals

        def empty(a):
            return torch.empty(a.shape, dtype=convert.JAX_TO_TORCH_DTYPE[a.dtype], device=device)

        if isinstance(avals, (tuple, list)):
            return tuple(empty(a) for a in avals)
        return empty(avals)

    def _tpu_impl(self, *args):
        return self.tpu_op()(*args)

    def tpu_op(self):
        """The TorchTPU `jax_op` for this kernel (lowers with Mosaic, `interpret=False`).

        Called on `meta` tensors it runs `jax.export(..., platforms=["tpu"])`:
        the real Pallas-to-Mosaic lowering, usable on hosts without a TPU.
        """
        with self._lock:
            if self._tpu_op is None:
                from torch_tpu._internal.pallas import jax_op  # lazy: torch_tpu is optional

                name = f"{self.qualname}__tpu"
                ns, short = name.split("::")
                existing = getattr(getattr(torch.ops, ns), short, None)
                self._tpu_op = (
                    existing.default
                    if existing is not None
                    else jax_op(name, self._typed_tpu_function())
                )
            return self._tpu_op

    def _typed_tpu_function(self):
        kernel = self.kernel
        annotations = {
            "tensor": jax.Array,
            "optional_tensor": jax.Array | None,
            **_PY_TYPES,
        }

        def fn(*args):
            return kernel(*args, interpret=False)

        params = [
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotations[k])
            for n, k in zip(self._arg_names, self._kinds)
        ]
        n = self._num_returns
        returns = jax.Array if n == 1 else tuple[(jax.Array,) * n]
        fn.__signature__ = inspect.Signature(params, return_annotation=returns)
        fn.__name__ = self.name
        return fn

    def register_autograd(self, backward: Callable, setup_context: Callable) -> None:
        if not self.registered_here:
            return
        torch.library.register_autograd(
            self.qualname, backward, setup_context=setup_context, lib=self.library.lib
        )


class OpLibrary:
    """All ops of one built kernel, under its source-hash namespace."""

    def __init__(self, python_name: str, package_dir: str | os.PathLike):
        self.python_name = python_name
        self.namespace = op_namespace(python_name, package_dir)
        self.lib = torch.library.Library(self.namespace, "FRAGMENT")
        self.ops: dict[str, JaxOp] = {}

    def define(self, name: str, schema: str, *, kernel, reference) -> JaxOp:
        op = JaxOp(self, name, schema, kernel, reference)
        self.ops[name] = op
        return op

    def define_differentiable(
        self, name: str, schema: str, *, kernel, reference, differentiable: tuple[str, ...]
    ) -> JaxOp:
        return _define_differentiable(
            self, name, schema, kernel=kernel, reference=reference, differentiable=differentiable
        )


def _vjp_function(fn, num_outputs: int, diff_idx: tuple[int, ...], arg_count: int):
    """JAX backward of `fn`: (cotangents..., primal args...) -> one gradient per diff arg.

    The gradient comes from jax.vjp, i.e. from the kernel's own custom_vjp
    (its backward Pallas kernels). A differentiable argument passed as None
    (an absent optional tensor) gets a 0-element placeholder, since op
    schemas cannot return None.
    """

    def backward(*args, **kwargs):
        cts, primals = args[:num_outputs], list(args[num_outputs:])
        assert len(primals) == arg_count
        live = tuple(i for i in diff_idx if primals[i] is not None)

        def f(*diff_vals):
            full = list(primals)
            for i, v in zip(live, diff_vals):
                full[i] = v
            return fn(*full, **kwargs)

        _, vjp = jax.vjp(f, *(primals[i] for i in live))
        grads = dict(zip(live, vjp(cts[0] if num_outputs == 1 else tuple(cts))))
        return tuple(
            grads[i] if i in grads else jax.numpy.zeros((0,), jax.numpy.float32) for i in diff_idx
        )

    return backward


def _define_differentiable(
    self: "OpLibrary", name: str, schema: str, *, kernel, reference, differentiable: tuple[str, ...]
) -> JaxOp:
    """Defines `name` and `name_backward`, and wires autograd between them.

    `differentiable` names the tensor arguments that get gradients. The
    backward op takes the output cotangents then the forward's arguments, and
    runs jax.vjp of the same JAX function (the kernel's custom_vjp), so the
    backward is itself a kernel op on every device.
    """
    fwd = self.define(name, schema, kernel=kernel, reference=reference)
    names, kinds = fwd._arg_names, fwd._kinds
    diff_idx = tuple(names.index(n) for n in differentiable)
    n_out = fwd._num_returns
    args_sig = schema[schema.index("(") + 1 : schema.rindex(") ->")]
    ct_sig = ", ".join(f"Tensor _ct{i}" for i in range(n_out))
    rets = ", ".join("Tensor" for _ in diff_idx)
    bwd_schema = (
        f"({ct_sig}, {args_sig}) -> ({rets})"
        if len(diff_idx) > 1
        else f"({ct_sig}, {args_sig}) -> Tensor"
    )
    bwd = self.define(
        f"{name}_backward",
        bwd_schema,
        kernel=_vjp_function(kernel, n_out, diff_idx, len(names)),
        reference=_vjp_function(reference, n_out, diff_idx, len(names)),
    )

    def setup_context(ctx, inputs, output):
        tensor_pos = [
            i for i, k in enumerate(kinds) if k.endswith("tensor") and inputs[i] is not None
        ]
        ctx.save_for_backward(*(inputs[i] for i in tensor_pos))
        ctx.tensor_pos = tensor_pos
        ctx.inputs = [None if i in tensor_pos else a for i, a in enumerate(inputs)]
        outs = output if isinstance(output, (tuple, list)) else (output,)
        ctx.out_meta = [(o.shape, o.dtype) for o in outs]

    def backward(ctx, *grads):
        args = list(ctx.inputs)
        for i, t in zip(ctx.tensor_pos, ctx.saved_tensors):
            args[i] = t
        cts = [
            g
            if g is not None
            else torch.zeros(shape, dtype=dtype, device=args[ctx.tensor_pos[0]].device)
            for g, (shape, dtype) in zip(grads, ctx.out_meta)
        ]
        got = bwd(*cts, *args)
        got = got if isinstance(got, (tuple, list)) else (got,)
        result = [None] * len(kinds)
        for i, g in zip(diff_idx, got):
            result[i] = None if args[i] is None else g
        return tuple(result)

    fwd.register_autograd(backward, setup_context)
    fwd.backward_op = bwd
    return fwd
