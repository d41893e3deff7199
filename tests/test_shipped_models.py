"""The models that ship in ``replayssm/assets`` (issue: a newcomer's first command writes real
text): they load, the target predicts held-out code far above chance, and the draft agrees
with the target often enough for speculation to pay.

The snippet below was written for this test (it is not in the training corpus, the Python
standard library).  Measured when the floors were set: target next-byte accuracy 0.79, draft
agreement with the target 0.85, mean accepted length 2.87 (4 drafts) on the README prompt.
Chance is 1/257.
"""

from __future__ import annotations

import os

import pytest
import torch

import replayssm

ASSETS = os.path.join(os.path.dirname(replayssm.__file__), "assets")
TARGET, DRAFT = os.path.join(ASSETS, "tiny-mamba2"), os.path.join(ASSETS, "tiny-mamba2-draft")
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(DRAFT, "config.json")),
                                reason="shipped models not present")

SNIPPET = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] pairs and return them sorted."""
    result = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1][1] = max(result[-1][1], end)
        else:
            result.append([start, end])
    return result
'''


@pytest.fixture(scope="module")
def models():
    from replayssm.models import load_model

    return (load_model(TARGET, device="cpu", dtype=torch.float32),
            load_model(DRAFT, device="cpu", dtype=torch.float32))


def test_target_predicts_held_out_code_and_draft_agrees(models):
    target, draft = models
    ids = torch.tensor([[256] + list(SNIPPET.encode())])  # <eos> = start of a file
    with torch.no_grad():
        pt, pd = target(ids)[0].argmax(-1), draft(ids)[0].argmax(-1)
    accuracy = (pt[:-1] == ids[0, 1:]).float().mean().item()
    agreement = (pt == pd).float().mean().item()
    assert accuracy > 0.6, f"target next-byte accuracy {accuracy:.2f} (measured 0.79)"
    assert agreement > 0.7, f"draft/target agreement {agreement:.2f} (measured 0.85)"


def test_speculation_with_the_shipped_draft_accepts_drafts_and_keeps_the_text():
    from replayssm import LLM, SamplingParams, SpeculativeConfig

    params = SamplingParams(max_tokens=48)
    plain = LLM(TARGET, device="cpu", dtype="float32").generate(["def fibonacci(n):"], params)[0]
    spec = LLM(TARGET, device="cpu", dtype="float32",
               speculative=SpeculativeConfig(method="draft", draft_model=DRAFT, num_tokens=4)
               ).generate(["def fibonacci(n):"], params)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.mean_accepted_length > 2.0, f"mean accepted length {spec.mean_accepted_length:.2f}"
    assert plain.text.strip(), "the shipped model wrote nothing"


@pytest.mark.parametrize("tree", [None, "topk"])
def test_shipped_mtp_head_loads_drafts_and_keeps_the_text(tree):
    """The trained MTP head beside the target (``mtp.safetensors``, docs/TRAINING.md) loads
    and its greedy speculation writes the plain text, accepting drafts (measured when the
    floor was set: 2.14 chain, 2.35 top-k tree, 4 drafts, on this prompt)."""
    from replayssm import LLM, SamplingParams, SpeculativeConfig

    params = SamplingParams(max_tokens=48)
    plain = LLM(TARGET, device="cpu", dtype="float32").generate(["def fibonacci(n):"], params)[0]
    sp = SpeculativeConfig(method="mtp", num_tokens=4, tree=tree, tree_width=2)
    spec = LLM(TARGET, device="cpu", dtype="float32", speculative=sp).generate(["def fibonacci(n):"], params)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.mean_accepted_length > 1.6, f"mean accepted length {spec.mean_accepted_length:.2f}"
