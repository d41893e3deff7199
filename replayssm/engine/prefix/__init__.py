"""Automatic prefix caching at token granularity (``LLM(..., enable_prefix_caching=True)``).

Prompts are cut into blocks of ``block_size`` tokens.  A block is identified by a hash chain,
``hash(parent block's hash, its tokens)``, so equal hashes mean equal prefixes (the tokens
and the parent are compared too: a hash collision is a miss, never a wrong hit).  What a
cached block holds lives in the model cache (:mod:`replayssm.models.prefix`): per SSM layer
every token's ring entry and conv input, a checkpoint state when the block ends on a
multiple of the checkpoint interval, and (hybrids) the attention block, shared with the
sequences reading it.

* :class:`PrefixIndex` is the host-side index (no tensors): hash chain, longest-prefix lookup
  at token granularity (whole blocks by hash, then the longest common token prefix inside
  the best child of the last whole block), reference counts (blocks a running sequence
  reads or extends are never evicted) and LRU eviction of unreferenced leaves when a new
  block or checkpoint needs room.  Unit-tested on its own.
* :class:`PrefixCache` ties the index to the model cache and the sequences: a lookup at
  admission, the resume (``cache.load_prefix``) before a sequence's first prefill, the
  capture of the blocks its prefill computes (store blocks assigned before, blocks and
  checkpoints inserted after), and the references it gives back when it finishes.

Chat turns: when a request finishes, :meth:`PrefixCache.capture_end` also caches its state
after the prompt and reply it fed (``prompt + output[:-1]``) as a **state point** (a
checkpoint row with the conv window) at the end of **state-only** blocks (tokens and
attention blocks, no per-token entries), so the next turn resumes at the end of the reply;
a state-only block is resumed only at a state point (``prefix_cache_replies=False``: prompts
only).

Why a hit can end at any token: the model cache resumes exactly at any position from the
nearest checkpoint plus the stored entries since it, so a hit is never rounded down to a
block or checkpoint boundary (engines that store only states can resume only where a state
was saved).  The resumed sequence then prefills the rest of its prompt; a hit stops one
token short of the prompt's end, so that prefill is never empty (it gives the first
token's logits).

Where each part lives (one room, three floors):

* here, ``engine/prefix/``: :mod:`.index` (the host-side index), :mod:`.cache` (the policy:
  lookups, resumes, captures, checkpoints, the engine's hooks), :mod:`.plan` (the store's
  size and checkpoint interval, part of :mod:`replayssm.engine.cache_plan`);
* the store's tensors (token blocks, checkpoints, the per-slot capture table):
  :mod:`replayssm.cache.prefix`, allocated by the model cache;
* the copies, folds and resumes over those tensors: :mod:`replayssm.models.prefix`, called
  through the model cache's ``prefix_*`` / ``load_prefixes`` methods.
"""

from .cache import PrefixCache, SeqPrefix
from .index import CachedBlock, Match, PrefixIndex, block_hash
from .plan import StorePlan, default_checkpoint_interval, plan_store

__all__ = ["PrefixCache", "SeqPrefix", "CachedBlock", "Match", "PrefixIndex", "block_hash", "StorePlan",
           "default_checkpoint_interval", "plan_store"]
