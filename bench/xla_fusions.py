"""Scheduled time of a program's XLA parts: every fusion's own final bundles, run.

The sweep charges the XLA part of a program (the MoE layer's sort, dispatch,
activation and combine; the whole of an XLA-only baseline) this way: each
fusion (and sort, copy, ...) XLA compiled for the program is executed the way
`bench.llo` executes a Pallas launch, its final VLIW bundles with its DMAs
on the HBM model. The times are summed as if the fusions ran one after
another (XLA's async copies between them are added at copy bandwidth); the
Pallas launches themselves are left out (the sweep schedules those with
their scalar-prefetch values). Before 2026-12-01 the sweep used XLA's
estimated cycles floored at its cost analysis's bytes, which cannot see where
XLA keeps an array (in the MoE layer it keeps the routed rows in VMEM) and
count a row gather of a bf16 array as ~8x the rows it moves.

A fusion's run cannot know values it reads from memory (gather indices,
XLA's ragged dot's group bounds): a branch on one falls through, so a loop
may not run. Such a fusion is charged at least every byte of its HBM
operands and result at copy bandwidth (for XLA's ragged dot in transformers'
grouped_mm at Qwen3's shape, that floor is its time: the run moved 6 MB of
805; at smaller shapes the same fusion's run reads every weight).

Checked: an elementwise add over 100 MB is scheduled within 1.03x of its bytes
at copy bandwidth (tests/bench/test_xla_fusions.py).

    python -m bench.xla_fusions --tokens 512 --generation v6e --routing gather

prints the fusions of `api.moe_experts`' program for Qwen3-30B-A3B, slowest
first, and their sum.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from . import llo, schedule
from .xla_cost import array_bytes

_COPY_START = re.compile(r"%copy-start[\w.]* = \((\w+)\[([\d,]*)\]")
# A kernel with several outputs has a tuple type, "(bf16[..]{..}, f32[..]{..})",
# spaces included: the type is matched lazily up to the custom-call.
_CUSTOM_CALL = re.compile(r"%([\w.\-]+) = [^\n]*? custom-call\(")
# A fusion longer than this many bundles (XLA's lax.ragged_dot lowering, a
# masked convolution estimated at 1e10 cycles) is cut off and reported
# incomplete rather than run for minutes.
MAX_BUNDLES = 5_000_000
_CUT = "stopped after"


@dataclasses.dataclass(frozen=True)
class FusionTime:
    name: str
    us: float
    bundles: int
    dma_bytes: int
    notes: tuple
    floored: bool = False  # us is its HBM operands' bytes at copy bandwidth


@dataclasses.dataclass(frozen=True)
class XlaSchedule:
    fusions: list  # FusionTime, slowest first
    copy_bytes: int  # moved by XLA's async copies (copy-start / copy-done)
    copy_us: float

    @property
    def total_us(self) -> float:
        return sum(f.us for f in self.fusions) + self.copy_us

    @property
    def incomplete(self) -> list[str]:
        """Fusions whose run was cut off at max_bundles: their times are not
        the schedule's."""
        return [f.name for f in self.fusions if any(n.startswith(_CUT) for n in f.notes)]


def _copy_bytes(hlo: str) -> int:
    return sum(array_bytes(m.group(1), m.group(2)) for m in _COPY_START.finditer(hlo))


_DEF = re.compile(
    r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\](\{[^}]*\})?\S* [\w\-]+\(([^)]*)\)", re.M
)


def hbm_bytes(hlo: str) -> dict[str, int]:
    """{instruction: bytes of its operands and result that live in HBM}.

    An array XLA placed in VMEM carries S(1) in its layout; tuples count 0.
    This is every byte the instruction could touch, not what it must: a gather
    or a dynamic slice reads less of its operand.
    """
    shapes = {}
    for m in _DEF.finditer(hlo):
        in_vmem = "S(1)" in (m.group(4) or "")
        shapes[m.group(1)] = (0 if in_vmem else array_bytes(m.group(2), m.group(3)), m.group(5))
    out = {}
    for name, (own, operands) in shapes.items():
        out[name] = own + sum(
            shapes.get(o, (0, ""))[0] for o in re.findall(r"%([\w.\-]+)", operands)
        )
    return out


def schedule_fusions(
    texts: dict[str, str], hlo: str, generation: str, max_bundles: int = MAX_BUNDLES
) -> XlaSchedule:
    """Runs each XLA fusion's bundles, leaving out the Pallas kernels the HLO
    names (the sweep schedules those with their scalar-prefetch values)."""
    kernels = set(_CUSTOM_CALL.findall(hlo))
    hz = schedule.clock_hz(generation)
    hbm = schedule.hbm_model(generation)
    copy_bw = schedule.copy_bytes_per_s(generation)
    touched = hbm_bytes(hlo)
    fusions = []
    for name, text in texts.items():
        if name in kernels:
            continue
        res = llo.simulate(text, {}, hbm, generation, max_bundles=max_bundles)
        us = res.cycles / hz * 1e6
        # A run that branched on, or computed with, a value it could not know
        # may have skipped a loop (XLA's ragged dot: its weight loop never ran
        # and it moved 6 MB of 805): such a fusion is charged at least every
        # HBM byte it could touch.
        floor = touched.get(name, 0) / copy_bw * 1e6
        unsure = res.unknown_branches > 0 or any("unknown" in n for n in res.notes)
        floored = unsure and floor > us
        fusions.append(
            FusionTime(
                name,
                max(us, floor) if unsure else us,
                res.bundles,
                res.dma_bytes,
                tuple(res.notes),
                floored,
            )
        )
    for name, moved in offloaded_bytes(hlo).items():
        fusions.append(
            FusionTime(name, moved / copy_bw * 1e6, 0, moved, (_OFFLOAD_NOTE,), floored=True)
        )
    copies = _copy_bytes(hlo)
    fusions.sort(key=lambda f: -f.us)
    return XlaSchedule(fusions, copies, copies / copy_bw * 1e6)


_OFFLOAD_NOTE = "SparseCore offload: charged its bytes at copy bandwidth (no schedule read)"
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_START = re.compile(
    r"^\s*%([\w.\-]+) = [^\n]*async-start\([^\n]*async_execution_thread=\"sparsecore\"", re.M
)
_UPDATE = re.compile(r"^\s*%[\w.\-]+ = \(\(([^)]*)\)[^\n]* async-update\(%([\w.\-]+)", re.M)
_DONE = re.compile(
    r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\][^\n]* async-done\(%([\w.\-]+)\)", re.M
)


def offloaded_bytes(hlo: str) -> dict[str, int]:
    """{async-done name: bytes} of the gathers and scatters XLA offloads to
    the SparseCore (v6e, tpu7x; `async_execution_thread="sparsecore"`). Their
    code is not in the TensorCore dumps, so they are charged at least their
    bytes at copy bandwidth: a gather reads its indices and the rows it
    gathers and writes them (2x its result); a scatter reads its indices and
    updates and reads and writes its result. Up to 2026-12-02 they were not
    charged at all: 8,192-token prefill of Qwen3's layer gathers 268 MB
    twice (dispatch and combine), 1.07 GB moved."""
    # The entry computation's: each offload's own body repeats its start/done.
    entry = hlo[hlo.find("\nENTRY") + 1 :] if "\nENTRY" in hlo else hlo
    text = re.sub(r"\{[^{}\n]*\}", "", entry)  # layouts hold parentheses and commas
    starts = set(_START.findall(text))
    operands = {}  # start name -> its operands' (dtype, dims), in order
    for m in _UPDATE.finditer(text):
        if m.group(2) in starts:
            operands[m.group(2)] = _ARRAY.findall(m.group(1))
    out = {}
    for m in _DONE.finditer(text):
        name, dtype, dims, src = m.groups()
        start = src.removesuffix(".update")
        if start not in starts:
            continue
        result = array_bytes(dtype, dims)
        ops = [array_bytes(d, s) for d, s in operands.get(start, [])]
        # Scatter (operand, indices, updates...): the operand is the result,
        # read and written. Gather (operand, indices): the operand is read
        # only where gathered, which is the result's size.
        out[name] = 2 * result + sum(ops[1:])
    return out


def schedule_xla_parts(fn, args, generation: str) -> XlaSchedule:
    """Compiles fn(*args) (ShapeDtypeStructs) for `generation` and schedules
    each of its XLA fusions."""
    from torch_bindings.aot import tpu_compile

    if schedule.enable_dumps() is None:
        raise schedule.Unavailable("libtpu was loaded before bench could enable its dumps")
    _, dumps = schedule.compile_tagged(
        lambda program: tpu_compile(program, list(args), generation), fn, fusions=True
    )
    return schedule_fusions(dumps.fusions, dumps.hlo or "", generation)


def _moe_program(model: str, tokens: int, generation: str, routing: str):
    from ragged_dot_tpu import tiling

    from . import moe, registry

    if routing == "gather":
        tiling.route_by_matmul = lambda *a: False
    point = moe.MoePoint(moe.MODELS[model], tokens, "uniform")
    built = registry.REGISTRY["ours_moe_experts"].build(point, generation, None)
    return built.fn, registry.program_args(built, point.compile_args())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--generation", default="v6e")
    p.add_argument("--routing", choices=("auto", "gather"), default="auto")
    p.add_argument("--top", type=int, default=10)
    a = p.parse_args(argv)
    fn, args = _moe_program(a.model, a.tokens, a.generation, a.routing)
    s = schedule_xla_parts(fn, args, a.generation)
    for f in s.fusions[: a.top]:
        floored = "  floored at its HBM bytes" if f.floored else ""
        print(
            f"{f.us:9.2f} us  {f.name:40s} {f.bundles:>8} bundles  {f.dma_bytes:>10} DMA bytes{floored}"
        )
    print(
        f"{a.model} {a.tokens} tokens {a.generation} routing={a.routing}: "
        f"{len(s.fusions)} XLA fusions {s.total_us - s.copy_us:.1f} us + async copies "
        f"{s.copy_bytes / 1e6:.2f} MB {s.copy_us:.1f} us = {s.total_us:.1f} us"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
