"""Chunked prefill: a step holds at most max_num_batched_tokens tokens; long prompts run in
chunks that continue from the state the previous chunk left, while running requests keep
decoding, and greedy output is the same with any budget."""

import pytest

from replayssm import LLM, SamplingParams, SpeculativeConfig

from engine_helpers import PROMPTS, reference_greedy

N = 10
LONG = [(7 * i) % 31 for i in range(57)]


@pytest.fixture(scope="module")
def expected(target):
    return [reference_greedy(target, p, N) for p in PROMPTS + [LONG]]


@pytest.mark.parametrize("budget", [1, 3, 8, 10_000])
@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
def test_any_budget_gives_the_same_greedy_output(target, expected, mode, budget):
    llm = LLM(target, decode_mode=mode, auto_threshold=6, max_num_batched_tokens=budget)
    outs = llm.generate(PROMPTS + [LONG], SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_chunked_prefill_with_speculation(target, draft, expected, spec):
    sp = SpeculativeConfig(spec, num_tokens=3, draft_model=draft if spec == "draft" else None)
    llm = LLM(target, speculative=sp, max_num_batched_tokens=6)
    outs = llm.generate(PROMPTS + [LONG], SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected


def test_a_long_prompt_does_not_stall_decoding(target, expected):
    """A prompt longer than the budget arrives while others decode: they get a token every
    step, the prompt's chunks go through in the leftover budget, and no step holds more
    tokens than the budget allows."""
    budget = 12
    llm = LLM(target, max_num_batched_tokens=budget, max_num_seqs=4)
    short = [llm.add_request(p, SamplingParams(max_tokens=N)) for p in PROMPTS[:3]]
    llm.step()                                          # the short prompts are in
    long = llm.add_request(LONG, SamplingParams(max_tokens=N))
    steps = 0
    while long.prefilling or not long.output_ids:
        before = [len(s.output_ids) for s in short]
        llm.step()
        steps += 1
        for s, b in zip(short, before):
            assert s.is_finished or len(s.output_ids) == b + 1, "a running request skipped a step"
    assert steps >= len(LONG) // budget                # the prompt really went in chunks
    while llm.has_unfinished():
        llm.step()
    assert [llm.output(s).token_ids for s in short] == expected[:3]
    assert llm.output(long).token_ids == expected[-1]


def test_scheduled_tokens_stay_within_the_budget(target):
    budget = 9
    llm = LLM(target, max_num_batched_tokens=budget, max_num_seqs=8)
    for p in PROMPTS + [LONG, LONG[:20]]:
        llm.add_request(p, SamplingParams(max_tokens=4))
    while llm.has_unfinished():
        batch = llm.scheduler.schedule()
        decode = len(batch.running) * llm.plan.memory.verify_tokens
        chunk = sum(n for _, n in batch.prefill)
        assert chunk <= max(budget - decode, budget // 4, 1)
        new, _ = llm.executor.run(batch)
        llm._postprocess(batch, new)


def test_bad_budget_is_a_clear_error(target):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(target, max_num_batched_tokens=0)
