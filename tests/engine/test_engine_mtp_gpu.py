"""MTP speculation on CUDA: greedy output with and without CUDA graphs (the target's verify
graph and the MTP draft-step graph), chains and trees (skipped without a GPU)."""

import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N = 16
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7], [9] * 12, list(range(40))]


@pytest.fixture(scope="module")
def cuda_mtp_model(tmp_path_factory):
    models = pytest.importorskip("replayssm.models")
    from replayssm.bench.common import private_copy
    from replayssm.bench.e2e import _random_model_dir
    from replayssm.bench.random_mtp import add_random_mtp

    root = tmp_path_factory.mktemp("gpu_mtp")
    d = add_random_mtp(private_copy(_random_model_dir("tiny", str(root)), root / "with_mtp"))
    m = models.load_model(d, device="cuda:0", dtype=torch.float32, mtp=True)
    out = []
    for p in PROMPTS:
        ids, gen = torch.tensor([p], device="cuda"), []
        for _ in range(N):
            t = int(m(ids)[0, -1].argmax())
            gen.append(t)
            ids = torch.cat([ids, torch.tensor([[t]], device="cuda")], 1)
        out.append(gen)
    return m, out


@pytest.mark.parametrize("tree", [None, "topk"])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("mode", ["recurrent", "replay", "auto"])
def test_cuda_mtp(cuda_mtp_model, mode, graphs, tree):
    from replayssm import LLM, SamplingParams, SpeculativeConfig

    m, expected = cuda_mtp_model
    sp = SpeculativeConfig("mtp", num_tokens=3, tree=tree, tree_width=2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        llm = LLM(m, device="cuda", dtype="float32", decode_mode=mode, cuda_graphs=graphs, max_seq_len=128, max_num_seqs=len(PROMPTS),
                  auto_threshold=10, speculative=sp, buffer_size=16)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    assert [o.token_ids for o in outs] == expected
    if graphs:
        failed = [str(x.message) for x in w if "CUDA graph" in str(x.message)]
        assert not failed, failed[0][:500]
        assert llm.drafter.runner._graphs, "no MTP draft-step graph was captured"
        assert any(k.kind == "spec" for k in llm.runner._graphs), "no verify graph was captured"
