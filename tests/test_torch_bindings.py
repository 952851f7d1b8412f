"""torch_bindings on a toy Pallas kernel: op definition, devices, caching, autograd, compile."""

import jax
import pytest
import torch
from jax.experimental import pallas as pl

from torch_bindings import OpLibrary, cpu_impl, op_namespace, source_hash
from torch_bindings.vjp import split_vjp


def _scale_shift_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * w_ref[...]


def scale_shift(x, w, b, alpha: float, *, interpret: bool):
    """alpha * x * w (+ b), the product in a Pallas kernel."""

    @jax.custom_vjp
    def f(x, w):
        return pl.pallas_call(
            _scale_shift_kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            interpret=interpret,
        )(x, w)

    def fwd(x, w):
        return f(x, w), (x, w)

    def bwd(res, g):
        x_, w_ = res
        return g * w_, g * x_

    f.defvjp(fwd, bwd)
    y = alpha * f(x, w)
    return y if b is None else y + b


def scale_shift_ref(x, w, b, alpha: float):
    y = alpha * x * w
    return y if b is None else y + b


_fwd, _bwd = split_vjp(scale_shift, diff=(0, 1, 2))


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    pkg = tmp_path_factory.mktemp("toy_pkg")
    (pkg / "a.py").write_text("x = 1\n")
    lib = OpLibrary("toy", pkg)
    lib.scale_shift = lib.define_differentiable(
        "scale_shift",
        "(Tensor x, Tensor w, Tensor? b, float alpha) -> Tensor",
        forward=lambda x, w, b, alpha, *, interpret: _fwd(
            x, w, b, alpha=alpha, interpret=interpret
        ),
        backward=lambda args, out, res, ct, *, interpret: _bwd(
            args[:3], out, res, ct, alpha=args[3], interpret=interpret
        ),
        reference=scale_shift_ref,
        differentiable=("x", "w", "b"),
    )
    return lib


def test_namespace_is_per_source(tmp_path):
    (tmp_path / "m.py").write_text("a = 1\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"junk")
    first = op_namespace("pkg", tmp_path)
    assert first.startswith("_pkg_") and len(first) == len("_pkg_") + 10
    (tmp_path / "__pycache__" / "other.pyc").write_bytes(b"more junk")
    assert op_namespace("pkg", tmp_path) == first  # bytecode does not count
    (tmp_path / "m.py").write_text("a = 2\n")
    assert op_namespace("pkg", tmp_path) != first
    assert source_hash(tmp_path) == op_namespace("pkg", tmp_path).rsplit("_", 1)[1]


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_forward_and_autograd_with_optional_tensor(lib, impl):
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    b = torch.randn(4, 8, requires_grad=True)
    with cpu_impl(impl):
        y = lib.scale_shift(x, w, b, 0.5)
        gx, gw, gb = torch.autograd.grad(y.sin().sum(), (x, w, b))
        y2 = lib.scale_shift(x, w, None, 2.0)
        (gx2,) = torch.autograd.grad(y2.sum(), (x,))
    torch.testing.assert_close(y, 0.5 * x * w + b)
    torch.testing.assert_close(gx, torch.cos(y) * 0.5 * w)
    torch.testing.assert_close(gw, torch.cos(y) * 0.5 * x)
    torch.testing.assert_close(gb, torch.cos(y))
    torch.testing.assert_close(gx2, 2.0 * w)


def test_int64_and_non_contiguous_inputs(lib):
    x = torch.randn(8, 4).t()  # non-contiguous
    w = torch.ones(4, 8)
    torch.testing.assert_close(lib.scale_shift(x, w, None, 1.0), x.contiguous())


def test_meta_and_fake_shapes(lib):
    x = torch.empty(3, 5, device="meta")
    y = lib.scale_shift(x, x, None, 1.0)
    assert y.shape == (3, 5) and y.device.type == "meta"


def test_compile_fullgraph_including_backward(lib):
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(4, 8)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, w):
        return lib.scale_shift(x, w, None, 3.0).square().sum()

    f(x, w).backward()
    torch.testing.assert_close(x.grad, 2 * 3.0 * x * w * 3.0 * w)


def test_jit_cache_is_keyed_by_static_arguments(lib):
    op = lib.scale_shift
    x = torch.randn(2, 2)
    torch.testing.assert_close(op(x, x, None, 1.0), x * x)
    torch.testing.assert_close(op(x, x, None, 1.0), x * x)
    # A cached function must not serve another static value.
    torch.testing.assert_close(op(x, x, None, 2.0), 2.0 * x * x)
    keys = [k for k in op._jit_cache if k[0] == "interpret"]
    assert ("interpret", (1.0,)) in keys and ("interpret", (2.0,)) in keys


def test_same_source_loaded_twice_reuses_registration(tmp_path):
    (tmp_path / "a.py").write_text("y = 1\n")
    a = OpLibrary("twice", tmp_path)
    op_a = a.define(
        "f", "(Tensor x) -> Tensor", kernel=lambda x, *, interpret: x + 1, reference=lambda x: x + 1
    )
    b = OpLibrary("twice", tmp_path)
    op_b = b.define(
        "f", "(Tensor x) -> Tensor", kernel=lambda x, *, interpret: x + 1, reference=lambda x: x + 1
    )
    assert a.namespace == b.namespace and op_a.op is op_b.op
    torch.testing.assert_close(op_b(torch.zeros(2)), torch.ones(2))


def test_typed_function_for_torch_tpu_matches_schema(lib):
    import inspect

    fn = lib.scale_shift._typed_tpu_function()
    sig = inspect.signature(fn)
    assert list(sig.parameters) == ["x", "w", "b", "alpha"]
    assert sig.parameters["alpha"].annotation is float
    assert sig.return_annotation is jax.Array
    out = lib.scale_shift.tpu_op()(
        torch.empty(2, 3, device="meta"), torch.empty(2, 3, device="meta"), None, 1.0
    )
    assert out.shape == (2, 3)


def test_cpu_impl_switch_reaches_every_vendored_copy():
    """The top-level torch_bindings switch must steer a kernel that vendors its own copy."""
    import rmsnorm_tpu

    op = rmsnorm_tpu.ops._rms_norm
    x, w = torch.randn(2, 24), torch.randn(24)
    with cpu_impl("reference"):
        rmsnorm_tpu.rms_norm(x, w, 0.125)
    assert ("reference", (0.125, False)) in op._jit_cache
    assert ("interpret", (0.125, False)) not in op._jit_cache
    rmsnorm_tpu.rms_norm(x, w, 0.125)
    assert ("interpret", (0.125, False)) in op._jit_cache
