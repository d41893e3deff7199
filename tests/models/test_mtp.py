"""MTP heads: checkpoint layouts against transformers modules, the hidden states the target
keeps for them, their own cache, and the errors for checkpoints without one."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch

import mtp_checkpoint as M
from replayssm.models import WeightError, load_model

ARCHS = ["mamba2", "qwen3_next", "nemotron_h"]


@pytest.fixture(scope="module")
def with_mtp(tiny, tmp_path_factory):
    """``name -> (hf_model, dir with an MTP head, reference data, our model with head)``."""
    root = tmp_path_factory.mktemp("mtp_models")
    cache = {}

    def get(name):
        if name not in cache:
            hf, path = tiny(name)
            d = str(root / name)
            shutil.copytree(path, d)
            ref = M.add_mtp(d, seed=len(name))
            cache[name] = (hf, d, ref, load_model(d, dtype="float64", mtp=True))
        return cache[name]

    return get


@pytest.mark.parametrize("name", ARCHS)
def test_mtp_head_matches_transformers_modules(with_mtp, name):
    """u = fc([n_e(E x_{t+1}); n_h(h_t)]), g = norm(layers(u)): ours vs transformers' decoder
    layers and norms composed the same way, float64; and the shared LM head on g."""
    hf, _, ref, ours = with_mtp(name)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (2, 11), generator=g)
    h = M.hf_hidden(hf, ids)
    want = M.reference_g(ref, hf.get_input_embeddings().weight, ids[:, 1:], h[:, :-1])
    got = ours.mtp(ids[:, 1:], h[:, :-1])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ours.mtp.logits(got), hf.lm_head(want).to(torch.float64), rtol=1e-9, atol=1e-9)
    # the hidden half matters (a wrong pairing changes g)
    assert (ours.mtp(ids[:, 1:], h[:, 1:]) - want).abs().max() > 1e-3


@pytest.mark.parametrize("name", ARCHS)
def test_cache_keeps_final_normed_hidden_states(with_mtp, name):
    """prefill / verify / commit / decode write the LM head's input of each token into
    ``cache.hidden`` (and every prompt row into ``prompt_hidden``), equal to transformers'
    ``last_hidden_state``; rows of other slots are untouched."""
    hf, _, _, ours = with_mtp(name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (1, 13), generator=g)
    want = M.hf_hidden(hf, ids)[0]
    for mode in ("replay", "kv"):
        cache = ours.make_cache(4, mode=mode, buffer_size=8, max_new=4, max_seq_len=32)
        cache.keep_hidden(hf.config.hidden_size)
        slot = torch.tensor([2])
        ours.prefill(cache, slot, ids[:, :7], torch.tensor([7]))
        torch.testing.assert_close(cache.take_prompt_hidden(2), want[:7], rtol=1e-9, atol=1e-9)
        assert cache.take_prompt_hidden(2) is None
        torch.testing.assert_close(cache.hidden[2, 0], want[6], rtol=1e-9, atol=1e-9)
        ours.verify(cache, slot, ids[:, 7:11])
        torch.testing.assert_close(cache.hidden[2, :4], want[7:11], rtol=1e-9, atol=1e-9)
        ours.commit(cache, torch.tensor([2]))                        # keep tokens 7, 8
        ours.decode(cache, slot, ids[:, 9])
        torch.testing.assert_close(cache.hidden[2, 0], want[9], rtol=1e-9, atol=1e-9)
        assert (cache.hidden[1] == 0).all() and (cache.hidden[3] == 0).all()
        cache.release([2])
        assert 2 not in cache.prompt_hidden


@pytest.mark.parametrize("name", ARCHS)
def test_head_cache_matches_full_forward(with_mtp, name):
    """The head's own cache (attention KV; a Mamba-2 block's replay ring): prefill, a verify
    committed in part, a verify rolled back and a tree give the no-cache forward's outputs."""
    hf, _, _, ours = with_mtp(name)
    head = ours.mtp
    g = torch.Generator().manual_seed(2)
    D, V = hf.config.hidden_size, hf.config.vocab_size
    ids = torch.randint(0, V, (1, 12), generator=g)
    hid = torch.randn(1, 12, D, generator=g, dtype=torch.float64)
    full = head(ids, hid)[0]
    cache = head.make_cache(3, mode="replay", buffer_size=8, max_new=4, max_seq_len=32, poison=True)
    s = torch.tensor([1])
    head.prefill(cache, s, ids[:, :5], torch.tensor([5]), hid[:, :5])
    out = head.verify(cache, s, ids[:, 5:9], hid[:, 5:9])
    torch.testing.assert_close(out[0], full[5:9], rtol=1e-9, atol=1e-9)
    head.commit(cache, torch.tensor([2]))                           # pairs 5, 6 kept
    bad = head.verify(cache, s, ids[:, 9:10] * 0, hid[:, 9:10] * 3)  # a wrong guess, rolled back
    head.commit(cache, torch.tensor([0]))
    assert (bad[0, 0] - full[7]).abs().max() > 1e-6
    # a tree: node 0 = pair 7, node 1 its child (pair 8), node 2 a sibling of node 1
    tids = torch.stack([ids[0, 7], ids[0, 8], (ids[0, 8] + 1) % V])[None]
    thid = torch.stack([hid[0, 7], hid[0, 8], hid[0, 8]])[None]
    out = head.verify_tree(cache, s, tids, torch.tensor([[-1, 0, 0]]), thid)
    torch.testing.assert_close(out[0, :2], full[7:9], rtol=1e-9, atol=1e-9)
    head.commit(cache, torch.tensor([2]), torch.tensor([[0, 1, 2]]))
    out = head.decode(cache, s, ids[:, 9], hid[:, 9])
    torch.testing.assert_close(out[0], full[9], rtol=1e-9, atol=1e-9)


def test_checkpoint_without_mtp_head_is_a_clear_error(tiny, tmp_path):
    from replayssm import LLM, SpeculativeConfig

    _, path = tiny("qwen3_next")
    with pytest.raises(WeightError, match=r"missing from the checkpoint: mtp\.fc\.weight.*no MTP head"):
        load_model(path, mtp=True)
    with pytest.raises(ValueError, match="mtp"):
        LLM(path, speculative=SpeculativeConfig("mtp"))
    plain = load_model(tiny("mamba2")[1], dtype="float64")
    with pytest.raises(ValueError, match=r"load_model\(path, mtp=True\)"):
        LLM(plain, speculative=SpeculativeConfig("mtp"))
    _, npath = tiny("nemotron_h")
    with pytest.raises(WeightError, match="num_nextn_predict_layers"):
        load_model(npath, mtp=True)
    # a declared head whose tensors are absent names them too
    d = tmp_path / "m"
    shutil.copytree(tiny("mamba2")[1], d)
    M.add_mtp(str(d))
    os.remove(d / "mtp.safetensors")
    with pytest.raises(WeightError, match=r"mtp\.layers\.0\.mixer"):
        load_model(str(d), mtp=True)
    # without mtp=True the head's tensors are skipped, as before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not hasattr(load_model(str(d)), "mtp")
