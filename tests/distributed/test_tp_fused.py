"""The fused tensor-parallel finish's reference path (CPU): the deferred gated-norm sum of
``[partial ; sums]`` per norm group against the float64 formula, and the switch
``REPLAYSSM_TP_FUSED`` (0: today's hooks and sharded norm; 1: deferred sums), both exact
against one rank."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

import hf_utils as H  # noqa: E402

pytest.importorskip("replayssm.distributed")
from replayssm.distributed.fused import GroupScale, fused_enabled, reference_sum  # noqa: E402
from replayssm.ops.tp_reduce import reduce_add_norm  # noqa: E402


@pytest.mark.parametrize("W,G,dtype", [(2, 1, torch.float64), (4, 2, torch.float32), (4, 1, torch.float32),
                                       (2, 2, torch.float64)])
def test_reference_sum_is_the_grouped_formula(W, G, dtype):
    """Each simulated rank's message, all-reduced (summed over the ranks), gives the same
    rows on every rank: ``Σ_g c_g Σ_{r∈g} p_r`` (rows 5: odd; groups of ``W / G`` ranks)."""
    g = torch.Generator().manual_seed(W * 10 + G)
    parts = [torch.randn(5, 7, generator=g, dtype=torch.float64).to(dtype) for _ in range(W)]
    sums = [torch.rand(5, generator=g, dtype=torch.float64).to(dtype) * 9 + 0.1 for _ in range(W)]
    k = W // G
    scales = [GroupScale(sums[r], r // k, G, 12, 1e-5) for r in range(W)]
    msgs = []
    for r in range(W):   # pass 1: record each rank's message
        reference_sum(lambda m: msgs.append(m.clone()) or m, parts[r], scales[r])
    total = sum(msgs)
    outs = [reference_sum(lambda m: total.clone(), parts[r], scales[r]) for r in range(W)]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    _, _, want = reduce_add_norm(parts, sums, ranks_per_group=k, group_size=12, gate_eps=1e-5, dtype=torch.float64)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(outs[0].double(), want, atol=tol, rtol=tol)
    assert outs[0].dtype == dtype
    plain = reference_sum(lambda m: m * 2, parts[0], None)          # no scale: the all-reduce itself
    assert torch.equal(plain, parts[0] * 2)


def test_switch_reads_zero_or_one(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_TP_FUSED", "0")
    assert not fused_enabled()
    monkeypatch.setenv("REPLAYSSM_TP_FUSED", "1")
    assert fused_enabled()
    with pytest.raises(ValueError, match="REPLAYSSM_TP_FUSED"):
        fused_enabled("yes")


def test_max_rows_reads_a_positive_count_and_bounds_the_fused_calls(monkeypatch):
    """Calls of more rows than ``REPLAYSSM_TP_FUSED_MAX_ROWS`` (default: every call the buffers
    hold) or than the buffers hold take the unfused path."""
    from replayssm.distributed.fused import DEFAULT_MAX_ROWS, FusedFinish, fused_max_rows

    monkeypatch.delenv("REPLAYSSM_TP_FUSED_MAX_ROWS", raising=False)
    assert fused_max_rows() == DEFAULT_MAX_ROWS == 4096
    small = FusedFinish(None, "cpu", torch.bfloat16, 8, 160, 0, 1, None)          # 10 rows of 8 channels
    assert small.max_rows == 10 and small.fused_rows == 10                     # the buffer caps the default
    monkeypatch.setenv("REPLAYSSM_TP_FUSED_MAX_ROWS", "5")
    assert fused_max_rows() == 5
    for bad in ("0", "-3", "many"):
        with pytest.raises(ValueError, match="REPLAYSSM_TP_FUSED_MAX_ROWS"):
            fused_max_rows(bad)
    fin = FusedFinish(None, "cpu", torch.bfloat16, 8, 1 << 20, 0, 1, None)   # CPU: builds no buffers
    assert fin.max_rows == (1 << 20) // 16 and fin.fused_rows == 5
    fin.ok = True
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert fin.mode(3, x) == "reference"                                      # not CUDA: the reference
    fin.device = torch.device("cuda")                                         # the decision alone
    xc = type("X", (), {"device": torch.device("cuda"), "dtype": torch.bfloat16})()
    assert fin.mode(5, xc) == "fused" and fin.mode(6, xc) is None and fin.mode(0, xc) is None


@pytest.fixture(scope="module")
def mamba_path(tmp_path_factory):
    m = H.tiny_mamba2(seed=5, num_heads=6, head_dim=5, hidden_size=15, n_groups=1, num_hidden_layers=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return H.save_tiny(m, str(tmp_path_factory.mktemp("tp_fused") / "mamba2"))


@pytest.mark.parametrize("fused", ["0", "1"])
def test_both_paths_match_one_rank(mamba_path, fused, one_thread, monkeypatch):
    """A cross-rank gated norm (one group over both ranks), 3 layers (an odd number of
    sub-blocks): full forward and cached greedy decoding equal one rank's in float64."""
    from replayssm import LLM, SamplingParams
    from replayssm.distributed import TensorParallelGroup
    from replayssm.distributed.fused import DeferredSum, SymmOutProj
    from replayssm.distributed.layers import DeferredGatedNorm, ShardedGatedRMSNorm
    from replayssm.models import load_model

    monkeypatch.setenv("REPLAYSSM_TP_FUSED", fused)   # the worker inherits it; each rank reads it at build
    grp = TensorParallelGroup(2, "cpu", worker_threads=1)
    try:
        ref = load_model(mamba_path, dtype="float64")
        tp = grp.load_model(mamba_path, dtype="float64")
        mixer = tp.local.backbone.layers[0].mixer
        assert type(mixer.norm) is (DeferredGatedNorm if fused == "1" else ShardedGatedRMSNorm)
        assert (type(mixer.out_proj) is SymmOutProj) == (fused == "1")
        seen = []
        mixer.register_forward_hook(lambda mod, a, out: seen.append(type(out)))   # after the TP hook
        ids = torch.randint(0, ref.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(tp(ids), ref(ids), rtol=0, atol=1e-12)
        assert seen == [DeferredSum if fused == "1" else torch.Tensor]
        prompts = [[1, 2, 3, 4, 5], [7]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = []
            for m in (ref, tp):
                with LLM(m, max_seq_len=32, decode_mode="replay") as llm:
                    outs.append([o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6))])
        assert outs[0] == outs[1]
    finally:
        grp.close()


QWEN = dict(linear_num_key_heads=2, linear_num_value_heads=6, num_attention_heads=6, num_key_value_heads=2,
            moe_intermediate_size=10, shared_expert_intermediate_size=6, intermediate_size=18, mlp_only_layers=[0],
            attention_bias=True)


def _as_fused(fin, D: int, rows: int = 32) -> list:
    """Turn a one-rank ``FusedFinish`` (off on CPU) into the GPU path on host buffers: the
    kernels run in the Triton interpreter, without the barrier (one rank); returns the list
    every kernel call appends its parity and trailing flag to."""
    fin.ok, fin.max_rows, fin.parity, fin.pad_ptrs = True, rows, 0, None
    fin.parts = [torch.full((rows, D), float("nan"), dtype=fin.dtype) for _ in range(2)]
    fin.sums = [torch.full((rows,), float("nan")) for _ in range(2)]
    fin.part_ptrs = [torch.tensor([t.data_ptr()]) for t in fin.parts]
    fin.ss_ptrs = [torch.tensor([t.data_ptr()]) for t in fin.sums]
    fin.mode = lambda n, x: "fused" if 0 < n <= rows and x.dtype == fin.dtype else None
    calls, run = [], fin.run

    def counted(*a, trailing=False, **kw):
        calls.append((fin.parity, trailing))
        return run(*a, trailing=trailing, **kw)

    fin.run = counted
    return calls


NEMOTRON = dict(hybrid_override_pattern="M*-EM", mamba_num_heads=6, n_groups=2, num_attention_heads=6,
                num_key_value_heads=1, intermediate_size=18, moe_intermediate_size=10,
                moe_shared_expert_intermediate_size=6, moe_latent_size=5, use_bias=True, mlp_bias=True)


@pytest.mark.parametrize("arch", ["mamba2", "qwen3_next", "nemotron_h"])
def test_fused_path_through_the_model_on_one_rank(arch, tmp_path, one_thread):
    """The GPU path's plumbing through a whole model (one rank, host buffers, kernels in the
    interpreter): projections writing into the buffer, deferred sums finished by the next
    norm, parities alternating within a forward and back to 0 after it; logits equal the
    plain model's (float32), and the prefill + decode of the engine gives the same tokens."""
    from replayssm import LLM, SamplingParams
    from replayssm.distributed import TensorParallelGroup
    from replayssm.distributed.fused import SymmOutProj
    from replayssm.models import load_model

    if arch == "mamba2":
        m = H.tiny_mamba2(seed=5, num_heads=6, head_dim=5, hidden_size=15, n_groups=1, num_hidden_layers=3)
    elif arch == "qwen3_next":
        m = H.tiny_qwen3_next(seed=5, **QWEN)
    else:                                    # biases: projections write bias-included partials
        m = H.tiny_nemotron_h(seed=5, **NEMOTRON)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = H.save_tiny(m, str(tmp_path / arch))
    grp = TensorParallelGroup(1, "cpu", worker_threads=1)
    try:
        ref = load_model(path, dtype="float32")
        tp = grp.load_model(path, dtype="float32")
        calls = _as_fused(tp.local.tp_fused, ref.config.hidden_size)
        subs = sum(len(b.subs) for b in tp.local.blocks)
        assert sum(isinstance(x, SymmOutProj) for x in tp.local.modules()) >= 3
        ids = torch.randint(0, ref.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(tp.local(ids), ref(ids), atol=2e-5, rtol=2e-5)
        assert [p for p, _ in calls] == [i % 2 for i in range(subs)]
        assert [t for _, t in calls] == [False] * (subs - 1) + [True]
        assert tp.local.tp_fused.parity == 0
        if arch == "mamba2":
            outs = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for model in (ref, tp):
                    with LLM(model, max_seq_len=32, decode_mode="replay") as llm:
                        outs.append([o.token_ids for o in llm.generate([[1, 2, 3, 4, 5], [7]],
                                                                       SamplingParams(max_tokens=4))])
            assert outs[0] == outs[1] and len(calls) > subs
    finally:
        grp.close()
