"""MTP drafting (``method="mtp"``): the target's own multi-token-prediction head proposes chains or token trees.

The head (:class:`replayssm.models.mtp.MTPHead`) is a small causal model over the pairs
``(h_t, x_{t+1})`` (target hidden state after token ``t``, next token), pair ``t`` at
position ``t``.  It keeps a cache of its own under the target's slot numbers; the target
keeps its final-normed hidden states in ``cache.hidden`` (``ModelCache.keep_hidden``), which
every target call writes on the device.

Invariant: before a proposal, the head has committed the pairs of every target token but the
last ``a``, where ``a`` is what the last target step accepted (its accepted nodes and the
bonus token; ``a = 1`` after a prefill).  A proposal then runs, device-only:

1. **catch-up**: the ``a`` pending pairs — the accepted nodes' hidden states gathered from
   ``cache.hidden`` along the accepted path, with the tokens that followed them (the
   accepted drafts, then the bonus token) — as one MTP ``verify`` of ``K+1`` pairs (padded),
   committed ``a`` per row.  Its output at pair ``a-1`` is ``g_1``; ``lm_head(g_1)`` gives
   draft 1.
2. **drafts 2..k** (chain): an MTP ``verify`` of the tentative pairs ``(g_1, d_1) .. (g_r,
   d_r)``, committed 0 (rolled back: the next catch-up replaces them with the target's
   hidden states); output ``r`` gives ``g_{r+1}`` and draft ``r+1``.
   **Trees** (static rank paths, each node's children the top-ranked tokens of its MTP
   distribution): level ``l`` evaluates the nodes of levels ``< l`` as one ``verify_tree``
   (committed 0), node ``i``'s hidden input being its parent's ``g``.

Greedy steps are one CUDA graph per batch bucket (:class:`MTPStepGraphs`), replayed with no
host sync: the host packs the catch-up tokens, node indices and counts into one small
host-to-device copy, the graph gathers ``cache.hidden`` itself.  The draft step is a graph of
its own, launched right before the target's verify graph with nothing between them that waits
for the device (the tokens it drafts stay on the device as the verify graph's input; the
host's one sync is the verify step's result), so one fused graph would save only a graph
launch.  Sampled rows draw from the MTP distribution (eager), so speculative sampling stays
lossless.

Plain steps (the length policy's ``T = 0``) defer the catch-up: the pending pairs' hidden
states move into a per-slot window of ``W`` pairs (``mtp_window`` rounded up to a multiple of
``K+1``; a gather and a scatter, no sync) and are committed, ``K+1`` per pass and in order,
when drafting resumes, when a row's window would overflow, or before a swap-out (window
passes: one graph per bucket and pass count).  The head's cache ends exactly as if it had
caught up every step.  ``mtp_window=0``: the catch-up runs before every plain step instead
(a graph of ``K+1`` pairs per row after a speculative step, of one pair after a plain one).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ...runtime import canonical_device, host_to_device
from ..batching import batch_buckets, bucket_for, pad_rows
from ..model_runner import CAPTURE_ERROR_MODE
from ..sampler import Sampler, process, sample_from
from ..sequence import Sequence
from .base import Drafter, Proposal, chain_parent, static_tree


def mtp_head_of(model):
    """The loaded MTP head of ``model``, or a ValueError saying how to get one."""
    head = getattr(model, "mtp", None)
    if head is None:
        raise ValueError("speculative method 'mtp' needs the target's MTP head: pass a model directory whose "
                         "checkpoint has one, or a model loaded with load_model(path, mtp=True) (tensor "
                         "parallel: TensorParallelGroup.load_model(path, mtp=True))")
    return head


class MTPDrafter(Drafter):
    """Chains (``tree=None``: ``num_tokens`` drafts) or static trees (rank paths) from the
    target's MTP head.  ``target_cache`` is the target's cache (it starts keeping hidden
    states here); the head's cache is made with the same slots, from ``spec`` (the target's
    :class:`~replayssm.cache.spec.CacheSpec`) via ``spec.for_draft()``.

    The drafter keeps the host bookkeeping (each request's pending catch-up nodes, the
    sampler's draws); the device work is an :class:`MTPSteps`.  Under tensor parallelism
    (``target.make_on_every_rank``) every rank holds one over its shards and runs each call
    (one message per call)."""

    method = "mtp"
    uses_mtp_head = True
    lazy_catch_up = False   # plain_step moves the pending pairs into the head's window
    samples_q = True

    def __init__(self, target, target_cache, sampler: Sampler, device, max_batch: int, spec, num_tokens: int,
                 tree=None, cuda_graphs: bool = False, pad_batches: bool = False, window: int = 16,
                 fused_runner=None):
        mtp_head_of(target)
        self.target_cache, self.sampler = target_cache, sampler
        self.device = canonical_device(device)
        kw = dict(max_batch=max_batch, spec=spec, num_tokens=num_tokens, tree=tree, cuda_graphs=cuda_graphs,
                  pad_batches=pad_batches, window=window)
        self._split = hasattr(type(target), "make_on_every_rank")
        if self._split:   # split over ranks: each rank's device
            self.steps = target.make_on_every_rank(MTPSteps, target, target_cache, None, **kw)
        else:
            self.steps = MTPSteps(target, target_cache, self.device, **kw)
        st = self.steps
        self.tree, self.parent, self.rank, self.depth = st.tree, st.parent, st.rank, st.depth
        self.k, self.num_nodes, self.width = st.k, st.num_nodes, st.width
        self.window, self.chunks = st.window, st.chunks
        self._nodes: dict = {}             # request id -> target nodes of its pending catch-up pairs
        self._stashed: dict = {}           # request id -> pairs deferred in the head's window (plain steps)
        self.num_deferred = 0              # pairs deferred so far (stats)
        self.num_flushes = 0               # window passes run (on resume, on a full window, before a swap)
        self._parent_t = torch.tensor(self.parent, dtype=torch.long, device=self.device)
        # the draft step and the target's verify as one graph (``mtp_fused``; one rank only)
        self.fused = None
        if fused_runner is not None and not self._split:
            self.fused = MTPFusedStep(self.steps, fused_runner, cuda_graphs, pad_batches)

    # the device half's parts (under tensor parallelism: rank 0's, to read)
    @property
    def head(self):
        return self.steps.head

    @property
    def cache(self):
        return self.steps.cache

    @property
    def runner(self):
        return self.steps.runner

    @classmethod
    def own_layout(cls, setup):
        return mtp_head_of(setup.target).cache_layout(setup.spec.for_draft())

    @classmethod
    def create(cls, setup, *, target, cache, sampler, runner, num_slots):
        sp = setup.config
        return cls(target, cache, sampler, setup.device, num_slots, setup.spec, sp.num_tokens, tree=sp.tree,
                   cuda_graphs=runner.use_graphs, pad_batches=runner.pad_batches, window=sp.mtp_window,
                   fused_runner=runner if sp.mtp_fused else None)

    def graph_shapes(self):
        return [(self.num_nodes, self.tree)]

    def capture(self, lengths=()) -> int:
        """The greedy draft step's graphs: per batch bucket and chain length in ``lengths``
        (a tree: its one shape), the catch-up alone (before plain steps), the window passes,
        and with ``mtp_fused`` the fused draft-and-verify graphs."""
        ns = self._node_counts(lengths)
        return self.steps.capture(ns) + (self.fused.capture(ns) if self.fused is not None else 0)

    def null_step(self, batch: int, T: int):
        """A call running the draft step of ``T`` drafts (``T = 0``: the drafter's work before
        a plain step that follows another: the window's one-pair write, or without a window
        the one-pair catch-up) on ``batch`` null-slot rows, as graph padding does: what the
        length policy's start-up table adds to a step's cost (``warmup.measure_draft_costs``).
        None for a model split over ranks (its steps run on every rank)."""
        _check_probe(batch, T, self.num_nodes - 1 if self.tree else self.k)
        if self._split:
            return None
        st = self.steps
        if T == 0:
            if self.window:   # a run of plain steps: one pair per row into the window
                rows = [(0, 0, [0])] * batch
                return lambda: st.stash(rows)
            ins1 = st.plain_runner1._inputs(batch)
            return lambda: st.plain_runner1.run(*ins1, 1)
        ins = st.runner._inputs(batch)
        n = self.num_nodes if self.tree else min(int(T), self.k) + 1
        return lambda: st.runner.run(*ins, n)

    def null_flush(self, batch: int):
        """A call running one window pass (``width`` deferred pairs per row) on ``batch``
        null-slot rows: the length policy's price of each pass a step runs first
        (:meth:`catchup_passes`); None without a window or for a model split over ranks."""
        _check_probe(batch, 0, 0)
        if self._split or not self.window:
            return None
        ins = self.steps.stash_runner._inputs(batch)
        return lambda: self.steps.stash_runner.run(*ins, 1)

    def catchup_passes(self, seqs: list[Sequence], T: int) -> int:
        """Window passes a step of ``T`` drafts over ``seqs`` runs before its own work: a
        speculative step first commits every deferred pair (``ceil(max deferred / width)``
        passes); a plain step only when some row's window would overflow (then its whole
        window).  The length policy adds their price to the step's."""
        if not self.window:
            return 0
        m = [self._stashed.get(s.request_id, 0) for s in seqs]
        if T:
            return -(-max(m, default=0) // self.width)
        over = [mi for mi, s in zip(m, seqs) if mi + len(self._nodes.get(s.request_id) or [0]) > self.window]
        return -(-max(over) // self.width) if over else 0

    def _node_counts(self, lengths) -> list[int]:
        if self.tree or not lengths:
            return [self.num_nodes]
        return sorted({min(int(t), self.k) + 1 for t in lengths})

    # ---- bookkeeping ---------------------------------------------------------------------------
    def prefill(self, seqs: list[Sequence]) -> None:
        """Run the head over each prompt's pairs (:meth:`MTPSteps.prefill`)."""
        for s in seqs:
            self._nodes[s.request_id] = [0]
            self._stashed[s.request_id] = 0
        self.steps.prefill([(s.slot, list(s.prompt_ids)) for s in seqs])

    def accepted(self, seqs, accepted, path) -> None:
        """The accepted nodes become the next catch-up's pairs (tree: along ``path``)."""
        rows = path.tolist() if (self.tree and path is not None) else None
        for b, (s, a) in enumerate(zip(seqs, accepted)):
            self._nodes[s.request_id] = rows[b][:a] if rows is not None else list(range(a))

    def plain_step(self, seqs: list[Sequence]) -> None:
        """Before a step without speculation: the pending pairs leave ``cache.hidden`` (the
        plain step overwrites it) for the head's window, to be committed when drafting
        resumes; rows whose window would overflow commit it first (one pass per ``width``
        pairs).  Without a window the head commits the pending pairs now.  Afterwards the
        plain step's own pair, its hidden state at node 0 with the token it produced, is the
        one pending."""
        if not self.window:
            self.steps.catch_up(self._catchup_rows(seqs))
        else:
            full = [s for s in seqs
                    if self._stashed.get(s.request_id, 0) + len(self._nodes.get(s.request_id) or [0]) > self.window]
            if full:
                self._flush(full)
            moves = []
            for s in seqs:
                nodes, m = self._nodes.get(s.request_id) or [0], self._stashed.get(s.request_id, 0)
                moves.append((s.slot, m, nodes))
                self._stashed[s.request_id] = m + len(nodes)
                self.num_deferred += len(nodes)
            self.steps.stash(moves)
        for s in seqs:
            self._nodes[s.request_id] = [0]

    def _flush(self, seqs: list[Sequence]) -> None:
        """Commit the deferred pairs of ``seqs`` (rows with none are left out): one window
        pass per ``width`` pairs of the row with the most."""
        rows, most, W = [], 0, self.window
        for s in seqs:
            m = self._stashed.get(s.request_id, 0)
            if m:
                a = len(self._nodes.get(s.request_id) or [0])
                toks = s.last_ids(m + a)[:m]
                rows.append([s.slot, m] + toks + [toks[-1]] * (W - m))
                most = max(most, m)
                self._stashed[s.request_id] = 0
        if rows:
            self.num_flushes += 1
            self.steps.flush(rows, -(-most // self.width))

    def release(self, seq: Sequence) -> None:
        self._nodes.pop(seq.request_id, None)
        self._stashed.pop(seq.request_id, None)
        if seq.slot is not None:
            self.steps.release(seq.slot)

    def swap_out(self, seq: Sequence) -> None:
        """The head's cache slot goes to host memory (its deferred pairs committed first);
        the pending catch-up nodes stay (their hidden states travel with the target's slot,
        ``ModelCache.swap_out``)."""
        self._flush([seq])
        self.steps.swap_out(seq.slot, seq.swap_key)

    def swap_in(self, seq: Sequence) -> None:
        self.steps.swap_in(seq.slot, seq.swap_key)

    def drop_swapped(self, seq: Sequence) -> None:
        self._nodes.pop(seq.request_id, None)
        self._stashed.pop(seq.request_id, None)
        self.steps.drop_swapped(seq.swap_key)

    def reset(self) -> None:
        """Forget a draft step left half-way by a failed engine step (the head's pending verify)."""
        self.steps.reset()

    # ---- proposals ------------------------------------------------------------------------------
    def _catchup_rows(self, seqs) -> list[list[int]]:
        """Per row ``[slot, count, tokens (K+1), nodes (K+1)]`` of the pending pairs, padded
        with copies of the last one (host ints: :meth:`MTPSteps.inputs` makes the tensors)."""
        K1, rows = self.width, []
        for s in seqs:
            nodes = self._nodes.get(s.request_id) or [0]
            a = len(nodes)
            toks = s.last_ids(a)
            rows.append([s.slot, a] + toks + toks[-1:] * (K1 - a) + nodes + nodes[-1:] * (K1 - a))
        return rows

    def propose(self, seqs: list[Sequence], k: int | None = None) -> Proposal:
        """A chain of ``k`` drafts (default ``num_tokens``) or the whole tree."""
        B = len(seqs)
        n = self.num_nodes if (self.tree or k is None) else min(int(k), self.k) + 1
        if self.window:   # drafting resumes: the pairs deferred by plain steps first
            self._flush(seqs)
        rows = self._catchup_rows(seqs)
        parent = (self._parent_t.expand(B, -1).contiguous() if self.tree
                  else chain_parent(B, n, self.device))
        valid = torch.ones(B, n, dtype=torch.bool, device=self.device)
        if all(s.params.greedy for s in seqs):
            return Proposal(self.steps.greedy(rows, n), parent, valid, None, tree=self.tree)
        # rank 0's draws and parameters, so that every rank samples the same drafts
        greedy = [bool(s.params.greedy) for s in seqs]
        u = self.sampler.uniforms(seqs, self.num_nodes)
        sb = self.sampler.batch(seqs, penalties=False)
        tokens, q = self.steps.sampled(rows, greedy, sb, u, n)
        return Proposal(tokens, parent, valid, q, tree=self.tree)

    def fused_step(self, seqs: list[Sequence], k: int | None = None):
        """With ``mtp_fused``, for all-greedy rows: the proposal of :meth:`propose` and the
        target's verify, greedy acceptance and commit of it, as one call (one graph per
        bucket and length); returns ``(proposal, accepted [B], bonus [B], path [B, N] | None)``,
        or None where the step cannot be fused (sampling rows, no fused runner)."""
        if self.fused is None or not all(s.params.greedy for s in seqs):
            return None
        B = len(seqs)
        n = self.num_nodes if (self.tree or k is None) else min(int(k), self.k) + 1
        if self.window:
            self._flush(seqs)
        tokens, acc, bonus, path = self.fused.run(self._catchup_rows(seqs), n)
        parent = (self._parent_t.expand(B, -1).contiguous() if self.tree
                  else chain_parent(B, n, self.device))
        valid = torch.ones(B, n, dtype=torch.bool, device=self.device)
        return Proposal(tokens, parent, valid, None, tree=self.tree), acc, bonus, path


class MTPSteps:
    """The device half of MTP drafting: the head, its cache (``spec.for_draft()``, the
    target's slots), and the draft step, eager or as CUDA graphs (:class:`MTPStepGraphs`).

    Every rank of a tensor-parallel model holds one (the head's layers are sharded like the
    model's, its logits gathered complete on every rank); the methods in ``EVERY_RANK`` are
    the drafter's only calls and take host values (slots, prompts, packed catch-up rows) or,
    for sampled steps, rank 0's sampling batch and uniforms, so every rank drafts the same
    tokens and feeds them back identically.  ``device=None``: the target's."""

    EVERY_RANK = ("prefill", "catch_up", "stash", "flush", "greedy", "sampled", "release", "swap_out", "swap_in",
                  "drop_swapped", "reset", "capture")

    def __init__(self, target, target_cache, device, max_batch: int, spec, num_tokens: int, tree=None,
                 cuda_graphs: bool = False, pad_batches: bool = False, window: int = 0):
        self.head = mtp_head_of(target)
        self.target_cache, self.max_batch = target_cache, max_batch
        self.device = canonical_device(target.device if device is None else device)
        self.tree = tree is not None
        if self.tree:
            self.parent, self.rank, self.depth = static_tree(tree)
            self.k = max(self.depth)
        else:
            self.k = int(num_tokens)
            self.parent = list(range(-1, self.k))
            self.rank, self.depth = [0] * (self.k + 1), list(range(self.k + 1))
        self.num_nodes = len(self.parent)
        self.width = self.k + 1            # catch-up pairs per step: at most depth + 1
        if self.width > spec.max_new or self.num_nodes > spec.max_new:
            raise ValueError(f"MTP drafting needs max_new >= {max(self.width, self.num_nodes)}, got {spec.max_new}")
        self.cache = self.head.make_cache(max_batch + 1, spec.for_draft(), device=self.device)
        target_cache.keep_hidden(target.config.hidden_size)
        self.runner = MTPStepGraphs(self._greedy_body, self.device, max_batch, self.width, cuda_graphs, pad_batches)
        # the catch-up alone, before a plain step (the length policy's T = 0): a graph too; after
        # a plain step every row has one pending pair, so runs of plain steps take one pair per
        # row (a pass over K+1 padded pairs would put K+1 times the tokens through the layer)
        self.plain_runner = MTPStepGraphs(self._plain_body, self.device, max_batch, self.width, cuda_graphs,
                                          pad_batches)
        self.plain_runner1 = MTPStepGraphs(self._plain_body, self.device, max_batch, 1, cuda_graphs, pad_batches)
        # the window of pairs deferred by plain steps: their hidden states [P, W, D] (W a
        # multiple of the catch-up width), committed ``width`` pairs a pass (a graph per pass count)
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"MTP window must be an int >= 0 (pairs), got {window!r}")
        self.chunks = -(-window // self.width)
        self.window = self.chunks * self.width
        self.stash_buf = None
        if self.window:
            h = target_cache.hidden
            self.stash_buf = torch.zeros(max_batch + 1, self.window, h.shape[-1], dtype=h.dtype, device=self.device)
        self.stash_runner = MTPStepGraphs(self._stash_body, self.device, max_batch, max(self.window, 1), cuda_graphs,
                                          pad_batches)
        # per tree level: the head's parent array over the nodes evaluated so far (made here:
        # a host-to-device copy is not allowed while a CUDA graph captures)
        self._level_parent = {}
        if self.tree:
            for lvl in range(1, max(self.depth)):
                upto = max(i for i in range(self.num_nodes) if self.depth[i] == lvl) + 1
                self._level_parent[lvl] = torch.tensor([p - 1 for p in self.parent[1:upto]], device=self.device)

    # ---- calls (every rank) --------------------------------------------------------------------
    def prefill(self, rows) -> None:
        """Run the head over each prompt's pairs ``(h_t, x_{t+1})``, ``t < L-1`` (``rows``:
        ``(slot, prompt ids)``; the last pair waits for the first sampled token: the first
        catch-up).  Where the target computed only the last ``m < L`` prompt tokens (their
        hidden states are all it kept), the head runs over the pairs of those: its drafts
        know less of the prompt, the output is the same."""
        todo = []
        for slot, prompt in rows:
            ph = self.target_cache.take_prompt_hidden(slot)
            L = len(prompt)
            m = 0 if ph is None else min(L, int(ph.shape[0]))
            if m >= 2:
                todo.append((slot, prompt[L - m + 1:], ph[ph.shape[0] - m:ph.shape[0] - 1]))
            else:   # no pair yet: the slot starts empty (it swaps out like any other)
                self.cache.start(slot)
        budget = 8192
        while todo:
            group, width = [], 0
            while todo and (not group or max(width, len(todo[0][1])) * (len(group) + 1) <= budget):
                width = max(width, len(todo[0][1]))
                group.append(todo.pop(0))
            B, D = len(group), self.head.config.hidden_size
            ids = torch.zeros(B, width, dtype=torch.long)
            hid = torch.zeros(B, width, D, dtype=group[0][2].dtype, device=self.device)
            for b, (_, toks, ph) in enumerate(group):
                ids[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
                hid[b, : len(toks)] = ph
            slots = host_to_device(torch.tensor([g[0] for g in group], dtype=torch.long), self.device)
            lengths = host_to_device(torch.tensor([len(g[1]) for g in group], dtype=torch.long), self.device)
            with torch.inference_mode():
                self.head.prefill(self.cache, slots, host_to_device(ids, self.device), lengths, hid)

    def inputs(self, rows) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(slots [B], tokens [B, K+1], nodes [B, K+1], count [B])`` of packed catch-up
        rows (:meth:`MTPDrafter._catchup_rows`); one host-to-device copy."""
        K1 = self.width
        t = host_to_device(torch.tensor(rows, dtype=torch.long), self.device)
        return t[:, 0], t[:, 2:2 + K1], t[:, 2 + K1:], t[:, 1]

    def catch_up(self, rows) -> None:
        """Commit the pending pairs of ``rows`` (before a step without speculation); one pair
        per row when no row has more (after a plain step)."""
        slots, toks, nodes, count = self.inputs(rows)
        if all(r[1] == 1 for r in rows):
            self.plain_runner1.run(slots, toks[:, :1].contiguous(), nodes[:, :1].contiguous(), count, 1)
        else:
            self.plain_runner.run(slots, toks, nodes, count, 1)

    def stash(self, moves) -> None:
        """Move pending pairs' hidden states into the window: ``moves`` per row ``(slot, m,
        nodes)``: ``cache.hidden[slot, nodes[j]]`` to window entry ``m + j`` (one
        host-to-device copy of the flat indices, a gather and a scatter; no host sync)."""
        W, N = self.window, self.target_cache.hidden.shape[1]
        dst, src = [], []
        for slot, m, nodes in moves:
            if m + len(nodes) > W:
                raise ValueError(f"MTP window: {m} + {len(nodes)} pairs exceed the window of {W}")
            dst += [slot * W + m + j for j in range(len(nodes))]
            src += [slot * N + int(x) for x in nodes]
        idx = host_to_device(torch.tensor([dst, src], dtype=torch.long), self.device)
        D = self.stash_buf.shape[-1]
        with torch.inference_mode():
            rows = self.target_cache.hidden.view(-1, D).index_select(0, idx[1])
            self.stash_buf.view(-1, D).index_copy_(0, idx[0], rows)

    def flush(self, rows, n: int) -> None:
        """Commit deferred pairs: ``rows`` per row ``[slot, m, tokens (window)]`` (the token
        after each deferred hidden state, padded), ``n`` passes of ``width`` pairs."""
        t = host_to_device(torch.tensor(rows, dtype=torch.long), self.device)
        toks = t[:, 2:]
        self.stash_runner.run(t[:, 0], toks, toks, t[:, 1], int(n))

    def greedy(self, rows, n: int | None = None) -> Tensor:
        """The greedy proposal's tokens ``[B, n]`` (a chain of ``n`` nodes, default all;
        replayed graph, or eager)."""
        return self.runner.run(*self.inputs(rows), self.num_nodes if n is None else int(n))

    def sampled(self, rows, greedy, sb, u: Tensor, n: int | None = None) -> tuple[Tensor, Tensor]:
        """Tokens ``[B, n]`` and draft distributions ``q [B, n, V]``: greedy rows (``greedy``:
        per row) take the ``rank``-th top token (one-hot q), sampling rows draw from the MTP
        distribution (``sb``: the rows' penalty-free SamplingBatch) with the uniforms
        ``u [B, N]`` (i.i.d. among siblings, as lossless multi-draft sampling needs)."""
        g = host_to_device(torch.tensor(list(greedy), dtype=torch.bool), self.device)[:, None]
        u = host_to_device(u, self.device)

        def pick(logits: Tensor, i: int, rank: int):
            q = process(logits, sb)
            top = logits.topk(rank + 1, -1).indices[:, rank]
            tok = torch.where(g[:, 0], top, sample_from(q, u[:, i]))
            onehot = torch.zeros_like(q).scatter(-1, tok[:, None], 1.0)
            return tok, torch.where(g, onehot, q)

        with torch.inference_mode():
            return self._body(*self.inputs(rows), pick, n)

    def release(self, slot: int) -> None:
        self.cache.release([slot])

    def swap_out(self, slot: int, key) -> None:
        self.cache.swap_out(slot, key)

    def swap_in(self, slot: int, key) -> None:
        self.cache.swap_in(slot, key)

    def drop_swapped(self, key) -> None:
        self.cache.drop_swapped(key)

    def reset(self) -> None:
        self.cache.clear_pending()

    def capture(self, ns=None) -> int:
        """Graphs of the greedy step for each node count in ``ns`` (default: all nodes) and of
        the catch-up alone (``K+1`` pairs and one pair per row)."""
        return (self.runner.capture(list(ns) if ns else [self.num_nodes]) + self.plain_runner.capture([1])
                + self.plain_runner1.capture([1])
                + (self.stash_runner.capture(range(1, self.chunks + 1)) if self.window else 0))

    # ---- the draft step (device work only) ------------------------------------------------------
    def _catch_up(self, slots: Tensor, toks: Tensor, nodes: Tensor, count: Tensor) -> Tensor:
        """Commit the pending pairs; returns ``g`` after each row's last one ``[B, D]``."""
        hidden = self.target_cache.hidden[slots[:, None], nodes]              # [B, K+1, D]
        g = self.head.verify(self.cache, slots, toks, hidden)
        self.head.commit(self.cache, count)
        return g[torch.arange(g.shape[0], device=g.device), count - 1]

    def _body(self, slots, toks, nodes, count, pick, n: int | None = None):
        """Tokens ``[B, N]`` (node 0 = the last token; a chain of ``n`` nodes, default all)
        and the draft distributions ``q [B, N, V]`` (or None) of one proposal;
        ``pick(logits [B, V], node, rank) -> (token [B], q [B, V] | None)``."""
        n = self.num_nodes if (n is None or self.tree) else n
        B = slots.shape[0]
        ar = torch.arange(B, device=slots.device)
        last = toks[ar, count - 1]
        zero = torch.zeros(B, dtype=torch.long, device=slots.device)
        g = [self._catch_up(slots, toks, nodes, count)] + [None] * (n - 1)
        tokens: list = [last] + [None] * (n - 1)
        qs: list = [None] * n
        logits: dict = {}

        def expand(i: int) -> None:
            p = self.parent[i]
            if p not in logits:
                logits[p] = self.head.logits(g[p])
            tokens[i], qs[i] = pick(logits[p], i, self.rank[i] if self.tree else 0)

        if not self.tree:
            for r in range(1, n):
                expand(r)
                if r + 1 < n:   # g of draft r: re-run the tentative pairs, roll back
                    out = self.head.verify(self.cache, slots, torch.stack(tokens[1:r + 1], 1),
                                           torch.stack(g[:r], 1))
                    self.head.commit(self.cache, zero)
                    g[r] = out[:, -1]
        else:
            D = max(self.depth)
            for lvl in range(1, D + 1):
                new = [i for i in range(self.num_nodes) if self.depth[i] == lvl]
                for i in new:
                    expand(i)
                if lvl < D:                   # g of every node so far, as one tree (rolled back)
                    upto = new[-1] + 1
                    hid = torch.stack([g[self.parent[i]] for i in range(1, upto)], 1)
                    out = self.head.verify_tree(self.cache, slots, torch.stack(tokens[1:upto], 1),
                                                self._level_parent[lvl].expand(B, -1).contiguous(), hid)
                    self.head.commit(self.cache, zero)
                    for i in range(1, upto):
                        g[i] = out[:, i - 1]
        tok = torch.stack(tokens, 1)
        if n == 1 or qs[1] is None:
            return tok, None
        qs[0] = torch.zeros_like(qs[1])
        return tok, torch.stack(qs, 1)

    def _stash_body(self, slots, toks, nodes, count, n: int) -> Tensor:
        """``n`` passes over the window: pass ``j`` verifies entries ``j·w .. (j+1)·w - 1``
        (``w`` = width) with their tokens and commits ``clamp(count - j·w, 0, w)`` per row."""
        w = self.width
        for j in range(n):
            hid = self.stash_buf[slots, j * w:(j + 1) * w]
            self.head.verify(self.cache, slots, toks[:, j * w:(j + 1) * w].contiguous(), hid)
            self.head.commit(self.cache, (count - j * w).clamp(0, w))
        return count

    def _plain_body(self, slots, toks, nodes, count, n: int) -> Tensor:
        return self._catch_up(slots, toks, nodes, count)

    def _greedy_body(self, slots, toks, nodes, count, n: int) -> Tensor:
        return self._body(slots, toks, nodes, count, _greedy_pick, n)[0]


def _check_probe(batch, T, most: int) -> None:
    """A draft-step probe's ``batch >= 1`` rows and ``0 <= T <= most`` drafts, else ValueError."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"draft-step probe: batch must be a positive int, got {batch!r}")
    if isinstance(T, bool) or not isinstance(T, int) or not 0 <= T <= most:
        raise ValueError(f"draft-step probe: T must be an int in [0, {most}], got {T!r}")


def _rows(out, B: int):
    """The first ``B`` rows of a step's output (a tensor or a tuple of tensors / None)."""
    if isinstance(out, tuple):
        return tuple(None if x is None else x[:B] for x in out)
    return out[:B]


def _greedy_pick(logits: Tensor, i: int, rank: int):
    if rank == 0:
        return logits.argmax(-1), None
    return logits.topk(rank + 1, -1).indices[:, rank], None


class MTPStepGraphs:
    """The greedy MTP draft step, eager or as one CUDA graph per batch bucket.

    ``body(slots [Bp], tokens [Bp, K+1], nodes [Bp, K+1], count [Bp], n) -> tokens [Bp, n]``
    is device work only.  Rows past the batch use the null slot 0 with one pair.  One graph per
    (batch bucket, nodes ``n``); ``capture(ns)`` takes every bucket's graphs before serving
    (largest first, one memory pool); a key whose capture fails runs eagerly, with a warning."""

    def __init__(self, body, device, max_batch: int, width: int, cuda_graphs: bool = False, pad: bool = False,
                 on_fail=None):
        self.body, self.device, self.width = body, canonical_device(device), width
        self.on_fail = on_fail   # called after a failed capture (drop the caches' pending verify)
        self.buckets = batch_buckets(max_batch)
        self.use_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.pad = pad or self.use_graphs
        self._graphs: dict = {}
        self._failed: set = set()
        self._pool = None

    def _inputs(self, Bp: int):
        """Static inputs of ``Bp`` padding rows: the null slot 0 with one pair (node 0, token 0)."""
        z = torch.zeros(Bp, dtype=torch.long, device=self.device)
        zz = torch.zeros(Bp, self.width, dtype=torch.long, device=self.device)
        return z, zz, zz.clone(), torch.ones(Bp, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def run(self, slots: Tensor, toks: Tensor, nodes: Tensor, count: Tensor, n: int) -> Tensor:
        """Proposal tokens ``[B, n]`` of the greedy step (replayed graph, or eager)."""
        B = slots.shape[0]
        if not self.pad:
            return self.body(slots, toks, nodes, count, n)
        Bp = bucket_for(self.buckets, B)
        ins = (pad_rows(slots, Bp), pad_rows(toks, Bp), pad_rows(nodes, Bp), pad_rows(count, Bp, 1))
        key = (Bp, n)
        if self.use_graphs and key not in self._failed:
            g = self._graphs.get(key) or self._capture(Bp, n)
            if g is not None:
                graph, static_in, out = g
                for dst, src in zip(static_in, ins):
                    dst.copy_(src)
                graph.replay()
                return _rows(out, B)
        return _rows(self.body(*ins, n), B)

    def capture(self, ns) -> int:
        """Capture every bucket's graph for each node count in ``ns`` (largest first);
        returns how many were captured."""
        if not self.use_graphs:
            return 0
        keys = [(Bp, n) for Bp in sorted(self.buckets, reverse=True) for n in sorted(ns, reverse=True)]
        return sum(self._capture(*k) is not None for k in keys if k not in self._graphs and k not in self._failed)

    @torch.inference_mode()
    def _capture(self, Bp: int, n: int):
        ins = self._inputs(Bp)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):   # warm-up on the null slot (kernels compile here)
                for _ in range(2):
                    self.body(*ins, n)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=CAPTURE_ERROR_MODE):
                out = self.body(*ins, n)
            self._pool = graph.pool()
        except Exception as e:  # pragma: no cover - depends on the model's kernels
            warnings.warn(f"CUDA graph capture of the MTP draft step (batch {Bp}, {n} nodes) failed, "
                          f"running eagerly: {e}")
            self._failed.add((Bp, n))
            if self.on_fail is not None:
                self.on_fail()
            return None
        self._graphs[(Bp, n)] = (graph, ins, out)
        return self._graphs[(Bp, n)]


class MTPFusedStep:
    """The greedy MTP draft step and the target's greedy verify step (verify, accept, commit:
    ``runner._greedy_body``) as one body, one CUDA graph per (batch bucket, nodes ``n``, the
    target cache's form).  ``body(slots, tokens, nodes, count, n) -> (drafts [Bp, n],
    accepted [Bp], bonus [Bp], path [Bp, n] | None)``; padding rows (the null slot 0) keep only
    their root valid, as the verify step pads them."""

    def __init__(self, steps: "MTPSteps", runner, cuda_graphs: bool = False, pad_batches: bool = False):
        self.steps, self.runner = steps, runner
        self.cuda_graphs, self.pad_batches = cuda_graphs, pad_batches
        self._graphs: dict = {}   # target form -> MTPStepGraphs
        self._parent = torch.tensor(steps.parent, dtype=torch.long, device=steps.device)

    def _graphs_for_form(self) -> MTPStepGraphs:
        form = self.runner._form()
        g = self._graphs.get(form)
        if g is None:
            g = self._graphs[form] = MTPStepGraphs(self.body, self.steps.device, self.steps.max_batch,
                                                   self.steps.width, self.cuda_graphs, self.pad_batches,
                                                   on_fail=self._drop_pending)
        return g

    def body(self, slots: Tensor, toks: Tensor, nodes: Tensor, count: Tensor, n: int):
        st = self.steps
        tokens = st._greedy_body(slots, toks, nodes, count, n)
        Bp = tokens.shape[0]
        if st.tree:
            parent = self._parent.expand(Bp, -1).contiguous()
        else:
            parent = chain_parent(Bp, n, tokens.device)
        valid = (slots != 0)[:, None].expand(Bp, n).clone()
        valid[:, 0] = True
        acc, bonus, path = self.runner._greedy_body(slots, tokens, parent, valid, st.tree, None)
        return tokens, acc, bonus, path

    def _drop_pending(self) -> None:
        """After a failed capture: forget the target's and the head's half-done verify."""
        self.runner._drop_pending()
        self.steps.reset()

    def run(self, rows, n: int):
        """``(drafts [B, n], accepted [B], bonus [B], path [B, n] | None)`` of packed catch-up rows."""
        self.runner.num_calls["tree" if self.steps.tree else "verify"] += 1
        return self._graphs_for_form().run(*self.steps.inputs(rows), int(n))

    def capture(self, ns) -> int:
        return self._graphs_for_form().capture(list(ns))
