"""Tensor parallelism over four ranks on CPU (gloo): every model type, float64, equal to one rank.

One four-rank group serves the module (forwards, greedy replay/KV decoding, speculation,
MTP, prefix caching, bf16 states, FP8, grammar masks); the last test closes it and starts an
engine-owned group of four (shared-memory control ring, fused finish off), then kills a
worker.  Sizes are chosen so that four ranks exercise what
two do not: KV heads replicated across ranks (2 KV heads over 4 ranks, each kept by two),
Mamba-2 norm groups spanning 4 and 2 ranks (the fused finish's reference path with W=4),
odd per-rank counts (3 GDN value heads, 3 expert channels, 5 shared-expert channels) and an
odd vocabulary (67: shards 17, 17, 17, 16).  ``qwen3_next_80b`` is the
Qwen3-Next-80B-A3B structure of ``scripts/gpu_tp_big.py --model qwen3-next-80b`` at tiny
size: GDN layers with full attention every 4th, 16:2-like query:KV ratio (8:2), gated
attention with partial rotary 0.25, MoE in every layer with a shared expert.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import shutil
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

import hf_utils as H  # noqa: E402
from tp_checks import assert_bf16_states_on_every_rank, assert_forward_matches, save_tiny_specs  # noqa: E402
from tp_prefix import cached_runs, prefix_prompts  # noqa: E402
import mtp_checkpoint as M  # noqa: E402

pytest.importorskip("transformers")

from test_falcon_h1 import tiny_falcon_h1  # noqa: E402
from test_granite_bamba import _build as granite_or_bamba  # noqa: E402
from test_kimi_linear import tiny_kimi  # noqa: E402
from test_qwen3_5 import tiny_qwen3_5, tiny_qwen3_5_moe  # noqa: E402
from test_zamba2 import tiny_zamba2  # noqa: E402

from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.models import load_model  # noqa: E402

dist_mod = pytest.importorskip("replayssm.distributed")




N = 4
N_NEW = 8
MAXLEN = 64
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SPECS = {
    "qwen3_next_80b": (H.tiny_qwen3_next, H.QWEN3_NEXT_80B_TINY),
    # one norm group over all four ranks (the deferred gated norm's W=4 sum); tied embeddings
    "mamba2": (H.tiny_mamba2, dict(num_heads=12, head_dim=5, hidden_size=30, n_groups=1, num_hidden_layers=2,
                                   vocab_size=67, tie_word_embeddings=True)),
    # Mamba-2 of 8 heads in 2 groups (each over two ranks; no projection bias, so its norm is
    # deferred too), attention 4 heads / 1 KV head, relu2 MLP, sigmoid MoE with a latent projection
    "nemotron_h": (H.tiny_nemotron_h, dict(hybrid_override_pattern="M*-EM", mamba_num_heads=8, n_groups=2,
                                           num_attention_heads=4, num_key_value_heads=1, intermediate_size=20,
                                           moe_intermediate_size=12, moe_shared_expert_intermediate_size=4,
                                           moe_latent_size=5, use_bias=False, mlp_bias=True)),
    "qwen3_5": (tiny_qwen3_5, dict(linear_num_key_heads=4, linear_num_value_heads=12, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=20)),
    "qwen3_5_moe": (tiny_qwen3_5_moe, dict(linear_num_key_heads=4, linear_num_value_heads=8, num_attention_heads=8,
                                           num_key_value_heads=2, moe_intermediate_size=12,
                                           shared_expert_intermediate_size=4)),
    # Mamba-2 8 heads, one group (a norm over four ranks), attention 4 / 2 KV, experts, shared MLP
    "granite": (lambda seed, **o: granite_or_bamba("granite", seed, **o),
                dict(mamba_n_heads=8, mamba_d_head=6, intermediate_size=8, shared_intermediate_size=12,
                     mamba_proj_bias=True)),
    "bamba": (lambda seed, **o: granite_or_bamba("bamba", seed, **o),
              dict(mamba_n_heads=8, mamba_d_head=5, intermediate_size=12, num_key_value_heads=1,
                   attention_bias=True, tie_word_embeddings=True)),
    # Mamba-2 8 heads of 4 in 2 groups, attention 4 heads / 1 KV head, every bias and multiplier
    "falcon_h1": (tiny_falcon_h1, dict(num_attention_heads=4, mamba_d_ssm=32, mamba_n_heads=8, intermediate_size=24)),
    # shared blocks with adapters, 4 heads of 8, Mamba-2 8 heads in 4 groups (split)
    "zamba2": (tiny_zamba2, dict(hidden_size=16, num_attention_heads=4, n_mamba_heads=8, mamba_ngroups=4,
                                 intermediate_size=12)),
    # KDA and MLA one head a rank (MLA's latent on all four), experts of 3 channels a rank and
    # a shared expert of 3, dense MLP of 5 a rank
    "kimi_linear": (tiny_kimi, dict(num_attention_heads=4, num_key_value_heads=4, linear_num_heads=4,
                                    linear_head_dim=5, moe_intermediate_size=12, intermediate_size=20)),
}
MTP_ARCHS = {"qwen3_next_80b": 1.5, "nemotron_h": 1.5}   # name: the MTP fc's noise (drafts accepted and rejected)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tiny models in five processes)."""


@pytest.fixture(scope="module")
def group():
    from replayssm.distributed import TensorParallelGroup

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    g = TensorParallelGroup(N, "cpu", worker_threads=1)
    torch.set_num_threads(n)
    yield g
    g.close()
    assert multiprocessing.active_children() == []


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp4")
    out = save_tiny_specs(root, SPECS, seed=41)
    for i, (name, noise) in enumerate(MTP_ARCHS.items()):
        d = str(root / (name + "_mtp"))
        shutil.copytree(out[name], d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            M.add_mtp(d, seed=5 + i)
        M.make_predictable(d, seed=1, mtp_noise=noise)
        out[name + "_mtp"] = d
    return out


@pytest.fixture(scope="module")
def models(paths, group):
    """``models(name, mtp=False) -> (one rank, four ranks)``, float64 (cached)."""
    cache = {}

    def get(name, mtp=False):
        key = name + ("_mtp" if mtp else "")
        if key not in cache:
            cache[key] = (load_model(paths[key], dtype="float64", mtp=mtp),
                          group.load_model(paths[key], dtype="float64", mtp=mtp))
        return cache[key]

    return get


def _generate(model, params=None, outputs=False, prompts=PROMPTS, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM(model, max_seq_len=MAXLEN, **kw) as llm:
            outs = llm.generate(prompts, params or SamplingParams(max_tokens=N_NEW))
    return outs if outputs else [o.token_ids for o in outs]


# ---------------------------------------------------------------------------------------
# the 80B preset itself (no process)
# ---------------------------------------------------------------------------------------
def _preset():
    spec = importlib.util.spec_from_file_location("gpu_tp_big", os.path.join(ROOT, "scripts", "gpu_tp_big.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.QWEN3_NEXT_80B


@pytest.mark.parametrize("n", [2, 4])
def test_80b_preset_splits_every_layer_kind(n):
    """The full-size preset's shards at TP=2 and 4 (meta device): every rank holds a slice of
    all 512 experts' intermediate dimension and of the shared expert, its query heads and the
    KV head they read (replicated at 4), its GDN heads; routers and norms replicated."""
    from replayssm.distributed import check_tensor_parallel, local_config
    from replayssm.distributed.loading import _skeletons
    from replayssm.distributed.sharding import Shard, shard_rules
    from replayssm.models.registry import parse_config

    cfg = parse_config(_preset(), "preset")
    assert cfg.layer_kinds.count("attention") == 12 and cfg.layer_kinds[3] == "attention"
    assert all(cfg.is_moe_layer(i) for i in range(48)) and cfg.rotary_dim == 64
    check_tensor_parallel(cfg, n)
    loc = local_config(cfg, n)
    assert (loc.num_attention_heads, loc.num_key_value_heads) == (16 // n, 2 // n if n == 2 else 1)
    assert (loc.linear_num_key_heads, loc.linear_num_value_heads) == (16 // n, 32 // n)
    assert (loc.moe_intermediate_size, loc.shared_expert_intermediate_size) == (512 // n, 512 // n)
    assert loc.num_experts == 512 and loc.num_experts_per_tok == 10              # every expert on every rank
    gmodel = _skeletons(cfg, torch.bfloat16, "meta", 0, n, None)[0]
    for r in range(n):
        rules = shard_rules(gmodel, n, r)
        a, b = r * 512 // n, (r + 1) * 512 // n
        for i in (0, 3, 47):
            ffn = f"model.layers.{i}.mlp."
            assert rules[ffn + "experts.gate_up_proj"] == Shard(1, ((a, b), (512 + a, 512 + b)))
            assert rules[ffn + "experts.down_proj"] == Shard(2, ((a, b),))
            assert rules[ffn + "shared_expert.down_proj.weight"] == Shard(1, ((a, b),))
            assert ffn + "gate.weight" not in rules                    # the router: replicated
        kv = r // (n // 2)                                            # TP=4: ranks 0, 1 read KV head 0
        for w in ("k_proj", "v_proj"):
            assert rules[f"model.layers.3.self_attn.{w}.weight"] == Shard(0, ((kv * 256, (kv + 1) * 256),))
        h = 16 // n                                                   # query heads, each [q | gate] of 2 x 256
        assert rules["model.layers.3.self_attn.q_proj.weight"] == Shard(0, ((r * h * 512, (r + 1) * h * 512),))
        k0, v0 = r * 16 // n, r * 32 // n                             # GDN: key heads and their value heads
        assert rules["model.layers.0.linear_attn.out_proj.weight"] == Shard(1, ((v0 * 128, (v0 + 32 // n) * 128),))
        per_key = 2 * 128 + 2 * 2 * 128
        assert rules["model.layers.0.linear_attn.in_proj_qkvz.weight"] == Shard(
            0, ((k0 * per_key, (k0 + 16 // n) * per_key),))


# ---------------------------------------------------------------------------------------
# four processes
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(SPECS))
def test_full_forward_matches(models, arch):
    assert_forward_matches(*models(arch), atol=1e-12)


@pytest.mark.parametrize("arch", list(SPECS))
def test_greedy_matches_one_rank(models, arch):
    ref, tp = models(arch)
    want = _generate(ref, decode_mode="recurrent")
    assert len({tuple(w) for w in want}) > 1          # the continuations differ: the test can fail
    for mode in ("replay", "kv"):
        assert _generate(tp, decode_mode=mode) == want, mode


def test_fused_finish_reference_path_spans_four_ranks(models):
    """Default ``REPLAYSSM_TP_FUSED=1`` on CPU: Mamba-2's gated norm is deferred past
    ``out_proj`` (a :class:`DeferredSum` leaves the mixer) with one norm group over all four
    ranks (Mamba-2: group 0 of 1) or over two (Nemotron-H: rank 0 in group 0 of 2); the
    reference sum of ``[partial ; sums]`` finishes it (the forward equalities above)."""
    from replayssm.distributed.fused import DeferredSum
    from replayssm.distributed.layers import DeferredGatedNorm

    for arch, groups in (("mamba2", 1), ("nemotron_h", 2)):
        ref, tp = models(arch)
        norms = [m for m in tp.local.modules() if isinstance(m, DeferredGatedNorm)]
        assert norms and {(n.group_index, n.num_groups) for n in norms} == {(0, groups)}, arch
        mixer = next(m for m in tp.local.modules() if isinstance(getattr(m, "norm", None), DeferredGatedNorm))
        seen = []
        handle = mixer.register_forward_hook(lambda mod, a, out: seen.append(type(out)))
        try:
            ids = torch.tensor([[1, 2, 3]])
            torch.testing.assert_close(tp(ids), ref(ids), rtol=0, atol=1e-12)
        finally:
            handle.remove()
        assert seen == [DeferredSum], arch


@pytest.mark.parametrize("arch,method", [("qwen3_next_80b", "draft"), ("qwen3_next_80b", "ngram-tree"),
                                         ("nemotron_h", "ngram"), ("mamba2", "draft-tree")])
def test_speculation_keeps_greedy_output(models, arch, method):
    ref, tp = models(arch)
    draft = models("mamba2")[0] if arch != "mamba2" else models("qwen3_next_80b")[0]
    sp = {"ngram": SpeculativeConfig("ngram", num_tokens=3),
          "draft": SpeculativeConfig("draft", num_tokens=3, draft_model=draft),
          "ngram-tree": SpeculativeConfig("tree", num_tokens=3, tree_width=2),
          "draft-tree": SpeculativeConfig("tree", draft_model=ref, tree_width=2, tree_depth=2)}[method]
    assert _generate(tp, decode_mode="replay", speculative=sp) == _generate(ref, decode_mode="recurrent")


def test_sampled_speculation_matches_one_rank(models):
    ref, tp = models("qwen3_next_80b")
    sp = SpeculativeConfig("draft", num_tokens=3, draft_model=models("mamba2")[0])
    params = SamplingParams(max_tokens=N_NEW, temperature=0.9, seed=5)
    kw = dict(speculative=sp, decode_mode="auto", auto_threshold=6)
    assert _generate(tp, params, **kw) == _generate(ref, params, **kw)


@pytest.mark.parametrize("tree", [None, "topk"])
@pytest.mark.parametrize("arch", list(MTP_ARCHS))
def test_mtp_speculation_matches_one_rank(models, arch, tree):
    """The MTP head's layers sharded over four ranks (its attention's KV head replicated):
    output and acceptances equal one rank's, which equals plain decoding."""
    ref, tp = models(arch, mtp=True)
    kw = dict(decode_mode="replay", speculative=SpeculativeConfig("mtp", num_tokens=3, tree=tree, tree_width=2))
    one = _generate(ref, outputs=True, **kw)
    four = _generate(tp, outputs=True, pad_batches=True, **kw)
    assert [o.token_ids for o in four] == [o.token_ids for o in one] == _generate(ref, decode_mode="replay")
    assert [o.num_accepted for o in four] == [o.num_accepted for o in one]
    assert 0 < sum(o.num_accepted for o in four) < sum(o.num_drafted for o in four)


@pytest.mark.parametrize("arch", ["qwen3_next_80b", "mamba2", "zamba2", "kimi_linear"])
def test_prefix_caching_matches_one_rank(models, arch):
    ref, tp = models(arch)
    prompts = prefix_prompts(ref.config.vocab_size)
    (got, hits), (want_cached, ref_hits) = cached_runs((tp, ref), prompts, MAXLEN)
    assert got == want_cached == _generate(ref, SamplingParams(max_tokens=5), prompts=prompts)
    assert hits == ref_hits > 0


def test_random_80b_structure_generates_on_four_ranks(group):
    """``random_model`` (shards built per rank, the margin recipe) of the preset's structure:
    greedy continuations of the oracle's kind, equal in replay and recurrent decoding."""
    cfg = dict(_preset(), vocab_size=67, hidden_size=32, num_hidden_layers=4, num_attention_heads=8, head_dim=8,
               linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8)
    model = group.random_model(cfg, dtype="float64", seed=2, margin=True)
    try:
        rec = _generate(model, decode_mode="recurrent")
        assert _generate(model, decode_mode="replay") == rec
        assert [len(o) for o in rec] == [N_NEW] * len(PROMPTS)
    finally:
        model.close()


def test_state_dtype_reaches_every_rank(models):
    """A bf16 state spec on four ranks: logits equal one rank's with the same bf16 states and
    differ from float64 states' (every worker took the spec)."""
    assert_bf16_states_on_every_rank(*models("qwen3_next_80b"), mode="kv")


def test_mtp_chunked_forked_preempted_matches_one_rank(models):
    """The MTP head's per-rank state on four ranks through chunked prefills (chunks of 5),
    samples forked from one prefill, swaps out and back, and plain steps while more than two
    requests run: output equals one rank's and plain decoding's."""
    import dataclasses

    ref, tp = models("qwen3_next_80b", mtp=True)
    sp = dataclasses.replace(SpeculativeConfig("mtp", num_tokens=3), disable_by_batch_size=2)
    kw = dict(decode_mode="replay", speculative=sp, max_num_batched_tokens=5, max_num_seqs=3, kv_block_size=4)

    def serve(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with LLM(model, max_seq_len=MAXLEN, **kw) as llm:
                seqs = [llm.add_request(p, SamplingParams(max_tokens=N_NEW, n=n)) for p, n in zip(PROMPTS, (1, 2, 1))]
                step = 0
                while llm.has_unfinished():
                    llm.step()
                    step += 1
                    if step % 3 == 0:
                        for s in [s for s in llm.scheduler.running if not s.prefilling][-2:]:
                            llm.scheduler.preempt(s)
                return [[x.output_ids for x in s.group] for s in seqs], llm.stats["preemptions"]

    want = [[e] * n for e, n in zip(_generate(ref), (1, 2, 1))]
    (one, n1), (four, n4) = serve(ref), serve(tp)
    assert four == one == want
    assert n4 == n1 >= 2


def test_fp8_checkpoint_splits_over_four_ranks(paths, group, tmp_path):
    """The 80B structure quantized to FP8 (per-tensor scales: replicated on every rank): the
    four-rank model's logits and greedy output equal the one-device FP8 model's."""
    from replayssm.models.quantize import quantize_checkpoint

    d = str(tmp_path / "fp8")
    quantize_checkpoint(paths["qwen3_next_80b"], d, None)
    one, tp = load_model(d, dtype="float64"), group.load_model(d, dtype="float64")
    fp8 = [n for n, p in tp.local.named_parameters() if p.dtype == torch.float8_e4m3fn]
    assert any("experts" in n for n in fp8) and any("linear_attn" in n for n in fp8)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9]])
    a, b = one(ids), tp(ids)
    assert (a - b).abs().max().item() <= 1e-9 * a.abs().max().item()
    assert _generate(tp, decode_mode="replay") == _generate(one, decode_mode="replay")


def test_constrained_speculation_on_four_ranks_equals_plain_constrained(group, tmp_path):
    """Grammar masks of a speculative step reach all four ranks: constrained n-gram
    speculation under TP=4 gives one rank's plain constrained output (a Mamba-2 of 12 heads
    with the shipped byte tokenizer: the shipped model's 10 heads do not split in four)."""
    pytest.importorskip("llguidance")
    from replayssm.models.loader import load_tokenizer

    asset = os.path.join(ROOT, "replayssm", "assets", "tiny-mamba2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = H.save_tiny(H.tiny_mamba2(seed=9, vocab_size=257, num_heads=12, head_dim=5, hidden_size=30, n_groups=1,
                                      pad_token_id=None), str(tmp_path / "m"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(asset, f), d)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    prompts = ["Person: ", "abab abab ab", "the the the "]
    params = [SamplingParams(max_tokens=24, structured_outputs={"json": schema}),
              SamplingParams(max_tokens=12, structured_outputs={"regex": r"(ab|cd)+x?"}),
              SamplingParams(max_tokens=10)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM(d, max_seq_len=128, dtype="float64") as llm:
            want = [o.token_ids for o in llm.generate(prompts, params)]
        sp = SpeculativeConfig("ngram", num_tokens=3, prompt_lookup_min=1, spec_policy="fixed")
        with LLM(group.load_model(d, dtype="float64"), max_seq_len=128, speculative=sp,
                 tokenizer=load_tokenizer(d)) as llm:
            outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert outs[0].num_verify_steps + outs[1].num_verify_steps > 0     # constrained rows speculated


@pytest.mark.parametrize("mode", ["replay", "kv"])
def test_greedy_exchange_over_four_ranks_resolves_boundary_ties(group, tmp_path, mode, monkeypatch):
    """V = 67 over four ranks (shards of 17; the last holds 16): rows tied at every shard
    boundary and between shards; greedy tokens from the four shards' (max, index) pairs equal
    one rank's, and the logits gather (switch off) gives the same."""
    sys.path.insert(0, os.path.dirname(__file__))
    import tp_greedy as G

    path = G.tied_head_checkpoint(str(tmp_path / "tied"), 67, N, num_heads=12, head_dim=5, hidden_size=30,
                                  n_groups=1)
    ref, tp = load_model(path, dtype="float64"), group.load_model(path, dtype="float64")
    want, _, _ = G.generate(ref, decode_mode=mode)
    assert any(b - 1 in row for row in want for b in G.boundaries(67, N))   # a boundary tie decided
    monkeypatch.setenv("REPLAYSSM_TP_GREEDY_LOCAL", "1")
    got, n_greedy, _ = G.generate(tp, decode_mode=mode, pad_batches=mode == "replay")
    assert got == want and n_greedy > 0
    monkeypatch.setenv("REPLAYSSM_TP_GREEDY_LOCAL", "0")
    got, n_greedy, n_logits = G.generate(tp, decode_mode=mode)
    assert got == want and n_greedy == 0 and n_logits > 0
    tp.close()


# ---------------------------------------------------------------------------------------
# last: an engine-owned group of four (the module's group is closed first)
# ---------------------------------------------------------------------------------------
def test_engine_owned_four_ranks_shared_memory_unfused_and_a_worker_killed(paths, group, monkeypatch):
    """``LLM(path, tensor_parallel_size=4)`` with the GPU's control channel (a shared-memory
    ring with three readers) and the fused finish off (``REPLAYSSM_TP_FUSED=0``: the sharded
    gated norm's all-reduced sums over four ranks): greedy output equals one rank's; a killed
    worker fails the next call by name, and close leaves no process."""
    import signal
    import time

    from replayssm.distributed import WorkerFailed
    from replayssm.distributed.layers import DeferredGatedNorm, ShardedGatedRMSNorm

    want = _generate(load_model(paths["mamba2"], dtype="float64"))
    group.close()
    assert multiprocessing.active_children() == []
    monkeypatch.setenv("REPLAYSSM_TP_CONTROL", "shm")
    monkeypatch.setenv("REPLAYSSM_TP_FUSED", "0")   # read by every rank as it builds (workers inherit it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(paths["mamba2"], dtype="float64", tensor_parallel_size=4, max_seq_len=MAXLEN, decode_mode="replay")
    try:
        tp = llm.model
        assert tp.group._channel is not None and tp.tensor_parallel_size == 4
        norms = [m for m in tp.local.modules() if isinstance(m, ShardedGatedRMSNorm)]
        assert norms and not any(isinstance(m, DeferredGatedNorm) for m in norms)
        assert {(m.group_index, m.num_groups) for m in norms} == {(0, 1)}
        assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))] == want
        workers = sorted(multiprocessing.active_children(), key=lambda p: p.name)
        assert len(workers) == 3
        os.kill(workers[1].pid, signal.SIGKILL)          # rank 2
        t0 = time.monotonic()
        with pytest.raises(WorkerFailed, match=rf"rank 2 \(pid {workers[1].pid}\) exited with code -9"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))
        assert time.monotonic() - t0 < 30
    finally:
        llm.close()
    assert multiprocessing.active_children() == []
