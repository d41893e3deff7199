"""Sampling: transforms, seeded reproducibility, and lossless speculative sampling."""

import math

import pytest
import torch

from replayssm import LLM, SamplingParams, SpeculativeConfig
from replayssm.engine.sampler import accept_greedy, accept_tree, sample_from, transform

from engine_helpers import PROMPTS


def chi2_critical(dof: int, z: float = 3.29) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z=3.29 is p = 0.0005."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    exp = probs * n
    keep = exp > 5
    stat = float((((counts - exp) ** 2)[keep] / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def joint3(target, prompt) -> torch.Tensor:
    """The exact distribution of ``target``'s first three sampled tokens (temperature 1) after
    ``prompt``, over a 4-token vocabulary: ``[64]``, index ``a*16 + b*4 + c``."""
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt]))[0, -1], -1)
        p2 = torch.softmax(target(torch.tensor([[*prompt, a] for a in range(4)]))[:, -1], -1)
        p3 = torch.softmax(target(torch.tensor([[*prompt, a, b] for a in range(4) for b in range(4)]))[:, -1], -1)
    return (p1[:, None, None] * p2[:, :, None] * p3.reshape(4, 4, 4)).reshape(-1)


def assert_first_three_follow(outs, expect: torch.Tensor) -> None:
    """The outputs' first three tokens (4-token vocabulary) pass a chi-square test against
    ``expect [64]``."""
    counts = torch.zeros(64, dtype=torch.float64)
    for o in outs:
        a, b, c = o.token_ids
        counts[a * 16 + b * 4 + c] += 1
    stat, dof = chi2(counts, expect)
    assert stat < chi2_critical(dof), (stat, dof)


def test_transform_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]]).repeat(4, 1)
    temp = torch.tensor([0.0, 1.0, 1.0, 2.0])
    top_k = torch.tensor([0, 2, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 0.6, 1.0])
    p = transform(logits, temp, top_k, top_p)
    assert torch.equal(p[0], torch.tensor([1.0, 0, 0, 0, 0]))                   # greedy: one-hot
    assert (p[1, 2:] == 0).all() and torch.allclose(p[1, :2].sum(), torch.tensor(1.0))  # top-k 2
    full = torch.softmax(logits[0], -1)
    kept = (p[2] > 0).sum()
    assert full.sort(descending=True).values[: kept - 1].sum() < 0.6 <= full.sort(descending=True).values[:kept].sum()
    assert torch.allclose(p[3], torch.softmax(logits[0] / 2, -1))
    assert torch.allclose(p.sum(-1), torch.ones(4))


def test_sample_from_matches_probs():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.1, 0.0, 0.5, 0.25, 0.15])
    M = 20000
    u = torch.rand(M, generator=g)
    s = sample_from(probs.expand(M, -1), u)
    counts = torch.bincount(s, minlength=5).double()
    assert counts[1] == 0
    stat, dof = chi2(counts, probs.double())
    assert stat < chi2_critical(dof)


# ---- a synthetic bigram world: target P[prev] and draft Q[prev] over V tokens ----------
V = 4


def _tables(seed=0):
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(2 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    Q = torch.softmax(2 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    return P, Q


def _chain(root, Q, k, g, sampled):
    B = root.shape[0]
    toks, qs = [root], [torch.zeros(B, V, dtype=torch.float64)]
    for _ in range(k):
        q = Q[toks[-1]]
        t = sample_from(q, torch.rand(B, generator=g, dtype=torch.float64)) if sampled else q.argmax(-1)
        toks.append(t)
        qs.append(q)
    tokens = torch.stack(toks, 1)
    parent = torch.arange(-1, k).expand(B, k + 1)
    return tokens, parent, torch.stack(qs, 1) if sampled else None


def _tree(root, Q, g, sampled, width=3):
    """root -> `width` children (i.i.d. draws, or the top-`width` distinct tokens) -> one
    child each (a draw, or the top token)."""
    B = root.shape[0]
    toks, pars, qs = [root], [-1], [torch.zeros(B, V, dtype=torch.float64)]
    q0 = Q[root]
    top = q0.topk(width, -1).indices
    for c in range(width):
        t = sample_from(q0, torch.rand(B, generator=g, dtype=torch.float64)) if sampled else top[:, c]
        toks.append(t)
        pars.append(0)
        qs.append(q0)
    for c in range(width):
        q1 = Q[toks[1 + c]]
        t = sample_from(q1, torch.rand(B, generator=g, dtype=torch.float64)) if sampled else q1.argmax(-1)
        toks.append(t)
        pars.append(1 + c)
        qs.append(q1)
    tokens = torch.stack(toks, 1)
    parent = torch.tensor(pars).expand(B, -1)
    return tokens, parent, torch.stack(qs, 1) if sampled else None


@pytest.mark.parametrize("kind", ["chain-sampled", "chain-delta", "tree-iid", "tree-distinct"])
def test_speculative_sampling_preserves_target_distribution(kind):
    """The first two generated tokens are distributed as P[0][a] * P[a][b] (chi-square)."""
    P, Q = _tables()
    g = torch.Generator().manual_seed(1)
    M, n = 12000, 2
    out = [[] for _ in range(M)]
    root = torch.zeros(M, dtype=torch.long)
    rows = torch.arange(M)
    while rows.numel():
        r = root[rows]
        sampled = kind.endswith("sampled") or kind.endswith("iid")
        if kind.startswith("chain"):
            tokens, parent, q = _chain(r, Q, 3, g, sampled)
        else:
            tokens, parent, q = _tree(r, Q, g, sampled)
        p = P[tokens]
        valid = torch.ones_like(tokens, dtype=torch.bool)
        u = torch.rand(len(rows), tokens.shape[1] + 1, generator=g, dtype=torch.float64)
        acc, leaf, bonus = accept_tree(p, tokens, parent, valid, q, u)
        from replayssm.cache.tree import path_to

        path, _ = path_to(parent, leaf)
        keep = []
        for j, b in enumerate(rows.tolist()):
            new = [int(tokens[j, i]) for i in path[j, 1:int(acc[j])]] + [int(bonus[j])]
            out[b].extend(new)
            root[b] = out[b][-1]
            if len(out[b]) < n:
                keep.append(b)
        rows = torch.tensor(keep, dtype=torch.long)
    counts = torch.zeros(V * V, dtype=torch.float64)
    for o in out:
        counts[o[0] * V + o[1]] += 1
    expect = (P[0][:, None] * P).reshape(-1)
    stat, dof = chi2(counts, expect)
    assert stat < chi2_critical(dof), (stat, dof)


def test_invalid_nodes_are_skipped():
    P, Q = _tables()
    B = 3
    tokens = torch.tensor([[0, 1, 2, 3]] * B)
    parent = torch.tensor([[-1, 0, 1, 2]] * B)
    valid = torch.tensor([[True, True, False, False]] * B)
    p = torch.zeros(B, 4, V, dtype=torch.float64)
    p[:, :, :] = torch.eye(V, dtype=torch.float64)[[1, 2, 3, 0]]  # greedy: node i predicts tokens[i+1]
    acc, leaf, bonus = accept_greedy(p, tokens, parent, valid)
    assert acc.tolist() == [2] * B and bonus.tolist() == [2] * B
    acc2, leaf2, bonus2 = accept_tree(p, tokens, parent, valid, None, torch.full((B, 5), 0.5, dtype=torch.float64))
    assert acc2.tolist() == acc.tolist() and bonus2.tolist() == bonus.tolist()


def test_seeded_sampling_is_reproducible(target):
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_k=8, top_p=0.95, seed=s) for s in (11, 12, 11)]
    llm = LLM(target)
    a = [o.token_ids for o in llm.generate(PROMPTS[:3], params)]
    assert a[0] != a[1] or PROMPTS[0] != PROMPTS[1]
    # same seeds, a different batch composition and order: same outputs
    llm2 = LLM(target, max_num_seqs=1)
    b = [o.token_ids for o in llm2.generate([PROMPTS[2], PROMPTS[0]], [params[2], params[0]])]
    assert b == [a[2], a[0]]


@pytest.mark.parametrize("method", ["ngram", "draft", "tree"])
def test_seeded_speculative_sampling_is_reproducible(target, draft, method):
    sp = SpeculativeConfig(method, num_tokens=3, draft_model=draft if method != "ngram" else None,
                           tree_width=2, tree_depth=2)
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=5)
    runs = [[o.token_ids for o in LLM(target, speculative=sp).generate(PROMPTS[:3], params)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(len(t) == 20 for t in runs[0])


@pytest.mark.parametrize("method", ["draft", "tree", "tree-static", "ngram-tree"])
def test_engine_speculative_sampling_distribution(method):
    """End to end on a 4-token vocabulary: the first three sampled tokens (two of them from
    speculative steps) follow the model's own joint distribution (chi-square, 64 cells)."""
    from recompute_model import tiny_pair

    target, draft = tiny_pair(vocab_size=4, draft_noise=1.0)
    prompt = [1, 2]
    if method == "tree-static":
        sp = SpeculativeConfig("tree", draft_model=draft, tree=[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)],
                               spec_policy="fixed")
    elif method == "ngram-tree":
        prompt = [1, 2, 3, 1, 2, 0, 1, 2]  # several earlier continuations of the last tokens
        sp = SpeculativeConfig("tree", num_tokens=2, tree_width=3, prompt_lookup_max=2, spec_policy="fixed")
    else:   # fixed: every step speculates at this batch (the adaptive policy would decode plainly)
        sp = SpeculativeConfig(method, num_tokens=3, draft_model=draft, tree_width=2, tree_depth=2,
                               spec_policy="fixed")
    expect = joint3(target, prompt)   # exact joint distribution of the first three tokens
    llm = LLM(target, speculative=sp, max_num_seqs=256, seed=3)
    M = 4000
    outs = llm.generate([prompt] * M, SamplingParams(max_tokens=3, temperature=1.0))
    assert_first_three_follow(outs, expect)
    assert sum(o.num_accepted for o in outs) > 0


def test_ngram_index_matches_brute_force():
    """The incremental n-gram index proposes exactly what a full scan finds."""
    import random

    from replayssm.engine.spec import NgramIndex, ngram_continuations

    rng = random.Random(0)
    for trial in range(40):
        vocab = rng.choice([2, 3, 5])
        n_min = rng.randint(1, 2)
        n_max = rng.randint(n_min, 4)
        idx = NgramIndex(n_min, n_max)
        ids = []
        for _ in range(rng.randint(1, 60)):
            ids.append(rng.randrange(vocab))
            if rng.random() < 0.5:
                length, count = rng.randint(1, 5), rng.randint(1, 4)
                assert idx.continuations(ids, length, count) == ngram_continuations(ids, n_min, n_max, length, count)


def test_ngram_drafter_keeps_its_own_copy_of_each_sequence():
    """The drafter's lookups (``NgramIndex.sync``: the new tokens only, no concatenation of
    the whole context per step) equal a full scan of ``prompt + output`` as outputs grow,
    and a request id used again by a new sequence gets a fresh index."""
    import random

    from replayssm import SamplingParams
    from replayssm.engine.sequence import Sequence
    from replayssm.engine.spec import NgramTreeDrafter, ngram_continuations

    rng = random.Random(1)
    drafter = NgramTreeDrafter(3, 3, 1, 3, "cpu")
    for trial in range(6):
        s = Sequence([rng.randrange(4) for _ in range(rng.randint(1, 30))], SamplingParams(max_tokens=64),
                     request_id="same-id")      # every trial reuses the id (the last one was not released)
        for _ in range(12):
            s.output_ids.extend(rng.randrange(4) for _ in range(rng.randint(1, 4)))
            got = drafter._lookup(s, 4, 3)
            assert got == ngram_continuations(s.prompt_ids + s.output_ids, 1, 3, 4, 3)
