"""Speedup ratios of ``bench e2e`` runs against their targets, one panel per preset (PNG).

Reads the ``e2e.json`` of one or more ``bench e2e`` runs and draws, per batch size, replay /
recurrent decoding and replay speculation / standard decoding (the run's ``summary``), with
the issue's targets as dashed lines.  Runs of the same preset with different ``--max-tokens``
are drawn side by side.  Usage::

    python3 scripts/plot_spec_ratios.py out/nemotron/e2e.json out/qwen/e2e.json --out ratios.png
"""

from __future__ import annotations

import argparse
import json
import re

#: the targets of the hybrids issue: replay / recurrent per preset, speculation / standard
REPLAY_TARGET = {"nemotron-h-4b": 1.3, "qwen3-next-4b": 1.25, "2.7b": 1.3}
SPEC_TARGET = 1.8


def ratios(run: dict) -> dict:
    """``{batch: {"replay / recurrent": r, "spec / standard": s}}`` from a run's summary."""
    out: dict[int, dict[str, float]] = {}
    for key, v in run["summary"].items():
        m = re.fullmatch(r"(replay_vs_recurrent|replay_spec_vs_standard)_B(\d+)", key)
        if m:
            name = "replay / recurrent" if m.group(1) == "replay_vs_recurrent" else "spec / standard"
            out.setdefault(int(m.group(2)), {})[name] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="e2e.json files")
    ap.add_argument("--out", default="spec_ratios.png")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.load(open(p)) for p in args.runs]
    presets = list(dict.fromkeys(r["config"]["preset"] for r in runs))
    fig, axes = plt.subplots(1, len(presets), figsize=(5.5 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        bars = []   # (label, metric, value)
        for r in (r for r in runs if r["config"]["preset"] == preset):
            for b, vals in sorted(ratios(r).items()):
                for metric, v in vals.items():
                    bars.append((f"B={b}\n{r['config']['max_tokens']} tok", metric, v))
        groups = list(dict.fromkeys(label for label, _, _ in bars))
        metrics = ("replay / recurrent", "spec / standard")
        w = 0.38
        for i, metric in enumerate(metrics):
            xs = [groups.index(label) + (i - 0.5) * w for label, m, _ in bars if m == metric]
            ys = [v for _, m, v in bars if m == metric]
            ax.bar(xs, ys, w, label=metric, color=("tab:gray", "tab:blue")[i])
            for x, y in zip(xs, ys):
                ax.text(x, y + 0.02, f"{y:.2f}", ha="center", fontsize=8)
        ax.axhline(SPEC_TARGET, ls="--", color="tab:blue", lw=1, label=f"spec target {SPEC_TARGET}x")
        if preset in REPLAY_TARGET:
            ax.axhline(REPLAY_TARGET[preset], ls="--", color="tab:gray", lw=1,
                       label=f"replay target {REPLAY_TARGET[preset]}x (B=256)")
        ax.set_xticks(range(len(groups)), groups, fontsize=8)
        ax.set_ylim(0, max([v for _, _, v in bars] + [SPEC_TARGET]) * 1.2)
        ax.set_ylabel("speedup (x)")
        ax.set_title(preset)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    device = runs[0]["config"].get("device_name", "")
    fig.suptitle(args.title or f"bench e2e ratios ({device})", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
