"""Speculative decoding's drafters, one module each, and the registry the engine builds them from.

* :mod:`.base`  — :class:`Proposal`, :func:`chain_parent`, the :class:`Drafter` base
* :mod:`.ngram` — prompt lookup: chains (``ngram``) and tries (``tree`` without a draft model)
* :mod:`.draft` — draft-model chains (``draft``)
* :mod:`.tree`  — draft-model beam or static trees (``tree`` with a draft model; STree)
* :mod:`.mtp`   — the target's own MTP head (``mtp``), with its CUDA-graph draft step
* :mod:`.policy` — how many tokens each step drafts (0: a plain decode step), chosen from
  measured acceptance and step cost (``SpeculativeConfig.spec_policy``)
* :mod:`.acceptance` — per-depth acceptance estimates (pooled over the drafter's rows, per request)
* :mod:`.simulate` — a length policy on a synthetic acceptance trace (tests, offline comparisons)

The engine calls two functions::

    setup = prepare_drafter(sp, target, spec, device, dtype)   # None without speculation
    setup.draft_model, setup.layout                             # for loading / memory planning
    drafter = setup.build(target=model, cache=cache, sampler=sampler, runner=runner, num_slots=n)

and then asks the drafter what to capture (``graph_shapes``, ``sampled_shapes``,
``capture``); every step, ``length_policy(config, runner).choose(seqs)`` picks the draft
length ``k`` passed to ``drafter.propose(seqs, k)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache.spec import CacheSpec
from ..config import SpeculativeConfig
from ..loading import is_model, load
from .base import Drafter, Proposal, chain_parent, static_tree
from .draft import DraftModelBase, DraftModelDrafter
from .mtp import MTPDrafter, MTPStepGraphs, mtp_head_of
from .ngram import NgramDrafter, NgramIndex, NgramTreeDrafter, ngram_continuations
from .tree import DraftTreeDrafter

__all__ = ["DRAFTERS", "DraftModelBase", "DraftModelDrafter", "DraftTreeDrafter", "Drafter", "DrafterSetup",
           "MTPDrafter", "MTPStepGraphs", "NgramDrafter", "NgramIndex", "NgramTreeDrafter", "Proposal",
           "chain_parent", "drafter_class", "mtp_head_of", "ngram_continuations", "prepare_drafter",
           "static_tree"]


def _tree(sp: SpeculativeConfig) -> type[Drafter]:
    """``method="tree"``: a draft-model tree with a draft model, else an n-gram trie."""
    return DraftTreeDrafter if sp.draft_model is not None else NgramTreeDrafter


#: ``SpeculativeConfig.method`` -> its drafter class, or a resolver ``sp -> class``
DRAFTERS: dict = {
    "ngram": NgramDrafter,
    "draft": DraftModelDrafter,
    "tree": _tree,
    "mtp": MTPDrafter,
}


def drafter_class(sp: SpeculativeConfig) -> type[Drafter]:
    """The drafter class that serves ``sp`` (through :data:`DRAFTERS`)."""
    entry = DRAFTERS.get(sp.method)
    if entry is None:
        raise ValueError(f"no drafter for speculative method {sp.method!r}; known: {sorted(DRAFTERS)}")
    return entry if isinstance(entry, type) else entry(sp)


@dataclass
class DrafterSetup:
    """What :func:`prepare_drafter` decided before the engine's caches exist.

    ``config``: the speculative config; ``cls``: the drafter class; ``target``: the target
    model; ``spec``: the target's cache spec (drafters' own caches use ``spec.for_draft()``);
    ``draft_model``: the loaded draft model (None for drafters without one); ``layout``: the
    per-slot layout of the drafter's own cache for memory planning (None: it keeps none)."""

    config: SpeculativeConfig
    cls: type
    target: object
    spec: CacheSpec
    device: torch.device
    dtype: torch.dtype
    draft_model: object = None
    layout: object = None

    def build(self, *, target, cache, sampler, runner, num_slots: int) -> Drafter:
        """The drafter on the engine's parts: ``target`` (model), ``cache`` (its cache),
        ``sampler``, ``runner`` (the target's runner; its ``use_graphs`` / ``pad_batches``
        decide padding and graphs), ``num_slots`` (drafter caches hold ``num_slots + 1``)."""
        return self.cls.create(self, target=target, cache=cache, sampler=sampler, runner=runner,
                               num_slots=num_slots)


def prepare_drafter(sp: SpeculativeConfig | None, target, spec: CacheSpec, device, dtype) -> DrafterSetup | None:
    """Pick the drafter for ``sp`` and load what it needs before memory planning: the draft
    model (``sp.draft_model``: a loaded model, or a directory loaded on ``device`` in ``dtype``;
    its vocabulary must match the target's) and its own cache's per-slot layout.  None
    without speculation."""
    if sp is None:
        return None
    cls = drafter_class(sp)
    setup = DrafterSetup(sp, cls, target, spec, device, dtype)
    if cls.uses_draft_model:
        dm = sp.draft_model
        setup.draft_model = dm if is_model(dm) else load(dm, device, dtype)[0]
        have, want = int(setup.draft_model.config.vocab_size), int(target.config.vocab_size)
        if have != want:
            raise ValueError(f"draft model vocab_size {have} != target vocab_size {want}")
    setup.layout = cls.own_layout(setup)
    return setup
