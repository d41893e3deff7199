"""Tensor parallelism on CPU: two processes over gloo, greedy output identical to one.

One worker group is spawned for the module and every model and engine below runs on it
(spawning costs seconds on a loaded machine); the last tests start an engine-owned group
and kill its worker.  Models: tiny random transformers checkpoints with odd per-rank head
counts (6 Mamba-2 / attention / GDN value heads: 3 per rank), both group layouts (Mamba-2
groups replicated with a cross-rank gated norm; groups split), KV heads split and
replicated, MoE with a shared expert and a latent projection, row-parallel biases, tied
embeddings and an odd vocabulary (61: a padded vocabulary shard).  The same checkpoints with
an MTP head (its layers sharded by the same rules) serve MTP speculation.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
import time
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

import hf_utils as H  # noqa: E402
import mtp_checkpoint as M  # noqa: E402
from tp_checks import assert_bf16_states_on_every_rank  # noqa: E402

from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.cache.spec import CacheSpec  # noqa: E402
from replayssm.models import load_model  # noqa: E402
from replayssm.models.registry import read_config  # noqa: E402

dist_mod = pytest.importorskip("replayssm.distributed")
from replayssm.distributed import WorkerFailed, check_tensor_parallel  # noqa: E402

N_NEW = 10
MAXLEN = 64
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]

SPECS = {
    # Mamba-2, one group: B/C replicated on both ranks, the gated norm spans them; tied embeddings
    "mamba2": (H.tiny_mamba2, dict(num_heads=6, head_dim=5, hidden_size=15, n_groups=1, num_hidden_layers=2,
                                   tie_word_embeddings=True)),
    # Nemotron-H: Mamba (2 groups: split) + attention (6 heads, 1 KV head: replicated) + relu2 MLP
    # + sigmoid MoE with shared expert and latent projection; biases on every projection
    "nemotron_h": (H.tiny_nemotron_h, dict(hybrid_override_pattern="M*-EM", mamba_num_heads=6, n_groups=2,
                                           num_attention_heads=6, num_key_value_heads=1, intermediate_size=18,
                                           moe_intermediate_size=10, moe_shared_expert_intermediate_size=6,
                                           moe_latent_size=5, use_bias=True, mlp_bias=True)),
    # Qwen3-Next: GDN (2 key heads, 6 value heads) + gated attention (6 heads, 2 KV heads: split,
    # with biases) + a dense MLP layer and MoE layers with a gated shared expert
    "qwen3_next": (H.tiny_qwen3_next, dict(linear_num_key_heads=2, linear_num_value_heads=6, num_attention_heads=6,
                                           num_key_value_heads=2, moe_intermediate_size=10,
                                           shared_expert_intermediate_size=6, intermediate_size=18,
                                           mlp_only_layers=[0], attention_bias=True)),
    # the draft model for draft-model speculation (unsharded, on rank 0)
    "draft": (H.tiny_mamba2, dict(num_heads=4, head_dim=4, hidden_size=8, n_groups=1, num_hidden_layers=1)),
}
ARCHS = ["mamba2", "nemotron_h", "qwen3_next"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tiny models in several processes; ``tests/conftest.py``)."""


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    out = {}
    for i, (name, (fn, over)) in enumerate(SPECS.items()):
        m = fn(seed=11 + i, **over)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[name] = H.save_tiny(m, str(root / name))
    return out


#: the MTP fc's noise: some drafts accepted, some rejected (catch-ups of every length)
MTP_NOISE = {"mamba2": 0.8, "qwen3_next": 1.5, "nemotron_h": 1.5}


@pytest.fixture(scope="module")
def mtp_paths(paths, tmp_path_factory):
    """The three checkpoints with a random MTP head each (made predictable: drafts accepted)."""
    import shutil

    root = tmp_path_factory.mktemp("tp_mtp_models")
    out = {}
    for i, name in enumerate(ARCHS):
        d = str(root / name)
        shutil.copytree(paths[name], d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            M.add_mtp(d, seed=3 + i)
        M.make_predictable(d, seed=1, mtp_noise=MTP_NOISE[name])
        out[name] = d
    return out


@pytest.fixture(scope="module")
def models(paths, group):
    """``models(name, dtype) -> (TP=1 model, TP=2 model)`` (cached)."""
    cache = {}

    def get(name, dtype="float64"):
        if (name, dtype) not in cache:
            cache[name, dtype] = (load_model(paths[name], dtype=dtype), group.load_model(paths[name], dtype=dtype))
        return cache[name, dtype]

    return get


@pytest.fixture(scope="module")
def mtp_models(mtp_paths, group):
    """``mtp_models(name, dtype) -> (TP=1 model, TP=2 model)``, both with their MTP head (cached)."""
    cache = {}

    def get(name, dtype="float64"):
        if (name, dtype) not in cache:
            p = mtp_paths[name]
            cache[name, dtype] = (load_model(p, dtype=dtype, mtp=True), group.load_model(p, dtype=dtype, mtp=True))
        return cache[name, dtype]

    return get


@pytest.fixture(scope="module")
def expected(models):
    """Greedy continuations of PROMPTS by full forwards of the TP=1 model (the ground truth)."""
    cache = {}

    def get(name, dtype="float64"):
        if (name, dtype) not in cache:
            m = models(name, dtype)[0]
            rows = []
            for p in PROMPTS:
                ids, gen = torch.tensor([p]), []
                for _ in range(N_NEW):
                    t = int(m(ids)[0, -1].argmax())
                    gen.append(t)
                    ids = torch.cat([ids, torch.tensor([[t]])], 1)
                rows.append(gen)
            cache[name, dtype] = rows
        return cache[name, dtype]

    return get


def _generate(model, params=None, outputs=False, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM(model, max_seq_len=MAXLEN, **kw) as llm:
            outs = llm.generate(PROMPTS, params or SamplingParams(max_tokens=N_NEW))
    return outs if outputs else [o.token_ids for o in outs]


# ---------------------------------------------------------------------------------------
# before any process: configuration checks
# ---------------------------------------------------------------------------------------
def test_bad_size_is_refused_before_any_process_starts(paths):
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"num_heads \(6\)"):
        LLM(paths["mamba2"], tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\)"):
        LLM(paths["qwen3_next"], tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        LLM(paths["mamba2"], tensor_parallel_size=0)
    assert multiprocessing.active_children() == before
    nem = read_config(paths["nemotron_h"])
    with pytest.raises(ValueError, match=r"mamba_num_heads \(6\)"):
        check_tensor_parallel(nem, 4)
    with pytest.raises(ValueError, match=r"n_groups \(2\)"):
        check_tensor_parallel(dataclasses.replace(read_config(paths["mamba2"]), n_groups=2), 3)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(7\)"):
        check_tensor_parallel(dataclasses.replace(nem, moe_intermediate_size=7), 2)


def test_a_config_that_contradicts_the_checkpoint_is_named_before_a_shard_is_built(paths, tmp_path, monkeypatch):
    """The tensor-parallel loader runs the single-GPU loader's header check first: a config
    field that the tensors contradict is a ConfigError naming it, before any skeleton."""
    import json
    import shutil

    from replayssm.distributed import loading
    from replayssm.models import ConfigError

    bad = tmp_path / "bad"
    shutil.copytree(paths["mamba2"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["state_size"] = 2 * cfg["state_size"]
    (bad / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(loading, "_skeletons", lambda *a, **k: pytest.fail("a shard skeleton was built"))
    with pytest.raises(ConfigError, match="state_size") as e:
        loading.load_shard(str(bad), 0, 2)
    assert "config.json" in str(e.value)


@pytest.mark.parametrize("mtp", [False, True])
def test_each_rank_reads_only_its_shard(paths, mtp_paths, monkeypatch, mtp):
    """Rank 1's load never reads a sharded tensor whole: only its slices come off the file
    (with ``mtp``: the MTP head's layers too; its fc is replicated)."""
    import safetensors

    from replayssm.distributed.loading import load_shard
    from replayssm.distributed.sharding import Shard, shard_rules

    real = safetensors.safe_open
    read = {}   # key -> elements read

    class Slice:
        def __init__(self, sl, key):
            self.sl, self.key = sl, key

        def get_shape(self):
            return self.sl.get_shape()

        def get_dtype(self):
            return self.sl.get_dtype()

        def __getitem__(self, idx):
            t = self.sl[idx]
            read[self.key] = read.get(self.key, 0) + t.numel()
            return t

    class Handle:
        def __init__(self, *a, **kw):
            self.h = real(*a, **kw)

        def keys(self):
            return self.h.keys()

        def get_slice(self, key):
            return Slice(self.h.get_slice(key), key)

        def get_tensor(self, key):
            t = self.h.get_tensor(key)
            read[key] = read.get(key, 0) + t.numel()
            return t

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return self.h.__exit__(*a)

    monkeypatch.setattr(safetensors, "safe_open", Handle)
    src = mtp_paths if mtp else paths
    for name in ARCHS:
        full = load_model(src[name], dtype="float64", mtp=mtp)
        read.clear()
        local = load_shard(src[name], rank=1, size=2, dtype="float64", mtp=mtp)
        rules = shard_rules(full, 2, 1)
        sharded = {n: r for n, r in rules.items() if isinstance(r, Shard)}
        assert sharded
        assert any(n.startswith("mtp.") for n in sharded) == mtp
        if mtp:
            fc = "mtp.layers.0.eh_proj.weight" if name == "nemotron_h" else "mtp.fc.weight"
            assert fc not in rules and local.mtp.target is local
        lp, fp = dict(local.named_parameters()), dict(full.named_parameters())
        for n, rule in sharded.items():
            key = n if n in read else None
            if key is not None:  # single-key tensors: exactly the shard's elements were read
                assert read[key] == lp[n].numel() * rule.size // lp[n].shape[rule.dim], n
        # row-parallel biases: zeros on rank 1; replicated tensors equal the full model's
        for n, p in lp.items():
            if rules.get(n) == "root_only":
                assert torch.count_nonzero(p) == 0, n
            elif n not in rules:
                assert torch.equal(p, fp[n]), n
        # the vocabulary shard: rows [31, 61) of 61, one padding row of zeros
        emb = local.embed_weight()
        assert emb.shape[0] == 31 and torch.equal(emb[:30], full.embed_weight()[31:]) and not emb[30].any()


# ---------------------------------------------------------------------------------------
# two processes
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_full_forward_matches(models, arch):
    ref, tp = models(arch)
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    a, b = ref(ids), tp(ids)
    assert b.shape == a.shape == (2, 9, 61)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    assert tp.tensor_parallel_size == 2


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_one_rank(models, expected, arch, mode, dtype):
    """Every decode mode (replay also with padded batches, the CUDA-graph path's padding)."""
    tp = models(arch, dtype)[1]
    assert _generate(tp, decode_mode=mode, auto_threshold=6, pad_batches=mode == "replay") == expected(arch, dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("method", ["ngram", "draft", "ngram-tree", "draft-tree"])
@pytest.mark.parametrize("arch", ARCHS)
def test_speculation_keeps_greedy_output(models, expected, arch, method, dtype):
    ref, tp = models(arch, dtype)
    draft = models("draft", dtype)[0]
    sp = {"ngram": SpeculativeConfig("ngram", num_tokens=3),
          "draft": SpeculativeConfig("draft", num_tokens=3, draft_model=draft),
          "ngram-tree": SpeculativeConfig("tree", num_tokens=3, tree_width=2),
          "draft-tree": SpeculativeConfig("tree", draft_model=ref, tree_width=2, tree_depth=2)}[method]
    mode = {"mamba2": "replay", "nemotron_h": "kv", "qwen3_next": "recurrent"}[arch] if method != "draft-tree" \
        else "replay"
    assert _generate(tp, decode_mode=mode, speculative=sp) == expected(arch, dtype)


def test_sampled_speculation_matches_one_rank(models):
    """Sampling: rank 0 samples and accepts; the commit of the accepted counts is broadcast."""
    ref, tp = models("qwen3_next")
    sp = SpeculativeConfig("draft", num_tokens=3, draft_model=models("draft")[0])
    params = SamplingParams(max_tokens=N_NEW, temperature=0.9, seed=5)
    assert _generate(tp, params, speculative=sp, decode_mode="auto", auto_threshold=6) == \
        _generate(ref, params, speculative=sp, decode_mode="auto", auto_threshold=6)


def _mtp(tree=None):
    return SpeculativeConfig("mtp", num_tokens=3, tree=tree, tree_width=2)


@pytest.mark.parametrize("dtype,tree", [("float64", None), ("float32", None), ("float64", "topk")])
@pytest.mark.parametrize("mode", ["replay", "recurrent"])
@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_speculation_matches_one_rank(mtp_models, arch, mode, dtype, tree):
    """MTP under tensor parallelism (the head's layers sharded, every draft step on both
    ranks): the greedy output, and the drafts accepted per request, equal one rank's with
    MTP, which equals plain decoding; drafts were both accepted and rejected.  Chains in
    float64 and float32, trees in float64."""
    ref, tp = mtp_models(arch, dtype)
    kw = dict(decode_mode=mode, speculative=_mtp(tree))
    one = _generate(ref, outputs=True, **kw)
    two = _generate(tp, outputs=True, pad_batches=mode == "replay", **kw)
    assert [o.token_ids for o in two] == [o.token_ids for o in one] == _generate(ref, decode_mode=mode)
    assert [o.num_accepted for o in two] == [o.num_accepted for o in one]
    assert 0 < sum(o.num_accepted for o in two) < sum(o.num_drafted for o in two)


@pytest.mark.parametrize("tree", [None, "topk"])
def test_mtp_sampled_speculation_matches_one_rank(mtp_models, tree):
    """Sampled MTP drafts: rank 0's uniforms and sampling parameters go to every rank, so
    both draw the same drafts from the same gathered logits; with the same seeds the output
    equals one rank's draw for draw (the same distribution, exactly), drafts accepted and
    rejected alike, and the greedy row in the batch stays greedy."""
    ref, tp = mtp_models("qwen3_next")
    params = [SamplingParams(max_tokens=N_NEW, temperature=0.9, seed=5), SamplingParams(max_tokens=N_NEW),
              SamplingParams(max_tokens=N_NEW, temperature=1.0, top_k=5)]
    kw = dict(speculative=_mtp(tree), decode_mode="auto", auto_threshold=6, seed=3)
    one, two = (_generate(m, params, outputs=True, **kw) for m in (ref, tp))
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert [(o.num_drafted, o.num_accepted) for o in two] == [(o.num_drafted, o.num_accepted) for o in one]
    assert 0 < sum(o.num_accepted for o in two) < sum(o.num_drafted for o in two)
    assert two[1].token_ids == _generate(ref)[1]


def _serve(model, preempt_every=0, **kw):
    """PROMPTS (the second with n=2 greedy samples, forked from one prefill); every
    ``preempt_every`` steps the two latest decoding sequences are swapped out.  Returns every
    sample's tokens and the preemption count."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM(model, max_seq_len=MAXLEN, **kw) as llm:
            seqs = [llm.add_request(p, SamplingParams(max_tokens=N_NEW, n=n)) for p, n in zip(PROMPTS, (1, 2, 1))]
            step = 0
            while llm.has_unfinished():
                llm.step()
                step += 1
                if preempt_every and step % preempt_every == 0:
                    for s in [s for s in llm.scheduler.running if not s.prefilling][-2:]:
                        llm.scheduler.preempt(s)
            return [[x.output_ids for x in s.group] for s in seqs], llm.stats["preemptions"]


@pytest.mark.parametrize("tree", [None, "topk"])
def test_mtp_chunked_forked_preempted_and_plain_steps_match_one_rank(mtp_models, tree):
    """Under tensor parallelism the head's per-rank state follows every path one rank's
    does: prompts prefilled in chunks of 5 (each chunk's hidden states), samples forked
    from one prefill, sequences swapped out and back (the head's slot on every rank), and
    plain steps while more than two requests run (``disable_by_batch_size``: the head's
    catch-up on every rank).  Output equals one rank's and plain decoding's."""
    ref, tp = mtp_models("qwen3_next")
    sp = dataclasses.replace(_mtp(tree), disable_by_batch_size=2)
    kw = dict(decode_mode="replay", speculative=sp, max_num_batched_tokens=5, max_num_seqs=3, kv_block_size=4)
    want = [[e] * n for e, n in zip(_generate(ref), (1, 2, 1))]
    one, n1 = _serve(ref, 3, **kw)
    two, n2 = _serve(tp, 3, **kw)
    assert two == one == want
    assert n2 == n1 >= 2


def test_mtp_chains_of_varying_length_match_one_rank(mtp_models):
    """Chains shorter than ``num_tokens`` (a length policy's ``propose(seqs, k)``: 1, 2, 3
    drafts in turn) run on both ranks alike: output and acceptances equal one rank's."""
    ref, tp = mtp_models("nemotron_h")
    got = {}
    for name, m in (("one", ref), ("two", tp)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with LLM(m, max_seq_len=MAXLEN, decode_mode="replay", speculative=_mtp()) as llm:
                propose, calls = llm.drafter.propose, []

                def varying(seqs, k=None):
                    calls.append(len(calls) % 3 + 1)
                    return propose(seqs, calls[-1])

                llm.drafter.propose = varying
                outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))
        got[name] = [(o.token_ids, o.num_drafted, o.num_accepted) for o in outs]
        assert len(calls) >= 3
    assert got["two"] == got["one"]
    assert [g[0] for g in got["two"]] == _generate(ref)


@pytest.mark.parametrize("arch", ["mamba2", "nemotron_h"])
def test_mtp_with_prefix_caching_matches_one_rank(mtp_models, arch):
    """Prefix hits skip the cached tokens' prefill, so no rank keeps their hidden states: the
    head drafts from the computed part on every rank alike, output as one rank's."""
    ref, tp = mtp_models(arch)
    base = [(7 * i + 3) % 61 for i in range(22)]
    prompts = [base, base[:13] + [5, 6], base]
    kw = dict(decode_mode="kv" if arch == "nemotron_h" else "replay", kv_block_size=4, speculative=_mtp(),
              enable_prefix_caching=True, prefix_checkpoint_interval=8)
    params = SamplingParams(max_tokens=N_NEW)
    got = {}
    for name, m in (("one", ref), ("two", tp)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with LLM(m, max_seq_len=MAXLEN, **kw) as llm:
                got[name] = [llm.generate([p], params)[0].token_ids for p in prompts]
                assert llm.stats["prefix_hit_tokens"] > 0
    assert got["two"] == got["one"] == [_generate_one(ref, p, params) for p in prompts]


def test_mtp_steps_proxy_forwards_only_every_rank_methods(mtp_models):
    """Rank 0's handle on the drafter's device half forwards its EVERY_RANK methods and
    refuses the others by name (they would run on rank 0 alone); reads are rank 0's."""
    from replayssm.distributed import ShardedObject

    _, tp = mtp_models("mamba2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM(tp, max_seq_len=MAXLEN, speculative=_mtp()) as llm:
            steps = llm.drafter.steps
            assert isinstance(steps, ShardedObject) and steps.head is tp.mtp is llm.drafter.head
            with pytest.raises(AttributeError, match="inputs: not in its EVERY_RANK"):
                steps.inputs([[1, 1, 0, 0, 0, 0, 0, 0, 0, 0]])
            assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=4))[0].token_ids) == 4


def test_mtp_needs_a_head_and_its_layers_must_split(mtp_paths, models):
    """A split model loaded without its head is refused by name (the group goes on); the MTP
    layers' sizes count only when the head is loaded."""
    _, tp = models("mamba2")
    with pytest.raises(ValueError, match=r"needs the target's MTP head.*TensorParallelGroup\.load_model"):
        LLM(tp, speculative=_mtp(), max_seq_len=MAXLEN)
    assert tp.group.alive and tp.mtp is None
    cfg = read_config(mtp_paths["nemotron_h"])
    dense = dataclasses.replace(cfg, layer_types=tuple(t for t in cfg.layer_types if t != "moe"),
                                moe_intermediate_size=7)
    check_tensor_parallel(dense, 2)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(7\)"):
        check_tensor_parallel(dense, 2, mtp=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_caching_matches_one_rank(models, arch):
    """Prefix caching under tensor parallelism: rank 0's index picks store blocks and
    checkpoints, every rank captures, checkpoints and resumes its heads' share; requests
    resumed at checkpoints, inside blocks and past the ring give one rank's output."""
    ref, tp = models(arch)
    base = [(7 * i + 3) % 61 for i in range(30)]
    prompts = [base, base[:9] + [1, 2], base[:17] + [3], base[:22] + [4, 5], base]
    params = SamplingParams(max_tokens=6)
    kw = dict(decode_mode="kv" if arch == "nemotron_h" else "replay", kv_block_size=4, buffer_size=6,
              enable_prefix_caching=True, prefix_checkpoint_interval=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM(tp, max_seq_len=MAXLEN, **kw) as llm:
            got = [llm.generate([p], params)[0].token_ids for p in prompts]
            assert llm.stats["prefix_hit_tokens"] == 9 + 17 + 22 + 28   # (the 30-token base caches 7 blocks)
    want = [_generate_one(ref, p, params) for p in prompts]
    assert got == want


@pytest.mark.parametrize("arch,mode", [("mamba2", "replay"), ("nemotron_h", "kv")])
def test_chat_replies_are_cached_on_every_rank(models, arch, mode):
    """A finished request's state after prompt and reply (a state point) is saved by every
    rank for its heads; the next chat turn resumes at the reply's end on both ranks and
    gives one rank's output."""
    ref, tp = models(arch)
    prompt = [(7 * i + 3) % 61 for i in range(13)]
    params = SamplingParams(max_tokens=5)
    kw = dict(decode_mode=mode, kv_block_size=4, buffer_size=6, enable_prefix_caching=True,
              prefix_checkpoint_interval=8)
    turns, hits = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM(tp, max_seq_len=MAXLEN, **kw) as llm:
            for t in range(3):
                before = llm.stats["prefix_hit_tokens"]
                out = llm.generate([prompt], params)[0].token_ids
                turns.append((list(prompt), out))
                hits.append(llm.stats["prefix_hit_tokens"] - before)
                prompt = prompt + out + [11 + t, 12 + t]
    assert [out for _, out in turns] == [_generate_one(ref, p, params) for p, _ in turns]
    assert hits[1:] == [len(turns[0][0]) + 4, len(turns[1][0]) + 4]


def _generate_one(model, prompt, params):
    with LLM(model, max_seq_len=MAXLEN) as llm:
        return llm.generate([prompt], params)[0].token_ids


def test_model_api_and_bad_input_keep_the_group(models):
    """The model API runs on every rank; bad input raises the same ValueError on rank 0 (the
    workers drop it) and the group goes on."""
    ref, tp = models("nemotron_h")
    spec = CacheSpec(max_seq_len=32)
    c1, c2 = ref.make_cache(3, spec), tp.make_cache(3, spec)
    assert c2.spec == spec and tp.make_cache(3, max_seq_len=32).spec == spec
    slots, ids, lens = torch.tensor([1, 2]), torch.tensor([[3, 4, 5], [6, 0, 0]]), torch.tensor([3, 1])
    torch.testing.assert_close(tp.prefill(c2, slots, ids, lens), ref.prefill(c1, slots, ids, lens), rtol=0, atol=1e-12)
    for c in (c1, c2):   # a cache change runs on every rank: slot 2 restarts
        c.release(torch.tensor([2]))
    one = (slots[1:], ids[1:], lens[1:])
    torch.testing.assert_close(tp.prefill(c2, *one), ref.prefill(c1, *one), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="token ids must be in"):
        tp.decode(c2, slots, torch.tensor([99, 1]))
    torch.testing.assert_close(tp.decode(c2, slots, torch.tensor([7, 8])), ref.decode(c1, slots, torch.tensor([7, 8])),
                               rtol=0, atol=1e-12)
    assert tp.group.alive
    tp.local.make_cache(2)  # rank 0's own shard is an ordinary model



@pytest.mark.parametrize("mode", ["replay", "kv"])
def test_state_dtype_reaches_every_rank(models, mode):
    """A 16-bit state spec is every rank's: the split model's logits equal the one-rank model's
    with the same bf16 states (each head's state rounds the same way on its rank) and differ
    from the float64 states' (so the workers did not keep their default)."""
    assert_bf16_states_on_every_rank(*models("qwen3_next"), mode=mode)

RANDOM_CFG = dict(model_type="nemotron_h", vocab_size=61, hidden_size=16, hybrid_override_pattern="M*E",
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=4,
                  ssm_state_size=6, n_groups=2, conv_kernel=3, n_routed_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=6, moe_shared_expert_intermediate_size=4, eos_token_id=None)


def test_random_shards_share_replicated_weights():
    """Random weights built per rank on the device: replicated parameters agree across
    ranks, sharded ones differ and have the local shapes (no process needed to build one)."""
    from replayssm.distributed.loading import _skeletons, random_shard
    from replayssm.distributed.sharding import Shard, shard_rules

    r0, r1 = (random_shard(RANDOM_CFG, r, 2, dtype="float32") for r in (0, 1))
    p0, p1 = dict(r0.named_parameters()), dict(r1.named_parameters())
    rules = shard_rules(_skeletons(r0.tp.config, torch.float32, "cpu", 0, 2, None)[0], 2, 0)
    for n, p in p0.items():
        assert p.shape == p1[n].shape and torch.isfinite(p).all(), n
        if not isinstance(rules.get(n), Shard):
            assert torch.equal(p, p1[n]), n
    w0, w1 = p0["backbone.layers.0.mixer.in_proj.weight"], p1["backbone.layers.0.mixer.in_proj.weight"]
    assert w0.shape == (8 + 8 + 6 + 6 + 2, 16) and not torch.equal(w0, w1)   # [z | x | B | C | dt] of 2 heads


def test_random_shards_margin_recipe():
    """The benchmarks' margin recipe per rank: the embedding rows of both ranks are one
    unit-variance draw, ``lm_head`` is that draw's rows permuted over sqrt(d) (padded rows
    zero), residual output projections are scaled by 1/sqrt(layers), the rest as without it."""
    from replayssm.distributed.loading import random_shard

    V, D, L = RANDOM_CFG["vocab_size"], RANDOM_CFG["hidden_size"], len(RANDOM_CFG["hybrid_override_pattern"])
    r = [dict(random_shard(RANDOM_CFG, k, 2, dtype="float32", seed=4, margin=True).named_parameters()) for k in (0, 1)]
    plain = dict(random_shard(RANDOM_CFG, 0, 2, dtype="float32", seed=4).named_parameters())
    g = torch.Generator().manual_seed(4 * 1_000_003 + 17)
    full = torch.randn(V, D, generator=g)
    perm = torch.randperm(V, generator=g)
    Vs = -(-V // 2)
    emb = torch.cat([r[0]["backbone.embeddings.weight"], r[1]["backbone.embeddings.weight"]])
    head = torch.cat([r[0]["lm_head.weight"], r[1]["lm_head.weight"]])
    assert emb.shape == head.shape == (2 * Vs, D)
    assert torch.equal(emb[:V], full) and torch.equal(emb[V:], torch.zeros(2 * Vs - V, D))
    torch.testing.assert_close(head[:V], full[perm] / D ** 0.5, rtol=0, atol=0)
    name = "backbone.layers.0.mixer.out_proj.weight"
    torch.testing.assert_close(r[0][name], plain[name] / L ** 0.5)
    other = "backbone.layers.0.mixer.in_proj.weight"
    assert torch.equal(r[0][other], plain[other])


RANDOM_MTP_CFG = dict(RANDOM_CFG, num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")


def test_random_model_generates(group):
    model = group.random_model(RANDOM_CFG, dtype="float32", seed=3)
    out = _generate(model, decode_mode="replay")
    assert [len(o) for o in out] == [N_NEW] * len(PROMPTS)
    model.close()
    model = group.random_model(RANDOM_MTP_CFG, dtype="float32", seed=3, mtp=True)   # with a random MTP head
    out = _generate(model, outputs=True, decode_mode="replay", speculative=_mtp())
    assert [len(o.token_ids) for o in out] == [N_NEW] * len(PROMPTS) and all(o.num_drafted for o in out)
    model.close()


def test_random_mtp_shards_share_replicated_weights():
    """A random MTP head per rank: its fc and norms agree across ranks, its attention and
    experts are sharded like the model's."""
    from replayssm.distributed.loading import random_shard

    r0, r1 = (random_shard(RANDOM_MTP_CFG, r, 2, dtype="float32", mtp=True) for r in (0, 1))
    p0, p1 = dict(r0.named_parameters()), dict(r1.named_parameters())
    assert torch.equal(p0["mtp.layers.0.eh_proj.weight"], p1["mtp.layers.0.eh_proj.weight"])
    assert p0["mtp.layers.0.eh_proj.weight"].shape == (16, 32)
    q0, q1 = p0["mtp.layers.0.mixer.q_proj.weight"], p1["mtp.layers.0.mixer.q_proj.weight"]
    assert q0.shape == (8, 16) and not torch.equal(q0, q1)                 # one of 2 heads of 8
    assert p0["mtp.layers.1.mixer.experts.up_proj"].shape[1] == 3          # 6 expert channels / 2


def test_startup_report_times_every_phase_on_every_rank(models, group, caplog):
    """``group.startup_times``: rank 0's start (spawn, waiting, the process groups), the
    worker's own (process start, imports, rendezvous) and both ranks' loads and engine
    setup; asking is not itself timed, and the table names every phase."""
    import logging
    import math

    from replayssm.distributed.startup import format_times

    tp = models("mamba2")[1]
    before = group.startup_times
    assert set(before) == {0, 1}
    r0, r1 = before[0], before[1]
    assert {"spawn", "wait_workers", "init_process_group", "control_group", "group_start", "load",
            "load.check", "load.skeleton", "load.allreduce_setup", "load.read", "load.transform",
            "load.to_device", "load.setup", "load.setup_wait"} <= set(r0)
    assert {"process_start", "imports", "store_connect", "init_process_group", "control_group", "load",
            "load.read", "load.to_device", "load.setup", "load.setup_wait"} <= set(r1)
    assert "spawn" not in r1 and "process_start" not in r0
    assert all(math.isfinite(v) and v >= 0 for r in (r0, r1) for v in r.values())
    assert r0["group_start"] >= r0["wait_workers"] and r1["load"] >= r1["load.read"]
    for r in (r0, r1):   # the collective setup runs beside the reading: its wait is what it did not hide
        assert r["load.setup"] >= r["load.allreduce_setup"] and r["load.setup_wait"] <= r["load"]
    assert group.startup_times[1] == r1                      # a report adds no phase
    _generate(tp, decode_mode="replay")                      # an engine: caches and a runner on every rank
    with caplog.at_level(logging.INFO, logger="replayssm.distributed"):
        after = group.log_startup()
    for r in (0, 1):
        assert after[r]["make_cache"] > before[r].get("make_cache", 0.0)
        assert after[r]["runner"] > before[r].get("runner", 0.0)
        assert after[r]["load"] == before[r]["load"]
    text = format_times(after)
    assert "rank 1" in text and "load.read" in text and text.split("\n", 1)[1] in caplog.text


# ---------------------------------------------------------------------------------------
# an engine that owns its group; a worker that dies
# ---------------------------------------------------------------------------------------
def test_engine_owned_group_and_worker_failure(mtp_paths, group):
    """An engine that loads the model itself, with its MTP head (speculative method 'mtp')."""
    want = _generate(load_model(mtp_paths["mamba2"], dtype="float64"))
    group.close()   # one group per process: the module's is done
    assert multiprocessing.active_children() == []
    llm = LLM(mtp_paths["mamba2"], dtype="float64", tensor_parallel_size=2, max_seq_len=MAXLEN,
              speculative=_mtp())
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))] == want
        (worker,) = multiprocessing.active_children()
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailed, match=r"rank 1 .* exited with code -9"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))
        assert time.monotonic() - t0 < 30
        with pytest.raises(WorkerFailed, match="failed earlier"):
            llm.generate([[1]], SamplingParams(max_tokens=2))
    finally:
        llm.close()
    assert multiprocessing.active_children() == []
