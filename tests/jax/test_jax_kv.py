"""The JAX backend's KV-only form (``decode_mode="kv"``): no state (``S0 = 0``), every token's
entries kept in a buffer of ``max_seq_len`` (a ring that never wraps or flushes), and ``auto``
(KV-only rows switch to replay at a threshold: a flush in the same buffer).  Greedy tokens
against the PyTorch engine's same form (Mamba-2, Nemotron-H, Qwen3-Next; with and without
n-gram speculation; up to the end of the context), every cache array after prefill / decode /
verify+commit against float64 references (the full forward's logits, a prefill of the whole
sequence, the recurrent form's state and windows), and bad settings (a buffer larger than
memory, a bad threshold) refused before any compile."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from replayssm import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from replayssm.jax import generate as G  # noqa: E402
from replayssm.jax import model as M  # noqa: E402
from replayssm.jax import ops  # noqa: E402
from replayssm.jax.generate import JaxLLM  # noqa: E402

PROMPTS = [[3, 5, 7, 3, 5, 7, 3, 5], [11, 2, 9, 40, 33, 11, 2, 9, 40, 1, 2, 3, 4], [8]]
TOL = dict(rtol=1e-10, atol=1e-10)


def _params(max_tokens=(14, 20, 9)):
    return [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]


def _torch_kv(path, prompts, params, spec=None, **kw):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(path, dtype="float64", decode_mode="kv", speculative=spec, **kw)
        return [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("name,method", [("mamba2", None), ("mamba2_g3", "ngram"), ("nemotron_h", "ngram"),
                                         ("qwen3_next", None), ("qwen3_next", "ngram")])
def test_kv_greedy_tokens_match_torch_kv(hf_model_dir, name, method):
    path = hf_model_dir(name)
    spec = SpeculativeConfig("ngram", num_tokens=3) if method else None
    ref = _torch_kv(path, PROMPTS, _params(), spec)
    out = JaxLLM(path, dtype="float64", decode_mode="kv", speculative=spec).generate(PROMPTS, _params())
    assert [o.token_ids for o in out] == ref
    assert [len(o.token_ids) for o in out] == [14, 20, 9]
    if method:
        assert sum(o.num_accepted for o in out) > 0   # drafts were accepted: commits of several entries


@pytest.mark.parametrize("name,method", [("mamba2", None), ("nemotron_h", "ngram"), ("qwen3_next", "ngram")])
def test_auto_greedy_tokens_match_torch_auto(hf_model_dir, name, method):
    """``auto`` with a threshold of 10: the prompt of 13 starts in replay form, the others
    switch while generating (in a decode or a verify)."""
    path = hf_model_dir(name)
    spec = SpeculativeConfig("ngram", num_tokens=3) if method else None
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = [o.token_ids for o in LLM(path, dtype="float64", decode_mode="auto", auto_threshold=10, buffer_size=8,
                                        speculative=spec).generate(PROMPTS, _params())]
    finally:
        torch.set_num_threads(n)
    llm = JaxLLM(path, dtype="float64", decode_mode="auto", auto_threshold=10, buffer_size=8, speculative=spec)
    assert [o.token_ids for o in llm.generate(PROMPTS, _params())] == ref


@pytest.mark.parametrize("name", ["nemotron_h", "qwen3_next"])
def test_kv_runs_to_the_end_of_the_context(hf_model_dir, name):
    """A prompt + generation that fills ``max_seq_len`` with n-gram speculation: the backend
    stops one verify window (``k + 1``) short of it (its rule for every form; the PyTorch
    engine's KV-only form fills it to the last token), and its tokens are the PyTorch
    engine's up to there."""
    path = hf_model_dir(name)
    S, k = 48, 3
    spec = SpeculativeConfig("ngram", num_tokens=k)
    prompts = [PROMPTS[1] * 2, PROMPTS[0]]
    params = [SamplingParams(max_tokens=100, ignore_eos=True)] * 2
    ref = _torch_kv(path, prompts, params, spec, max_seq_len=S)
    llm = JaxLLM(path, dtype="float64", decode_mode="kv", speculative=spec, max_seq_len=S)
    out = llm.generate(prompts, params)
    assert [len(p) + len(o.token_ids) for p, o in zip(prompts, out)] == [S - k - 1] * 2
    assert [o.token_ids for o in out] == [r[:S - k - 1 - len(p)] for r, p in zip(ref, prompts)]
    assert [len(p) + len(r) for p, r in zip(prompts, ref)] == [S] * 2


def _entries(c):
    return {k: np.asarray(v) for k, v in c.items() if k[:1] == "r" or k in ("k", "v")}


@pytest.mark.parametrize("name", ["mamba2", "nemotron_h", "qwen3_next"])
def test_kv_cache_steps_match_references(hf_model_dir, name):
    """Prefill of padded rows of two lengths, two decode steps, a verify of 3 tokens
    committing 2 / 0, a decode with one row inactive: logits equal the full forward's, the entry
    buffers (and K/V) equal those of a KV-only prefill of each row's whole committed sequence,
    ``ring_len == seq_len``, and the state folded from the entries and the conv windows equal
    the recurrent form's after the same tokens (float64)."""
    llm = JaxLLM(hf_model_dir(name), dtype="float64", decode_mode="kv", layer_loop="scan")   # stacked params
    spec, p = llm.spec, llm.params
    S = 32
    prefill = jax.jit(lambda p, c, i, n: M.prefill(spec, p, c, i, n))   # compiled: eager steps are slow
    decode = jax.jit(lambda p, c, t, a=None: M.decode(spec, p, c, t, active=a))
    seqs = [[3, 5, 7, 3, 5, 9, 2], [1, 2, 9]]
    ids = jnp.asarray([seqs[0], seqs[1] + [0] * 4], jnp.int32)
    c = M.init_cache(spec, 2, "kv", 4, S, fill=float("nan"))
    assert all("state" not in st for st in c.stages) and c.L == S
    lg, c = prefill(p, c, ids, jnp.asarray([7, 3], jnp.int32))
    got = {0: [np.asarray(lg[0])], 1: [np.asarray(lg[1])]}
    for t in ([4, 6], [8, 1]):
        lg, c = decode(p, c, jnp.asarray(t, jnp.int32))
        for b in (0, 1):
            seqs[b].append(t[b])
            got[b].append(np.asarray(lg[b]))
    tok = jnp.asarray([[10, 11, 12], [13, 14, 15]], jnp.int32)

    @jax.jit
    def verify_commit(p, c, tok, a):
        lv, c, pend = M.verify(spec, p, c, tok)
        return lv, M.commit(spec, c, pend, a)

    lv, c = verify_commit(p, c, tok, jnp.asarray([2, 0], jnp.int32))
    seqs[0] += [10, 11]
    got[0] += [np.asarray(lv[0, 0]), np.asarray(lv[0, 1])]
    lens = [len(s) for s in seqs]
    assert np.asarray(c.seq_len).tolist() == lens == np.asarray(c.ring_len).tolist()
    assert np.asarray(c.ring_start).tolist() == [0, 0]
    # references, both rows in one call each: the full forward, a KV-only prefill of each row's
    # whole sequence, the recurrent form's caches after it
    padded = jnp.asarray([sq + [2] * (max(lens) + 1 - len(sq)) for sq in seqs], jnp.int32)
    full = np.asarray(jax.jit(lambda p, i: M.forward(spec, p, i))(p, padded))
    ref = prefill(p, M.init_cache(spec, 2, "kv", 4, S), padded, jnp.asarray(lens, jnp.int32))[1]
    rec = prefill(p, M.init_cache(spec, 2, "recurrent", 4, S), padded, jnp.asarray(lens, jnp.int32))[1]
    for b, n in enumerate(lens):
        np.testing.assert_allclose(np.stack(got[b]), full[b, n - len(got[b]):n], **TOL)
        for (sb, cnt), st, rst, cst in zip(spec.stages, c.stages, ref.stages, rec.stages):
            for key, want in _entries(rst).items():   # [Ly, 1, n, ...]: the committed entries
                np.testing.assert_allclose(np.asarray(st[key])[:, b, :n], want[:, b, :n], **TOL, err_msg=key)
            for key in [k for k in cst if k.startswith("win_")]:
                np.testing.assert_allclose(np.asarray(st[key])[:, b], np.asarray(cst[key])[:, b], **TOL,
                                           err_msg=f"{key} row {b}")
            if "state" in cst:
                folded = _fold(sb.mixer, p, spec, st, b, n)
                np.testing.assert_allclose(folded[:, 0], np.asarray(cst["state"])[:, b], **TOL)
    _, c = decode(p, c, jnp.asarray([1, 1], jnp.int32), jnp.asarray([True, False]))
    assert np.asarray(c.ring_len).tolist() == np.asarray(c.seq_len).tolist() == [len(seqs[0]) + 1, len(seqs[1])]


def _fold(sp, p, spec, st, b, n, start=0, S0=None):
    """The state of row ``b`` folded from its ``n`` entries from ``start`` onto ``S0`` (default
    0), every layer of a stage: ``S_n = e^{Σ a} S0 + Σ_j e^{Σ_{i>j} a_i} (entry_j)`` through the
    replay ops."""
    s = next(i for i, (sb, _) in enumerate(spec.stages) if sb.mixer is sp)
    outs = []
    for layer in range(spec.stages[s][1]):
        def ring(name):
            a = jnp.asarray(st[name])[layer, b:b + 1]
            return ops.gather_ring(a, jnp.asarray([start]))
        valid = jnp.arange(st["rx" if sp.kind == "mamba" else "ru"].shape[2])[None, :] < n
        init = None if S0 is None else jnp.asarray(S0)[layer, b:b + 1]
        if sp.kind == "mamba":
            A = -jnp.exp(p["stages"][s]["mixer"]["A_log"][layer])
            x, B, dt = ring("rx"), ring("rB"), ring("rdt")
            dt = jnp.where(valid[..., None], dt, 0.0)
            init = jnp.zeros((1, sp.H, sp.d, sp.n), dt.dtype) if init is None else init
            outs.append(ops.m2_build_state(init, jnp.where(valid[..., None, None], x, 0.0),
                                           jnp.where(valid[..., None, None], B, 0.0), dt, A * dt, valid))
        else:
            u, k, g = ring("ru"), ring("rk"), ring("rg")
            w, tot = ops.gdn_hist_weights(g, valid)
            init = jnp.zeros((1, sp.HV, sp.K, sp.V), g.dtype) if init is None else init
            outs.append(ops.gdn_build_state(init, jnp.where(valid[..., None, None], u, 0.0),
                                            jnp.where(valid[..., None, None], k, 0.0), w, tot))
    return np.stack([np.asarray(o) for o in outs])


@pytest.mark.parametrize("name", ["mamba2", "nemotron_h", "qwen3_next"])
def test_auto_switches_rows_at_the_threshold(hf_model_dir, name):
    """``auto`` (threshold 6, ring 8, verify windows of 3): a prompt of 7 starts in replay form
    (the prefill's state, ring empty); a prompt of 3 reaches 6 tokens in a verify and switches
    at the next verify (``S0 = S_6``, the accepted entries in the ring); a prompt of 4 reaches 5
    and switches in a decode (``S0 = S_6``, ring empty, then one entry).  Logits equal the
    full forward's; each row's checkpoint equals the recurrent form's state at its switch /
    flush, and checkpoint + ring fold to the recurrent state after all its tokens (float64)."""
    llm = JaxLLM(hf_model_dir(name), dtype="float64", decode_mode="auto", buffer_size=8, auto_threshold=6,
                 layer_loop="scan")   # the model functions below take stacked params
    spec, p = llm.spec, llm.params
    S = 32
    prefill = jax.jit(lambda p, c, i, n: M.prefill(spec, p, c, i, n))
    decode = jax.jit(lambda p, c, t: M.decode(spec, p, c, t))

    @jax.jit
    def verify_commit(p, c, tok, a):
        lv, c, pend = M.verify(spec, p, c, tok)
        return lv, M.commit(spec, c, pend, a)

    seqs = [[3, 5, 7, 3, 5, 9, 2], [1, 2, 9], [4, 4, 8, 1]]
    ids = jnp.asarray([sq + [0] * (7 - len(sq)) for sq in seqs], jnp.int32)
    c = M.init_cache(spec, 3, "auto", 8, S, fill=float("nan"), auto_threshold=6)
    assert c.L == S and c.auto == (8, 6)
    lg, c = prefill(p, c, ids, jnp.asarray([len(sq) for sq in seqs], jnp.int32))
    assert np.asarray(c.ring_len).tolist() == [0, 3, 4]
    got = [[np.asarray(lg[b])] for b in range(3)]
    for tok, a in (([[10, 11, 12], [13, 14, 15], [16, 17, 18]], [3, 3, 1]),
                   ([[19, 20, 21], [22, 23, 24], [25, 26, 27]], [3, 1, 0])):
        lv, c = verify_commit(p, c, jnp.asarray(tok, jnp.int32), jnp.asarray(a, jnp.int32))
        for b in range(3):
            seqs[b] += tok[b][:a[b]]
            got[b] += [np.asarray(lv[b, j]) for j in range(a[b])]
    for t in ([30, 31, 32], [33, 34, 35]):
        lg, c = decode(p, c, jnp.asarray(t, jnp.int32))
        for b in range(3):
            seqs[b].append(t[b])
            got[b].append(np.asarray(lg[b]))
    lens = [len(sq) for sq in seqs]
    assert np.asarray(c.seq_len).tolist() == lens == [15, 9, 7]
    # row 0: replay from the prompt, flushed S_10 in the second verify (h = 3: 3 + 6 > 8), then
    # 3 + 2 entries; row 1: 6 entries, switched in the second verify (S_6, 1 entry) + 2;
    # row 2: 5 entries, switched in the first decode (S_6, ring empty) + 1
    assert np.asarray(c.ring_len).tolist() == [5, 3, 1]
    switched = [10, 6, 6]
    T = max(lens) + 1
    padded = jnp.asarray([sq + [2] * (T - len(sq)) for sq in seqs], jnp.int32)
    full = np.asarray(jax.jit(lambda p, i: M.forward(spec, p, i))(p, padded))
    rec = prefill(p, M.init_cache(spec, 3, "recurrent", 8, S), padded, jnp.asarray(lens, jnp.int32))[1]
    at = prefill(p, M.init_cache(spec, 3, "recurrent", 8, S), padded, jnp.asarray(switched, jnp.int32))[1]
    for b, n in enumerate(lens):
        np.testing.assert_allclose(np.stack(got[b]), full[b, n - len(got[b]):n], **TOL)
        for (sb, cnt), st, rst, ast in zip(spec.stages, c.stages, rec.stages, at.stages):
            if "state" not in st:
                continue
            np.testing.assert_allclose(np.asarray(st["state"])[:, b], np.asarray(ast["state"])[:, b], **TOL)
            h = int(c.ring_len[b])
            folded = _fold(sb.mixer, p, spec, st, b, h, int(c.ring_start[b]), st["state"])
            np.testing.assert_allclose(folded[:, 0], np.asarray(rst["state"])[:, b], **TOL)
            for key in [k for k in rst if k.startswith("win_")]:
                np.testing.assert_allclose(np.asarray(st[key])[:, b], np.asarray(rst[key])[:, b], **TOL)


def test_kv_bad_input_is_refused_before_compile(hf_model_dir, monkeypatch):
    path = hf_model_dir("mamba2")
    with pytest.raises(ValueError, match="auto_threshold must be a positive int"):
        JaxLLM(path, decode_mode="auto", auto_threshold=0)
    with pytest.raises(ValueError, match="auto_threshold must be a positive int with decode_mode='auto'"):
        JaxLLM(path, decode_mode="kv", auto_threshold=8)
    with pytest.raises(ValueError, match="entry buffers"):
        JaxLLM(path, dtype="float64", decode_mode="auto", max_seq_len=2**40)
    with pytest.raises(ValueError, match="entry buffers.*lower max_seq_len or use decode_mode='replay'"):
        JaxLLM(path, dtype="float64", decode_mode="kv", max_seq_len=2**40)
    JaxLLM(path, dtype="float64", decode_mode="replay", max_seq_len=2**40)   # replay keeps no per-token entries
    llm = JaxLLM(path, dtype="float64", decode_mode="kv", max_seq_len=64)
    one_row = M.entry_bytes(llm.spec, "kv", 1, 16, 64)
    assert one_row > 0 and M.entry_bytes(llm.spec, "replay", 1, 16, 64) * 4 == one_row   # 16 vs 64 entries
    monkeypatch.setattr(G, "_memory_bytes", lambda: 2 * one_row)   # one row fits, three do not
    with pytest.raises(ValueError, match="3 row"):
        llm.generate(PROMPTS, _params())
    assert not llm._programs   # nothing was compiled
    with pytest.raises(ValueError, match="leaves no room"):
        llm.generate([[1] * 63], _params((4,)))
