"""The plain decode step's masks (``engine.structured.logits``): the grammar fill on the worker
thread started before the forward (``prepare``) and the device-side application (``apply``)
against a plain float64 reference built row by row from each matcher's own bitmask, for
mixed batches (free, grammar, bans, ``min_tokens``, ``logit_bias`` rows), all-constrained
batches, logits wider than the grammar's vocabulary, and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import replayssm
from replayssm.engine.config import SamplingParams
from replayssm.engine.structured import ConstraintFactory, LogitsMasker
from replayssm.engine.structured.logits import GRAMMAR_STATS

pytest.importorskip("llguidance")

MODEL = Path(replayssm.__file__).parent / "assets" / "tiny-mamba2"
EOS = 256
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


class _Seq:
    def __init__(self, constraint, output_ids=()):
        self.constraint, self.output_ids = constraint, list(output_ids)


def _factory():
    from tokenizers import Tokenizer
    return ConstraintFactory(Tokenizer.from_file(str(MODEL / "tokenizer.json")), 257, EOS)


def enc(s: str) -> list[int]:
    return [ord(ch) for ch in s]   # the byte-level vocabulary


def _advance(c, toks):
    for t in toks:
        assert c.matcher is None or c.matcher.consume_token(t)
    return c


def reference(logits: torch.Tensor, seqs) -> torch.Tensor:
    """Row by row in float64: biases added, bans and grammar-disallowed tokens (the
    matcher's own single-row bitmask; tokens past its vocabulary) set to -inf."""
    out = logits.double().clone()
    V = out.shape[1]
    for b, s in enumerate(seqs):
        c = s.constraint
        if c is None:
            continue
        for t, v in zip(*c.bias):
            out[b, t] += float(torch.tensor(v, dtype=torch.float32))
        for t in c.banned(s.output_ids):
            out[b, t] = float("-inf")
        if c.matcher is not None:
            bits = int.from_bytes(c.matcher.compute_bitmask(), "little")
            for t in range(V):
                if t >= c.mask_vocab or not (bits >> t) & 1:
                    out[b, t] = float("-inf")
    return out


def _batch(every: bool):
    f = _factory()
    P = SamplingParams
    rows = [(P(structured_outputs={"json": SCHEMA}), '{"name":"ab'),
            (P(structured_outputs={"regex": "(ab|cd)+x?"}), "abc"),
            (P(min_tokens=4, bad_words=("b", "q"), logit_bias={97: 2.5, 120: -1.25}), "a"),   # no grammar
            (P(structured_outputs={"choice": ["yes", "no"]}, logit_bias={110: 3.0}), ""),
            (P(structured_outputs={"json": SCHEMA}), '{"name":"x","n":1'),
            (P(min_tokens=2, structured_outputs={"regex": "[a-c]*"}), "")]
    if not every:
        rows.insert(1, (P(), "zz"))    # free rows between constrained ones
        rows.append((P(), ""))
    seqs = []
    for p, text in rows:
        c = f.build(p)[0]
        seqs.append(_Seq(None if c is None else _advance(c, enc(text)), enc(text)))
    return seqs


@pytest.mark.parametrize("every", [True, False])
@pytest.mark.parametrize("V,dtype", [(257, torch.float32), (301, torch.bfloat16), (257, torch.float64)])
def test_apply_matches_the_row_by_row_reference(every, V, dtype):
    seqs = _batch(every)
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(len(seqs), V, generator=g, dtype=torch.float64) * 4).to(dtype)
    keep = logits.clone()
    m = LogitsMasker("cpu")
    job = m.prepare(seqs)   # the fill runs on the worker while the caller does other work
    out = m.apply(logits, seqs, job)
    ref = reference(logits, seqs)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(out.double()[fin], ref[fin], rtol=1e-6, atol=1e-6)
    assert torch.equal(logits, keep)   # the input is untouched
    for b, s in enumerate(seqs):
        if s.constraint is None:
            assert torch.equal(out[b], logits[b].float())
        elif s.constraint.matcher is not None:
            assert torch.isfinite(out[b]).any()
    assert torch.equal(m.apply(logits, seqs), out)   # without a job: the same
    assert all(m.stats[k] >= 0 for k in GRAMMAR_STATS) and m.stats["grammar_fill_s"] > 0


def test_decode_loop_with_the_worker_equals_the_reference_each_step():
    """Greedy steps: prepare (worker fill) -> apply -> argmax -> advance, against the
    reference from the same matchers; every row's output stays valid."""
    f = _factory()
    seqs = [_Seq(f.build(SamplingParams(structured_outputs={"json": SCHEMA}))[0]) for _ in range(5)] + \
        [_Seq(None), _Seq(f.build(SamplingParams(structured_outputs={"regex": "(ab|cd)+x"}))[0])]
    m = LogitsMasker("cpu")
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        logits = torch.randn(len(seqs), 257, generator=g)
        job = m.prepare(seqs)
        if step % 3 == 0:
            m.prepare(seqs)   # a job left behind (a step that raised): the next one waits for it
            job = m.prepare(seqs)
        out = m.apply(logits, seqs, job)
        ref = reference(logits, seqs)
        assert torch.equal(torch.isinf(out), torch.isinf(ref)), step
        toks = out.argmax(-1).tolist()
        assert toks == ref.argmax(-1).tolist()
        for s, t in zip(seqs, toks):
            c = s.constraint
            if c is not None and not c.done:
                assert c.matcher.validate_tokens([t]) == 1
                c.advance(t)
            s.output_ids.append(t)


def test_free_batches_pay_nothing():
    m = LogitsMasker("cpu")
    seqs = [_Seq(None), _Seq(None)]
    x = torch.randn(2, 257, dtype=torch.bfloat16)
    assert m.prepare(seqs) is None
    assert m.apply(x, seqs) is x and m.apply(x, seqs, None) is x
    assert m._worker is None and m._executor is None


def test_banned_bits_against_a_plain_unpack():
    m = LogitsMasker("cpu")
    g = torch.Generator().manual_seed(1)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 4), generator=g, dtype=torch.int64).to(torch.int32)
    mask[0, 0] = -1
    mask[1, 1] = -2 ** 31   # only bit 31
    plain = [[bool((int(w) & 0xFFFFFFFF) >> k & 1) for w in row for k in range(32)] for row in mask.tolist()]
    for V in (97, 128, 150):
        want = torch.tensor([[not (t < 128 and r[t]) for t in range(V)] for r in plain])
        assert torch.equal(m.banned(mask, V), want), V
        assert torch.equal(m._unpack(mask, V), ~want)


def test_bad_input_raises_and_a_failed_fill_reaches_its_step():
    f = _factory()
    seqs = [_Seq(f.build(SamplingParams(structured_outputs={"regex": "ab"}))[0]), _Seq(None)]
    m = LogitsMasker("cpu")
    with pytest.raises(ValueError, match="B = 2"):
        m.apply(torch.zeros(3, 257), seqs)
    with pytest.raises(ValueError, match="B = 2"):
        m.apply(torch.zeros(257), seqs)
    job = m.prepare(seqs)
    with pytest.raises(ValueError, match="another batch"):
        m.apply(torch.zeros(2, 257), list(seqs), job)
    assert seqs[0].constraint.matcher.validate_tokens(enc("ab")) == 2   # untouched

    class Broken:   # not a matcher: llguidance rejects it on the worker
        pass

    bad = _Seq(f.build(SamplingParams(structured_outputs={"regex": "ab"}))[0])
    bad.constraint.matcher = Broken()
    batch = [bad]
    job = m.prepare(batch)
    with pytest.raises(TypeError):   # llguidance's own error, raised in the step that owned the fill
        m.apply(torch.zeros(1, 257), batch, job)
    out = m.apply(torch.zeros(2, 257), seqs)   # the masker still works
    assert torch.isfinite(out[0]).sum() == 1 and torch.isfinite(out[0, 97])


def test_fill_bitmask_checks_its_buffer_and_needs_no_torch_compile():
    import os
    import subprocess
    import sys

    from replayssm.engine.structured.logits import fill_bitmask
    c = _factory().build(SamplingParams(structured_outputs={"regex": "ab"}))[0]
    for bad in (torch.zeros(1, 9, dtype=torch.int64), torch.zeros(9, dtype=torch.int32),
                torch.zeros(9, 2, dtype=torch.int32).t()):
        with pytest.raises(ValueError, match="fill_bitmask"):
            fill_bitmask(None, [(c.matcher, 0)], bad)
    m = LogitsMasker("cpu")
    m.apply(torch.zeros(1, 257), [_Seq(c)])
    buf = torch.zeros(1, 9, dtype=torch.int32)
    fill_bitmask(m._executor, [(c.matcher, 0)], buf)
    assert int.from_bytes(c.matcher.compute_bitmask(), "little") == \
        sum((w & 0xFFFFFFFF) << (32 * k) for k, w in enumerate(buf[0].tolist()))
    # a constrained step does not import llguidance's torch helpers (they import torch.compile)
    code = ("import sys, torch; from tests.engine.test_structured_masker import _batch; "
            "from replayssm.engine.structured import LogitsMasker; s = _batch(False); "
            "LogitsMasker('cpu').apply(torch.zeros(len(s), 257), s); "
            "print('llguidance.torch' in sys.modules, 'torch._dynamo' in sys.modules)")
    root = Path(replayssm.__file__).parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         check=False, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.stdout.split()[-2:] == ["False", "False"], out.stderr[-2000:]


def test_draft_masks_ban_past_the_grammar_vocabulary_for_grammar_rows_only():
    """Logits wider than the grammar's vocabulary (301 > 257): a bans-only row keeps the extra
    tokens, a grammar row does not; both as the plain step's masks (``apply``)."""
    from replayssm.engine.structured.drafts import DraftMasks
    f = _factory()
    seqs = [_Seq(f.build(SamplingParams(structured_outputs={"regex": "(ab)+"}))[0]),
            _Seq(f.build(SamplingParams(bad_words=("q",)))[0])]
    N, V = 3, 301
    tokens = torch.tensor([[0, 97, 98], [0, 120, 121]])
    parent = torch.tensor([[-1, 0, 1], [-1, 0, 1]])
    valid = torch.ones(2, N, dtype=torch.bool)
    m = LogitsMasker("cpu")
    mask, v2 = DraftMasks(m).build(seqs, tokens, parent, valid, False, False, V)
    assert v2.all()
    for b in range(2):
        out = seqs[b].output_ids
        for i in range(N):
            want = torch.isfinite(m.apply(torch.zeros(1, V), [_Seq(seqs[b].constraint, out)]))[0]
            assert torch.equal(mask[b, i], want), (b, i)
            if seqs[b].constraint.matcher is not None and i < N - 1:
                seqs[b].constraint.matcher.consume_token(int(tokens[b, i + 1]))
            out = out + [int(tokens[b, i + 1])] if i < N - 1 else out
    assert mask[1, :, 257:].all() and not mask[0, :, 257:].any()


def test_a_decode_step_that_raises_leaves_the_matchers_free(monkeypatch):
    """The forward raising while the worker fills: the error goes up, the fill is waited for
    (the matchers are not left borrowed), and the next steps decode as before."""
    from replayssm.engine import LLM
    llm = LLM(str(MODEL), max_seq_len=64)
    p = SamplingParams(max_tokens=12, structured_outputs={"regex": "(ab|cd)+x"})
    want = [o.token_ids for o in llm.generate(["hi", "yo"], p)]
    llm.add_request("hi", p)
    llm.add_request("yo", p)
    llm.step()   # prefill + first token
    real = llm.runner.decode

    def boom(*a, **k):
        raise RuntimeError("forward failed")

    waits = []
    masker = llm.executor.masker
    monkeypatch.setattr(llm.runner, "decode", boom)
    monkeypatch.setattr(masker, "wait", lambda w=masker.wait: waits.append(masker._pending) or w())
    with pytest.raises(RuntimeError, match="forward failed"):
        llm.step()
    assert waits and waits[-1] is not None and masker._pending is None   # the failed step's fill, waited for
    seqs = list(llm.scheduler.running)
    for s in seqs:   # not "Already borrowed"
        assert s.constraint.matcher.validate_tokens([97]) in (0, 1)
    monkeypatch.setattr(llm.runner, "decode", real)
    llm.recover()
    while llm.has_unfinished():
        llm.step()
    assert sorted(s.output_ids for s in seqs) == sorted(want)
