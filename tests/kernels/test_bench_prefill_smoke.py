"""`replayssm bench prefill --smoke`: tiny shapes on CPU (the Triton interpreter), the kernels'
final states and outputs within the bound of the reference, JSON, summary table and plot."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from kernel_device import kernel_device  # noqa: E402

DEVICE = kernel_device()


def test_bench_prefill_smoke(tmp_path, capsys):
    from replayssm import cli

    assert cli.main(["bench", "prefill", "--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "prefill.json").read_text())
    assert set(res["families"]) == {"mamba2", "gdn"}
    for fam, blk in res["families"].items():
        assert len(blk["rows"]) == 2
        for row in blk["rows"]:
            assert row["ours_backend"] == "triton", row
            assert row["ok"] and row["ours_state_err"] < 1e-5 and row["ours_y_err"] < 1e-5, (fam, row)
            assert row["ours_ms"] > 0 and row["ref_ms"] > 0
    out = capsys.readouterr().out
    assert "peer not installed" in out and "correctness: all final states" in out
