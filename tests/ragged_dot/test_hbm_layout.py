"""Expert weights are read where XLA keeps them: no per-call copy of the weights.

XLA's TPU compiler lays each array out to pad its (8, 128) tiles least, so a
tensor-parallel shard's weight whose last dim is not lane-aligned (Qwen3 at
TP-8: [128, 2048, 96]) lives with its middle dim in lanes. A Pallas call that
asks for it row-major makes XLA copy all experts' weights before every call:
at TP-8 and one token that copy was 8x the kernels' own time.
`tiling.weight_minor_swapped` predicts the layout and api.py hands the kernels
that view. These tests hold the prediction to the compiler's own choice and
look for weight-sized copies in compiled MoE programs.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from bench import schedule
from gate import spec
from ragged_dot_tpu import api, tiling
from torch_bindings.aot import tpu_compile

# (experts, hidden, intermediate) per model, and tensor-parallel degrees: the
# expert weights' shapes of every layout transformers uses, whole and sharded.
MODELS = {
    "qwen3": (128, 2048, 768),
    "gemma4": (128, 2816, 704),
    "gpt_oss": (32, 2880, 2880),
    "mixtral": (8, 4096, 14336),
}


def _weight_shapes():
    shapes = set()
    for e, h, i in MODELS.values():
        for tp in (1, 2, 4, 8):
            ii = i // tp
            for a, b in ((h, 2 * ii), (h, ii)):
                shapes.add((e, a, b))
                shapes.add((e, b, a))
    return sorted(shapes)


LAYOUT = re.compile(r"entry_computation_layout=\{\(\w+\[[\d,]+\]\{([\d,]+)")


def _entry_layout(shape, dtype, generation):
    compiled = tpu_compile(lambda w: w[:1] * 2, [spec(shape, dtype)], generation)
    return tuple(int(d) for d in LAYOUT.search(compiled.as_text()).group(1).split(","))


# XLA's layout choice is the same on every generation we checked (v5e, v6e,
# tpu7x): the whole table on v6e, the shapes either side of the rule on tpu7x.
@pytest.mark.parametrize(
    "generation, shapes",
    [
        ("v6e", _weight_shapes()),
        ("tpu7x", [(128, 2048, 96), (128, 96, 2048), (32, 5760, 2880), (32, 2880, 5760)]),
    ],
    ids=["v6e", "tpu7x"],
)
def test_swap_rule_predicts_the_compilers_weight_layout(generation, shapes):
    for shape in shapes:
        layout = _entry_layout(shape, jnp.bfloat16, generation)
        # Every expert weight of these models is expert-major in either view.
        assert layout[-1] == 0, (shape, layout)
        assert tiling.weight_minor_swapped(shape) == (layout == (1, 2, 0)), (shape, layout)


def _optimized_hlo(fn, args, generation):
    """The compiler's optimized HLO (dumped: as_text fails on async ops)."""
    _, dumps = schedule.compile_tagged(lambda program: tpu_compile(program, args, generation), fn)
    return dumps.hlo


def _weight_copies(hlo: str, weight_elems: int) -> list[str]:
    """Ops that write a weight-sized array (copies, transposes, fusions)."""
    found = []
    for line in hlo[hlo.find("ENTRY") :].splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]+)\]\S* (\w[\w-]*)\(", line)
        if not m or m.group(3) in ("parameter", "bitcast", "custom-call"):
            continue
        elems = 1
        for d in m.group(2).split(","):
            elems *= int(d)
        if elems >= weight_elems:
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("is_transposed", [False, True])
@pytest.mark.parametrize("model", ["qwen3", "gemma4"])
def test_tp8_experts_layer_reads_weights_in_place(model, is_transposed):
    e, h, i = MODELS[model]
    i //= 8
    tokens, top_k = 8, 8
    gate_up = (e, h, 2 * i) if is_transposed else (e, 2 * i, h)
    down = (e, i, h) if is_transposed else (e, h, i)
    fn = functools.partial(
        api.moe_experts, num_experts=e, is_transposed=is_transposed, config="v6e"
    )
    args = [
        spec((tokens, h)),
        spec((tokens, top_k), jnp.int32),
        spec((tokens, top_k), jnp.float32),
        spec(gate_up),
        spec(down),
    ]
    hlo = _optimized_hlo(fn, args, "v6e")
    assert "tpu_custom_call" in hlo
    assert _weight_copies(hlo, e * h * i) == []


def test_tp8_ragged_dot_gradients_read_and_write_weights_in_place():
    """d_lhs reads the weight and d_rhs writes it in the compiler's layout."""
    e, k, n, m = 128, 2048, 96, 64

    def loss(lhs, rhs, sizes):
        return api.ragged_dot(lhs, rhs, sizes, config="v6e").astype(jnp.float32).sum()

    fn = jax.value_and_grad(loss, argnums=(0, 1))
    args = [spec((m, k)), spec((e, k, n)), spec((e,), jnp.int32)]
    hlo = _optimized_hlo(fn, args, "v6e")
    assert hlo.count("tpu_custom_call") >= 3
    assert tiling.weight_minor_swapped((e, k, n))
    assert _weight_copies(hlo, e * k * n) == []
