"""Decode tokens/s of ``bench e2e`` runs side by side, one panel per preset (PNG): e.g. the
same workload before and after a change, measured in one device session.

Each argument is ``label=path/to/e2e.json``; runs are grouped by their preset, and each
(mode, batch) of a run (plain recurrent, plain replay, replay speculation) is one bar, labelled
with its tokens/s.  Usage::

    python3 scripts/plot_before_after.py before=old/e2e.json after=new/e2e.json --out e2e.png
"""

from __future__ import annotations

import argparse
import json


def bars(run: dict) -> dict[str, float]:
    """``{"<mode> B=<batch>": decode tokens/s}`` of a run (plain modes, then speculation)."""
    out = {}
    for r in run["throughput"]:
        out[f"{r['mode']} B={r['batch']}"] = r["decode_tokens_per_s"]
    for r in run.get("speculative") or []:
        out[f"{r['mode']} spec B={r['batch']}"] = r["decode_tokens_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="label=e2e.json")
    ap.add_argument("--out", default="e2e_before_after.png")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_preset: dict[str, list[tuple[str, dict]]] = {}
    for arg in args.runs:
        label, _, path = arg.partition("=")
        if not path:
            raise SystemExit(f"expected label=path, got {arg!r}")
        with open(path) as f:
            run = json.load(f)
        by_preset.setdefault(run["config"].get("preset") or run["config"].get("model"), []).append((label, bars(run)))
    fig, axes = plt.subplots(1, len(by_preset), figsize=(7 * len(by_preset), 4.5), squeeze=False)
    for ax, (preset, runs) in zip(axes[0], by_preset.items()):
        keys = list(dict.fromkeys(k for _, b in runs for k in b))
        width = 0.8 / len(runs)
        for i, (label, b) in enumerate(runs):
            xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(keys))]
            vals = [b.get(k, 0.0) for k in keys]
            rects = ax.bar(xs, vals, width, label=label)
            ax.bar_label(rects, labels=[f"{v / 1e3:.1f}k" if v else "" for v in vals], fontsize=7, padding=1)
        ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(preset)
        ax.legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
