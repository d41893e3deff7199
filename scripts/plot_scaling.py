"""Plot of tensor- and data-parallel scaling from the device runs' JSON (docs/data/*.json)
and the 2.7B TP=2 ÷ TP=1 ratios measured with ``scripts/profile_tp.py`` (listed below, as
they appear in docs/BENCHMARKS.md: the profile script's JSON did not come back from the
machine).

    python scripts/plot_scaling.py [--out docs/img/scaling_2026-11-27.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"

#: 2.7B replay, TP=2 ÷ TP=1 decode tok/s at B = 1 / 64 / 256 (two H200s, 2026-11-27,
#: docs/BENCHMARKS.md "The 2026-11-27 night device runs")
TP2_27B = {
    "all-reduce + add/norm (evening)": (0.87, 1.14, 1.36),
    "fused finish ≤16 rows, 2-byte peer reads": (0.99, 1.10, 1.32),
    "fused finish, 16-byte peer reads": (1.10, 1.29, 1.49),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "docs" / "img" / "scaling_2026-11-27.png"))
    a = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    batches = (1, 64, 256)
    x = range(len(batches))
    w = 0.8 / len(TP2_27B)
    for i, (name, r) in enumerate(TP2_27B.items()):
        ax[0].bar([j + (i - 1) * w for j in x], r, w, label=name)
    ax[0].axhline(1.0, color="k", lw=0.8)
    ax[0].axhline(1.7, color="r", ls="--", lw=0.8, label="target at B=256")
    ax[0].set_xticks(list(x), [f"B={b}" for b in batches])
    ax[0].set_ylabel("TP=2 ÷ TP=1 decode tok/s")
    ax[0].set_title("2.7B Mamba-2, replay, two H200s")
    ax[0].legend(fontsize=7)

    rows = {}
    for tp in (2, 4):
        d = json.loads((DATA / f"tp_big_nemotron56b_tp{tp}_2026-11-27.json").read_text())
        for r in d["rows"]:
            key = "spec" if r["speculative"] else r["mode"]
            rows[(tp, r["batch"], key)] = r["decode_tokens_per_s"]
    modes = ("recurrent", "replay", "spec")
    bs = sorted({b for _, b, _ in rows})
    labels = [f"{m}\nB={b}" for b in bs for m in modes]
    xs = range(len(labels))
    for k, tp in enumerate((2, 4)):
        ax[1].bar([j + (k - 0.5) * 0.4 for j in xs], [rows.get((tp, b, m), 0) for b in bs for m in modes], 0.4,
                  label=f"TP={tp}")
    for j, (b, m) in enumerate([(b, m) for b in bs for m in modes]):
        r2, r4 = rows.get((2, b, m)), rows.get((4, b, m))
        if r2 and r4:
            ax[1].text(j, r4 * 1.02, f"{r4 / r2:.2f}×", ha="center", fontsize=7)
    ax[1].set_xticks(list(xs), labels, fontsize=7)
    ax[1].set_ylabel("decode tok/s")
    ax[1].set_title("Nemotron-H-56B-class, bf16 states, four H200s")
    ax[1].legend(fontsize=7)

    d = json.loads((DATA / "gpu_dp_2026-11-27.json").read_text())
    dp = [(r["dp"], r["out_tok_s"]) for r in d["rows"]]
    ax[2].bar([str(n) for n, _ in dp], [t for _, t in dp], color="tab:green")
    for n, t in dp:
        ax[2].text(str(n), t * 1.02, f"{t:.0f}", ha="center", fontsize=8)
    ax[2].set_xlabel("data-parallel replicas (`serve --data-parallel-size`)")
    ax[2].set_ylabel("output tok/s (bench serve)")
    ax[2].set_title("nemotron-h-4b serving, two H200s\n(DP=1: the engine ran inside the API process)", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
