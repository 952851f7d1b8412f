"""Run the TPU compiler's final VLIW schedule of one kernel, scalar unit only.

libtpu writes, for every Mosaic kernel it compiles, the final bundle schedule
(`*-final_bundles.txt`, see bench/schedule.py for how it is dumped). Each
bundle issues in one cycle unless it waits. This module parses that text and
executes it the way the TensorCore's scalar unit would: scalar registers,
predicates, SMEM (seeded with the kernel's scalar-prefetch operands), branches
with their delay slots, DMA starts and semaphore waits. Vector, MXU and EUP
work is not computed; it only occupies its bundle. So every loop runs its real
trip count (read from the same SMEM values the TPU would read), every bundle
of the static schedule is counted once per execution, and the time spent
waiting on DMAs comes from a small HBM model (one shared pipe at the device's
bandwidth plus a fixed latency per DMA).

The MXUs are the one vector resource it does model: the compiler's schedule
issues matmul ops faster than an MXU can take them (a bf16 matmul of 16 rows
in ~4 bundles per MXU on tpu7x, ~13 on v5e, against the 8 and 16 cycles the
clock's own assumption of 2 and 1 rows per cycle gives), and the hardware
then waits. Each `vmatmul` occupies its MXU for its rows / rows per cycle
(`MxuModel`); an op issued while its MXU still has a queued op stalls the
clock until the MXU takes it. So a kernel can never schedule faster than its
matmul rows at the peak the clock was derived from.

What this cannot see, by construction: other stalls the static schedule does
not show (MXU result latency beyond what the scheduler planned for, VMEM bank
conflicts), and anything that depends on vector data read back into scalar
registers (counted as unknown; a branch on an unknown predicate falls through
and is reported).
"""

from __future__ import annotations

import collections
import dataclasses
import re
import numpy as np
from typing import Iterable

# Bytes per DMA granule in `size_in_granules` (a [16, 2048] bf16 window is
# 2048 granules; an s32[128] SMEM copy is 16): checked on v5e, v6e and tpu7x
# dumps by tests/bench/test_llo.py.
GRANULE_BYTES = 32
# How many bundles after a taken branch still execute before it jumps.
# v5e/v6e: always the next 4 (the compiler pads with empty bundles). tpu7x:
# the rest of the branch's basic block: the bundles up to the next region start,
# or to the first non-empty bundle shallower than the branch (a back-edge:
# than its loop body), up to 8;
# the empty padding there is not a slot; a forward branch's slots also end
# before the first unpredicated DMA, wait or SMEM store (the skipped block's
# own). The rules were chosen because they are the ones under which the
# schedules of our kernels move exactly the bytes their jaxprs say, branch
# only on known predicates and wait only for copies they started
# (tests/bench/test_llo.py checks this on each generation).
BRANCH_DELAY_SLOTS = 4
DELAY_RULE = {"v5e": "fixed4", "v6e": "fixed4", "v5p": "fixed4", "tpu7x": "block"}


# Ops whose effect the executor tracks and no delay slot can hold unpredicated
# unless it is meant for both paths.
_SCALAR_EFFECTS = ("dma.", "vsync", "sst", "sfence")


def delay_slots(bundles: list[Bundle], rule: str) -> list[int]:
    """Delay slots of the branch in each bundle (0 where there is none)."""
    out = [0] * len(bundles)
    region_at = {} if rule == "fixed4" else _region_at(bundles)
    for i, bd in enumerate(bundles):
        if bd.branch is None:
            continue
        if rule == "fixed4":
            out[i] = BRANCH_DELAY_SLOTS
            continue
        target = _branch_target(bd.branch, region_at)
        forward = target is not None and target > i
        # A back-edge's slots are its loop's: they end at the first bundle
        # shallower than the body (the target's depth), even where the
        # branch itself sits a level up. The waits after the dK/dV kernel's
        # dQ write loop ran on every trip otherwise, each for the copy just
        # started (tpu7x 8k: 367k of its 5.67M cycles).
        depth = bd.depth if forward or target is None else max(bd.depth, bundles[target].depth)
        n = 0
        for j in range(i + 1, min(i + 9, len(bundles))):
            nxt = bundles[j]
            if nxt.starts or nxt.mark in ("LB", "PF") or (nxt.ops and nxt.depth < depth):
                break
            # A forward branch's slots end before an unpredicated DMA, wait,
            # semaphore or SMEM update: the compiler fills a slot only with
            # what may run on both paths (pure scalar work, or ops predicated
            # on the fall-through), so such an op is the skipped block's own.
            # Counting it ran another row slot's semaphore wait on every
            # kernel_combine step (a `pl.when` block per slot). Empty padding
            # is no such sign: a pipelined grid loop's branch over its body
            # is followed by three empty bundles and then the next step's
            # prefetch DMA, which must run whichever way it goes.
            if forward and any(
                op.pred is None and op.name.startswith(_SCALAR_EFFECTS) for op in nxt.ops
            ):
                break
            n += 1
        out[i] = n
    return out


def _region_at(bundles: list[Bundle]) -> dict:
    """Region number -> index of the bundle where it starts."""
    out: dict = {}
    for i, bd in enumerate(bundles):
        for r in bd.starts:
            out.setdefault(r, i)
    return out


def _branch_target(op: Op, region_at: dict) -> int | None:
    m = re.search(r"\$region(\d+)", op.text)
    return region_at.get(int(m.group(1))) if m else None


_MASK = (1 << 32) - 1
_CONST_PRED = {"0": False, "1": True}


# ----------------------------------------------------------------- parsing


@dataclasses.dataclass(frozen=True)
class Ptr:
    """A symbolic address: allocation name + offset (words for SMEM)."""

    base: str
    offset: int = 0
    scale: int = 0  # log2 of the address unit relative to the allocation's own


@dataclasses.dataclass
class Op:
    name: str
    dst: str | None  # physical register ("s28", "p3") or None
    pred: tuple | None  # (register, negated) guarding the op
    keep: object  # operand kept when the predicate is false, "(p, %s)" form
    args: list  # operand tokens (see _operand)
    named: dict  # /*name=*/ operands (DMA size, semaphore, ...)
    text: str


@dataclasses.dataclass
class Bundle:
    addr: int
    depth: int  # loop nesting the compiler printed as '>' marks
    ops: list
    starts: list  # region numbers starting at this bundle
    branch: Op | None = None
    mark: str = ""  # LB (loop body), PF (predicated fallthrough), ...


_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+([A-Z]{2})?:\s*(>*)\s*\{")
_REGION = re.compile(r"Start(?:/End empty)? region (\d+)")
_LABEL = re.compile(r"/\*(\w+)=\*/")
_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_REG = re.compile(r"%[sp]\d+_([sp]\d+)$")
_OPNAME = re.compile(r"^(?:%([\w]+)\s*=\s*)?([a-z_][\w.<>]*(?: memory space>)?)\s*(.*)$", re.S)


def _split_top(s: str, sep: str) -> list[str]:
    """Split on `sep` outside brackets."""
    out, depth, cur = [], 0, []
    i = 0
    while i < len(s):
        if s.startswith(sep, i) and depth == 0:
            out.append("".join(cur))
            cur = []
            i += len(sep)
            continue
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        cur.append(c)
        i += 1
    out.append("".join(cur))
    return out


def _operand(tok: str):
    """('reg', 's28') | ('imm', int) | ('ptr', Ptr) | ('mem', base, index) | ('raw', str)."""
    tok = tok.strip()
    m = _REG.match(tok)
    if m:
        return ("reg", m.group(1))
    if re.fullmatch(r"-?\d+", tok):
        return ("imm", int(tok) & _MASK)
    if re.fullmatch(r"\$0x[0-9a-f]+", tok):
        return ("imm", int(tok[1:], 16) & _MASK)
    m = re.fullmatch(r"\[(?:(\w+):)?\[?(.*?)\]?\]", tok)
    if m:
        space, inner = m.group(1), m.group(2)
        parts = [p.strip() for p in inner.split("+")]
        base = parts[0]
        base_v = ("ptr", Ptr(base[1:])) if base.startswith("#") else _operand(base)
        idx = [_operand(p) for p in parts[1:]]
        if space is None and not idx:
            return base_v
        return ("mem", base_v, idx)
    return ("raw", tok)


def _parse_op(text: str) -> Op | None:
    body = _COMMENT.sub("", _LABEL.sub(r"@@\1=", text))
    body = re.sub(r"\[resolvable:\$\w+\]", "", body)
    named = {m.group(1): _operand(m.group(2)) for m in re.finditer(r"@@(\w+)=\s*([^,]+)", body)}
    body = re.sub(r"@@\w+=", "", body).strip()
    m = _OPNAME.match(body)
    if not m:
        return None
    dst_full, name, rest = m.group(1), m.group(2), m.group(3).strip()
    dst = None
    if dst_full:
        r = re.match(r"[sp]\d+_([sp]\d+)$", dst_full)
        dst = r.group(1) if r else None
    pred = keep = None
    if name.startswith("dma.") or name.startswith("vsync"):
        rest = re.sub(r"^\[thread:\$\d+\]\s*", "", rest)
    # A predicate register, or a constant the compiler folded it to: "(0)" is
    # an op that never runs (v6e keeps such DMAs in the schedule).
    pm = re.match(r"^\((!?)(?:%p\d+_(p\d+)|([01]))(?:,\s*([^)]*))?\)\s*,?\s*", rest)
    if pm:
        pred = (pm.group(2) or pm.group(3), pm.group(1) == "!")
        if pm.group(4):
            keep = _operand(pm.group(4))
        rest = rest[pm.end() :]
    # Operands are separated by commas, or only by a space after an address
    # ("sst [smem:[#allocation8]] %s1").
    toks = [
        t.strip()
        for piece in _split_top(rest, ",")
        for t in _split_top(piece.strip(), " ")
        if t.strip()
    ]
    args = []
    for t in toks:  # loads and stores carry their predicate after the address
        pm = re.fullmatch(r"\((!?)%p\d+_(p\d+)\)", t)
        if pm and pred is None:
            pred = (pm.group(2), pm.group(1) == "!")
        else:
            args.append(_operand(t))
    return Op(name, dst, pred, keep, args, named, text.strip())


def parse(text: str) -> list[Bundle]:
    """Bundles of a `*-final_bundles.txt` file, in address order."""
    chunks: list[tuple[re.Match, list[str]]] = []
    for line in text.splitlines():
        m = _BUNDLE.match(line)
        if m:
            chunks.append((m, [line[m.end() :]]))
        elif chunks:
            chunks[-1][1].append(line)
    bundles = []
    for m, lines in chunks:
        whole = "\n".join(lines)
        close = _matching_brace(whole)
        inside, trailer = whole[:close], whole[close + 1 :]
        ops = [o for o in (_parse_op(t) for t in _split_top(inside, ";;")) if o]
        b = Bundle(
            int(m.group(1), 0),
            len(m.group(3)),
            ops,
            [int(r) for r in _REGION.findall(trailer)],
            mark=m.group(2) or "",
        )
        for o in ops:
            if o.name == "sbr.rel":
                b.branch = o
        bundles.append(b)
    return bundles


def _matching_brace(s: str) -> int:
    depth = 1
    in_comment = False
    i = 0
    while i < len(s):
        if s.startswith("/*", i):
            in_comment = True
            i += 2
            continue
        if in_comment and s.startswith("*/", i):
            in_comment = False
            i += 2
            continue
        if not in_comment:
            if s[i] == "{":
                depth += 1
            elif s[i] == "}":
                depth -= 1
                if depth == 0:
                    return i
        i += 1
    return len(s)


# ------------------------------------------------------------- slot classes

# What each op occupies, for "which VLIW slot binds this loop".
SLOTS = ("scalar", "vld", "vst", "valu", "mxu_push", "mxu_matmul", "mxu_pop", "eup", "xlu", "dma")


def slot_of(name: str) -> str:
    if name.startswith(("dma.", "vsync")):
        return "dma"
    if name.startswith("v"):
        if name.startswith("vld"):
            return "vld"
        if name.startswith("vst") and not name.startswith("vstv"):
            return "vst"
        if name.startswith(("vmatpush", "vmatprep.subr")):
            return "mxu_push"
        if name.startswith(("vmatmul", "vmatprep.mubr")):
            return "mxu_matmul"
        if ".mrf" in name or name.endswith(".mrb"):  # v5e/v6e result FIFO; tpu7x result buffer
            return "mxu_pop"
        if (
            name.startswith(
                ("vexp", "vrcp", "vlog", "vrsqrt", "vpow", "vtanh", "vsqrt", "vsin", "vcos", "verf")
            )
            or name == "vpop"
            or ".eup" in name
        ):
            return "eup"
        if (
            "xlane" in name
            or name.startswith(("vxpose", "vperm", "vrot", "vbcast"))
            or "permute" in name
            or ".trf" in name
        ):
            return "xlu"
        return "valu"
    return "scalar"


# ---------------------------------------------------------------- execution


@dataclasses.dataclass(frozen=True)
class MxuModel:
    """How long a matmul op holds its MXU.

    rows_per_cycle: rows of lhs one MXU takes per cycle at full width (the
    same ASSUMPTION the clock is derived from, torch_bindings.tpu_info), for
    16-bit operands; 8-bit ops take twice the rows at twice the rate (the
    int8 / fp8 peaks are 2x bf16's), 32-bit ops half the rows.
    queue: ops an MXU holds beyond the one it runs before the issuing bundle
    waits (ASSUMPTION: 1).
    """

    rows_per_cycle: int
    queue: int = 1

    def cycles(self, name: str) -> int:
        # One op streams one vreg of lhs rows: 8 sublanes of 32-bit words,
        # i.e. 16 rows of 16-bit values or 32 of 8-bit ones.
        if ".f32" in name or ".s32" in name:
            return max(1, 8 // self.rows_per_cycle)
        return max(1, 16 // self.rows_per_cycle)


_MXU_ID = re.compile(r"\.mxu(\d+)")


def _mxu_ops(bd: "Bundle", mxu: "MxuModel | None") -> list:
    """(mxu index, cycles) of each matmul op the bundle issues."""
    if mxu is None:
        return []
    out = []
    for o in bd.ops:
        if o.name.startswith("vmatmul"):
            m = _MXU_ID.search(o.text)
            out.append((int(m.group(1)) if m else 0, mxu.cycles(o.name)))
    return out


@dataclasses.dataclass
class HbmModel:
    """DMAs share one pipe at `bytes_per_cycle`; each completes `latency_cycles`
    after its last byte moves."""

    bytes_per_cycle: float
    latency_cycles: float


@dataclasses.dataclass
class LoopStat:
    start: int  # address of the first bundle of the body
    end: int  # address of the last bundle (the branch's last delay slot)
    body_bundles: int
    iterations: int  # executions of the first bundle
    cycles: int  # bundles executed inside the body plus its MXU stalls, inner loops excluded
    slots: dict  # ops per slot class in one pass of the body (inner loops excluded)
    binding: str  # the slot class with the highest ops / capacity
    floor_bundles: float  # that slot's ops / capacity: the body's lower bound


@dataclasses.dataclass
class Result:
    cycles: float  # bundles issued + cycles stalled on DMA waits and on the MXUs
    bundles: int
    stall_cycles: float  # waiting on DMAs
    dmas: int
    dma_bytes: int
    loops: list
    unknown_branches: int
    notes: list
    mxu_stall_cycles: float = 0.0  # waiting for an MXU to take a matmul op
    stopped: bool = False  # cut off at max_bundles: every figure is a lower bound


def _int8_tiles(a):
    """The bytes of an int8 [..., R, C] array (C <= 128) in the TPU's layout,
    as kernels compiled for v6e and tpu7x address it in SMEM (read off the
    bundles of JAX's splash attention, whose block masks are int8 [1, 4, 4]
    at 2k and [1, 8, 8] at 4k): rows padded to a multiple of four, each four
    rows one row of 128 words, a word holding those rows of one column, the
    lowest byte the first. None for wider arrays (not seen)."""
    *lead, r, c = a.shape
    if c > 128:
        return None
    rp = -(-r // 4) * 4
    x = np.zeros((*lead, rp, 128), np.uint8)
    x[..., :r, :c] = a.view(np.uint8)
    x = x.reshape(*lead, rp // 4, 4, 128)
    return np.ascontiguousarray(np.swapaxes(x, -1, -2)).reshape(-1)


def _memory_words(a, nbytes: int):
    """The 32-bit words of array `a` as a `nbytes` copy moves them: an int8
    array of two or more dims in the TPU's layout (_int8_tiles) when that is
    the size, else row-major and packed, else with the minor dimension padded
    to 128 elements (the lane tiling); None when none fits. Until 2026-12-06
    an int8 array took the padded row-major layout, four elements of a row to
    a word where the kernel reads four rows of a column: JAX's splash
    attention then read most of its causal block mask as empty and skipped
    their blocks (v6e, 4k, d=64 forward: 322.0 us scheduled)."""
    a = np.ascontiguousarray(a if isinstance(a, np.ndarray) else np.asarray(a, np.int32))
    layouts = [a.reshape(-1)]
    tiled = _int8_tiles(a) if a.ndim >= 2 and a.dtype.itemsize == 1 else None
    if tiled is not None:
        # First: an int8 [.., 4k, 128] array has the same size either way.
        layouts.insert(0, tiled)
    if a.ndim >= 1:
        pad = -a.shape[-1] % 128
        layouts.append(np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]).reshape(-1))
    for flat in layouts:
        raw = flat.view(np.uint8)
        if -(-len(raw) // GRANULE_BYTES) * GRANULE_BYTES == nbytes:
            raw = np.concatenate([raw, np.zeros(nbytes - len(raw), np.uint8)])
            return raw.view("<u4")
    return None


class Unknown(Exception):
    pass


def _signed(v: int) -> int:
    return v - (1 << 32) if v & (1 << 31) else v


class _Machine:
    def __init__(
        self,
        bundles: list[Bundle],
        operands: dict,
        hbm: HbmModel,
        max_bundles: int,
        delay_rule: str = "fixed4",
        mxu: MxuModel | None = None,
    ):
        self.b = bundles
        self.mxu = mxu
        self.mxu_free: dict = {}  # MXU index -> cycle its queue drains
        self.mxu_stall = 0.0
        self._mxu_memo: dict = {}
        self.delay = delay_slots(bundles, delay_rule)
        self.operands = operands  # index -> list[int] (scalar prefetch values) or None
        self.hbm = hbm
        self.max_bundles = max_bundles
        self.regs: dict = {}
        self.smem: dict = {}
        self.sem_now: collections.Counter = collections.Counter()
        self.sem_pending: dict = collections.defaultdict(list)  # sem -> [(t, amount)]
        self.pipe_free = 0.0
        self.cycle = 0.0
        self.stall = 0.0
        self.dmas = 0
        self.dma_bytes = 0
        self.unknown_branches = 0
        self.notes: set = set()
        self.region_at = _region_at(bundles)

    # -- values
    def val(self, opnd):
        kind = opnd[0]
        if kind == "reg":
            return self.regs.get(opnd[1])
        if kind == "imm":
            return opnd[1]
        if kind == "ptr":
            return opnd[1]
        if kind == "mem":
            return self.addr(opnd)
        return None

    def addr(self, opnd):
        base = self.val(opnd[1]) if opnd[0] == "mem" else self.val(opnd)
        idx = [self.val(i) for i in (opnd[2] if opnd[0] == "mem" else [])]
        if isinstance(base, int) and all(isinstance(i, int) for i in idx):
            return ("abs", base + sum(idx))
        if isinstance(base, Ptr) and all(isinstance(i, int) for i in idx):
            return Ptr(base.base, base.offset + sum(_signed(i) for i in idx), base.scale)
        if isinstance(base, int) and len(idx) == 1 and isinstance(idx[0], Ptr):
            return Ptr(idx[0].base, idx[0].offset + _signed(base), idx[0].scale)
        return None

    def pred_ok(self, op: Op):
        if op.pred is None:
            return True
        p = _CONST_PRED.get(op.pred[0], self.regs.get(op.pred[0]))
        if p is None:
            return None
        return (not p) if op.pred[1] else bool(p)

    # -- semaphores and DMAs
    def sem_key(self, opnd):
        v = self.val(opnd) if opnd[0] != "mem" else self.addr(opnd)
        return v if v is not None else ("unknown",)

    def start_dma(self, op: Op):
        size = op.named.get("size_in_granules")
        n = self.val(size) if size is not None else None
        if not isinstance(n, int):
            self.notes.add(f"{op.name} with an unknown size counted as 0 bytes")
            n = 0
        nbytes = n * GRANULE_BYTES
        start = max(self.cycle, self.pipe_free)
        self.pipe_free = start + nbytes / self.hbm.bytes_per_cycle
        done = self.pipe_free + self.hbm.latency_cycles
        sem = op.named.get("dst_syncflagno")
        self.sem_pending[self.sem_key(sem) if sem else ("none",)].append((done, n))
        self.dmas += 1
        self.dma_bytes += nbytes
        if op.name.endswith("_to_smem"):
            self.copy_to_smem(op, n)

    def copy_to_smem(self, op: Op, granules: int):
        src_opnd = op.named.get("hbm") or op.named.get("vmem")
        src = self.val(src_opnd) if src_opnd else None
        dst = self.val(op.named["smem"]) if "smem" in op.named else None
        if not (isinstance(src, Ptr) and src.base.startswith("operand") and isinstance(dst, Ptr)):
            self.notes.add("an SMEM copy from an unknown source")
            return
        data = self.operands.get(int(src.base[len("operand") :]))
        if data is None:
            self.notes.add(f"SMEM copy of {src.base}: values unknown")
            return
        if src.offset:
            self.notes.add(f"SMEM copy of part of {src.base}: values unknown")
            return
        words = _memory_words(data, granules * GRANULE_BYTES)
        if words is None:
            self.notes.add(f"SMEM copy of {src.base}: its memory layout is not one we know")
            return
        for i, v in enumerate(words):
            self.smem[Ptr(dst.base, dst.offset + i)] = int(v)

    def wait(self, op: Op):
        sem_opnd = op.args[0]
        need = self.val(op.args[1]) if len(op.args) > 1 else None
        key = self.sem_key(sem_opnd)
        pend = sorted(self.sem_pending[key])
        have = self.sem_now[key]
        t = self.cycle
        while pend and (need is None or _signed(have & _MASK) < _signed(need)):
            done, amount = pend.pop(0)
            have += amount
            t = max(t, done)
        if need is not None and _signed(have & _MASK) < _signed(need):
            self.notes.add("a DMA wait no started DMA satisfies (counted as no wait)")
        self.sem_pending[key] = pend
        self.sem_now[key] = have
        if t > self.cycle:
            self.stall += t - self.cycle
            self.cycle = t

    # -- MXU occupancy
    def _mxu_issue(self, ops: list, start: float) -> tuple[float, dict]:
        """Issues (offset, mxu, cycles) ops of a straight run beginning at
        `start`; returns the stall they cause and the MXUs' new drain times."""
        free = dict(self.mxu_free)
        stall = 0.0
        q = self.mxu.queue
        for off, x, c in ops:
            t = start + off + stall
            f = free.get(x, 0.0)
            if f - t > q * c:  # its queue is full: wait until it takes one
                stall += f - t - q * c
                t = f - q * c
            free[x] = max(f, t) + c
        return stall, free

    def mxu_run(self, pc: int, ops: list) -> float:
        """Stall of a run of bundles at pc (its matmul ops `ops`), memoized on
        the MXUs' backlog when the run starts: loops repeat the same state."""
        t0 = self.cycle
        key = (pc,) + tuple(
            sorted((x, max(0.0, f - t0)) for x, f in self.mxu_free.items() if f > t0)
        )
        hit = self._mxu_memo.get(key)
        if hit is None:
            stall, free = self._mxu_issue(ops, t0)
            hit = (stall, tuple((x, f - t0) for x, f in free.items()))
            if len(self._mxu_memo) < 200_000:
                self._mxu_memo[key] = hit
        stall, rel = hit
        for x, f in rel:
            self.mxu_free[x] = t0 + f
        self.mxu_stall += stall
        return stall

    # -- scalar ALU
    def alu(self, op: Op):
        n = op.name
        a = [self.val(x) for x in op.args]
        ints = all(isinstance(x, int) for x in a)
        if n.startswith("smov") or n.startswith("int_to_ptr"):
            return a[-1] if a else None
        if n.startswith("scalar_lea"):
            base, idx = a[0], (a[1] if len(a) > 1 else 0)
            if isinstance(base, Ptr) and isinstance(idx, int):
                return Ptr(base.base, base.offset + _signed(idx), base.scale)
            if isinstance(base, int) and isinstance(idx, int):
                return (base + idx) & _MASK
            return None
        if n == "scalar_select":
            p = a[0]
            if p is None:
                return None
            return a[1] if p else a[2]
        if n.startswith("scmp."):
            if not ints:
                if (
                    len(a) == 2
                    and isinstance(a[0], Ptr)
                    and isinstance(a[1], Ptr)
                    and a[0].base == a[1].base
                ):
                    x, y = a[0].offset, a[1].offset
                else:
                    return None
            else:
                x, y = a
                if ".s32" in n:
                    x, y = _signed(x), _signed(y)
            cmp = n.split(".")[1]
            return {
                "eq": x == y,
                "ne": x != y,
                "lt": x < y,
                "le": x <= y,
                "gt": x > y,
                "ge": x >= y,
            }[cmp]
        if n in ("por", "pand", "pnand", "pnor", "pxor", "pneg", "pmov"):
            if n in ("pand", "pnand") and any(x is not None and not x for x in a[:2]):
                return n == "pnand"  # one known false operand decides it
            if n in ("por", "pnor") and any(x is not None and bool(x) for x in a[:2]):
                return n == "por"  # one known true operand decides it
            if any(x is None for x in a):
                return None
            if n == "pneg":
                return not a[0]
            if n == "pmov":
                return bool(a[0])
            x, y = bool(a[0]), bool(a[1])
            return {
                "por": x or y,
                "pand": x and y,
                "pnand": not (x and y),
                "pnor": not (x or y),
                "pxor": x != y,
            }[n]
        if n.startswith("sld"):
            if "core id" in op.text:  # one TensorCore per device: always core 0
                return 0
            addr = self.addr(op.args[0])
            if addr is None:
                return None
            return self.smem.get(addr)
        if (
            n.startswith(("sshll", "sshrl"))
            and len(a) == 2
            and isinstance(a[0], Ptr)
            and isinstance(a[1], int)
        ):
            # an address changing units (words <-> bytes) stays the same address
            sh = a[1] & 31
            off = a[0].offset << sh if n.startswith("sshll") else a[0].offset >> sh
            return Ptr(a[0].base, off, a[0].scale + (sh if n.startswith("sshll") else -sh))
        if not ints:
            return None
        x = a[0]
        y = a[1] if len(a) > 1 else 0
        base = n.split(".")[0]
        if base == "sadd":
            return (x + y) & _MASK
        if base == "ssub":
            return (x - y) & _MASK
        if base == "smul":
            return (x * y) & _MASK
        if base == "smulhi":  # high word of the product (division by constants)
            if ".s32" in n:
                return ((_signed(x) * _signed(y)) >> 32) & _MASK
            return ((x * y) >> 32) & _MASK
        if base == "sand":
            return x & y
        if base == "sor":
            return x | y
        if base == "sxor":
            return x ^ y
        if base == "sshll":
            return (x << (y & 31)) & _MASK
        if base == "sshrl":
            return x >> (y & 31)
        if base == "sshra":
            return (_signed(x) >> (y & 31)) & _MASK
        if base in ("smin", "smax"):
            sx, sy = (_signed(x), _signed(y)) if ".s32" in n else (x, y)
            return (min if base == "smin" else max)(sx, sy) & _MASK
        if base in ("sdiv", "srem") and y:
            sx, sy = (_signed(x), _signed(y)) if ".s32" in n else (x, y)
            q = int(sx / sy)
            return (q if base == "sdiv" else sx - q * sy) & _MASK
        self.notes.add(f"scalar op {n} not modeled (result unknown)")
        return None

    def run(self) -> Result:
        bundles = self.b
        nb = len(bundles)
        # Bundles with only vector work change no scalar state: a run of them is
        # stepped over at once (counted through a difference array).
        live = [
            [o for o in bd.ops if not (o.name.startswith("v") and not o.name.startswith("vsync"))]
            for bd in bundles
        ]
        next_live = [nb] * (nb + 1)
        for i in range(nb - 1, -1, -1):
            next_live[i] = i if live[i] else next_live[i + 1]
        mx = [_mxu_ops(bd, self.mxu) for bd in bundles]
        own_ops = [[(0, x, c) for x, c in m] for m in mx]  # a live bundle's, as a run of one
        run_ops: dict = {}  # start of a vector-only run -> its matmul ops
        for i in range(nb):
            if not live[i] and (i == 0 or live[i - 1]):
                run_ops[i] = [(j - i, x, c) for j in range(i, next_live[i]) for x, c in mx[j]]
        self.stall_at = collections.Counter()  # bundle -> MXU stall cycles charged there
        diff = [0] * (nb + 1)
        pc = 0
        jump_to = None
        delay = 0
        issued = 0
        while 0 <= pc < nb:
            if not live[pc] and jump_to is None:
                k = next_live[pc]
                step = k - pc
                diff[pc] += 1
                diff[k] -= 1
                issued += step
                ops = run_ops.get(pc)
                if ops is None:  # entered mid-run (a branch target)
                    ops = run_ops[pc] = [(j - pc, x, c) for j in range(pc, k) for x, c in mx[j]]
                if ops:
                    s = self.mxu_run(pc, ops)
                    if s:
                        self.stall_at[pc] += s
                        self.cycle += s
                self.cycle += step
                pc = k
                continue
            diff[pc] += 1
            diff[pc + 1] -= 1
            issued += 1
            if mx[pc]:
                s = self.mxu_run(-pc - 1, own_ops[pc])
                if s:
                    self.stall_at[pc] += s
                    self.cycle += s
            self.cycle += 1
            if issued > self.max_bundles:
                self.notes.add(f"stopped after {self.max_bundles} bundles")
                break
            writes = []
            branch_taken = None
            for op in live[pc]:
                n = op.name
                if n == "sphi" or n.startswith("inlined_call_operand"):
                    if n.startswith("inlined_call_operand"):
                        idx = re.search(r"index: (\d+)", op.text)
                        i = int(idx.group(1)) if idx else -1
                        if "<no memory space>" in op.text:
                            data = self.operands.get(i)
                            writes.append(
                                (
                                    op.dst,
                                    int(np.asarray(data).reshape(-1)[0]) & _MASK
                                    if data is not None
                                    else None,
                                )
                            )
                        else:
                            writes.append((op.dst, Ptr(f"operand{i}")))
                    continue
                ok = self.pred_ok(op)
                if n == "sbr.rel":
                    if ok is None:
                        self.unknown_branches += 1
                        ok = False
                    if ok:
                        branch_taken = _branch_target(op, self.region_at)
                    continue
                if ok is False:
                    if op.keep is not None and op.dst:
                        writes.append((op.dst, self.val(op.keep)))
                    continue
                if n.startswith("dma.done.wait"):
                    self.wait(op)
                    continue
                if n.startswith("dma."):
                    self.start_dma(op)
                    continue
                if n == "vsyncadd":
                    key = self.sem_key(op.args[0])
                    amt = self.val(op.args[1])
                    if isinstance(amt, int):
                        self.sem_now[key] += _signed(amt)
                    continue
                if n == "sst":
                    addr = self.addr(op.args[0])
                    v = self.val(op.args[1]) if len(op.args) > 1 else None
                    if addr is not None:
                        self.smem[addr] = v
                    continue
                if op.dst is None:
                    continue
                if n.startswith("int_to_ptr") and op.args and op.args[-1][0] == "reg":
                    # a type cast, not an instruction: it sees a value written in the
                    # same bundle
                    src = op.args[-1][1]
                    fresh = [v for r, v in writes if r == src]
                    writes.append((op.dst, fresh[-1] if fresh else self.regs.get(src)))
                    continue
                writes.append((op.dst, self.alu(op) if ok else None))
            for r, v in writes:
                if r:
                    self.regs[r] = v
            if jump_to is not None:  # in a taken branch's delay slots
                delay -= 1
                if delay <= 0:
                    pc, jump_to = jump_to, None
                    continue
            elif branch_taken is not None:
                if self.delay[pc] == 0:
                    pc = branch_taken
                    continue
                jump_to, delay = branch_taken, self.delay[pc]
            pc += 1
        counts, c = [], 0
        for d in diff[:nb]:
            c += d
            counts.append(c)
        loops = _loop_stats(bundles, counts, self.delay, self.stall_at, mx)
        return Result(
            self.cycle,
            issued,
            self.stall,
            self.dmas,
            self.dma_bytes,
            loops,
            self.unknown_branches,
            sorted(self.notes),
            self.mxu_stall,
            issued > self.max_bundles,
        )


def _capacities(bundles: Iterable[Bundle]) -> dict:
    """Ops of each slot class one bundle can hold: the most this schedule ever
    packs into one bundle (the compiler fills slots when it can)."""
    cap = collections.Counter()
    for bd in bundles:
        c = collections.Counter(slot_of(o.name) for o in bd.ops)
        for k, v in c.items():
            cap[k] = max(cap[k], v)
    return cap


def _loop_stats(
    bundles: list[Bundle],
    counts: list[int],
    delays: list[int],
    stall_at: dict | None = None,
    mx: list | None = None,
) -> list[LoopStat]:
    """mx: each bundle's matmul ops as (MXU, cycles) (`_mxu_ops`), or None."""
    region_at = _region_at(bundles)
    spans = []
    for i, bd in enumerate(bundles):
        if bd.branch is None:
            continue
        t = _branch_target(bd.branch, region_at)
        if t is not None and t <= i:
            spans.append((t, min(i + delays[i], len(bundles) - 1)))
    spans = sorted(set(spans), key=lambda s: s[1] - s[0])
    owner = [None] * len(bundles)
    for k, (a, e) in enumerate(spans):  # innermost first
        for i in range(a, e + 1):
            if owner[i] is None:
                owner[i] = k
    cap = _capacities(bundles)
    out = []
    for k, (a, e) in enumerate(spans):
        own = [i for i in range(a, e + 1) if owner[i] == k]
        slots = collections.Counter()
        busy = collections.Counter()
        for i in own:
            slots.update(slot_of(o.name) for o in bundles[i].ops)
            for x, c in mx[i] if mx else ():
                busy[x] += c
        floors = {s: slots[s] / cap[s] for s in slots if cap[s]}
        if busy:  # the busiest MXU's cycles: a floor no slot count shows
            slots["mxu_cycles"] = max(busy.values())
            floors["mxu_cycles"] = float(slots["mxu_cycles"])
        binding = max(floors, key=floors.get) if floors else "scalar"
        out.append(
            LoopStat(
                bundles[a].addr,
                bundles[e].addr,
                len(own),
                counts[a],
                sum(counts[i] for i in own) + round(sum((stall_at or {}).get(i, 0) for i in own)),
                dict(slots),
                binding,
                floors.get(binding, 0.0),
            )
        )
    out.sort(key=lambda l: -l.cycles)
    return out


# A causal 32k flash attention backward launch issues ~80M bundles; the
# executor runs ~1.5M a second on the project's machine.
MAX_BUNDLES = 400_000_000


def simulate(
    text: str, operands: dict, hbm: HbmModel, generation: str, max_bundles: int = MAX_BUNDLES
) -> Result:
    """Executes one kernel's final bundles.

    operands: custom-call operand index -> flat integer values, for the
    operands the kernel reads into SMEM or scalar registers (scalar prefetch);
    others may be absent.
    """
    from torch_bindings import tpu_info

    mxu = MxuModel(tpu_info.facts(generation).mxu_rows_per_cycle)
    return _Machine(parse(text), operands, hbm, max_bundles, DELAY_RULE[generation], mxu).run()
