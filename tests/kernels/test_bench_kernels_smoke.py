"""`replayssm bench kernels --smoke`: the whole benchmark runs on tiny shapes (Triton
interpreter on CPU, compiled kernels on a GPU), its correctness check passes, and it writes
its JSON, summary and plots."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

DEVICE = kernel_device()


def test_bench_kernels_smoke(tmp_path):
    from replayssm.bench import kernels

    assert kernels.main(["--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "kernels.json").read_text())
    errs = res["correctness"]  # max relative error of each kernel output / state vs naive
    assert errs and all(v < 1e-4 for v in errs.values()), errs
    for fam in ("mamba2", "gdn"):
        assert res[fam]["verify"], f"no verify timings for {fam}"
        for T, row in res[fam]["verify"].items():
            assert row["snapshot_us"] > 0 and row["replay_all_accept_us"] > 0, (fam, T)
    assert (tmp_path / "summary.txt").read_text().strip()
