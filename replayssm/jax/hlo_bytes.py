"""Bytes a compiled XLA program moves, read from its optimized HLO text, loops counted.

XLA's own ``compiled.cost_analysis()["bytes accessed"]`` counts the body of a ``while`` once
(a 64-layer ``lax.scan`` reads as one layer), so a decode step's number says little about the
layers.  :func:`hlo_bytes` walks the optimized module instead: every instruction of a
sequential computation (the entry, loop bodies and conditions, conditional branches, calls)
counts the bytes of its operands and its result, a ``while`` counts its body ``n`` times
when XLA knows the trip count ``n`` (``known_trip_count``, as it does for every ``lax.scan``)
and a ``conditional`` its most expensive branch.  Inside a fusion, an operand read only through
(dynamic-)slices or gathers counts the slices' bytes, and a result written in place
(a root ``dynamic-update-slice`` / ``scatter`` into an operand) counts the update's bytes:
the rules of XLA's own per-fusion utilisation, simplified.  ``copy`` instructions are listed
apart (:attr:`HloBytes.copies`): a copy of a cache-sized buffer each step is the classic
sign of an update that could not be done in place.

Used by :mod:`replayssm.jax.costs` (``python -m replayssm.jax.costs``); no device needed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["HloBytes", "hlo_bytes", "shape_bytes"]

_DT = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
       "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DT, key=len, reverse=True)) + r")\[([0-9,]*)\]")
_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
         "partition-id", "replica-id", "iota"}
_SLICERS = {"dynamic-slice", "slice", "gather"}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (a tuple: the sum of its arrays)."""
    total = 0
    for dt, dims in _ARRAY.findall(shape):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * _DT[dt]
    return total


@dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: list
    attrs: str
    root: bool

    @property
    def nbytes(self) -> int:
        return shape_bytes(self.shape)


def _split_operands(rest: str) -> tuple[list, str]:
    """``rest`` = text after ``op(``: the operand names and the attribute text after ``)``."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    inner, attrs = rest[:i - 1], rest[i:]
    return re.findall(r"%([\w.\-]+)", inner), attrs


def _parse(text: str) -> tuple[dict, str]:
    comps: dict = {}
    entry = cur = None
    for line in text.splitlines():
        m = _HEAD.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
            continue
        if cur is None or line.startswith("}"):
            continue
        m = _INSTR.match(line)
        if m:
            ops, attrs = _split_operands(m.group(5))
            comps[cur].append(_Instr(m.group(2), m.group(3), m.group(4), ops, attrs, bool(m.group(1))))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _attr(attrs: str, key: str):
    m = re.search(key + r"=%?([\w.\-]+)", attrs)
    return m and m.group(1)


@dataclass
class HloBytes:
    """``total``: bytes per call; ``rows``: ``(bytes, times, op, shape, where)`` per
    instruction (``bytes`` already multiplied by ``times``, the loop trip counts around it);
    ``copies``: the ``copy`` rows."""

    total: int = 0
    rows: list = field(default_factory=list)

    @property
    def copies(self) -> list:
        return [r for r in self.rows if r[2] == "copy"]

    def top(self, k: int = 15) -> list:
        return sorted(self.rows, key=lambda r: -r[0])[:k]


def _fusion_bytes(ins: _Instr, fused: list, by_name: dict) -> int:
    """Operand and result bytes of one fusion instruction (see the module docstring)."""
    users: dict = {}
    for f in fused:
        for o in f.operands:
            users.setdefault(o, []).append(f)
    root = next((f for f in fused if f.root), fused[-1])
    fb = {f.name: f for f in fused}
    outs = [fb[o] for o in root.operands] if root.op == "tuple" else [root]
    inplace = {}
    for o in outs:
        while o.op == "bitcast" and o.operands[0] in fb:
            o = fb[o.operands[0]]
        if o.op in ("dynamic-update-slice", "scatter") and o.operands and o.operands[0] in fb:
            upd = fb[o.operands[2 if o.op == "scatter" else 1]]
            inplace[o.operands[0]] = upd.nbytes
    total = 0
    for o in outs:
        base = o
        while base.op == "bitcast" and base.operands[0] in fb:
            base = fb[base.operands[0]]
        tgt = base.operands[0] if base.op in ("dynamic-update-slice", "scatter") and base.operands else None
        total += inplace[tgt] if tgt in inplace else o.nbytes
    def through_bitcasts(name):   # (user, the operand it reads) of a value, through bitcasts
        out = []
        for u in users.get(name, []):
            out.extend(through_bitcasts(u.name) if u.op == "bitcast" else [(u, name)])
        return out

    for f in fused:
        if f.op != "parameter":
            continue
        us = users.get(f.name, [])
        viewed = through_bitcasts(f.name)
        if f.name not in inplace and viewed and all(u.op in _SLICERS and u.operands[0] == src for u, src in viewed):
            total += sum(u.nbytes for u, _ in viewed)   # only the slices are read
            continue
        if f.name in inplace and all(u.op in ("dynamic-update-slice", "scatter", "dynamic-slice") and u.operands[0] == f.name
                                     for u in us):
            total += sum(u.nbytes for u in us if u.op == "dynamic-slice")   # read-modify-write of the slice
        elif us and all(u.op in _SLICERS and u.operands[0] == f.name for u in us):
            total += sum(u.nbytes for u in us)
        else:
            total += f.nbytes
    return total


def hlo_bytes(text: str) -> HloBytes:
    """:class:`HloBytes` of an optimized HLO module (``compiled.as_text()``)."""
    comps, entry = _parse(text)
    out = HloBytes()

    def walk(name: str, times: int, where: str) -> int:
        total = 0
        by_name = {i.name: i for i in comps[name]}
        for ins in comps[name]:
            if ins.op in _FREE:
                continue
            if ins.op == "while":
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
                n = int(m.group(1)) if m else 1
                b = walk(_attr(ins.attrs, "body"), times * n, where + f"/while×{n}")
                b += walk(_attr(ins.attrs, "condition"), times * n, where + f"/cond×{n}")
                total += b * n
                continue
            if ins.op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
                names = re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else \
                    [_attr(ins.attrs, "true_computation"), _attr(ins.attrs, "false_computation")]
                total += max(walk(b, times, where + "/branch") for b in names if b)
                continue
            if ins.op == "call":
                total += walk(_attr(ins.attrs, "to_apply"), times, where + "/call")
                continue
            if ins.op == "fusion":
                b = _fusion_bytes(ins, comps[_attr(ins.attrs, "calls")], by_name)
            elif ins.op == "dynamic-update-slice":
                b = 2 * by_name[ins.operands[1]].nbytes if ins.operands[1] in by_name else ins.nbytes
            elif ins.op == "scatter":
                b = 2 * by_name[ins.operands[2]].nbytes if ins.operands[2] in by_name else ins.nbytes
            elif ins.op in _SLICERS:
                b = 2 * ins.nbytes
            else:
                b = ins.nbytes + sum(by_name[o].nbytes for o in ins.operands if o in by_name)
            meta = re.search(r'op_name="([^"]*)"', ins.attrs)
            out.rows.append((b * times, times, ins.op, ins.shape.split("{")[0][:80],
                             f"{where}:{ins.name} {meta.group(1)[-70:] if meta else ''}"))
            total += b
        return total

    out.total = walk(entry, 1, "entry")
    return out
