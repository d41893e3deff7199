"""The engine on the real model implementations (replayssm.models), tiny random weights
built with transformers: Mamba-2, Gated DeltaNet (Qwen3-Next) and a Nemotron-H hybrid."""

import warnings

import pytest
import torch

models = pytest.importorskip("replayssm.models")
transformers = pytest.importorskip("transformers")

from engine_helpers import reference_greedy  # noqa: E402

from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402

N = 12
MAXLEN = 64  # the reference KV-only ops attend over the whole block table: keep it short
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]


def _save(model, root, name):
    d = root / name
    model.save_pretrained(str(d))
    return str(d)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_models")
    out = {}
    torch.manual_seed(0)
    mc = transformers.Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                                   state_size=16, n_groups=2, expand=2, conv_kernel=4, eos_token_id=None,
                                   bos_token_id=None, pad_token_id=None)
    out["mamba2"] = _save(transformers.Mamba2ForCausalLM(mc), root, "mamba2")
    torch.manual_seed(1)
    out["mamba2-draft"] = _save(transformers.Mamba2ForCausalLM(mc), root, "mamba2-draft")
    torch.manual_seed(2)
    qc = transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=0,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        eos_token_id=None)
    out["qwen3_next"] = _save(transformers.Qwen3NextForCausalLM(qc), root, "qwen3_next")
    torch.manual_seed(3)
    nc = transformers.NemotronHConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, hybrid_override_pattern="M*M-", num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=16, n_groups=2, mamba_n_groups=2, conv_kernel=4, eos_token_id=None)
    out["nemotron_h"] = _save(transformers.NemotronHForCausalLM(nc), root, "nemotron_h")
    return out


@pytest.fixture(scope="session")
def loaded(model_dirs):
    return {k: models.load_model(d, device="cpu", dtype=torch.float64) for k, d in model_dirs.items()}


@pytest.fixture(scope="session")
def expected(loaded):
    return {name: [reference_greedy(loaded[name], p, N) for p in PROMPTS]
            for name in ("mamba2", "qwen3_next", "nemotron_h")}


@pytest.mark.parametrize("arch", ["mamba2", "qwen3_next", "nemotron_h"])
@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
def test_modes_match_full_forward(loaded, expected, arch, mode):
    llm = LLM(loaded[arch], dtype="float64", decode_mode=mode, auto_threshold=6, max_seq_len=MAXLEN)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected[arch]


def _spec(name, loaded):
    d = loaded["mamba2-draft"]
    return {
        "ngram": SpeculativeConfig("ngram", num_tokens=3),
        "draft": SpeculativeConfig("draft", num_tokens=3, draft_model=d),
        "draft-self": SpeculativeConfig("draft", num_tokens=3, draft_model=loaded["mamba2"]),
        "tree-beam": SpeculativeConfig("tree", draft_model=d, tree_width=2, tree_depth=3),
        "tree-static": SpeculativeConfig("tree", draft_model=loaded["mamba2"], tree=[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]),
        "ngram-tree": SpeculativeConfig("tree", num_tokens=3, tree_width=2),
    }[name]


@pytest.mark.parametrize("name", ["ngram", "draft", "draft-self", "tree-beam", "tree-static", "ngram-tree"])
@pytest.mark.parametrize("mode", ["recurrent", "replay", "auto"])
def test_mamba2_speculation_keeps_greedy_output(loaded, expected, name, mode):
    llm = LLM(loaded["mamba2"], dtype="float64", decode_mode=mode, speculative=_spec(name, loaded),
              auto_threshold=10, max_seq_len=MAXLEN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected["mamba2"]
    if name in ("draft-self", "tree-static"):  # the target drafting for itself: all accepted
        assert all(o.mean_accepted_length > 2.5 for o in outs)


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])
@pytest.mark.parametrize("method", ["draft", "tree"])
def test_hybrid_speculation_keeps_greedy_output(loaded, expected, arch, method):
    m = loaded[arch]
    sp = SpeculativeConfig(method, num_tokens=3, draft_model=m, tree_width=2, tree_depth=2)
    for mode in ("replay", "kv"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = LLM(m, dtype="float64", decode_mode=mode, speculative=sp,
                       max_seq_len=MAXLEN).generate(PROMPTS, SamplingParams(max_tokens=N))
        assert [o.token_ids for o in outs] == expected[arch]


def test_load_from_directory_and_join_mid_flight(model_dirs, expected):
    llm = LLM(model_dirs["mamba2"], dtype="float64", max_num_seqs=2,
              speculative=SpeculativeConfig("draft", num_tokens=2, draft_model=model_dirs["mamba2-draft"]))
    a = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=N))
    llm.step()
    b = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=5))
    c = llm.add_request(PROMPTS[2], SamplingParams(max_tokens=N))
    while llm.has_unfinished():
        llm.step()
    assert llm.output(a).token_ids == expected["mamba2"][0]
    assert llm.output(b).token_ids == expected["mamba2"][1][:5]
    assert llm.output(c).token_ids == expected["mamba2"][2]


def test_seeded_sampling_real_model(loaded):
    sp = SpeculativeConfig("draft", num_tokens=3, draft_model=loaded["mamba2-draft"])
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=123)
    runs = [[o.token_ids for o in LLM(loaded["mamba2"], dtype="float64", speculative=sp).generate(PROMPTS, params)]
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_cli_generate_with_model_dir(model_dirs, capsys, expected):
    from replayssm.engine import cli

    rc = cli.main(["--model", model_dirs["mamba2"], "--token-ids", "1,2,3,4,5,1,2,3", "--max-tokens", str(N),
                   "--dtype", "float64", "--speculative", "draft", "--draft-model", model_dirs["mamba2-draft"]])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert cap.out.split() == [str(t) for t in expected["mamba2"][0]]
    assert "tokens/s" in cap.err and "mean accepted length" in cap.err


@pytest.mark.parametrize("mode", ["replay", "kv", "auto"])
@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])
def test_attention_kv_in_the_budget_grows_in_blocks(loaded, expected, arch, mode):
    """Hybrids keep attention keys/values in a paged pool sized by the memory budget (not a
    static max_seq_len per slot): the caches allocate no more than the budget, blocks are
    drawn as contexts grow and all come back, and the output is the full forward's."""
    m = loaded[arch]
    probe = LLM(m, dtype="float64", decode_mode=mode, max_seq_len=256, kv_block_size=4, auto_threshold=6)
    budget = 2 * probe.plan.memory.need(len(PROMPTS[2]) + N + probe.plan.memory.verify_tokens) + 1
    llm = LLM(m, dtype="float64", decode_mode=mode, max_seq_len=256, kv_block_size=4, auto_threshold=6,
              memory_budget=budget, max_num_seqs=8)
    attn = llm.cache.attn
    assert attn is not None and not llm.cache._static_attn
    assert attn.num_blocks - 1 < llm.num_slots * 256 // 4            # far below a static pool
    lay = llm.plan.layout    # the budget covers the slots and blocks sequences hold; the padding
    null = lay.slot_bytes + lay.block_bytes + lay.attn_block_bytes   # targets (null slot, null blocks) come on top
    assert llm.cache.nbytes() <= budget + null
    free = attn.free_blocks
    seqs = [llm.add_request(p, SamplingParams(max_tokens=N)) for p in PROMPTS]
    peak_used = 0
    while llm.has_unfinished():
        llm.step()
        assert llm.scheduler.reserved <= llm.blocks.pool_bytes
        peak_used = max(peak_used, free - attn.free_blocks)
    assert [llm.output(s).token_ids for s in seqs] == expected[arch]
    assert peak_used > 0 and attn.free_blocks == free and llm.scheduler.reserved == 0


@pytest.mark.parametrize("arch", ["mamba2", "qwen3_next", "nemotron_h"])
@pytest.mark.parametrize("mode", ["recurrent", "replay", "kv", "auto"])
def test_chunked_prefill_matches_full_forward(loaded, expected, arch, mode):
    """Prompts split into chunks of a few tokens (each continuing from the state, conv window,
    KV-only entries and attention KV the previous chunk left) give the full forward's tokens."""
    llm = LLM(loaded[arch], dtype="float64", decode_mode=mode, auto_threshold=6, max_seq_len=MAXLEN,
              max_num_batched_tokens=5)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected[arch]
