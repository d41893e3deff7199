"""Prefill benchmark: our packed (varlen) chunked-scan kernels vs the peers' prefill kernels.

``python -m replayssm bench prefill [--smoke] [--out DIR]`` (``replayssm bench prefill``).

For each family and shape (batch × tokens; default 1×8192, 16×2048, 64×512, 4×32768) one
run builds random bf16 inputs with nonzero fp32 initial states and times, with
``triton.testing.do_bench`` (median):

* **ours**: :func:`replayssm.kernels.mamba2_prefill.chunked_prefill_varlen` /
  :func:`replayssm.kernels.gdn_prefill.chunked_prefill_varlen` on the packed token stream
  (``cu_seqlens``), final states returned;
* **peer**: ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` (chunk 256, as the
  2.7B checkpoints) and fla ``chunk_gated_delta_rule`` (l2-norm in kernel), on the padded
  ``[B, T]`` layout they take, with final states; imported only if present;
* **ref**: the reference op ``chunked_prefill`` (fp32 math; what prefill ran before the
  kernels) and **compiled**: ``torch.compile`` of it (GDN: of one chunk step, the loop over
  chunks stays in Python — compiling the unrolled loop is impractical).

Final states (and outputs) of ours and of the peers are checked against the reference's
fp32 result: relative Frobenius error, bound ``TOL`` (the bf16 bound of the decode-kernel
tests).  A short table is printed last; ``prefill.json`` and ``prefill.png`` go to ``--out``.
Families: ``mamba2`` (2.7B: 80 heads × 64, d_state 128, 1 group), ``mamba2_g8`` (the bench
preset: 128 heads, 8 groups), ``gdn`` (HV=32, H=16, K=V=128).

``--smoke`` runs tiny fp32 shapes (on the GPU when there is one, else on CPU: the Triton interpreter when ``TRITON_INTERPRET=1``)
and checks correctness; CI uses it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from ..kernels import _triton
from ..kernels.dispatch import KernelOps
from ..ops import delta_rule
from ..ops.gdn import naive as gdn_naive
from ..ops.mamba2 import naive as mamba2_naive
from .kernels import _fla_prepare, _mamba_ssm_prepare, load_peers

FAMILIES = {
    "mamba2": dict(H=80, d=64, n=128, G=1),
    "mamba2_g8": dict(H=128, d=64, n=128, G=8),
    "gdn": dict(HK=16, HV=32, K=128, V=128),
}
SMOKE = {"mamba2": dict(H=3, d=8, n=16, G=1), "mamba2_g8": dict(H=4, d=8, n=16, G=2),
         "gdn": dict(HK=1, HV=2, K=16, V=16)}
SHAPES = [(1, 8192), (16, 2048), (64, 512), (4, 32768)]
SMOKE_SHAPES = [(1, 37), (3, 20)]
SMOKE_FAMILIES = ("mamba2", "gdn")
#: other kernel settings timed beside the defaults on CUDA (``--no-variants`` skips them)
VARIANTS = {
    "mamba2": [dict(block_t=64, block_d=32), dict(block_t=64, block_d=64), dict(block_t=32, block_d=32),
               dict(block_t=32, block_d=64), dict(block_t=64, block_d=64, precompute_cb=False)],
    "gdn": [dict(block_v=32), dict(block_v=64), dict(block_v=16), dict(inv=0), dict(inv=1)],
}
VARIANTS["mamba2_g8"] = VARIANTS["mamba2"]
TOL = 2e-2  # relative error bound for bf16 (decode-kernel tests' bf16 tolerance)
PEER_CHUNK = 256  # mamba_ssm chunk size of the Mamba-2 checkpoints


# ============================================================================== peers
PREFILL_PEERS = (
    ("mamba_ssm", ["mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"],
     "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined", _mamba_ssm_prepare),
    ("fla", ["fla", "fla.ops", "fla.ops.gated_delta_rule"],
     "fla.ops.gated_delta_rule.chunk", "chunk_gated_delta_rule", _fla_prepare),
)


def load_prefill_peers(root: str | None = None) -> dict:
    """The prefill peers, if present (installed, or source folders under ``root``, default
    ``$REPLAYSSM_PEERS`` or ``.peers``): ``{"mamba_ssm": fn, "fla": fn}`` plus ``*_error``
    entries for peers that are present but fail to import."""
    root = root or os.environ.get("REPLAYSSM_PEERS", ".peers")
    if os.path.isdir(os.path.join(root, "einops")) and root not in sys.path:
        try:
            importlib.import_module("einops")
        except ImportError:
            sys.path.insert(0, root)  # einops is pure Python: import it from the peers folder
    return load_peers(root, PREFILL_PEERS)


# ============================================================================== inputs
def m2_case(Bt: int, T: int, s: dict, device, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """Random Mamba-2 inputs on the padded ``[Bt, T]`` layout (views of one packed stream)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    H, d, n, G = s["H"], s["d"], s["n"], s["G"]

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    x = r(Bt, T, H, d).to(dtype)
    dt = F.softplus(r(Bt, T, H) - 1.0)  # Δ after softplus, fp32
    A = -torch.exp(r(H) * 0.5)
    B = r(Bt, T, G, n, scale=n ** -0.5).to(dtype)
    C = r(Bt, T, G, n, scale=n ** -0.5).to(dtype)
    D = r(H)
    S0 = r(Bt, H, d, n, scale=0.1)
    cu = torch.arange(0, Bt * T + 1, T, device=device, dtype=torch.int32)
    return dict(x=x, dt=dt, A=A, B=B, C=C, D=D, S0=S0, cu=cu)


def gdn_case(Bt: int, T: int, s: dict, device, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """Random GDN inputs (raw q/k: l2-normalised inside) on the padded ``[Bt, T]`` layout."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    HK, HV, K, V = s["HK"], s["HV"], s["K"], s["V"]

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    q = r(Bt, T, HK, K).to(dtype)
    k = r(Bt, T, HK, K).to(dtype)
    v = r(Bt, T, HV, V).to(dtype)
    gg = -torch.exp(r(HV) * 0.5 - 1.0) * F.softplus(r(Bt, T, HV))  # log-decay <= 0, fp32
    beta = torch.sigmoid(r(Bt, T, HV))
    S0 = r(Bt, HV, K, V, scale=0.1)
    cu = torch.arange(0, Bt * T + 1, T, device=device, dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=gg, beta=beta, S0=S0, cu=cu)


def packed(t):
    """``[Bt, T, ...] -> [Bt*T, ...]`` (a view)."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


# ============================================================================== callers
def ours_backend(device: str) -> str:
    """``"triton"`` where the kernels can run (CUDA, or CPU under the interpreter), else ``"naive"``."""
    return "triton" if _triton.usable(torch.empty(0, device=device)) else "naive"


def ours(fam: str, c: dict, backend: str = "triton", **kw):
    """Our packed prefill (``KernelOps(family).chunked_prefill_varlen``) on the flat token
    stream; returns ``(y [Bt,T,...], final)``."""
    if fam.startswith("mamba2"):
        y, S = KernelOps("mamba2", backend).chunked_prefill_varlen(
            packed(c["x"]), packed(c["dt"]), c["A"], packed(c["B"]), packed(c["C"]), c["D"], cu_seqlens=c["cu"],
            initial_state=c["S0"], check=False, **kw)
        return y.view_as(c["x"]), S
    y, S = KernelOps("gdn", backend).chunked_prefill_varlen(
        packed(c["q"]), packed(c["k"]), packed(c["v"]), packed(c["g"]), packed(c["beta"]), cu_seqlens=c["cu"],
        initial_state=c["S0"], check=False, **kw)
    return y.view_as(c["v"]), S


def reference(fam: str, c: dict, compiled=None):
    """The reference ``chunked_prefill`` (fp32 math) on the padded layout (or ``compiled``)."""
    if fam.startswith("mamba2"):
        f = compiled or mamba2_naive.chunked_prefill
        return f(c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], initial_state=c["S0"], chunk_size=64,
                 check=False)
    if compiled is not None:
        return compiled(c)
    return gdn_naive.chunked_prefill(c["q"], c["k"], c["v"], c["g"], c["beta"], initial_state=c["S0"], chunk_size=64)


def gdn_compiled_reference():
    """The reference GDN chunk loop with its per-chunk step under ``torch.compile``."""

    def chunk_step(St, qc, kc, vc, gc, bc):
        Gc = gc.cumsum(1)
        hk, hq = delta_rule._state_readout(St, kc), delta_rule._state_readout(St, qc)
        mask = delta_rule._chain_mask(qc.shape[0], qc.shape[1], qc.device)
        U, y = gdn_naive._delta_block(hk, hq, qc, kc, vc, Gc, bc, mask)
        w = torch.exp(Gc[:, -1:] - Gc)
        return y, torch.exp(Gc[:, -1])[..., None, None] * St + gdn_naive._sum_history_state(U, kc, w)

    step = torch.compile(chunk_step, dynamic=False)

    def run(c):
        qn, kn = delta_rule._prep_qk(c["q"], c["k"], torch.float32, None, True)
        v, g, b = c["v"].float(), c["g"].float(), c["beta"].float()
        St, ys = c["S0"], []
        for t0 in range(0, v.shape[1], 64):
            sl = slice(t0, t0 + 64)
            y, St = step(St, qn[:, sl], kn[:, sl], v[:, sl], g[:, sl], b[:, sl])
            ys.append(y)
        return torch.cat(ys, 1).to(c["v"].dtype), St

    return run


def peer_call(fam: str, c: dict, peers: dict):
    """The peer's prefill on the padded layout, or None when it is not installed."""
    if fam.startswith("mamba2"):
        f = peers.get("mamba_ssm")
        if f is None:
            return None
        return lambda: f(c["x"], c["dt"], c["A"], c["B"], c["C"], PEER_CHUNK, D=c["D"], initial_states=c["S0"],
                         return_final_states=True)
    f = peers.get("fla")
    if f is None:
        return None
    return lambda: f(c["q"], c["k"], c["v"], c["g"], c["beta"], initial_state=c["S0"], output_final_state=True,
                     use_qk_l2norm_in_kernel=True)


# ============================================================================== timing
def relerr(a, b) -> float:
    """``|a - b| / |b|`` (Frobenius), b the reference; NaN in a gives NaN (fp64 on CPU, fp32
    sums on the GPU, where the largest outputs hold over 10⁹ elements)."""
    dt = torch.float64 if a.device.type == "cpu" else torch.float32
    a, b = a.to(dt), b.to(dt)
    if not torch.isfinite(a).all():
        return float("nan")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def first_call(fn):
    """``(fn(), wall-clock ms)``: on CPU the first call is the timing (no repeats)."""
    t0 = time.perf_counter()
    out = fn()
    return out, 1e3 * (time.perf_counter() - t0)


def time_ms(fn, device: str, quick: bool = False) -> float:
    """Median milliseconds of ``fn()``: ``do_bench`` on CUDA (3 event-timed runs when one call
    takes over 50 ms), one wall-clock run on CPU."""
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    torch.cuda.synchronize()
    once = e0.elapsed_time(e1)
    if once > 50.0:
        ts = [once]
        for _ in range(1 if quick else 2):
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1))
        return sorted(ts)[len(ts) // 2]
    return tt.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100, return_mode="median")


# ============================================================================== run
def run_case(fam: str, Bt: int, T: int, s: dict, device: str, peers: dict, args, compiled: dict) -> dict:
    make = m2_case if fam.startswith("mamba2") else gdn_case
    c = make(Bt, T, s, device, dtype=torch.float32 if args.smoke else torch.bfloat16)
    row = {"batch": Bt, "tokens": T}
    (y_ref, S_ref), ms = first_call(lambda: reference(fam, c))
    if not args.no_ref_timing and not (args.budget is not None and time.time() - args.t0 > args.budget):
        row["ref_ms"] = ms if device != "cuda" else time_ms(lambda: reference(fam, c), device, True)
    if device == "cuda":
        torch.cuda.empty_cache()
    be = ours_backend(device)
    row["ours_backend"] = be
    (y, S), ms = first_call(lambda: ours(fam, c, be))
    row["ours_state_err"], row["ours_y_err"] = relerr(S, S_ref), relerr(y, y_ref)
    del y, S
    row["ours_ms"] = ms if device != "cuda" else time_ms(lambda: ours(fam, c, be), device, args.quick)
    call = peer_call(fam, c, peers) if device == "cuda" else None
    if call is not None:
        try:
            out = call()
            row["peer_state_err"], row["peer_y_err"] = relerr(out[-1], S_ref), relerr(out[0], y_ref)
            del out
            row["peer_ms"] = time_ms(call, device, args.quick)
            row["x_peer"] = row["peer_ms"] / row["ours_ms"]
        except Exception as exc:  # pragma: no cover - a peer failing is reported, not fatal
            row["peer_error"] = repr(exc)[:300]
    if device == "cuda" and args.variants:
        row["variants"] = []
        for kw in VARIANTS.get(fam, []):
            try:
                (yv, Sv), _ = first_call(lambda: ours(fam, c, be, **kw))
                err = max(relerr(Sv, S_ref), relerr(yv, y_ref))
                del yv, Sv
                row["variants"].append(dict(kw, ms=time_ms(lambda: ours(fam, c, be, **kw), device, True), err=err))
            except Exception as exc:  # pragma: no cover
                row["variants"].append(dict(kw, error=repr(exc)[:200]))
    late = args.budget is not None and time.time() - args.t0 > args.budget
    if late:
        row["skipped"] = "compiled reference (over --budget)"
    if args.compile and device == "cuda" and not late:
        try:
            if fam.startswith("mamba2"):
                if fam not in compiled:
                    compiled[fam] = torch.compile(mamba2_naive.chunked_prefill, dynamic=False)
                fn = compiled[fam]
            else:
                fn = compiled.setdefault(fam, gdn_compiled_reference())
            t0 = time.time()
            reference(fam, c, fn)
            row["compile_s"] = time.time() - t0
            row["compiled_ms"] = time_ms(lambda: reference(fam, c, fn), device, args.quick)
        except Exception as exc:  # pragma: no cover - compiler failures (or OOM) are reported, not fatal
            row["compiled_error"] = repr(exc)[:300]
            torch.cuda.empty_cache()
    row["ok"] = bool(row["ours_state_err"] <= TOL and row["ours_y_err"] <= TOL)
    return row


def run(args, save=None) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"  # smoke on a GPU machine: the compiled kernels
    fams = args.families.split(",") if args.families else list(SMOKE_FAMILIES if args.smoke else FAMILIES)
    unknown = [f for f in fams if f not in FAMILIES]
    if unknown:
        raise ValueError(f"--families: unknown {unknown}; choose from {', '.join(FAMILIES)}")
    try:
        shapes = SMOKE_SHAPES if args.smoke else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    except ValueError:
        raise ValueError(f"--shapes must be BxT pairs like 16x2048,4x32768, got {args.shapes!r}") from None
    if any(len(sh) != 2 or min(sh) < 1 for sh in shapes):
        raise ValueError(f"--shapes must be positive BxT pairs, got {args.shapes!r}")
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "date": _dt.date.today().isoformat(), "torch": torch.__version__, "tol": TOL, "families": {},
           "dtype": "float32" if args.smoke else "bfloat16"}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        pass
    peers = load_prefill_peers(args.peers) if device == "cuda" else {}
    out["peers"] = {k: (v if isinstance(v, str) else "ok") for k, v in peers.items()}
    for name in ("mamba_ssm", "fla"):
        if name not in peers:
            print(f"{name}: peer not installed" + ("" if device == "cuda" else " (CPU run)"))
    compiled: dict = {}
    if args.compile and device == "cuda":
        from torch import _dynamo

        _dynamo.config.cache_size_limit = 64  # one compile per (family, shape)
    for fam in fams:
        s = (SMOKE if args.smoke else FAMILIES)[fam]
        rows = []
        for Bt, T in shapes:
            try:
                row = run_case(fam, Bt, T, s, device, peers, args, compiled)
            except Exception as exc:  # pragma: no cover - e.g. out of memory at the largest shape
                row = {"batch": Bt, "tokens": T, "error": repr(exc)[:300], "ok": False, "ours_state_err": float("nan"),
                       "ours_ms": float("nan")}
                if device == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            if device == "cuda":
                torch.cuda.empty_cache()
            print(f"{fam} {Bt}x{T}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in row.items() if k not in ("batch", "tokens")),
                  flush=True)
            out["families"][fam] = {"shape": s, "rows": rows}
            if save is not None:
                save(out)
    return out


def summary(res: dict) -> list[str]:
    lines = [f"prefill on {res['device']} ({res['date']}), {res['dtype']} inputs, fp32 states; times in ms (median)",
             f"{'family':<10} {'shape':>9} {'ours':>8} {'peer':>8} {'x peer':>7} {'ref':>8} {'compiled':>9} "
             f"{'state err':>9} {'peer err':>9}  best variant (ms)"]

    def f(v, w, p=3):
        return f"{v:{w}.{p}f}" if isinstance(v, (int, float)) and v == v else f"{'-':>{w}}"

    for fam, blk in res["families"].items():
        for r in blk["rows"]:
            lines.append(f"{fam:<10} {str(r['batch']) + 'x' + str(r['tokens']):>9} {f(r['ours_ms'], 8)} "
                         f"{f(r.get('peer_ms'), 8)} {f(r.get('x_peer'), 7, 2)} {f(r.get('ref_ms'), 8)} "
                         f"{f(r.get('compiled_ms'), 9)} {r['ours_state_err']:9.1e} "
                         f"{r.get('peer_state_err', float('nan')):9.1e}  {_best_variant(r)}")
    bad = [(fam, r["batch"], r["tokens"]) for fam, blk in res["families"].items() for r in blk["rows"] if not r["ok"]]
    lines.append("correctness: " + ("all final states and outputs within %.0e of the reference" % res["tol"]
                                    if not bad else f"FAILED {bad}"))
    return lines


def _best_variant(r: dict) -> str:
    ok = [v for v in r.get("variants", []) if "ms" in v]
    if not ok:
        return ""
    b = min(ok, key=lambda v: v["ms"])
    return ",".join(f"{k}={v}" for k, v in b.items() if k not in ("ms", "err")) + f" {b['ms']:.3f}"


def plot(res: dict, outdir: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    fams = list(res["families"])
    fig, axes = plt.subplots(1, len(fams), figsize=(5 * len(fams), 4), squeeze=False)
    for ax, fam in zip(axes[0], fams):
        rows = res["families"][fam]["rows"]
        labels = [f"{r['batch']}x{r['tokens']}" for r in rows]
        kinds = [k for k in ("ours_ms", "peer_ms", "compiled_ms", "ref_ms") if any(r.get(k) for r in rows)]
        w = 0.8 / max(1, len(kinds))
        for j, k in enumerate(kinds):
            ax.bar([i + j * w for i in range(len(rows))], [r.get(k) or 0 for r in rows], w, label=k[:-3])
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(rows))], labels)
        ax.set_yscale("log")
        ax.set_ylabel("ms (median)")
        ax.set_title(fam)
        ax.legend()
    fig.tight_layout()
    p = os.path.join(outdir, "prefill.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="replayssm bench prefill", description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny fp32 run (CI): the GPU, else CPU (interpreter or naive ops)")
    ap.add_argument("--out", default=None, help="output folder (default out/bench_prefill, or $OUT/bench_prefill)")
    ap.add_argument("--families", default=None, help=f"comma-separated subset of {','.join(FAMILIES)}")
    ap.add_argument("--shapes", default=",".join(f"{b}x{t}" for b, t in SHAPES), help="batch x tokens, comma-separated")
    ap.add_argument("--peers", default=None, help="folder holding mamba_ssm/, fla/, einops/ (default .peers)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile of the reference")
    ap.add_argument("--no-ref-timing", action="store_true", help="run the reference for checks only")
    ap.add_argument("--no-variants", dest="variants", action="store_false",
                    help="time only the default kernel settings (CUDA runs also time VARIANTS)")
    ap.add_argument("--quick", action="store_true", help="shorter timing runs")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds after which the reference is no longer timed or compiled (ours and peers still are)")
    args = ap.parse_args(argv)
    args.t0 = time.time()
    outdir = args.out or (os.path.join(os.environ["OUT"], "bench_prefill") if os.environ.get("OUT")
                          else os.path.join("out", "bench_prefill"))
    os.makedirs(outdir, exist_ok=True)
    t0 = time.time()

    def save(r):
        with open(os.path.join(outdir, "prefill.json"), "w") as f:
            json.dump(r, f, indent=1, default=str)

    res = run(args, save)
    res["wall_s"] = time.time() - t0
    save(res)
    png = plot(res, outdir)
    lines = summary(res)
    print("\n".join(lines))
    print(f"wrote {outdir}/prefill.json" + (" and prefill.png" if png else "") + f" in {res['wall_s']:.1f}s")
    return 0 if all(r["ok"] for blk in res["families"].values() for r in blk["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
