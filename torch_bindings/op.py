"""Turn a JAX function that calls a Pallas kernel into a torch custom op.

One op, three homes:
- `tpu` tensors: through TorchTPU's official `jax_op` route (created lazily,
  only when a TPU tensor first arrives, so hosts without torch_tpu never import it);
- `cpu` tensors: the same JAX function on the host, tensors exchanged by DLPack
  without copies, the Pallas kernel in interpret mode or the XLA reference
  (see backend.py);
- `meta`/fake tensors: output shapes from `jax.eval_shape`, so
  `torch.compile(fullgraph=True)` traces through with no graph break.

Argument checks: an op defined with `check=` runs it on the op's arguments,
tensors given as shape-and-dtype specs (convert.TensorSpec), before it
dispatches: in eager mode once per call in `JaxOp.__call__` (cached per
shapes, dtypes and static arguments, so a repeated call costs a lookup), under
torch.compile once while tracing, from the fake implementation (Dynamo cannot
trace JAX code; the fake implementation runs as plain Python). The kernel's JAX
function is then called without checking again.

Autograd: `define_differentiable` wires the one path of vjp.py (a forward that
returns residuals, a backward that starts from them) into three ops, so the
backward never runs the forward again.

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
_TENSOR_KINDS = ("tensor", "optional_tensor", "tensor_list")


def _arg_kind(arg) -> str:
    t = str(arg.type)
    if t == "Tensor":
        return "tensor"
    if t in ("Tensor?", "Optional[Tensor]"):
        return "optional_tensor"
    if t in ("Tensor[]", "List[Tensor]"):
        return "tensor_list"
    if t in _PY_TYPES:
        return t
    raise ValueError(f"schema argument {arg.name}: unsupported type {t}")


def _return_kind(ret) -> str:
    t = str(ret.type)
    if t == "Tensor":
        return "tensor"
    if t in ("Tensor[]", "List[Tensor]"):
        return "tensor_list"
    raise ValueError(f"schema return: unsupported type {t}")


def _map_tensors(fn, x):
    """fn over every tensor of an argument: a tensor, None, or a list of tensors."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return [fn(t) for t in x]
    return fn(x)


def _requires_grad(args) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    )


class JaxOp:
    """A torch op backed by `kernel(*args, interpret=bool)` and `reference(*args)`.

    Both JAX callables take the op's arguments positionally, in schema order.
    `check(*args)`, if given, validates them (tensors as convert.TensorSpec).
    Fake tensors get their shapes from the reference (`shapes_from="reference"`)
    or from the implementation that will run on their device (`"impl"`: for
    ops whose outputs, e.g. residuals, differ between implementations).
    """

    def __init__(
        self,
        library: "OpLibrary",
        name: str,
        schema: str,
        kernel: Callable[..., Any],
        reference: Callable[..., Any],
        check: Callable[..., Any] | None = None,
        shapes_from: str = "reference",
        reference_flag: bool = False,
    ):
        self.library = library
        self.name = name
        self.qualname = f"{library.namespace}::{name}"
        self.kernel = kernel
        self.reference = reference
        self.check = check
        self.shapes_from = shapes_from
        # The last argument, a bool, picks the host implementation (True: the
        # reference) instead of the environment: a backward follows its forward.
        self.reference_flag = reference_flag
        parsed = torch._C.parse_schema(f"{self.qualname}{schema}")
        self._arg_names = [a.name for a in parsed.arguments]
        self._kinds = [_arg_kind(a) for a in parsed.arguments]
        self._return_kinds = [_return_kind(r) for r in parsed.returns]
        self._num_returns = len(parsed.returns)
        self._tensor_idx = tuple(i for i, k in enumerate(self._kinds) if k in _TENSOR_KINDS)
        self._jit_cache: dict = {}
        self._shape_cache: dict = {}
        self._checked: set = set()
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
        compiling = torch.compiler.is_compiling()
        if not compiling:
            self.check_args(args)
        if compiling or _requires_grad(args):
            return self.op(*args)
        # Nothing to differentiate: skip the Python autograd kernel that
        # register_autograd installs (~25 us per call of redispatch overhead).
        with torch._C._AutoDispatchBelowAutograd():
            return self.op(*args)

    def check_args(self, args, cache: bool = True) -> None:
        """Runs `check` on the arguments as specs; a passing signature is remembered."""
        if self.check is None:
            return
        if cache:
            key = self._signature(args)
            if key in self._checked:
                return
        tensors, statics = self._split(args)
        specs = tuple(_map_tensors(convert.TensorSpec.of, t) for t in tensors)
        self.check(*self._merge(specs, statics))
        if cache:
            self._checked.add(key)

    def _signature(self, args) -> tuple:
        """Static arguments, and shape and dtype of each tensor: what a check reads."""
        sig = []
        for a, kind in zip(args, self._kinds):
            if kind == "tensor" or (kind == "optional_tensor" and a is not None):
                sig.append((a.shape, a.dtype))
            elif kind == "tensor_list":
                sig.append(tuple((t.shape, t.dtype) for t in a))
            else:
                sig.append(a)
        return tuple(sig)

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
        if self.reference_flag:
            impl = "reference" if args[-1] else "interpret"
        else:
            impl = backend.current_cpu_impl()
        fn = self._jitted(impl, statics)
        out = fn(*(_map_tensors(convert.to_jax, t) for t in tensors))
        return convert.to_torch(out)

    def _fake_impl(self, *args):
        if torch.compiler.is_compiling():
            self.check_args(args, cache=False)
        tensors, statics = self._split(args)
        device = next(
            t.device if isinstance(t, torch.Tensor) else t[0].device
            for t in tensors
            if t is not None and (isinstance(t, torch.Tensor) or len(t))
        )
        if self.shapes_from == "reference":
            impl = "reference"
        else:
            impl = backend.current_cpu_impl() if device.type == "cpu" else "tpu"
        key = (impl, self._signature(args))
        avals = self._shape_cache.get(key)
        if avals is None:
            specs = [_map_tensors(convert.shape_dtype_struct, t) for t in tensors]
            fn = self.jax_function(impl)
            avals = jax.eval_shape(lambda *ts: fn(*self._merge(ts, statics)), *specs)
            self._shape_cache[key] = avals

        def empty(a):
            if isinstance(a, list):
                return [empty(x) for x in a]
            if isinstance(a, tuple):
                return tuple(empty(x) for x in a)
            return torch.empty(a.shape, dtype=convert.JAX_TO_TORCH_DTYPE[a.dtype], device=device)

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
            "tensor_list": list[jax.Array],
            **_PY_TYPES,
        }

        def fn(*args):
            return kernel(*args, interpret=False)

        params = [
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotations[k])
            for n, k in zip(self._arg_names, self._kinds)
        ]
        rets = [annotations[k] for k in self._return_kinds]
        returns = rets[0] if len(rets) == 1 else tuple[tuple(rets)]
        fn.__signature__ = inspect.Signature(params, return_annotation=returns)
        fn.__name__ = self.name
        return fn

    def register_autograd(self, backward: Callable, setup_context: Callable) -> None:
        if not self.registered_here:
            return
        torch.library.register_autograd(
            self.qualname, backward, setup_context=setup_context, lib=self.library.lib
        )


class DifferentiableOp:
    """A torch op differentiable through vjp.py's one path, from three JaxOps.

    - `plain`: the forward alone (what runs when nothing needs a gradient);
    - `forward`: the forward returning its outputs and a `Tensor[]` of
      residuals, with autograd registered: setup_context saves the inputs,
      outputs and residuals;
    - `backward`: (inputs, outputs, residuals, cotangents) -> one gradient per
      differentiable input, the package's backward rule.

    Calling it returns the outputs only. Other attributes are `plain`'s.
    """

    def __init__(self, plain: JaxOp, forward: JaxOp, backward: JaxOp, differentiable):
        self.plain = plain
        self.forward = forward
        self.backward = backward
        self.differentiable = differentiable

    def __call__(self, *args):
        if _requires_grad(args):
            if not torch.compiler.is_compiling():
                self.plain.check_args(args)
            outs = self.forward.op(*args)
            return outs[0] if len(outs) == 2 else tuple(outs[:-1])
        return self.plain(*args)

    def __getattr__(self, name):
        return getattr(self.plain, name)


class OpLibrary:
    """All ops of one built kernel, under its source-hash namespace."""

    def __init__(self, python_name: str, package_dir: str | os.PathLike):
        self.python_name = python_name
        self.namespace = op_namespace(python_name, package_dir)
        self.lib = torch.library.Library(self.namespace, "FRAGMENT")
        self.ops: dict[str, JaxOp] = {}

    def define(self, name: str, schema: str, *, kernel, reference, check=None, **kw) -> JaxOp:
        op = JaxOp(self, name, schema, kernel, reference, check=check, **kw)
        self.ops[name] = op
        return op

    def define_differentiable(
        self,
        name: str,
        schema: str,
        *,
        forward: Callable,
        backward: Callable,
        reference: Callable,
        differentiable: tuple[str, ...],
        check: Callable | None = None,
        primal: Callable | None = None,
    ) -> DifferentiableOp:
        """`name` differentiable in the tensor arguments `differentiable`: ops
        `name` (plain), `name_fwd` (with residuals) and `name_backward`.

        forward(*args, interpret) -> (outputs, residuals): args in schema order,
        outputs as the schema returns them, residuals a tuple of arrays.
        backward(args, outputs, residuals, cotangents, *, interpret) -> one
        gradient (or None) per name in `differentiable`. reference(*args) ->
        outputs: the XLA reference; its backward is jax.vjp of it.
        primal(*args, interpret) -> outputs, optional: the plain op's kernel
        (no residuals to keep, so it may fuse what forward must write; see vjp.py).
        """
        return _define_differentiable(
            self, name, schema, forward, backward, reference, differentiable, check, primal
        )


def _zeros_placeholder():
    # Op schemas cannot return None: an absent optional tensor's gradient.
    return jax.numpy.zeros((0,), jax.numpy.float32)


def _no_gradient(a) -> bool:
    """An absent optional tensor, or a one-byte one (int8 / float8 quantized
    weights, frozen as in transformers' own FP8 matmuls), gets no gradient:
    the backward op returns a placeholder and autograd sees None. `a` is a JAX
    array (backward op) or a torch tensor (autograd)."""
    if a is None:
        return True
    if isinstance(a, torch.Tensor):
        return a.element_size() == 1
    return jax.numpy.dtype(a.dtype).itemsize == 1


def _define_differentiable(
    lib: OpLibrary, name, schema, forward, backward, reference, differentiable, check, primal=None
) -> DifferentiableOp:
    head, rets = schema.rsplit("->", 1)
    args_sig = head.strip()[1:-1]
    rets = rets.strip()
    out_types = [r.strip() for r in rets[1:-1].split(",")] if rets.startswith("(") else [rets]
    n_out = len(out_types)

    if primal is None:
        primal = lambda *a, interpret: forward(*a, interpret=interpret)[0]  # noqa: E731
    plain = lib.define(
        name,
        schema,
        kernel=primal,
        reference=reference,
        check=check,
    )
    names, kinds = plain._arg_names, plain._kinds
    diff_idx = tuple(names.index(n) for n in differentiable)
    n_args = len(names)

    def as_tuple(outputs):
        return tuple(outputs) if n_out > 1 else (outputs,)

    def fwd_kernel(*args, interpret):
        outputs, residuals = forward(*args, interpret=interpret)
        return (*as_tuple(outputs), list(residuals))

    def fwd_reference(*args):
        # The reference keeps no residuals: its backward differentiates it again.
        return (*as_tuple(reference(*args)), [])

    fwd_op = lib.define(
        f"{name}_fwd",
        f"({args_sig}) -> ({', '.join(out_types)}, Tensor[])",
        kernel=fwd_kernel,
        reference=fwd_reference,
        check=check,
        shapes_from="impl",
    )

    def split_bwd_args(a):
        args = list(a[:n_args])
        outputs = tuple(a[n_args : n_args + n_out])
        residuals = tuple(a[n_args + n_out])
        cts = a[n_args + n_out + 1 :]
        cts = tuple(jax.numpy.zeros_like(o) if c is None else c for c, o in zip(cts, outputs))
        return args, outputs, residuals, cts

    def finish(args, grads):
        return tuple(
            _zeros_placeholder()
            if _no_gradient(args[i])
            else (jax.numpy.zeros_like(args[i]) if g is None else g)
            for i, g in zip(diff_idx, grads)
        )

    def bwd_kernel(*a, interpret):
        args, outputs, residuals, cts = split_bwd_args(a[:-1])
        grads = backward(
            tuple(args),
            outputs if n_out > 1 else outputs[0],
            residuals,
            cts if n_out > 1 else cts[0],
            interpret=interpret,
        )
        return finish(args, grads)

    def bwd_reference(*a):
        args, _, _, cts = split_bwd_args(a[:-1])
        live = tuple(i for i in diff_idx if args[i] is not None)

        def f(*values):
            full = list(args)
            for i, v in zip(live, values):
                full[i] = v
            return reference(*full)

        _, vjp = jax.vjp(f, *(args[i] for i in live))
        got = dict(zip(live, vjp(cts if n_out > 1 else cts[0])))
        return finish(args, [got.get(i) for i in diff_idx])

    out_sig = ", ".join(f"Tensor _out{i}" for i in range(n_out))
    ct_sig = ", ".join(f"Tensor? _ct{i}" for i in range(n_out))
    grad_rets = ", ".join("Tensor" for _ in diff_idx)
    bwd_op = lib.define(
        f"{name}_backward",
        f"({args_sig}, {out_sig}, Tensor[] _residuals, {ct_sig}, bool _reference) -> "
        + (f"({grad_rets})" if len(diff_idx) > 1 else "Tensor"),
        kernel=bwd_kernel,
        reference=bwd_reference,
        reference_flag=True,
    )

    def setup_context(ctx, inputs, output):
        outs, residuals = output[:n_out], output[n_out]
        tensor_pos = [
            i for i, k in enumerate(kinds) if k in _TENSOR_KINDS and inputs[i] is not None
        ]
        ctx.save_for_backward(*(inputs[i] for i in tensor_pos), *outs, *residuals)
        ctx.tensor_pos = tensor_pos
        ctx.inputs = [None if i in tensor_pos else a for i, a in enumerate(inputs)]
        # Host tensors: the forward ran the reference (no residuals) or the
        # kernel; the backward runs the same one, whatever the switch says then.
        ctx.reference = outs[0].device.type == "cpu" and backend.current_cpu_impl() == "reference"
        # Residual outputs never get a gradient: do not allocate zeros for them.
        ctx.set_materialize_grads(False)

    def backward_fn(ctx, *grads):
        saved = ctx.saved_tensors
        n_in = len(ctx.tensor_pos)
        args = list(ctx.inputs)
        for i, t in zip(ctx.tensor_pos, saved[:n_in]):
            args[i] = t
        outs, residuals = saved[n_in : n_in + n_out], list(saved[n_in + n_out :])
        cts = grads[:n_out]
        result = [None] * len(kinds)
        if all(g is None for g in cts):
            return tuple(result)
        got = bwd_op(*args, *outs, residuals, *cts, ctx.reference)
        got = got if isinstance(got, (tuple, list)) else (got,)
        for i, g in zip(diff_idx, got):
            result[i] = None if _no_gradient(args[i]) else g
        return tuple(result)

    fwd_op.register_autograd(backward_fn, setup_context)
    return DifferentiableOp(plain, fwd_op, bwd_op, differentiable)
