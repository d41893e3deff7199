"""Constrained rows in speculative steps (``engine.structured.drafts``): greedy output equal
to plain constrained decoding for every drafter, decode mode and length policy, in batches
mixing constrained and free rows; the draft walk's masks, cuts and ``valid`` against a plain
reference (one matcher stepped token by token); masked verify steps against masking by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import replayssm
from replayssm.engine import LLM
from replayssm.engine.config import SamplingParams, SpeculativeConfig
from replayssm.engine.spec.policy import ScriptedLengths
from replayssm.engine.structured import ConstraintFactory, LogitsMasker
from replayssm.engine.structured.drafts import DraftMasks, verified_chain

pytest.importorskip("llguidance")

ASSETS = Path(replayssm.__file__).parent / "assets"
MODEL, DRAFT = str(ASSETS / "tiny-mamba2"), str(ASSETS / "tiny-mamba2-draft")
EOS = 256
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99},
                         "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}
RX = r"(ab|cd)+x?"
CHOICES = ["the cat", "the dog", "a bird"]
PROMPTS = ["Person: ", "abab abab ab", "the the the ", "Once upon a time", "the cat and the"]
PARAMS = [SamplingParams(max_tokens=40, structured_outputs={"json": SCHEMA}),
          SamplingParams(max_tokens=14, structured_outputs={"regex": RX}),
          SamplingParams(max_tokens=10, structured_outputs={"choice": CHOICES}),
          SamplingParams(max_tokens=20),   # free
          SamplingParams(max_tokens=12, min_tokens=3, bad_words=("c",), structured_outputs={"choice": CHOICES})]


def check(outs) -> None:
    obj = json.loads(outs[0].text)
    assert set(obj) == {"name", "n", "ok"} and type(obj["n"]) is int and len(obj["name"]) <= 5
    assert re.fullmatch(RX, outs[1].text) and outs[2].text in CHOICES and outs[4].text in CHOICES[1:]


_ref = {}


def reference(model=MODEL, **kw):
    """Plain constrained decoding (no drafter), the ground truth of every greedy comparison."""
    key = (str(model),)
    if key not in _ref:
        _ref[key] = [o.token_ids for o in LLM(model, max_seq_len=256, **kw).generate(PROMPTS, PARAMS)]
    return _ref[key]


SPECS = {
    "ngram": dict(method="ngram", num_tokens=3, prompt_lookup_min=1),
    "draft": dict(method="draft", num_tokens=3, draft_model=DRAFT),
    "tree": dict(method="tree", draft_model=DRAFT, tree_width=2, tree_depth=3),
    "ngram-tree": dict(method="tree", num_tokens=3, tree_width=2),
}
CASES = [("ngram", "replay", "fixed"), ("ngram", "kv", "adaptive"), ("draft", "recurrent", "adaptive"),
         ("draft", "auto", "fixed"), ("draft", "replay", "scripted"), ("tree", "replay", "fixed"),
         ("tree", "kv", "adaptive"), ("ngram-tree", "auto", "scripted"), ("ngram", "recurrent", "scripted")]


@pytest.mark.parametrize("name,mode,policy", CASES)
def test_constrained_speculative_greedy_equals_plain(name, mode, policy):
    sp = SpeculativeConfig(**SPECS[name], spec_policy="fixed" if policy == "fixed" else "adaptive")
    llm = LLM(MODEL, max_seq_len=256, decode_mode=mode, speculative=sp, buffer_size=16, auto_threshold=10,
              pad_batches=mode == "replay")
    if policy == "scripted":   # every length of the adaptive policy's set, and plain steps between
        L = llm.executor.lengths
        llm.executor.lengths = ScriptedLengths(L.lengths, [0, *L.lengths, L.max, 1], L.tree,
                                               L.depth)
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == reference()
    check(outs)
    cons = [outs[i] for i in (0, 1, 2, 4)]
    assert sum(o.num_verify_steps for o in cons) > 0          # constrained rows speculated
    for o in outs:
        assert 0 <= o.num_accepted <= o.num_drafted


def test_draft_model_drafts_are_accepted_and_cut_on_constrained_rows():
    """The draft model is the target itself: every draft the grammar allows is accepted;
    the drafts it rejects are cut before verification (not counted as drafted)."""
    sp = SpeculativeConfig(method="draft", num_tokens=4, draft_model=MODEL, spec_policy="fixed")
    llm = LLM(MODEL, max_seq_len=256, speculative=sp)
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == reference()
    cons = [outs[i] for i in (0, 1, 2, 4)]
    assert sum(o.num_accepted for o in cons) > 0
    for o in cons:   # an identical drafter: every draft that survived the cut is accepted
        assert o.num_accepted == o.num_drafted, o


def test_hybrid_target_with_tree_and_chain(pair_257):
    """The tiny hybrid of tests/engine (a recompute reference model) with the shipped
    tokenizer: chain and beam-tree draft-model speculation against its plain constrained run."""
    from tokenizers import Tokenizer
    target, draft = pair_257
    tok = Tokenizer.from_file(str(Path(MODEL) / "tokenizer.json"))
    want = [o.token_ids for o in LLM(target, tokenizer=tok).generate(PROMPTS, PARAMS)]
    for sp in (SpeculativeConfig("draft", num_tokens=3, draft_model=draft),
               SpeculativeConfig("tree", draft_model=draft, tree_width=2, tree_depth=2, spec_policy="fixed")):
        llm = LLM(target, tokenizer=tok, speculative=sp)
        outs = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == want
        check(outs)
        assert sum(outs[i].num_verify_steps for i in (0, 1, 2, 4)) > 0


@pytest.fixture(scope="module")
def pair_257():
    from recompute_model import tiny_pair
    return tiny_pair(vocab_size=257, eos_token_id=EOS)


def test_sampled_constrained_speculation_validates():
    """Sampled rows with draft distributions (the rejected draft stays and is rejected by
    the masked target) and without; every output obeys its constraint."""
    for sp in (SpeculativeConfig("draft", num_tokens=3, draft_model=DRAFT),
               SpeculativeConfig("ngram", num_tokens=3, prompt_lookup_min=1),
               SpeculativeConfig("tree", draft_model=DRAFT, tree_width=2, tree_depth=2, spec_policy="fixed")):
        llm = LLM(MODEL, max_seq_len=256, speculative=sp)
        ps = [SamplingParams(**{**p.__dict__, "temperature": 0.9, "seed": i}) if i != 3 else p
              for i, p in enumerate(PARAMS)]
        outs = llm.generate(PROMPTS, ps)
        check(outs)
        assert sum(outs[i].num_verify_steps for i in (0, 1, 2, 4)) > 0


def test_sampled_verify_path_with_greedy_rows_equals_plain():
    """Greedy rows asking for logprobs take the sampled verify step (penalties, filters,
    logprobs): the mask is applied there too, before acceptance; logprobs stay the raw ones."""
    ps = [SamplingParams(**{**p.__dict__, "logprobs": 2}) for p in PARAMS]
    want = LLM(MODEL, max_seq_len=256).generate(PROMPTS, ps)
    llm = LLM(MODEL, max_seq_len=256, speculative=SpeculativeConfig("draft", num_tokens=3, draft_model=MODEL))
    outs = llm.generate(PROMPTS, ps)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert sum(outs[i].num_accepted for i in (0, 1, 2, 4)) > 0
    for o, w in zip(outs, want):
        assert len(o.logprobs) == len(w.logprobs)
        for (lp, top), (lp_w, top_w) in zip(o.logprobs, w.logprobs):   # (chosen, [(id, logprob), ...])
            assert abs(lp - lp_w) < 1e-4 and [t for t, _ in top] == [t for t, _ in top_w]


def test_logit_bias_rows_decode_plainly_beside_speculating_rows():
    sp = SpeculativeConfig(method="ngram", num_tokens=3, prompt_lookup_min=1)
    llm = LLM(MODEL, max_seq_len=256, speculative=sp)
    biased = SamplingParams(max_tokens=10, logit_bias={ord("t"): 3.0}, structured_outputs={"choice": CHOICES})
    ps = PARAMS + [biased]
    want = [o.token_ids for o in LLM(MODEL, max_seq_len=256).generate(PROMPTS + ["x"], ps)]
    outs = llm.generate(PROMPTS + ["x"], ps)
    assert [o.token_ids for o in outs] == want
    assert outs[-1].num_verify_steps == 0 and outs[-1].text in CHOICES


# ---- the draft walk against one matcher stepped by hand ------------------------------------
class _Seq:
    def __init__(self, constraint, output_ids=()):
        self.constraint, self.output_ids = constraint, list(output_ids)


def _factory():
    from tokenizers import Tokenizer
    return ConstraintFactory(Tokenizer.from_file(str(Path(MODEL) / "tokenizer.json")), 257, EOS)


def _plain_mask(c, out, V=257) -> torch.Tensor:
    """The plain decode step's mask: LogitsMasker on zero logits (-inf = banned)."""
    x = LogitsMasker("cpu").apply(torch.zeros(1, V), [_Seq(c, out)])
    return torch.isfinite(x[0])


@pytest.mark.parametrize("has_q", [False, True])
def test_walk_masks_and_cuts_match_stepping_one_matcher(has_q):
    f = _factory()
    c_json = f.build(SamplingParams(structured_outputs={"json": SCHEMA}))[0]
    c_rx = f.build(SamplingParams(structured_outputs={"regex": RX}))[0]
    c_bad = f.build(SamplingParams(min_tokens=2, bad_words=("ab",)))[0]   # no grammar: bans only
    enc = lambda s: [ord(ch) for ch in s]   # noqa: E731  (the byte-level vocabulary)
    rows = [(c_json, enc('{"name'), [], enc('{"nam')),      # row: constraint, drafts, output, cut prefix
            (None, enc("zzzzz"), [], None),                  # a free row: untouched
            (c_rx, enc("abcq!"), [], enc("abc")),            # cut at the 4th draft
            (c_bad, enc("xab") + [EOS, 5], [], None),        # 'b' after 'a' is banned: cut after 'a'
            (c_rx, [], [], [])]                               # no drafts at all
    B, N = len(rows), 6
    tokens = torch.zeros(B, N, dtype=torch.long)
    valid = torch.zeros(B, N, dtype=torch.bool)
    for b, (_, d, _, _) in enumerate(rows):
        tokens[b, 1:1 + len(d)] = torch.tensor(d[:N - 1], dtype=torch.long)
        valid[b, :1 + min(len(d), N - 1)] = True
    parent = torch.arange(-1, N - 1).expand(B, N).contiguous()
    seqs = [_Seq(c, o) for c, _, o, _ in rows]
    before = [c.matcher.deep_copy() if c is not None and c.matcher else None for c, *_ in rows]
    mask, v2 = DraftMasks(LogitsMasker("cpu")).build(seqs, tokens, parent, valid, False, has_q, 257)
    assert mask.shape == (B, N, 257) and v2.shape == (B, N)
    # the matchers are where they were (the walk rolled back)
    for (c, *_), m0 in zip(rows, before):
        if m0 is not None:
            assert c.matcher.validate_tokens(enc('{"')) == m0.validate_tokens(enc('{"'))
    assert mask[1].all() and torch.equal(v2[1], valid[1])
    for b in (0, 2, 3, 4):
        c, d, out, cut = rows[b]
        if cut is None:   # bans: 'x', 'a' pass, 'b' after 'a' is banned
            cut = d[:2] if b == 3 else d
        n_ok = len(cut)
        want_valid = valid[b].clone() if has_q else torch.arange(N) <= n_ok
        assert torch.equal(v2[b], want_valid & valid[b] if not has_q else valid[b]), (b, v2[b])
        ref = c.matcher.deep_copy() if c.matcher is not None else None
        ref_c = c.copy(ref)
        ref_c.mask_vocab = c.mask_vocab
        for i in range(n_ok + 1):
            assert torch.equal(mask[b, i], _plain_mask(ref_c, out + cut[:i])), (b, i)
            if i < n_ok and ref is not None:
                assert ref.consume_token(cut[i])
        assert mask[b, n_ok + 1:].all()   # never accepted: open


def test_walk_rejects_bad_shapes_before_touching_a_matcher():
    f = _factory()
    c = f.build(SamplingParams(structured_outputs={"regex": RX}))[0]
    dm = DraftMasks(LogitsMasker("cpu"))
    t = torch.tensor([[0, 97, 98]])
    par = torch.tensor([[-1, 0, 1]])
    ok = torch.ones(1, 3, dtype=torch.bool)
    for args in ((t, par[:, :2], ok), (t, par, ok[:, :2]), (t[0], par[0], ok[0])):
        with pytest.raises(ValueError, match="DraftMasks.build"):
            dm.build([_Seq(c)], *args, False, False, 257)
    with pytest.raises(ValueError, match="B = 2"):
        dm.build([_Seq(c), _Seq(None)], t, par, ok, False, False, 257)
    assert c.matcher.validate_tokens([97, 98]) == 2   # untouched


def test_tree_rows_verify_their_first_child_chain():
    parent = [-1, 0, 0, 1, 1, 3, 2]
    valid = [True, True, True, True, False, True, True]
    assert verified_chain(parent, valid, True) == [0, 1, 3, 5]
    assert verified_chain(parent, [True, False] + [True] * 5, True) == [0, 2, 6]
    assert verified_chain(list(range(-1, 4)), [True, True, True, False, True], False) == [0, 1, 2]


def test_masked_verify_steps_equal_masking_by_hand():
    """The runner's masked greedy and sampled verify steps accept as the reference
    acceptance on logits masked by hand (a random mask, odd shapes)."""
    from replayssm.engine.sampler import accept_greedy
    llm = LLM(MODEL, max_seq_len=128, speculative=SpeculativeConfig("ngram", num_tokens=4), pad_batches=True)
    r = llm.runner
    g = torch.Generator().manual_seed(3)
    B, N, V = 3, 5, 257
    prompts = [[65, 66, 67], [70] * 5, [80, 81]]
    slots = [1, 2, 3]
    tokens = torch.randint(0, V, (B, N), generator=g)
    mask = torch.rand(B, N, V, generator=g) < 0.6
    valid = torch.ones(B, N, dtype=torch.bool)
    parent = torch.arange(-1, N - 1).expand(B, N).contiguous()
    for s, p in zip(slots, prompts):
        r.prefill([s], [p])
    logits = r.verify(slots, tokens.clone())   # the reference logits (then rolled back)
    r.commit(torch.ones(B, dtype=torch.long))
    mask.scatter_(-1, logits.argmax(-1, keepdim=True), False)   # the unmasked choice is never allowed
    want = accept_greedy(logits.masked_fill(~mask, float("-inf")), tokens, parent, valid)
    assert not torch.equal(want[2], accept_greedy(logits, tokens, parent, valid)[2])
    other = [4, 5, 6]   # the same states in other slots
    for s, p in zip(other, prompts):
        r.prefill([s], [p])
    acc, bonus, _ = r.greedy_verify_step(other, tokens, parent, valid, False, mask=mask)
    assert torch.equal(acc, want[0]) and torch.equal(bonus, want[2])


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for y in (x or ()) for t in _tensors(y)] if isinstance(x, (tuple, list)) else []


class _Replay:
    """A CUDA graph stand-in on CPU: capture runs the body on the static inputs, replay runs
    it again and writes into the captured outputs."""

    def __init__(self, body):
        self.body, self.outs = body, body()

    def replay(self):
        for dst, src in zip(_tensors(self.outs), _tensors(self.body())):
            dst.copy_(src)


def test_masked_graph_keys_read_the_mask_from_their_static_input():
    """With graphs simulated on CPU, masked greedy and sampled verify steps are their own
    graph keys whose static mask input carries each step's mask."""
    from replayssm.engine.model_runner import GraphKey
    llm = LLM(MODEL, max_seq_len=256, pad_batches=True,
              speculative=SpeculativeConfig("draft", num_tokens=3, draft_model=MODEL, spec_policy="fixed"))
    r, keys = llm.runner, []

    def capture(key, ins, body, warm, what):
        keys.append(key)
        g = _Replay(body)
        r._graphs[key] = (g, ins, g.outs)
        return r._graphs[key]

    r._capture_step = capture
    r.use_graphs = True
    r._graph_failed.update({GraphKey("decode", b, r._form()) for b in r.buckets})
    ps = PARAMS[:3] + [SamplingParams(**{**PARAMS[0].__dict__, "logprobs": 1})]
    want = [o.token_ids for o in LLM(MODEL, max_seq_len=256).generate(PROMPTS[:4], ps)]
    assert [o.token_ids for o in llm.generate(PROMPTS[:4], ps)] == want
    assert {(k.kind, k.masked) for k in keys} >= {("sspec", True)}
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], PARAMS[:3])] == reference()[:3]
    assert {(k.kind, k.masked) for k in keys} >= {("spec", True), ("sspec", True)}


def test_sampled_acceptance_is_exact_for_the_masked_target_only_when_rejected_drafts_stay():
    """Why drafts with distributions are not cut: a draft ``x ~ q`` the grammar rejects,
    kept and verified against the masked target, is rejected and the residual is drawn; the
    first token is then distributed exactly as the masked target.  Cutting such drafts (the
    bonus drawn from the masked target instead) skews it when ``q`` favours banned tokens."""
    from replayssm.engine.sampler import accept_tree
    g = torch.Generator().manual_seed(0)
    B, V = 400_000, 6
    allowed = torch.tensor([True, True, False, True, False, True])
    p = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64).masked_fill(~allowed, float("-inf")), -1)
    q = torch.tensor([0.05, 0.1, 0.4, 0.05, 0.3, 0.1], dtype=torch.float64)
    x = torch.multinomial(q.float(), B, replacement=True, generator=g)
    tokens = torch.stack([torch.zeros(B, dtype=torch.long), x], 1)
    parent = torch.tensor([-1, 0]).expand(B, 2)
    P = p.expand(B, 2, V)
    Q = torch.stack([torch.zeros(V, dtype=torch.float64), q]).expand(B, 2, V)
    u = torch.rand(B, 3, generator=g, dtype=torch.float64)

    def first_tokens(valid):
        acc, _, bonus = accept_tree(P, tokens, parent, valid, Q, u)
        return torch.where(acc >= 2, x, bonus)

    kept = torch.bincount(first_tokens(torch.ones(B, 2, dtype=torch.bool)), minlength=V).double() / B
    cut = torch.bincount(first_tokens(torch.stack([torch.ones(B, dtype=torch.bool), allowed[x]], 1)),
                         minlength=V).double() / B
    tol = 5 * (p * (1 - p) / B).sqrt() + 1e-4
    assert ((kept - p).abs() <= tol).all(), (kept, p)
    assert kept[~allowed].sum() == 0 and cut[~allowed].sum() == 0
    assert (cut - p).abs().max() > 0.02, (cut, p)   # the cut skews it
