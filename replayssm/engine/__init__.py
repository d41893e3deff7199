"""The inference engine: LLM API, continuous batching scheduler, model runner, sampler and
speculative drafters (n-gram, draft model, token trees).

Layout (nano-vllm style):

* ``config.py``    SamplingParams, SpeculativeConfig, EngineConfig (validated dataclasses)
* ``sequence.py``  Sequence: prompt/output ids, status, slot, cache form, acceptance stats
* ``protocols.py`` what the engine needs from a model and its cache (typing.Protocol)
* ``loading.py``   dtype names, model directories or loaded models
* ``memory.py``    per-sequence bytes from the caches' measured layouts (states, rings, KV, scratch)
* ``block_manager.py`` slots, KV-only blocks and the memory budget (one owner)
* ``scheduler.py`` continuous batching: admission FCFS; rejects the impossible
* ``model_runner.py`` prefill / decode / verify / verify_tree / commit on one cache;
  batch-size buckets with null-slot padding; optional CUDA graphs for decode
* ``sampler.py``   penalties (per-slot token statistics on the device; drafts counted at every
  draft node), temperature / top-k / top-p / min-p, logprobs, per-request generators, greedy
  and lossless (multi-step) speculative acceptance over chains and trees
* ``speculative.py`` drafters: prompt lookup (chain, trie), draft model (chain, beam or static
  tree); draft caches roll back through the same verify/commit API as the target
* ``detokenizer.py`` incremental detokenization (a window of recent tokens, whole UTF-8
  characters only) and stop-string search on the new text
* ``mtp_drafter.py`` drafting with the target's own MTP head (chains, top-k trees; its own
  cache, the target's kept hidden states; greedy steps as CUDA graphs)
* ``outputs.py``   RequestOutput
* ``engine.py``    LLMEngine: ``add_request`` / ``step`` / ``abort``; a step is schedule ->
  run (prefill, decode or draft-verify-accept-commit) -> postprocess (tokens, stop criteria,
  freeing, form switches)
* ``llm.py``       LLM: ``generate``, ``stream`` (offline loops over the steps)
* ``cli.py``       ``replayssm generate``

One step: admit waiting requests, prefill them, then one decode step (or one speculative
step: draft, verify, accept, commit) for every running request; finished requests release
their slots.  The model cache holds every token of a request except the last sampled one,
which is the input of the next step.  ``decode_mode="auto"`` keeps a request KV-only until
its context reaches ``auto_threshold`` tokens (default: where the traffic model says the
KV-only form stops reading fewer bytes than amortised replay), then switches it to a state.

Exports are resolved lazily so that ``import replayssm.engine`` stays cheap.
"""

_EXPORTS = {
    "LLM": "llm", "LLMEngine": "engine", "RequestOutput": "outputs",
    "SamplingParams": "config", "SpeculativeConfig": "config", "EngineConfig": "config",
    "Sequence": "sequence", "SequenceStatus": "sequence",
    "Scheduler": "scheduler", "ModelRunner": "model_runner", "Sampler": "sampler",
    "BlockManager": "block_manager", "CachedModel": "protocols",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'replayssm.engine' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
