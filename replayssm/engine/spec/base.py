"""What every drafter shares: :class:`Proposal`, :func:`chain_parent` and the :class:`Drafter` base.

A :class:`Proposal` packs, per row, ``N`` nodes where node 0 is the row's last accepted
token (not yet in the target cache) and nodes ``1..N-1`` are drafts, with ``parent [B, N]``
(``parent[:, 0] = -1``; a chain has ``parent[i] = i - 1``), ``valid [B, N]`` (padding
nodes are never accepted) and optional draft distributions ``q [B, N, V]`` for sampled
drafts (``None``: every draft is a deterministic choice).

A drafter also declares what the engine must prepare for it: the verify shapes to capture
as CUDA graphs up front (:meth:`Drafter.graph_shapes`, :meth:`Drafter.sampled_shapes`), its
own graphs (:meth:`Drafter.capture`), the per-slot layout of its own cache for memory
planning (:meth:`Drafter.own_layout`) and how it is built from the engine's parts
(:meth:`Drafter.create`); :mod:`replayssm.engine.spec` picks the class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..sequence import Sequence


@dataclass
class Proposal:
    tokens: Tensor          # [B, N] long
    parent: Tensor          # [B, N] long
    valid: Tensor           # [B, N] bool
    q: Tensor | None = None  # [B, N, V] draft distributions of sampled drafts
    tree: bool = False      # verify with verify_tree (else a chain: verify)

    @property
    def num_drafts(self) -> Tensor:
        """Valid drafts per row ``[B]`` (the root excluded)."""
        return self.valid[:, 1:].sum(-1)

    def truncate(self, n: int) -> "Proposal":
        """The first ``n`` nodes of every row (parents precede their children, so a prefix
        of the nodes is a tree; a chain stays a chain)."""
        if not 1 <= n <= self.tokens.shape[1]:
            raise ValueError(f"Proposal.truncate: n must be in [1, {self.tokens.shape[1]}], got {n}")
        q = None if self.q is None else self.q[:, :n]
        return Proposal(self.tokens[:, :n], self.parent[:, :n], self.valid[:, :n], q, self.tree)


def chain_parent(B: int, N: int, device) -> Tensor:
    """The parent array ``[B, N]`` of ``B`` chains of ``N`` nodes (``-1, 0, 1, ..., N-2``)."""
    return torch.arange(-1, N - 1, device=device).expand(B, N).contiguous()


def static_tree(paths) -> tuple[list[int], list[int], list[int]]:
    """``(parent, rank, depth)`` per node of a rank-path tree (node 0 = the root; node ``i``
    = ``paths[i-1]``, sorted by depth, see ``normalize_static_tree``)."""
    paths = list(paths)
    parent = [-1] + [0 if len(p) == 1 else 1 + paths.index(p[:-1]) for p in paths]
    return parent, [0] + [p[-1] for p in paths], [0] + [len(p) for p in paths]


class Drafter:
    """Proposes drafts for the running sequences and follows what the target accepted.

    Class attributes the registry reads: ``method`` (the ``SpeculativeConfig.method`` it
    serves), ``uses_draft_model`` (``SpeculativeConfig.draft_model`` is loaded for it),
    ``uses_mtp_head`` (the target must be loaded with its MTP head), ``samples_q`` (its
    sampled proposals carry draft distributions ``q``)."""

    method = "none"
    uses_draft_model = False
    uses_mtp_head = False
    samples_q = False

    # -- construction (the registry's setup calls these) ------------------------------------------
    @classmethod
    def own_layout(cls, setup):
        """Per-slot layout of the drafter's own cache (memory planning), or None when it
        keeps none.  ``setup``: the :class:`~replayssm.engine.spec.DrafterSetup`."""
        return None

    @classmethod
    def create(cls, setup, *, target, cache, sampler, runner, num_slots: int) -> "Drafter":
        """The drafter for ``setup`` on the engine's parts: ``target`` (the model), ``cache``
        (its cache), ``sampler``, ``runner`` (the target's runner: ``use_graphs``,
        ``pad_batches``), ``num_slots`` (sequences; caches hold ``num_slots + 1`` slots)."""
        raise NotImplementedError

    # -- what the engine prepares ---------------------------------------------------------------
    def graph_shapes(self) -> list[tuple[int, bool]]:
        """``(nodes, tree)`` of the greedy verify steps to capture up front ([] when the
        proposal's size varies per step: such graphs are captured when first met)."""
        return []

    def sampled_shapes(self) -> list[tuple[int, bool, bool]]:
        """``(nodes, tree, has_q)`` of the sampled verify steps to capture up front."""
        return [(n, tree, self.samples_q) for n, tree in self.graph_shapes()]

    def capture(self, lengths=()) -> int:
        """Capture the drafter's own CUDA graphs (a draft model's runner, MTP's step) before
        serving, for each draft length in ``lengths`` the engine may ask for; returns how
        many were captured."""
        return 0

    def null_step(self, batch: int, T: int):
        """A call that runs the drafter's own device work for a step of ``T`` drafts (``T = 0``:
        its work before a plain step) on ``batch`` null-slot rows, or None when there is none
        to time (host-only drafters).  The adaptive length policy's start-up cost table adds
        its time to the verify step's (``warmup.measure_draft_costs``)."""
        return None

    # -- per step -------------------------------------------------------------------------------
    def prefill(self, seqs: list[Sequence]) -> None:
        pass

    def propose(self, seqs: list[Sequence], k: int | None = None) -> Proposal | None:
        """Drafts for ``seqs``: chains of up to ``k`` drafts (default: the configured
        number; the engine's length policy picks ``k`` per step), trees their whole shape."""
        raise NotImplementedError

    def accepted(self, seqs: list[Sequence], accepted: list[int], path: Tensor | None) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def swap_out(self, seq: Sequence) -> None:
        """``seq`` is preempted (between steps, its slot still held): copy what the drafter
        keeps in that slot to host memory under ``seq.swap_key`` and free the slot.  Drafters
        without a cache of their own (n-gram) keep their per-request state as it is."""

    def swap_in(self, seq: Sequence) -> None:
        """``seq`` resumes in the (possibly different) slot ``seq.slot``: restore what
        :meth:`swap_out` kept."""

    def drop_swapped(self, seq: Sequence) -> None:
        """``seq`` was aborted while swapped out: forget its host copy."""

    #: whether the drafter catches up lazily from the token ids (:meth:`plain_step` does
    #: nothing): its plain steps may then overlap under async scheduling
    lazy_catch_up: bool = True

    def plain_step(self, seqs: list[Sequence]) -> None:
        """``seqs`` are about to decode one token without speculation (the engine's
        ``disable_by_batch_size``).  Drafters that catch up lazily from the token ids need
        nothing; the MTP head commits its pending pairs here (``lazy_catch_up = False``)."""

    def reset(self) -> None:
        """Forget a draft step left half-way by a failed engine step."""
