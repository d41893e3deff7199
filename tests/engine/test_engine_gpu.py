"""The engine on CUDA: every mode and drafter keeps greedy output, with and without CUDA
graphs, for a Mamba-2 and the two hybrid families at small size (skipped without a GPU)."""

import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N = 16
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9] * 12, list(range(40))]


DEVICE = "cuda"


@pytest.fixture(scope="module", params=["tiny", "nemotron-h-tiny", "qwen3-next-tiny"])
def cuda_model(request, tmp_path_factory):
    """A random fp32 model of the preset (Mamba-2, and the two hybrid families: attention,
    MLP / MoE layers) on the GPU, and its greedy continuations of PROMPTS (full forwards)."""
    models = pytest.importorskip("replayssm.models")
    from replayssm.bench.e2e import _random_model_dir

    d = _random_model_dir(request.param, str(tmp_path_factory.mktemp("gpu_model")))
    m = models.load_model(d, device=f"{DEVICE}:0" if DEVICE == "cuda" else DEVICE, dtype=torch.float32)
    return m, [_full_forward_greedy(m, p) for p in PROMPTS]


def _full_forward_greedy(m, prompt):
    """``N`` greedy tokens by full forwards over the whole sequence (the ground truth)."""
    ids, gen = torch.tensor([prompt], device=DEVICE), []
    for _ in range(N):
        t = int(m(ids)[0, -1].argmax())
        gen.append(t)
        ids = torch.cat([ids, torch.tensor([[t]], device=DEVICE)], 1)
    return gen


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
def test_cuda_modes(cuda_model, mode, graphs):
    from replayssm import LLM, SamplingParams

    m, expected = cuda_model
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        llm = LLM(m, device=DEVICE, dtype="float32", decode_mode=mode, cuda_graphs=graphs, max_seq_len=128, max_num_seqs=len(PROMPTS),
                  auto_threshold=10)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected  # graphs or their eager fallback: exact
    if graphs and mode in ("recurrent", "replay"):
        failed = [str(x.message) for x in w if "CUDA graph" in str(x.message)]
        if failed:
            pytest.xfail(f"the model's decode is not capturable yet: {failed[0][:300]}")
        assert llm.runner._graphs, "no decode graph was captured"


class _GraphableModel:
    """A device-only toy with the decode API (state per slot), to test capture and replay."""

    def __init__(self, V=50, D=16, device="cuda"):
        g = torch.Generator(device="cpu").manual_seed(0)
        self.emb = torch.randn(V, D, generator=g).to(device)
        self.w = torch.randn(D, V, generator=g).to(device)

        class C:
            vocab_size, eos_token_id = V, None

        self.config = C()

    def make_cache(self, num_slots, spec=None, **fields):
        return {"state": torch.zeros(num_slots, self.emb.shape[1], device=self.emb.device)}

    def prefill(self, cache, slots, ids, lengths):
        st = cache["state"]
        for b in range(ids.shape[0]):
            for t in range(int(lengths[b])):
                st[slots[b]] = 0.5 * st[slots[b]] + self.emb[ids[b, t]]
        return st[slots] @ self.w

    def decode(self, cache, slots, ids):
        st = cache["state"]
        st[slots] = 0.5 * st[slots] + self.emb[ids]
        return st[slots] @ self.w

    def verify(self, cache, slots, ids):
        st = cache["state"][slots]
        states = []
        for t in range(ids.shape[1]):
            st = 0.5 * st + self.emb[ids[:, t]]
            states.append(st)
        states = torch.stack(states, 1)                       # [B, T, D]
        cache["pending"] = (slots, states)
        return states @ self.w

    def commit(self, cache, accepted, path=None):
        slots, states = cache.pop("pending")
        B = slots.shape[0]
        pick = states[torch.arange(B, device=slots.device), (accepted - 1).clamp(min=0)]
        keep = (accepted > 0)[:, None]
        cache["state"][slots] = torch.where(keep, pick, cache["state"][slots])

    verify_tree = None


def test_runner_graph_capture_and_padding():
    from replayssm.engine.model_runner import ModelRunner

    m = _GraphableModel()
    outs = {}
    for graphs in (False, True):
        cache = m.make_cache(9)
        r = ModelRunner(m, cache, "cuda", max_batch=8, cuda_graphs=graphs)
        m.prefill(cache, torch.arange(1, 6, device="cuda"), torch.ones(5, 3, dtype=torch.long, device="cuda"),
                  torch.full((5,), 3, device="cuda"))
        seq = []
        for step in range(6):
            slots = [1, 2, 3, 4, 5][: 5 - step % 3]   # batch sizes change between steps
            toks = torch.tensor([(step * 7 + s) % 50 for s in slots])
            seq.append(r.decode(slots, toks).clone())
        outs[graphs] = (seq, cache["state"][1:6].clone())
        if graphs:
            assert r._graphs and not r._graph_failed
    for a, b in zip(outs[False][0], outs[True][0]):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(outs[False][1], outs[True][1])


@pytest.mark.parametrize("method", ["ngram", "draft", "tree"])
@pytest.mark.parametrize("mode", ["recurrent", "replay", "auto"])
def test_cuda_speculation(cuda_model, method, mode):
    from replayssm import LLM, SamplingParams, SpeculativeConfig

    m, expected = cuda_model
    # fixed: every step drafts (the adaptive policy may not, with the target as its own draft)
    sp = SpeculativeConfig(method, num_tokens=3, draft_model=None if method == "ngram" else m, tree_width=2,
                           tree_depth=2, spec_policy="fixed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(m, device=DEVICE, dtype="float32", decode_mode=mode, speculative=sp, max_seq_len=128, max_num_seqs=len(PROMPTS),
                  auto_threshold=10, cuda_graphs=True)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    if method != "ngram":
        assert min(o.mean_accepted_length for o in outs) > 2


@pytest.mark.parametrize("method", ["ngram", "draft", "tree"])
@pytest.mark.parametrize("mode", ["replay", "auto"])
def test_cuda_forced_draft_lengths_under_graphs(cuda_model, method, mode):
    """The length policy forced through random draft lengths (0 included) with CUDA graphs:
    every length replays its own captured verify graph and greedy output stays exact; the
    adaptive policy's start-up measurement covers every bucket and length."""
    import random

    from replayssm import LLM, SamplingParams, SpeculativeConfig
    from replayssm.engine.spec.policy import ScriptedLengths

    m, expected = cuda_model
    sp = SpeculativeConfig(method, num_tokens=3, draft_model=None if method == "ngram" else m, tree_width=2,
                           tree_depth=2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        llm = LLM(m, device=DEVICE, dtype="float32", decode_mode=mode, speculative=sp, max_seq_len=128,
                  max_num_seqs=len(PROMPTS), auto_threshold=10, cuda_graphs=True)
        L = llm.executor.lengths
        assert {(b, T) for b in llm.runner.buckets for T in (0,) + L.lengths} <= set(L.costs.table)
        rng = random.Random(len(method))
        llm.executor.lengths = ScriptedLengths(
            L.lengths, [0 if i % 3 == 1 else rng.randrange(L.max + 1) for i in range(64)], L.tree, L.depth)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    assert llm.stats["spec_T0_steps"] > 0 and any(llm.stats[f"spec_T{T}_steps"] for T in L.lengths)
    failed = [str(x.message) for x in w if "CUDA graph" in str(x.message)]
    assert not failed, failed[0][:500]


@pytest.mark.parametrize("method", ["draft", "tree"])
def test_cuda_speculation_large_grid_forms(cuda_model, method, monkeypatch):
    """The verify kernels' large-batch forms (Mamba-2: the split readout / combine kernels),
    forced at this small batch: greedy output still exact."""
    from replayssm import LLM, SamplingParams, SpeculativeConfig
    from replayssm.kernels import mamba2 as km

    monkeypatch.setattr(km, "LARGE_GRID", 1)
    m, expected = cuda_model
    sp = SpeculativeConfig(method, num_tokens=3, draft_model=m, tree_width=2, tree_depth=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(m, device=DEVICE, dtype="float32", decode_mode="replay", speculative=sp, max_seq_len=128,
                  max_num_seqs=len(PROMPTS), cuda_graphs=True)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
def test_cuda_prefix_caching(cuda_model, mode):
    """Prefix caching on the GPU (the fold kernel resumes and checkpoints): prompts sharing
    0, 1, a block, a checkpoint interval and more of a cached prompt, one by one and then all
    at once, give the full forwards' greedy output (fp32)."""
    from replayssm import LLM, SamplingParams

    m, expected = cuda_model
    base = PROMPTS[3]                                       # 40 tokens
    llm = LLM(m, device=DEVICE, dtype="float32", decode_mode=mode, cuda_graphs=True, max_seq_len=128,
              max_num_seqs=len(PROMPTS), auto_threshold=10, enable_prefix_caching=True, kv_block_size=4,
              prefix_checkpoint_interval=8, buffer_size=6)
    params = SamplingParams(max_tokens=N)
    assert llm.generate([base], params)[0].token_ids == expected[3]
    for p, want in zip(PROMPTS, expected):
        assert llm.generate([p], params)[0].token_ids == want
    prompts = [base[:k] + [3, 1, 4] for k in (1, 4, 8, 9, 13, 14, 15, 17, 23, 33)]
    want = [_full_forward_greedy(m, p) for p in prompts]
    for p, w in zip(prompts, want):
        assert llm.generate([p], params)[0].token_ids == w
    assert [o.token_ids for o in llm.generate(prompts[:4], params)] == want[:4]
    assert llm.prefix_stats()["prefix_hits"] >= len(prompts)


def test_runner_speculative_step_graphs_match_eager():
    from replayssm.engine.model_runner import ModelRunner
    from replayssm.engine.spec import chain_parent

    m = _GraphableModel()
    results = {}
    for graphs in (False, True):
        cache = m.make_cache(9)
        r = ModelRunner(m, cache, "cuda", max_batch=8, cuda_graphs=graphs)
        m.prefill(cache, torch.arange(1, 6, device="cuda"), torch.ones(5, 3, dtype=torch.long, device="cuda"),
                  torch.full((5,), 3, device="cuda"))
        g = torch.Generator().manual_seed(0)
        outs = []
        for step in range(6):
            slots = [1, 2, 3, 4, 5][: 5 - step % 3]
            B = len(slots)
            # drafts: the greedy continuation for some rows (accepted), noise for others
            toks = torch.randint(0, 50, (B, 4), generator=g)
            st = cache["state"][slots[0]].clone()
            for t in range(3):  # row 0 drafts the exact greedy chain: all accepted
                st = 0.5 * st + m.emb[toks[0, t]]
                toks[0, t + 1] = int((st @ m.w).argmax())
            valid = torch.ones(B, 4, dtype=torch.bool)
            valid[1, 3] = False
            acc, bonus, path = r.greedy_verify_step(slots, toks, chain_parent(B, 4, "cpu"), valid, tree=False)
            outs.append((acc.clone(), bonus.clone()))
            assert int(acc[0]) == 4
            st = m.decode(cache, torch.tensor(slots, device="cuda"), bonus)  # feed the bonus token
            outs.append((st.argmax(-1).clone(),))
        results[graphs] = (outs, cache["state"][1:6].clone())
        if graphs:
            assert any(k.kind == "spec" for k in r._graphs) and not r._graph_failed
    for a, b in zip(results[False][0], results[True][0]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)
    torch.testing.assert_close(results[False][1], results[True][1])
