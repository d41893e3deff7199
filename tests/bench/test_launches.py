"""``bench.launches``: operators per decode step per layer type, fused gates on vs off."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def test_fused_gates_remove_launches(monkeypatch, tmp_path):
    from replayssm.bench.e2e import _random_model_dir
    from replayssm.bench.launches import count_decode
    from replayssm.engine.loading import load
    from replayssm.kernels import _triton, dispatch

    if not _triton.interpreting():
        pytest.skip("counts the interpreter's launches (CPU run)")
    monkeypatch.setenv("REPLAYSSM_KERNELS", "triton")
    dispatch.reset()
    try:
        model = load(_random_model_dir("nemotron-h-tiny", str(tmp_path)), torch.device("cpu"), torch.float32)[0]
        res = {}
        for fused in ("0", "1"):
            monkeypatch.setenv("REPLAYSSM_FUSED_GATES", fused)
            res[fused] = count_decode(model, steps=2)
    finally:
        dispatch.reset()
    off, on = res["0"]["per_call"]["Mamba2Mixer"], res["1"]["per_call"]["Mamba2Mixer"]
    assert res["1"]["calls"]["Mamba2Mixer"] > 0
    assert on.get("triton:_gates_kernel") == 1 and "triton:_gates_kernel" not in off
    for op in ("softplus", "exp", "neg"):          # the per-call gate math is gone
        assert off.get(op, 0) >= 1 and op not in on
    assert sum(on.values()) <= sum(off.values()) - 3
    # the other layer types launch the same operators either way
    for kind in set(res["0"]["per_call"]) - {"Mamba2Mixer"}:
        assert res["0"]["per_call"][kind] == res["1"]["per_call"][kind], kind
