"""``gc_freeze``: the engine's objects move to the permanent generation once it is built
(off by default), so later full collections skip them; ``close()`` unfreezes."""

import gc

import pytest

from replayssm import LLM, SamplingParams
from replayssm.engine.config import EngineConfig


def test_gc_freeze_on_request_off_by_default_and_close_unfreezes(target):
    gc.unfreeze()
    try:
        llm = LLM(target, max_num_seqs=2, max_seq_len=64)
        assert llm.config.gc_freeze is False and gc.get_freeze_count() == 0
        llm = LLM(target, max_num_seqs=2, max_seq_len=64, gc_freeze=True)
        frozen = gc.get_freeze_count()
        assert llm.config.gc_freeze is True and frozen > 1000
        assert len(gc.get_objects()) < frozen   # what a full collection walks: the newer objects
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
        assert len(out[0].token_ids) == 4
        llm.close()
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("bad", [None, 1, "yes"])
def test_gc_freeze_rejects_non_bools(bad):
    with pytest.raises(ValueError, match="gc_freeze"):
        EngineConfig(gc_freeze=bad)
