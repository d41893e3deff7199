"""A tensor-parallel worker killed mid-generation: the engine's next step raises
``WorkerFailed`` naming the rank and its exit status within seconds (never a hang), the
engine refuses further steps, and closing it leaves no process behind."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from replayssm import LLM, SamplingParams

dist_mod = pytest.importorskip("replayssm.distributed")
from replayssm.distributed import WorkerFailed  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "replayssm" / "assets" / "tiny-mamba2"
PROMPT = [1, 2, 3, 4, 5, 6, 7]


def test_worker_killed_mid_generation_fails_the_step_not_hangs(one_thread):
    with LLM(str(MODEL), max_seq_len=256, device="cpu") as ref:
        want = ref.generate([PROMPT], SamplingParams(max_tokens=4))[0].token_ids
    assert multiprocessing.active_children() == []
    llm = LLM(str(MODEL), tensor_parallel_size=2, max_seq_len=256, device="cpu")
    try:
        seq = llm.add_request(PROMPT, SamplingParams(max_tokens=200))
        while len(seq.output_ids) < 4:
            llm.step()
        assert seq.output_ids[:4] == want   # it was generating correctly
        (worker,) = multiprocessing.active_children()
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailed, match=rf"rank 1 \(pid {worker.pid}\) exited with code -9"):
            while llm.has_unfinished():
                llm.step()
        assert time.monotonic() - t0 < 30
        with pytest.raises(WorkerFailed, match="failed earlier"):
            llm.step()
    finally:
        llm.close()
    assert multiprocessing.active_children() == []


def test_ranks_share_the_host_threads_while_the_group_is_open():
    """Default threads: each of the 2 ranks takes half of rank 0's intra-op threads (rank 0
    too, until close), so the processes do not oversubscribe the host's cores; the
    group still computes, and rank 0's count comes back on close."""
    import torch

    from replayssm.distributed import TensorParallelGroup

    n = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with TensorParallelGroup(2, "cpu") as g:
            assert torch.get_num_threads() == 2
            model = g.load_model(MODEL, "float32")
            logits = model(torch.tensor([PROMPT]))
            assert logits.shape == (1, len(PROMPT), model.config.vocab_size) and torch.isfinite(logits).all()
        assert torch.get_num_threads() == 4 and multiprocessing.active_children() == []
    finally:
        torch.set_num_threads(n)
