"""Sampling parameters beyond temperature/top-k/top-p: penalties, min-p, logprobs, n, stop
strings; all of them with speculation (lossless: same greedy tokens, same distributions)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from replayssm import LLM, SamplingParams, SpeculativeConfig
from replayssm.engine.detokenizer import Detokenizer, find_stop
from replayssm.engine.model_runner import GraphKey
from replayssm.engine.sampler import apply_penalties, blank_batch

from engine_helpers import PROMPTS, CharTok
from test_engine_sampling import assert_first_three_follow

N = 12


def _spec(method, draft):
    if method is None:
        return None
    if method == "ngram":
        return SpeculativeConfig("ngram", num_tokens=3)
    if method == "tree":
        return SpeculativeConfig("tree", draft_model=draft, tree_width=2, tree_depth=2)
    return SpeculativeConfig("draft", num_tokens=3, draft_model=draft)


# ---- the penalty formula, written out per token (the reference) -------------------------------
def ref_probs(logits, prompt, out, p: SamplingParams):
    x = [float(v) for v in logits]
    for t in range(len(x)):
        if t in prompt or t in out:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        c = out.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    if p.temperature == 0:
        best = max(range(len(x)), key=lambda t: x[t])
        return [1.0 if t == best else 0.0 for t in range(len(x))]
    m = max(x)
    e = [math.exp((v - m) / p.temperature) for v in x]
    pr = [v / sum(e) for v in e]
    if p.top_p < 1:
        order = sorted(range(len(pr)), key=lambda t: -pr[t])
        keep, mass = set(), 0.0
        for t in order:
            if mass >= p.top_p:   # the smallest prefix with mass >= top_p
                break
            keep.add(t)
            mass += pr[t]
        pr = [v if t in keep else 0.0 for t, v in enumerate(pr)]
    if p.min_p > 0:
        top = max(pr)
        pr = [v if v >= p.min_p * top else 0.0 for v in pr]
    s = sum(pr)
    return [v / s for v in pr]


def test_apply_penalties_matches_formula_at_every_draft_node():
    g = torch.Generator().manual_seed(0)
    V, B = 6, 3
    logits = torch.randn(B, 4, V, generator=g, dtype=torch.float64)
    params = [SamplingParams(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.9),
              SamplingParams(repetition_penalty=0.6, frequency_penalty=-0.5),
              SamplingParams()]
    prompts, outs = [[0, 1], [2], [5]], [[3, 3, 1], [4], []]
    tokens = torch.tensor([[1, 3, 3, 0], [4, 2, 5, 2], [0, 1, 2, 3]])
    parent = torch.tensor([[-1, 0, 1, 1], [-1, 0, 0, 2], [-1, 0, 1, 2]])
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    from replayssm.cache.tree import ancestor_mask

    sb = blank_batch(B, V, "cpu", use_penalties=True)
    for b, (p, pr, o) in enumerate(zip(params, prompts, outs)):
        sb.repetition[b], sb.presence[b] = p.repetition_penalty, p.presence_penalty
        sb.frequency[b] = p.frequency_penalty
        for t in pr + o:
            sb.seen[b, t] = True
        for t in o:
            sb.counts[b, t] += 1
    got = apply_penalties(logits, sb, tokens, ancestor_mask(parent), valid)
    for b in range(B):
        for i in range(4):
            path, j = [], i                       # drafts on the root..i path (node 0 excluded)
            while j > 0:
                if valid[b, j]:
                    path.append(int(tokens[b, j]))
                j = int(parent[b, j])
            p = SamplingParams(repetition_penalty=params[b].repetition_penalty, temperature=1.0,
                               presence_penalty=params[b].presence_penalty,
                               frequency_penalty=params[b].frequency_penalty)
            want = torch.tensor(ref_probs(logits[b, i], prompts[b], outs[b] + path[::-1], p), dtype=torch.float64)
            assert torch.allclose(torch.softmax(got[b, i], -1), want, atol=1e-12)


@pytest.mark.parametrize("method", [None, "ngram", "draft", "tree"])
def test_greedy_with_penalties_is_the_same_with_speculation(target, draft, method):
    params = [SamplingParams(max_tokens=N, repetition_penalty=1.5, presence_penalty=0.3),
              SamplingParams(max_tokens=N, frequency_penalty=1.2),
              SamplingParams(max_tokens=N)]
    prompts = [PROMPTS[3], PROMPTS[2], PROMPTS[0]]
    want = []
    for pr, p in zip(prompts, params):      # the reference: full forwards, formula per token
        out = []
        for _ in range(N):
            lg = target(torch.tensor([pr + out]))[0, -1]
            probs = ref_probs(lg, pr, out, p)
            out.append(max(range(len(probs)), key=lambda t: probs[t]))
        want.append(out)
    llm = LLM(target, speculative=_spec(method, draft), max_num_seqs=4)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert want[0] != [o.token_ids for o in LLM(target).generate([prompts[0]], SamplingParams(max_tokens=N))][0]


@pytest.mark.parametrize("method,kw", [
    (None, dict(repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.4, top_p=0.85)),
    ("draft", dict(repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.4, top_p=0.85)),
    ("tree", dict(repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.4, top_p=0.85)),
    ("draft", dict(min_p=0.2, frequency_penalty=0.8, temperature=0.8)),
])
def test_sampled_distribution_with_penalties_and_filters(method, kw):
    """The first three tokens follow the penalised, filtered joint distribution exactly,
    with and without speculation (chi-square over 64 cells, 4-token vocabulary)."""
    from recompute_model import tiny_pair

    target, draft = tiny_pair(vocab_size=4, draft_noise=1.0)
    prompt = [1, 2]
    p = SamplingParams(max_tokens=3, **{"temperature": 1.0, **kw})
    expect = torch.zeros(64, dtype=torch.float64)
    with torch.no_grad():
        p1 = ref_probs(target(torch.tensor([prompt]))[0, -1], prompt, [], p)
        for a in range(4):
            p2 = ref_probs(target(torch.tensor([prompt + [a]]))[0, -1], prompt, [a], p)
            for b in range(4):
                p3 = ref_probs(target(torch.tensor([prompt + [a, b]]))[0, -1], prompt, [a, b], p)
                for c in range(4):
                    expect[a * 16 + b * 4 + c] = p1[a] * p2[b] * p3[c]
    llm = LLM(target, speculative=_spec(method, draft), max_num_seqs=256, seed=7, pad_batches=True)
    M = 4000
    outs = llm.generate([prompt] * M, p)
    assert_first_three_follow(outs, expect)
    if method:
        assert sum(o.num_accepted for o in outs) > 0


@pytest.mark.parametrize("method", [None, "ngram", "draft"])
def test_logprobs(target, draft, method):
    p = SamplingParams(max_tokens=8, logprobs=3)
    out = LLM(target, speculative=_spec(method, draft)).generate([PROMPTS[3]], p)[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    ids = PROMPTS[3] + out.token_ids
    full = torch.log_softmax(target(torch.tensor([ids]))[0].double(), -1)
    for i, (lp, top) in enumerate(out.logprobs):
        row = full[len(PROMPTS[3]) - 1 + i]
        assert abs(lp - float(row[out.token_ids[i]])) < 1e-9
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
        assert top[0][0] == out.token_ids[i]          # greedy: the sampled token is the top one


@pytest.mark.parametrize("method", [None, "draft"])
def test_n_samples_share_one_prefill(target, draft, method):
    llm = LLM(target, speculative=_spec(method, draft), max_num_seqs=6)
    greedy = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=N, n=3))[0]
    plain = LLM(target).generate([PROMPTS[3]], SamplingParams(max_tokens=N))[0].token_ids
    assert [s.token_ids for s in greedy.samples] == [plain] * 3
    assert [s.index for s in greedy.samples] == [0, 1, 2]
    before = llm.runner.num_calls["prefill"]
    p = SamplingParams(max_tokens=N, n=4, temperature=1.0, seed=3)
    outs = llm.generate([PROMPTS[3]], p)[0].samples
    assert llm.runner.num_calls["prefill"] == before + 1          # one prefill for the 4 samples
    assert len({tuple(o.token_ids) for o in outs}) > 1
    again = llm.generate([PROMPTS[3]], p)[0].samples             # seeded: reproducible
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    # sample i with seed s+i equals a single request with that seed
    one = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=N, temperature=1.0, seed=5))[0]
    assert one.token_ids == outs[2].token_ids
    assert len(llm.scheduler.free_slots) == llm.num_slots
    with pytest.raises(ValueError, match="n=7"):
        llm.add_request(PROMPTS[0], SamplingParams(n=7))


def test_abort_ends_every_sample(target):
    llm = LLM(target, max_num_seqs=4)
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=N, n=3), request_id="g")
    llm.step()
    assert llm.abort("g") and not llm.has_unfinished()
    assert len(llm.scheduler.free_slots) == llm.num_slots


class _ByteTok:
    """Byte-level tokenizer: token i is byte i (like the shipped model's)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_never_splits_a_character_and_matches_full_decode():
    rng = random.Random(0)
    tok = _ByteTok()
    alphabet = "ab c\n€😀éß"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = list(text.encode())
        d = Detokenizer(tok, prompt_ids=list("x".encode()))
        pieces = [d.push(t) for t in ids]
        assert "".join(pieces) == d.text == text
        assert all("\ufffd" not in p for p in pieces)
    d = Detokenizer(tok)                     # a truncated character is released at the end
    d.push(0xE2)
    assert d.text == "" and d.flush() == "\ufffd"


def test_detokenizer_decodes_a_bounded_window(monkeypatch):
    calls = []

    class Counting(_ByteTok):
        def decode(self, ids):
            calls.append(len(ids))
            return super().decode(ids)

    d = Detokenizer(Counting(), context=4)
    for t in ("x" * 500).encode():
        d.push(t)
    assert max(calls) <= 5 and d.text == "x" * 500


def test_find_stop_only_searches_new_text():
    assert find_stop("hello world", 3, ["wor"]) == 6
    assert find_stop("hello world", 1, ["ll"]) is None      # ended before the new text
    assert find_stop("abcab", 1, ["b", "ab"]) == 3
    assert find_stop("abc", 2, []) is None



@pytest.mark.parametrize("method", [None, "ngram", "draft", "tree"])
def test_stop_string_cut_even_past_a_speculative_step(target, draft, method):
    tok = CharTok()
    base = LLM(target, tokenizer=tok).generate([PROMPTS[3]], SamplingParams(max_tokens=N))[0]
    stop = base.text[5:7]
    cut = base.text.index(stop)
    llm = LLM(target, tokenizer=tok, speculative=_spec(method, draft))
    out = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=N, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == base.text[:cut]
    # tokens end with the one that completed the stop string, nothing accepted after it
    assert out.token_ids == base.token_ids[: cut + len(stop)]


def test_sampled_step_padded_equals_unpadded(target, draft):
    """The sampled verify body on padded batches (what CUDA graphs replay) gives the same
    tokens as the unpadded one, with the same uniforms."""
    p = [SamplingParams(max_tokens=16, temperature=0.9, seed=s, top_k=20, min_p=0.05, repetition_penalty=1.2,
                        logprobs=2) for s in range(3)]
    outs = []
    for pad in (False, True):
        llm = LLM(target, speculative=_spec("draft", draft), pad_batches=pad, max_num_seqs=8)
        outs.append([(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS[:3], p)])
    assert outs[0] == outs[1]


class _ReplayGraph:
    """Stands in for a CUDA graph on CPU: 'capture' runs the body once on the static inputs
    (padding rows on the null slot), 'replay' runs it again and writes the results into the
    tensors the capture returned, as a replayed graph does."""

    def __init__(self, body):
        self.body = body
        self.outs = body()

    def replay(self):
        new = self.body()
        for dst, src in zip(_flat(self.outs), _flat(new)):
            dst.copy_(src)


def _flat(outs):
    acc, bonus, path, lps = outs
    return [acc, bonus] + ([path] if path is not None else []) + (list(lps) if lps is not None else [])


@pytest.mark.parametrize("method", ["draft", "tree", "ngram"])
def test_sampled_step_through_static_inputs_equals_eager(target, draft, method):
    """The graph path of the sampled step (static inputs copied in, the body replayed on
    them) gives exactly the eager path's tokens, logprobs and cache."""
    p = [SamplingParams(max_tokens=14, temperature=0.8, seed=s, top_p=0.9, min_p=0.02, presence_penalty=0.3,
                        logprobs=1) for s in range(3)] + [SamplingParams(max_tokens=14)]
    prompts = PROMPTS[:3] + [PROMPTS[3]]
    eager = LLM(target, speculative=_spec(method, draft), pad_batches=True, max_num_seqs=8)
    want = [(o.token_ids, o.logprobs) for o in eager.generate(prompts, p)]
    llm = LLM(target, speculative=_spec(method, draft), pad_batches=True, max_num_seqs=8)
    r = llm.runner
    captured = []

    def capture(key, Bp, N, tree, has_q, sb, warm=True):
        ins, a = r._sampled_inputs(Bp, N, has_q, sb)
        g = _ReplayGraph(lambda: r._sampled_body(*a[:6], a[6], tree))
        captured.append(key)
        r._graphs[key] = (g, ins, g.outs)
        return r._graphs[key]

    r._capture_sampled = capture
    r.use_graphs = True
    r._graph_failed.update({GraphKey("decode", b, r._form()) for b in r.buckets})
    r._capture_spec = lambda *a, **k: None
    got = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, p)]
    assert captured and got == want


@pytest.mark.parametrize("mode", ["replay", "kv"])
def test_n_samples_fork_a_real_model_cache(mode):
    """The shipped Mamba-2 (real ModelCache): n greedy samples forked from one prefill
    continue exactly like a request of their own, with draft speculation."""
    import os

    import replayssm

    assets = os.path.join(os.path.dirname(replayssm.__file__), "assets")
    target, dr = os.path.join(assets, "tiny-mamba2"), os.path.join(assets, "tiny-mamba2-draft")
    if not os.path.isfile(os.path.join(dr, "config.json")):
        pytest.skip("shipped models not present")
    sp = SpeculativeConfig("draft", num_tokens=3, draft_model=dr)
    llm = LLM(target, decode_mode=mode, speculative=sp, max_num_seqs=4, max_seq_len=128)
    plain = llm.generate(["def merge(a, b):"], SamplingParams(max_tokens=16))[0]
    before = llm.runner.num_calls["prefill"]
    out = llm.generate(["def merge(a, b):"], SamplingParams(max_tokens=16, n=3))[0]
    assert llm.runner.num_calls["prefill"] == before + 1
    assert [s.text for s in out.samples] == [plain.text] * 3
    assert [s.token_ids for s in out.samples] == [plain.token_ids] * 3
    assert len(llm.scheduler.free_slots) == llm.num_slots
