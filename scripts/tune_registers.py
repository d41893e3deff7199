"""Registers, spills and shared memory of every kernel launch, without a GPU.

Runs the kernel wrappers on small CPU tensors with every ``kernel[grid](...)`` launch
intercepted: each launch is compiled for ``sm_90`` (Triton's own ptxas) instead of run, and
``cuobjdump --dump-resource-usage`` reads the cubin.  ``SPILL`` (stack + local bytes per
thread) > 0 means spilled registers;
with ``REG`` near 255 occupancy collapses (the lesson of the Mamba-2 verify kernel).  The
local Triton may be newer than the device's, so treat the figures as a guide and confirm
with Nsight Compute on the GPU (``scripts/ncu_verify.py``).

    python scripts/tune_registers.py [--only decode,verify]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import torch

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from replayssm.bench.kernels import (GDN_SHAPE, M2_SHAPE, _ring, _set_fill, gdn_inputs, gdn_setup,  # noqa: E402
                                     m2_inputs, m2_setup)
from replayssm.cache.conv import ConvWindow  # noqa: E402
from replayssm.kernels import conv, norm  # noqa: E402
from replayssm.kernels import gdn as kg  # noqa: E402
from replayssm.kernels import mamba2 as km  # noqa: E402

_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
        torch.int32: "*i32", torch.bool: "*i1", torch.int8: "*i8"}
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_seen: dict = {}
rows: list = []


def _sig(v) -> str:
    if isinstance(v, torch.Tensor):
        return _PTR[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2 ** 31) <= v < 2 ** 31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"argument {v!r}")


def _usage(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    return {kv.split(":")[0]: int(kv.split(":")[1]) for kv in line.split() if ":" in kv and kv.split(":")[1].isdigit()}


def _compile(fn: JITFunction, args, kwargs, tag: str) -> None:
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    names = fn.arg_names
    bound = dict(zip(names, args))
    bound.update(kwargs)
    const_names = [p.name for p in fn.params if p.is_constexpr or bound.get(p.name, p.default) is None]
    for p in fn.params:   # defaulted arguments not passed (None pointers are constexpr)
        bound.setdefault(p.name, p.default)
    sig = {n: ("constexpr" if n in const_names else _sig(bound[n])) for n in names}
    consts = {(names.index(n),): bound[n] for n in const_names}
    key = (fn.__name__, tuple(sorted((k, str(v)) for k, v in consts.items())), tuple(sorted(opts.items())))
    if key in _seen:
        return
    cc = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                        options=opts)
    u = _usage(cc.asm["cubin"])
    flags = {n: bound[n] for n in const_names if isinstance(bound[n], (bool, int, str))}
    _seen[key] = u
    rows.append((tag, fn.__name__, opts.get("num_warps", 4), u.get("REG"), u.get("STACK", 0) + u.get("LOCAL", 0),
                 u.get("SHARED"), flags))


def intercept(tag_ref: list):
    def getitem(self, grid):
        return lambda *a, **kw: _compile(self, a, dict(kw), tag_ref[0])
    JITFunction.__getitem__ = getitem


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="decode,verify,other")
    args = ap.parse_args()
    tag = ["-"]
    intercept(tag)
    Bt, L, dt = 2, 16, torch.bfloat16
    slots = torch.arange(1, Bt + 1)
    ring = _ring(Bt + 1, L, "cpu")
    _set_fill(ring, slots, 3)
    plan = ring.plan_decode(slots)
    only = args.only.split(",")
    if "decode" in only:
        for fam, s, setup, inputs, mod, tiles in (
                ("mamba2", M2_SHAPE, m2_setup, m2_inputs, km, [dict(block_d=bd, num_warps=w) for bd, w in
                                                               ((32, 2), (64, 2), (64, 4))]),
                ("gdn", GDN_SHAPE, gdn_setup, gdn_inputs, kg, [dict(block_v=bv, num_warps=w) for bv, w in
                                                               ((32, 1), (32, 2), (64, 2))])):
            buf = setup(Bt, L, s, "cpu", dt)
            inp = inputs(Bt, s, "cpu", dt)
            for t in tiles:
                for mode in getattr(mod, "FLUSH_MODES", (None,)):
                    for pre in (False, True):
                        for fold in ("dot", "fma") if mode != "split" else ("dot",):
                            tag[0] = f"{fam} decode {mode or ''} {fold} pre={pre} {t}"
                            kw = dict(flush_mode=mode) if mode else {}
                            mod.replay_decode(buf, plan, **inp, pre_scores=pre, fold_form=fold, **kw, **t)
    if "verify" in only:
        for T in (1, 2, 4, 6):
            vplan = ring.plan_verify(slots, T, "verify")
            buf = m2_setup(Bt, L, M2_SHAPE, "cpu", dt)
            inp = m2_inputs(Bt, M2_SHAPE, "cpu", dt, T)
            for t in (dict(block_d=64, num_warps=2), dict(block_d=32, num_warps=2)):
                tag[0] = f"mamba2 verify T={T} {t}"
                km.replay_verify(buf, vplan, **inp, **t)
            buf = gdn_setup(Bt, L, GDN_SHAPE, "cpu", dt)
            inp = gdn_inputs(Bt, GDN_SHAPE, "cpu", dt, T)
            for t in (dict(impl="rows"), dict(impl="rows", block_v=64, num_warps=2), dict(impl="dot"),
                      dict(impl="dot", block_v=32, num_warps=2), dict(impl="dot", block_v=64, num_warps=2)):
                tag[0] = f"gdn verify T={T} {t}"
                kg.replay_verify(buf, vplan, **inp, **t)
    if "other" in only:
        for N, group, gate_first in ((5120, 5120, True), (128, 128, False)):
            tag[0] = f"gated norm N={N} group={group}"
            x = torch.randn(4, N, dtype=dt)
            norm.gated_rmsnorm(x, x, torch.ones(N, dtype=dt), 1e-6, group, gate_first)
        win = ConvWindow.allocate(Bt, 4096, 4, dtype=dt)
        tag[0] = "conv decode / verify / commit"
        conv.conv_decode(win, slots, torch.randn(Bt, 4096, dtype=dt), torch.randn(4096, 4), activation="silu")
        conv.conv_verify(win, slots, torch.randn(Bt, 4, 4096, dtype=dt), torch.randn(4096, 4), activation="silu")
        conv.conv_commit(win, slots, torch.randn(Bt, 4, 4096, dtype=dt), torch.ones(Bt, dtype=torch.long))
        for fam, s, mod, inputs in (("mamba2", M2_SHAPE, km, m2_inputs), ("gdn", GDN_SHAPE, kg, gdn_inputs)):
            tag[0] = f"{fam} recurrent / snapshot"
            pool = torch.randn(Bt + 1, *((s["H"], s["d"], s["n"]) if fam == "mamba2" else (s["HV"], s["K"], s["V"])))
            mod.recurrent_update(pool, **inputs(Bt, s, "cpu", dt), slot=slots)
            mod.snapshot_verify(pool, slots, **inputs(Bt, s, "cpu", dt, 4))
    print(f"{'launch':<62} {'kernel':<28} {'warps':>5} {'REG':>4} {'SPILL':>5} {'SHARED':>6}")
    for tg, name, w, reg, loc, sh, _flags in rows:
        print(f"{tg[:62]:<62} {name[:28]:<28} {w:>5} {reg:>4} {loc:>5} {sh:>6}")


if __name__ == "__main__":
    main()
