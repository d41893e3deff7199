"""ModelRunner: turns scheduled sequences into model calls on one cache.

Calls take Python slot lists and token tensors and return logits; the only host
synchronisation in a step is the one the caller does after sampling.  On CUDA,
``cuda_graphs=True`` captures ``decode`` and the whole speculative step — verify, acceptance
(greedy, or sampled with penalties and filters at every node), commit — once per
batch-size bucket and cache form (padding rows use the null slot 0) and replays it; any
capture failure falls back to eager execution for that key with a warning.  :meth:`ModelRunner.capture`
takes every fixed-shape graph before serving (``LLM`` calls it); keys first met mid-run are
captured then.

A captured step bakes in every host-side decision of the model call: the batch bucket, the
draft count, chain or tree, and the cache's SSM form (``cache.ssm_form()``: "replay", "kv",
"mixed", ... — it changes between steps in ``decode_mode="auto"`` as requests switch from
KV-only to state form), so the form is part of every graph key (:class:`GraphKey`).
Everything else a step reads (slots, lengths, ring pointers, block tables, the KV/state row
mask) is device data updated in place between replays.  Buckets and padding rows come from
:mod:`replayssm.engine.batching`.

``pad_batches=True`` pads eagerly to the same buckets, which lets the CPU tests exercise the
padding path that the graphs use.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache.tree import ancestor_mask, path_to
from ..runtime import canonical_device, host_to_device
from .batching import batch_buckets, bucket_for, pad_chain_parent, pad_rows
from .sampler import accept_greedy, accept_tree, blank_batch, process, token_logprobs

#: CUDA graph capture checks only the capturing thread's CUDA calls.  In the default
#: ("global") mode any thread of the process that calls a capture-unsafe CUDA API while a
#: graph is captured invalidates the capture and fails its own call: a JAX runtime in the
#: same process (``replayssm.jax.bench``) did exactly that on the H100 -- torch fell back to
#: eager decode and JAX's stream was left in an error state.
CAPTURE_ERROR_MODE = "thread_local"


@dataclass(frozen=True)
class GraphKey:
    """What one captured graph bakes in (the key of :attr:`ModelRunner._graphs`).

    ``kind``: ``"decode"``, ``"gdecode"`` (a decode step returning greedy tokens),
    ``"spec"`` (a greedy verify step) or ``"sspec"`` (a sampled verify step); ``batch``: the batch bucket ``Bp``; ``form``: the cache's SSM form
    (``cache.ssm_form()``, None for caches without one).  Verify steps add ``nodes`` (``N``
    inputs per row) and ``tree`` (verify_tree, else a chain); sampled steps add ``has_q``
    (draft distributions ``q [Bp, N, V]`` given) and ``sampling``
    (:meth:`SamplingBatch.key`: the host-side switches); verify steps of batches with
    constrained rows add ``masked`` (a ``[Bp, N, V]`` token mask applied to the verify logits
    before acceptance; these graphs are captured when first met)."""

    kind: str
    batch: int
    form: str | None = None
    nodes: int = 0
    tree: bool = False
    has_q: bool = False
    sampling: tuple = ()
    masked: bool = False


class ModelRunner:
    def __init__(self, model, cache, device, max_batch: int, cuda_graphs: bool = False,
                 pad_batches: bool = False, greedy_decode: bool | None = None):
        self.model, self.cache = model, cache
        self.device = canonical_device(device)
        self.max_batch = max_batch
        self.buckets = batch_buckets(max_batch)
        self.use_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        if cuda_graphs and not self.use_graphs:
            warnings.warn("cuda_graphs=True ignored: the device is not CUDA", stacklevel=2)
        self.pad_batches = pad_batches or self.use_graphs
        self._graphs: dict[GraphKey, tuple] = {}   # captured graph and its static tensors
        self._graph_failed: set[GraphKey] = set()  # keys whose capture failed (run eagerly)
        self._pool = None
        # greedy tokens cost less than logits (tensor parallelism: no vocabulary gather):
        # plain greedy decode steps take their own graphs (kind "gdecode").  None: as the
        # model says (every tensor-parallel rank gets rank 0's decision)
        self.greedy_decode = bool(getattr(model, "argmax_head", False) if greedy_decode is None else greedy_decode)
        self.num_calls = {"prefill": 0, "decode": 0, "verify": 0, "tree": 0, "greedy_decode": 0, "rows_decode": 0}
        # the last greedy decode's tokens [B] on the device (a view of its graph's static
        # output): what :meth:`decode_rows` feeds the next step from; None after any other call
        self._last_greedy: Tensor | None = None

    # -- helpers ---------------------------------------------------------------------------
    def _h2d(self, t: Tensor) -> Tensor:
        """Host -> device without waiting for queued work (pinned staging on CUDA)."""
        return t if t.device == self.device else host_to_device(t, self.device)

    def _slots(self, slots: list[int], pad_to: int | None = None) -> Tensor:
        s = list(slots) + [0] * ((pad_to or len(slots)) - len(slots))
        return self._h2d(torch.tensor(s, dtype=torch.long))

    def _form(self):
        """The cache's SSM form (part of every graph key; None for caches without one)."""
        f = getattr(self.cache, "ssm_form", None)
        return f() if callable(f) else None

    def _padded(self, B: int) -> int:
        """Rows a batch of ``B`` runs as: its bucket when batches are padded, else ``B``."""
        return bucket_for(self.buckets, B) if self.pad_batches else B

    def _pad_step(self, Bp: int, tokens: Tensor, parent: Tensor, valid: Tensor):
        """A verify step's ``tokens, parent, valid [B, N]`` padded to ``Bp`` rows: padding
        rows carry only their root (a chain, no valid drafts) on the null slot."""
        if tokens.shape[0] == Bp:
            return tokens, parent, valid
        return pad_rows(tokens, Bp), pad_chain_parent(parent, Bp), pad_rows(valid, Bp, False)

    # -- calls -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> Tensor:
        self.num_calls["prefill"] += 1
        self._last_greedy = None
        B, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        return self.model.prefill(self.cache, self._slots(slots), self._h2d(ids), self._h2d(lengths))

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: Tensor, greedy: bool = False) -> Tensor:
        """One decode step: ``logits [B, V]``, or with ``greedy=True`` each row's argmax
        token ``[B]`` int64 (the model's ``decode(..., greedy=True)``: its own graphs)."""
        self.num_calls["greedy_decode" if greedy else "decode"] += 1
        out = self._decode(slots, self._h2d(tokens), greedy)
        self._last_greedy = out if greedy else None
        return out

    def _decode(self, slots: list[int], tokens: Tensor, greedy: bool) -> Tensor:
        B = len(slots)
        kw = {"greedy": True} if greedy else {}
        if not self.pad_batches:
            return self.model.decode(self.cache, self._slots(slots), tokens, **kw)
        Bp = bucket_for(self.buckets, B)
        key = GraphKey("gdecode" if greedy else "decode", Bp, self._form())
        if self.use_graphs and key not in self._graph_failed:
            g = self._graphs.get(key)
            if g is None:
                g = self._capture_decode(key, Bp)
            if g is not None:
                graph, s_in, t_in, out = g
                s_in.copy_(self._slots(slots, Bp))
                t_in.copy_(pad_rows(tokens, Bp))
                graph.replay()
                return out[:B]
        out = self.model.decode(self.cache, self._slots(slots, Bp), pad_rows(tokens, Bp), **kw)
        return out[:B]

    @torch.inference_mode()
    def decode_rows(self, slots: list[int], rows: list[int]) -> Tensor:
        """A greedy decode step whose input tokens are the previous greedy decode's output,
        row ``rows[b]`` of it for row ``b`` (``tokens = prev[rows]``, gathered on the device:
        no host round trip); returns the greedy tokens ``[B]`` as :meth:`decode`.

        The gather (and whatever the caller queued on the previous output, e.g. its copy to
        the host) is queued on the stream before this step's replay overwrites the graph's
        static output.  Under tensor parallelism every rank gathers from its own previous
        output (identical on every rank: the greedy tokens are exchanged), so the control
        message carries only ``slots`` and ``rows``.  ``ValueError`` (nothing run) when the
        last call was not a greedy decode or a row is out of range."""
        prev = self._last_greedy
        if prev is None:
            raise ValueError("decode_rows needs a greedy decode step just before it (the tokens it feeds from)")
        if len(rows) != len(slots) or not rows:
            raise ValueError(f"decode_rows: {len(rows)} rows for {len(slots)} slots (one each, at least one)")
        n = int(prev.shape[0])
        if min(rows) < 0 or max(rows) >= n:
            raise ValueError(f"decode_rows: rows must be in [0, {n}), got {list(rows)}")
        self.num_calls["greedy_decode"] += 1
        self.num_calls["rows_decode"] += 1
        tokens = prev if list(rows) == list(range(n)) else prev[self._h2d(torch.tensor(rows, dtype=torch.long))]
        out = self._decode(slots, tokens, True)
        self._last_greedy = out
        return out

    @torch.inference_mode()
    def replay_ms(self, batch: int, n: int = 20, greedy: bool = False) -> float:
        """Milliseconds per replay of the captured plain-decode graph of ``batch``'s bucket
        (``greedy``: the greedy-token one, :attr:`greedy_decode` runners),
        ``n`` replays back to back (device time of the step alone, no host work between; a
        benchmark probe: the cache's contents are not meaningful afterwards).  NaN when no
        such graph was captured."""
        g = self._graphs.get(GraphKey("gdecode" if greedy else "decode", bucket_for(self.buckets, batch),
                                      self._form()))
        if g is None or not self.device.type == "cuda":
            return float("nan")
        self._last_greedy = None
        graph = g[0]
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    @torch.inference_mode()
    def verify(self, slots: list[int], tokens: Tensor) -> Tensor:
        self.num_calls["verify"] += 1
        B = len(slots)
        self._last_greedy = None
        tokens = self._h2d(tokens)
        Bp = self._padded(B)
        out = self.model.verify(self.cache, self._slots(slots, Bp), pad_rows(tokens, Bp))
        self._rows = (B, Bp)
        return out[:B]

    @torch.inference_mode()
    def verify_tree(self, slots: list[int], tokens: Tensor, parent: Tensor) -> Tensor:
        self.num_calls["tree"] += 1
        B = len(slots)
        self._last_greedy = None
        tokens, parent = self._h2d(tokens), self._h2d(parent)
        Bp = self._padded(B)
        out = self.model.verify_tree(self.cache, self._slots(slots, Bp), pad_rows(tokens, Bp),
                                     pad_chain_parent(parent, Bp))
        self._rows = (B, Bp)
        return out[:B]

    @torch.inference_mode()
    def commit(self, accepted: Tensor, path: Tensor | None = None) -> None:
        B, Bp = getattr(self, "_rows", (accepted.shape[0], accepted.shape[0]))
        accepted = pad_rows(accepted.to(self.device), Bp)
        if path is not None:
            path = pad_rows(path.to(self.device), Bp)
            self.model.commit(self.cache, accepted, path)
        else:
            self.model.commit(self.cache, accepted)

    # -- a whole greedy speculative step ----------------------------------------------------
    def _greedy_body(self, slots_t: Tensor, tokens: Tensor, parent: Tensor, valid: Tensor, tree: bool,
                     mask: Tensor | None = None):
        """verify -> (token mask ``[B, N, V]``: disallowed logits -> -inf) -> greedy
        acceptance -> commit, all device work (graph-capturable).  Unmasked, a
        :attr:`greedy_decode` runner's verify returns the argmax tokens (no logits gather
        under tensor parallelism)."""
        kw = {"greedy": True} if self.greedy_decode and mask is None else {}
        if tree:
            out = self.model.verify_tree(self.cache, slots_t, tokens, parent, **kw)
        else:
            out = self.model.verify(self.cache, slots_t, tokens, **kw)
        if kw:
            accepted, leaf, bonus = accept_greedy(None, tokens, parent, valid, g=out)
        else:
            logits = out if mask is None else out.masked_fill(~mask, float("-inf"))
            accepted, leaf, bonus = accept_greedy(logits, tokens, parent, valid)
        if tree:
            path = path_to(parent, leaf)[0]
            self.model.commit(self.cache, accepted, path)
        else:
            path = None
            self.model.commit(self.cache, accepted)
        return accepted, bonus, path

    @torch.inference_mode()
    def greedy_verify_step(self, slots: list[int], tokens: Tensor, parent: Tensor, valid: Tensor, tree: bool,
                           mask: Tensor | None = None):
        """Verify drafts, accept greedily and commit in one go; returns ``(accepted [B],
        bonus [B], path [B, N] | None)``.  With CUDA graphs the three are one graph per
        (batch bucket, nodes, chain|tree, masked); padding rows carry only their root on
        slot 0.  ``mask [B, N, V]`` bool (constrained rows): the tokens allowed after each node."""
        self.num_calls["tree" if tree else "verify"] += 1
        B, N = tokens.shape
        self._last_greedy = None
        tokens, parent, valid = self._h2d(tokens), self._h2d(parent), self._h2d(valid)
        Bp = self._padded(B)
        tokens, parent, valid = self._pad_step(Bp, tokens, parent, valid)
        if mask is not None:
            mask = pad_rows(mask, Bp, True)
        key = GraphKey("spec", Bp, self._form(), N, tree, masked=mask is not None)
        if self.use_graphs and key not in self._graph_failed:
            g = self._graphs.get(key) or self._capture_spec(key, Bp, N, tree,
                                                            **({"masked": True} if mask is not None else {}))
            if g is not None:
                graph, ins, outs = g
                src = (self._slots(slots, Bp), tokens, parent, valid) + ((mask,) if mask is not None else ())
                for dst, x in zip(ins, src):
                    dst.copy_(x)
                graph.replay()
                acc, bonus, path = outs
                return acc[:B], bonus[:B], (path[:B] if path is not None else None)
        acc, bonus, path = self._greedy_body(self._slots(slots, Bp), tokens, parent, valid, tree, mask)
        return acc[:B], bonus[:B], (path[:B] if path is not None else None)

    # -- a whole sampled speculative step ---------------------------------------------------
    def _sampled_body(self, slots_t: Tensor, tokens: Tensor, parent: Tensor, valid: Tensor, u: Tensor,
                      q: Tensor | None, sb, tree: bool, mask: Tensor | None = None):
        """verify -> penalties and filters at every node -> lossless acceptance
        (:func:`~replayssm.engine.sampler.accept_tree`, uniforms ``u [B, N+1]`` drawn before)
        -> commit -> raw log-probabilities along the accepted path; device work only, so
        the whole step is one graph-capturable body.  Returns ``(accepted, bonus, path,
        logprobs)`` where ``logprobs`` is ``None`` or ``(chosen [B, N], top values, top ids
        [B, N, k])`` for path positions ``0..accepted-1`` (the token after each path node)."""

        if tree:
            logits = self.model.verify_tree(self.cache, slots_t, tokens, parent)
        else:
            logits = self.model.verify(self.cache, slots_t, tokens)
        anc = ancestor_mask(parent) if sb.use_penalties else None
        # the token mask (constrained rows) before penalties and filters, as in a plain step
        masked = logits if mask is None else logits.masked_fill(~mask, float("-inf"))
        p = process(masked, sb, tokens, anc, valid)
        accepted, leaf, bonus = accept_tree(p, tokens, parent, valid, q, u)
        B, N = tokens.shape
        if tree:
            path = path_to(parent, leaf)[0]
            self.model.commit(self.cache, accepted, path)
        else:
            path = None
            self.model.commit(self.cache, accepted)
        lps = None
        if sb.logprobs >= 0:
            pos = torch.arange(N, device=tokens.device).expand(B, N)
            pth = path if tree else pos
            nxt = tokens.gather(1, torch.cat([pth[:, 1:], pth[:, -1:]], 1))
            nxt = torch.where(pos == (accepted - 1)[:, None], bonus[:, None], nxt)
            node_logits = logits.gather(1, pth[:, :, None].expand(B, N, logits.shape[-1]))
            lps = token_logprobs(node_logits, nxt, sb.logprobs)
        return accepted, bonus, path, lps

    @torch.inference_mode()
    def sampled_verify_step(self, slots: list[int], tokens: Tensor, parent: Tensor, valid: Tensor, tree: bool,
                            q: Tensor | None, sb, u: Tensor, mask: Tensor | None = None):
        """The sampled counterpart of :meth:`greedy_verify_step` (any mix of greedy and
        sampled rows, penalties, filters, logprobs): one graph per (batch bucket, nodes,
        chain|tree, cache form, draft distributions or not, the batch's sampling switches).
        ``sb``: the rows' :class:`~replayssm.engine.sampler.SamplingBatch`; ``u [B, N+1]``
        uniforms from each request's generator; ``mask [B, N, V]`` as in
        :meth:`greedy_verify_step`.  Padding rows are greedy on slot 0."""
        self.num_calls["tree" if tree else "verify"] += 1
        B, N = tokens.shape
        self._last_greedy = None
        tokens, parent, valid, u = self._h2d(tokens), self._h2d(parent), self._h2d(valid), self._h2d(u)
        Bp = self._padded(B)
        if Bp != B:
            tokens, parent, valid = self._pad_step(Bp, tokens, parent, valid)
            u = pad_rows(u, Bp, 0.5)
            q = pad_rows(q, Bp) if q is not None else None
            sb = sb.pad(Bp)
            mask = pad_rows(mask, Bp, True) if mask is not None else None
        key = GraphKey("sspec", Bp, self._form(), N, tree, q is not None, sb.key(), mask is not None)
        if self.use_graphs and key not in self._graph_failed:
            g = self._graphs.get(key) or self._capture_sampled(key, Bp, N, tree, q is not None, sb,
                                                               **({"masked": True} if mask is not None else {}))
            if g is not None:
                graph, ins, outs = g
                src = [self._slots(slots, Bp), tokens, parent, valid, u] + ([q] if q is not None else []) + \
                    ([mask] if mask is not None else []) + sb.tensors()
                for dst, x in zip(ins, src):
                    dst.copy_(x)
                graph.replay()
                return self._cut_sampled(outs, B)
        outs = self._sampled_body(self._slots(slots, Bp), tokens, parent, valid, u, q, sb, tree, mask)
        return self._cut_sampled(outs, B)

    @staticmethod
    def _cut_sampled(outs, B: int):
        acc, bonus, path, lps = outs
        if lps is not None:
            lps = tuple(x[:B] for x in lps)
        return acc[:B], bonus[:B], (path[:B] if path is not None else None), lps

    def _mask_input(self, Bp: int, N: int) -> Tensor:
        """The static ``[Bp, N, V]`` token mask of a masked verify step (all allowed until
        written: warm-up and capture run on it)."""
        V = int(self.model.config.vocab_size)
        m = self._shared("mask", (N, V), torch.bool)
        if not getattr(self, "_mask_opened", {}).get(N):
            m.fill_(True)
            self.__dict__.setdefault("_mask_opened", {})[N] = True
        return m[:Bp]

    def _sampled_inputs(self, Bp: int, N: int, has_q: bool, sb, masked: bool = False):
        """Static inputs of a sampled step: padding values (greedy rows on the null slot)."""
        s_in, t_in, p_in, v_in = self._spec_inputs(Bp, N)
        V = int(self.model.config.vocab_size)
        u_in = torch.full((Bp, N + 1), 0.5, dtype=torch.float32, device=self.device)
        # the [B, N, V] / [B, V] inputs are views of one buffer per shape shared by every batch
        # bucket (graphs replay one at a time; each replay overwrites its rows)
        q_in = self._shared("q", (N, V), torch.float32)[:Bp] if has_q else None
        sb_in = sb.blank(Bp)
        if sb_in.use_penalties:
            sb_in.counts = self._shared("counts", (V,), torch.float32)[:Bp]
            sb_in.seen = self._shared("seen", (V,), torch.bool)[:Bp]
        m_in = self._mask_input(Bp, N) if masked else None
        ins = [s_in, t_in, p_in, v_in, u_in] + ([q_in] if has_q else []) + ([m_in] if masked else []) + \
            sb_in.tensors()
        return ins, (s_in, t_in, p_in, v_in, u_in, q_in, sb_in, m_in)

    def _shared(self, name: str, shape: tuple, dtype) -> Tensor:
        """A zeroed ``[max bucket, *shape]`` static buffer, one per (name, shape, dtype)."""
        cache = self.__dict__.setdefault("_static_bufs", {})
        k = (name, shape, dtype)
        if k not in cache:
            cache[k] = torch.zeros((self.buckets[-1],) + tuple(shape), dtype=dtype, device=self.device)
        return cache[k]

    def _capture_sampled(self, key, Bp: int, N: int, tree: bool, has_q: bool, sb, warm: bool = True,
                         masked: bool = False):
        ins, args = self._sampled_inputs(Bp, N, has_q, sb, masked)
        s_in, t_in, p_in, v_in, u_in, q_in, sb_in, m_in = args
        body = lambda: self._sampled_body(s_in, t_in, p_in, v_in, u_in, q_in, sb_in, tree, m_in)  # noqa: E731
        return self._capture_step(key, ins, body, warm, "a sampled speculative step")

    def _capture_step(self, key, ins, body, warm: bool, what: str):
        """Capture ``body()`` (a speculative step reading the static inputs ``ins``) into the
        shared pool; returns ``(graph, ins, outputs)``, or None when capture fails (the key
        then runs eagerly).  ``NotImplementedError`` (e.g. no KV-only tree op) propagates:
        the caller switches forms and retries."""
        try:
            if warm:  # on the null slot only
                self._warm(body)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=CAPTURE_ERROR_MODE):
                outs = body()
            self._pool = graph.pool()
        except NotImplementedError:
            raise
        except Exception as e:  # pragma: no cover - depends on the model's kernels
            warnings.warn(f"CUDA graph capture of {what} {key} failed, running eagerly: {e}")
            self._graph_failed.add(key)
            self._drop_pending()
            return None
        entry = (graph, ins, outs)
        self._graphs[key] = entry
        return entry

    def _spec_inputs(self, Bp: int, N: int):
        s_in = torch.zeros(Bp, dtype=torch.long, device=self.device)
        t_in = torch.zeros(Bp, N, dtype=torch.long, device=self.device)
        p_in = torch.arange(-1, N - 1, device=self.device).expand(Bp, N).contiguous()
        v_in = torch.zeros(Bp, N, dtype=torch.bool, device=self.device)
        v_in[:, 0] = True
        return s_in, t_in, p_in, v_in

    def _drop_pending(self) -> None:
        """Forget a verify that failed half-way (its commit will never come)."""
        if getattr(self.cache, "pending", None) is not None:
            self.cache.clear_pending()

    def _warm(self, fn, passes: int = 2) -> None:
        """Run ``fn`` eagerly on a side stream (compiles kernels, sets up cuBLAS) before capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(passes):
                fn()
        torch.cuda.current_stream().wait_stream(stream)

    def _capture_spec(self, key, Bp: int, N: int, tree: bool, warm: bool = True, masked: bool = False):
        ins = self._spec_inputs(Bp, N)
        m_in = self._mask_input(Bp, N) if masked else None
        body = lambda: self._greedy_body(*ins, tree, m_in)  # noqa: E731
        return self._capture_step(key, ins + ((m_in,) if masked else ()), body, warm, "a speculative step")

    # -- CUDA graphs -----------------------------------------------------------------------
    def capture(self, spec_shapes=(), sampled_shapes=()) -> int:
        """Capture, ahead of serving, the decode graph of every batch bucket and the greedy
        speculative graph of every bucket for each ``(nodes, tree)`` in ``spec_shapes``, in the
        cache's current form; ``sampled_shapes`` ``(nodes, tree, draft distributions)`` add the
        sampled speculative step with plain temperature sampling (no filters, penalties or
        logprobs: other switches are captured when first used).  A graph first needed mid-run is captured then (warm-up passes
        plus capture: a stall of that step), so engines capture up front, as vLLM does.

        Memory: every key is first run eagerly once (kernels compile then, not during
        capture), the allocator's cache is released, then graphs are captured largest bucket
        first into one shared pool, where each smaller graph reuses blocks a larger one freed.
        (Warm-up beside a pool already holding the largest graph's temporaries, or smallest
        first, ran the 2.7B snapshot baseline out of memory.)
        Returns the number of graphs captured; keys that fail fall back to eager as usual."""
        if not self.use_graphs:
            return 0
        form, n = self._form(), 0
        keys: list[tuple[GraphKey, object]] = []   # (key, the sampled step's SamplingBatch | None)
        for Bp in sorted(self.buckets, reverse=True):
            keys.append((GraphKey("decode", Bp, form), None))
            if self.greedy_decode:
                keys.append((GraphKey("gdecode", Bp, form), None))
            keys += [(GraphKey("spec", Bp, form, N, tree), None) for N, tree in spec_shapes]
            for N, tree, has_q in sampled_shapes:
                sb = blank_batch(Bp, 0, self.device)
                keys.append((GraphKey("sspec", Bp, form, N, tree, has_q, sb.key()), sb))
        keys = [(k, sb) for k, sb in keys if k not in self._graphs and k not in self._graph_failed]
        runnable = []
        for key, sb in keys:
            Bp, N = key.batch, key.nodes
            try:
                if key.kind in ("decode", "gdecode"):
                    ins = self._decode_inputs(Bp)
                    greedy = key.kind == "gdecode"
                    self._warm(lambda: self.model.decode(self.cache, *ins, greedy=greedy), passes=1)
                elif key.kind == "sspec":
                    _, a = self._sampled_inputs(Bp, N, key.has_q, sb)
                    self._warm(lambda: self._sampled_body(*a[:6], a[6], key.tree, a[7]), passes=1)
                else:
                    ins = self._spec_inputs(Bp, N)
                    self._warm(lambda: self._greedy_body(*ins, key.tree), passes=1)
                runnable.append((key, sb))
            except NotImplementedError:  # e.g. no KV-only tree verify: captured after the switch
                self._drop_pending()
            except Exception as e:  # pragma: no cover - depends on the model's kernels
                warnings.warn(f"warm-up of CUDA graph {key} failed, it runs eagerly: {e}")
                self._graph_failed.add(key)
                self._drop_pending()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        for key, sb in runnable:
            Bp, N = key.batch, key.nodes
            if key.kind in ("decode", "gdecode"):
                n += self._capture_decode(key, Bp, warm=False) is not None
            elif key.kind == "sspec":
                n += self._capture_sampled(key, Bp, N, key.tree, key.has_q, sb, warm=False) is not None
            else:
                n += self._capture_spec(key, Bp, N, key.tree, warm=False) is not None
        return n

    def _decode_inputs(self, Bp: int):
        return (torch.zeros(Bp, dtype=torch.long, device=self.device),
                torch.zeros(Bp, dtype=torch.long, device=self.device))

    def _capture_decode(self, key, Bp: int, warm: bool = True):
        try:
            s_in, t_in = self._decode_inputs(Bp)
            kw = {"greedy": True} if key.kind == "gdecode" else {}
            if warm:  # on the null slot only
                self._warm(lambda: self.model.decode(self.cache, s_in, t_in, **kw))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=CAPTURE_ERROR_MODE):
                out = self.model.decode(self.cache, s_in, t_in, **kw)
            self._pool = graph.pool()
            entry = (graph, s_in, t_in, out)
            self._graphs[key] = entry
            return entry
        except Exception as e:  # pragma: no cover - depends on the model's kernels
            warnings.warn(f"CUDA graph capture of decode {key} failed, running eagerly: {e}")
            self._graph_failed.add(key)
            return None
