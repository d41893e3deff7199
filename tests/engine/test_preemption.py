"""Optimistic admission with preemption (``preemption_mode="swap"``) and priorities.

Greedy output is identical with and without preemption: on the tiny shipped Mamba-2 (float64)
in every decode mode, plain and speculating (n-gram, draft model, MTP), with sequences
preempted by hand between steps (its caches do not grow, a budget cannot force it); on a tiny
Nemotron-H hybrid (attention KV in a paged pool) where a small memory budget and long
``max_tokens`` force preemptions, with prefix caching too.  Then priorities (admission order,
victim choice), validation, and the capacity gain over worst-case reservation."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from replayssm import LLM, SamplingParams, SpeculativeConfig

transformers = pytest.importorskip("transformers")
models = pytest.importorskip("replayssm.models")

ASSETS = Path(__file__).resolve().parents[2] / "replayssm" / "assets"
TINY, TINY_DRAFT = str(ASSETS / "tiny-mamba2"), str(ASSETS / "tiny-mamba2-draft")
PROMPTS = [[(5 * i + 3 * j + 1) % 250 for j in range(3 + 2 * i)] for i in range(6)]


def _run(llm, prompts, params, preempt_every=0, slots=None):
    """Serve ``prompts`` (all queued at once); every ``preempt_every`` steps preempt the two latest
    running sequences past their prompt.  Returns the outputs' token ids; ``slots`` (a dict)
    collects the slots each request ran in."""
    seqs = [llm.add_request(p, q) for p, q in zip(prompts, params)]
    step = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while llm.has_unfinished():
            llm.step()
            step += 1
            for s in llm.scheduler.running if slots is not None else ():
                slots.setdefault(s.request_id, set()).add(s.slot)
            if preempt_every and step % preempt_every == 0:
                # the two latest, the earlier one first: it comes back first, into the other's slot
                for s in [s for s in llm.scheduler.running if not s.prefilling][-2:]:
                    llm.scheduler.preempt(s)
    assert not llm.cache._swapped and llm.scheduler.reserved == 0
    assert len(llm.blocks.free_slots) == llm.num_slots
    return [llm.output(s).token_ids for s in seqs]


def _spec(name):
    return {None: None, "ngram": SpeculativeConfig("ngram", num_tokens=3),
            "draft": SpeculativeConfig("draft", num_tokens=2, draft_model=TINY_DRAFT),
            "mtp": SpeculativeConfig("mtp", num_tokens=2)}[name]


@pytest.mark.parametrize("mode,spec", [("recurrent", None), ("replay", None), ("kv", None), ("auto", None),
                                       ("replay", "ngram"), ("auto", "draft"), ("kv", "draft"), ("replay", "mtp")])
def test_shipped_model_preempted_by_hand_keeps_greedy_output(mode, spec):
    kw = dict(dtype="float64", decode_mode=mode, max_seq_len=96, kv_block_size=4, auto_threshold=9,
              max_num_seqs=3, speculative=_spec(spec))
    params = [SamplingParams(max_tokens=14)] * len(PROMPTS)
    want = _run(LLM(TINY, **kw), PROMPTS, params)
    llm, slots = LLM(TINY, **kw), {}
    assert _run(llm, PROMPTS, params, preempt_every=3, slots=slots) == want
    assert llm.stats["preemptions"] >= 4
    assert any(len(v) > 1 for v in slots.values())           # swapped back into another slot


# ------------------------------------------------------------------- a hybrid with attention
@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    cfg = transformers.NemotronHConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=4, hybrid_override_pattern="M*M-", num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=16, n_groups=2, mamba_n_groups=2, conv_kernel=4, eos_token_id=None)
    torch.manual_seed(3)
    d = str(tmp_path_factory.mktemp("preempt") / "nemotron_h")
    transformers.NemotronHForCausalLM(cfg).save_pretrained(d)
    return models.load_model(d, device="cpu", dtype=torch.float64)


HP = [[(7 * i + 3 * j + 2) % 61 for j in range(4 + 3 * (i % 3))] for i in range(6)]


def _budget(model, mode, tokens, seqs, slots, spec=None, **kw):
    """A budget of ``slots`` slots (and the prefix store ``kw`` may ask for) whose block pools
    hold ``seqs`` sequences of ``tokens`` tokens (worst-case reservations): probes tell what
    everything but the pools takes."""
    budget = 1 << 32
    for _ in range(3):   # (what the rest takes may depend on the budget: settle it)
        probe = LLM(model, dtype="float64", decode_mode=mode, kv_block_size=4, speculative=spec, max_num_seqs=slots,
                    memory_budget=budget, **{"max_seq_len": 128, **kw})
        mem = probe.plan.memory
        want = seqs * mem.dynamic(tokens + mem.verify_tokens)
        if probe.blocks.pool_bytes == want:
            break
        budget += want - probe.blocks.pool_bytes
    return budget


@pytest.mark.parametrize("mode,spec", [("recurrent", None), ("replay", None), ("kv", None), ("auto", None),
                                       ("replay", "ngram"), ("kv", "draft")])
def test_hybrid_preempted_by_a_small_budget_keeps_greedy_output(hybrid, mode, spec):
    sp = {None: None, "ngram": SpeculativeConfig("ngram", num_tokens=3),
          "draft": SpeculativeConfig("draft", num_tokens=2, draft_model=hybrid)}[spec]
    params = [SamplingParams(max_tokens=40)] * len(HP)
    kw = dict(dtype="float64", decode_mode=mode, max_seq_len=128, kv_block_size=4, auto_threshold=10, speculative=sp)
    want = _run(LLM(hybrid, max_num_seqs=6, **kw), HP, params)
    llm = LLM(hybrid, memory_budget=_budget(hybrid, mode, 56, 2, 4, sp, auto_threshold=10), max_num_seqs=4, **kw)
    assert llm.num_slots == 4
    assert _run(llm, HP, params) == want
    assert llm.stats["preemptions"] > 0 and llm.scheduler.peak_running >= 3


@pytest.mark.parametrize("mode", ["replay", "kv"])
def test_hybrid_preemption_with_prefix_caching(hybrid, mode):
    base = [(11 * j + 5) % 61 for j in range(12)]
    prompts = [base + [i, (i * 7) % 61] for i in range(5)] + [base]
    params = [SamplingParams(max_tokens=36)] * len(prompts)
    kw = dict(dtype="float64", decode_mode=mode, max_seq_len=128, kv_block_size=4, buffer_size=6,
              enable_prefix_caching=True, prefix_checkpoint_interval=8, prefix_cache_blocks=24)
    want = _run(LLM(hybrid, max_num_seqs=6, **kw), prompts, params)
    llm = LLM(hybrid, memory_budget=_budget(hybrid, mode, 52, 2, 4, buffer_size=6, enable_prefix_caching=True,
                                            prefix_cache_blocks=24, prefix_checkpoint_interval=8),
              max_num_seqs=4, **kw)
    assert _run(llm, prompts, params) == want
    assert llm.stats["preemptions"] > 0 and llm.stats["prefix_hits"] > 0


# ------------------------------------------------------------------------------ priorities
def test_priority_orders_admission_fcfs_within_a_priority():
    llm = LLM(TINY, dtype="float64", max_seq_len=64, max_num_seqs=1)
    order = []
    prios = [0, 5, 1, 5, -2, 1]
    seqs = [llm.add_request(p, SamplingParams(max_tokens=2, priority=q)) for p, q in zip(PROMPTS, prios)]
    while llm.has_unfinished():
        llm.step()
        for s in llm.scheduler.running:
            if s.request_id not in order:
                order.append(s.request_id)
    ids = [s.request_id for s in seqs]
    # by priority (lower first), first come first served within one
    assert order == [ids[4], ids[0], ids[2], ids[5], ids[1], ids[3]]


def test_victims_are_the_lowest_priority_then_the_latest(hybrid):
    kw = dict(dtype="float64", decode_mode="replay", max_seq_len=128, kv_block_size=4)
    llm = LLM(hybrid, memory_budget=_budget(hybrid, "replay", 56, 2, 4), max_num_seqs=4, **kw)
    prios = [1, 0, 1, 0]
    seqs = [llm.add_request(p, SamplingParams(max_tokens=40, priority=q)) for p, q in zip(HP, prios)]
    first = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while llm.has_unfinished():
            running = list(llm.scheduler.running)
            llm.step()
            for s in running:
                if s.swapped and s.request_id not in first:
                    first[s.request_id] = llm.stats["steps"]
    assert first, "the budget forced no preemption"
    victims = sorted(first, key=first.get)
    assert victims[0] == seqs[2].request_id                    # priority 1, the latest of those
    assert seqs[1].num_preemptions == 0                        # the first high-priority request never
    assert all(llm.output(s).finish_reason == "length" for s in seqs)


def test_bad_settings_raise_before_anything_runs():
    for bad in ("1", 1.5, True, None):
        with pytest.raises(ValueError, match="priority"):
            SamplingParams(priority=bad)
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(TINY, max_seq_len=64, preemption_mode="recompute")
    llm = LLM(TINY, max_seq_len=64, max_num_seqs=2, preemption_mode="off")
    s = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=4))
    llm.step()
    llm.step()
    with pytest.raises(ValueError, match="preemption_mode='swap'"):
        llm.scheduler.preempt(s)
    llm = LLM(TINY, max_seq_len=64, max_num_seqs=2)
    s = llm.add_request(PROMPTS[5], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="only a running sequence"):
        llm.scheduler.preempt(s)                               # still waiting
    llm.step()
    llm.step()
    llm.scheduler.preempt(s)
    assert s.swapped and llm.abort(s.request_id)               # aborted while swapped out
    assert not llm.cache._swapped and not llm.has_unfinished() and llm.scheduler.reserved == 0


# ------------------------------------------------------------------------------ capacity
def test_capacity_with_preemption_is_at_least_1_5x_worst_case(hybrid):
    """Long ``max_tokens``, most requests stop early (a stop token standing in for EOS): at
    the same budget, optimistic admission runs far more sequences at once than reserving
    every request's worst case, loses none, and gives the same output."""
    kw = dict(dtype="float64", decode_mode="replay", max_seq_len=160, kv_block_size=4, max_num_seqs=12)
    prompts = [[(13 * i + 5 * j + 1) % 61 for j in range(6)] for i in range(12)]
    free = LLM(hybrid, **kw)
    ref = _run(free, prompts, [SamplingParams(max_tokens=8)] * len(prompts))
    # request i stops at its greedy token 2 + i % 5 (sooner if it appears earlier); three run long
    params = [SamplingParams(max_tokens=120, stop_token_ids=[] if i in (3, 7, 10) else [ref[i][2 + i % 5]])
              for i in range(len(prompts))]
    budget = _budget(hybrid, "replay", 6 + 120, 2, 12, max_seq_len=160)
    runs = {}
    for pm in ("off", "swap"):
        llm = LLM(hybrid, memory_budget=budget, preemption_mode=pm, **kw)
        runs[pm] = (_run(llm, prompts, params), llm.scheduler.peak_running, llm.stats["preemptions"])
    (out_off, peak_off, _), (out_swap, peak_swap, preempted) = runs["off"], runs["swap"]
    assert out_swap == out_off and all(out_off) and preempted > 0
    assert peak_swap >= 1.5 * peak_off, runs


def test_the_recompute_double_swaps_too(target, draft):
    """The test double (tests/recompute_model.py) implements the swap protocol: KV-only
    sequences under a tight budget are preempted and end as without preemption."""
    prompts = [[(7 * i + j) % 32 for j in range(6)] for i in range(5)]
    for sp in (None, SpeculativeConfig("draft", num_tokens=2, draft_model=draft)):
        kw = dict(decode_mode="kv", speculative=sp, max_seq_len=128, kv_block_size=4)
        params = [SamplingParams(max_tokens=30)] * len(prompts)
        want = _run(LLM(target, max_num_seqs=5, **kw), prompts, params)
        probe = LLM(target, max_num_seqs=4, memory_budget=1 << 32, **kw)
        mem = probe.plan.memory
        budget = (1 << 32) - probe.blocks.pool_bytes + 2 * mem.dynamic(36 + mem.verify_tokens)
        llm = LLM(target, max_num_seqs=4, memory_budget=budget, **kw)
        assert _run(llm, prompts, params) == want
        assert llm.stats["preemptions"] > 0 and llm.scheduler.peak_running >= 3
