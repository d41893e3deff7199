"""An engine that cannot go on (a lost tensor-parallel worker, or a reset that raises): the
loop ends every request in flight with the reason, refuses new ones, stops and tells the
server -- where an ordinary failed step only ends its requests and the loop goes on."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from recompute_model import tiny_pair

from replayssm import LLM, SamplingParams
from replayssm.distributed import WorkerFailed
from replayssm.server.engine_loop import AsyncEngine, EngineError, ShuttingDown


class Breaks:
    """An LLM whose ``fail_at``-th step raises ``exc``; ``recover_raises``: its reset too."""

    def __init__(self, llm, fail_at, exc, recover_raises=False):
        self.llm, self.fail_at, self.exc, self.recover_raises, self.calls = llm, fail_at, exc, recover_raises, 0
        self.recovered = 0

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def step(self):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise self.exc
        return self.llm.step()

    def recover(self):
        self.recovered += 1
        if self.recover_raises:
            raise RuntimeError("cache is gone")
        self.llm.recover()


@pytest.mark.parametrize("exc, recover_raises, reason", [
    (WorkerFailed("rank 1 (pid 7) exited with code -9"), False,
     "replayssm.distributed.group.WorkerFailed: rank 1 (pid 7) exited with code -9"),
    (RuntimeError("device lost"), True, "RuntimeError: device lost (then the engine's reset raised RuntimeError: "
                                        "cache is gone)"),
])
def test_a_failed_engine_ends_everything_and_refuses_new_requests(exc, recover_raises, reason):
    torch.set_num_threads(1)
    target, _ = tiny_pair(vocab_size=32)
    eng = Breaks(LLM(target, max_num_seqs=4), fail_at=3, exc=exc, recover_raises=recover_raises)
    loop = AsyncEngine(eng, max_running=4, max_queue=4)
    told = threading.Event()
    loop.on_failed = told.set

    async def run(prompt):
        stream = loop.submit([(loop.new_id("r"), prompt, SamplingParams(max_tokens=50, ignore_eos=True))])
        got = 0
        async for out in stream:
            got = len(out.token_ids)
        return got

    async def main():
        loop.start()
        try:
            res = await asyncio.wait_for(asyncio.gather(run([1, 2, 3]), run([4, 5]), run([6]),
                                                        return_exceptions=True), 30)
            assert all(isinstance(r, EngineError) and str(r) == f"engine failed: {reason}" for r in res), res
            assert loop.failed == reason and loop.in_flight == 0
            assert told.wait(5)
            for _ in range(100):   # the loop's thread ends
                if not loop.alive:
                    break
                await asyncio.sleep(0.02)
            assert not loop.alive
            with pytest.raises(ShuttingDown, match="engine failed: .*shutting down"):
                loop.submit([(loop.new_id("r"), [1], SamplingParams(max_tokens=2))])
            assert loop.in_flight == 0
        finally:
            loop.shutdown()

    asyncio.run(main())
    assert eng.recovered == (0 if isinstance(exc, WorkerFailed) else 1)   # a lost worker: no reset tried
