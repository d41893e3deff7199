"""The inference engine: LLM API, continuous batching scheduler, model runner, sampler and
speculative drafters (n-gram, draft model, token trees).

Layout (nano-vllm style): a small core and one room per concern.

* ``config.py``    SamplingParams, SpeculativeConfig, EngineConfig (validated dataclasses;
  ``EngineConfig.cache_spec()`` is the one :class:`~replayssm.cache.spec.CacheSpec`)
* ``engine.py``    LLMEngine: ``add_request`` / ``step`` / ``abort``; a step is schedule ->
  run -> postprocess, each delegated to the rooms below
* ``llm.py``       LLM: ``generate``, ``stream`` (offline loops over the steps)
* ``loading.py``   dtype names, model directories or loaded models, checked against the settings
* ``cache_plan.py`` memory: what a sequence costs (MemoryModel), how many slots and blocks
  fit (CachePlan), whether the caches fit the device; the context limit
* ``block_manager.py`` slots, paged blocks and the memory budget (one owner)
* ``scheduler.py`` continuous batching: FCFS admission, chunked prefill; rejects the impossible
* ``prefix/``      prefix caching: the index, the policy (resume, capture, checkpoints), the store's size
* ``mode_policy.py`` which form requests run in: a fixed decode mode, or ``auto`` (KV-only, then a state)
* ``executor.py``  the "run" of a step: prefill, decode, or draft-verify-accept-commit
* ``model_runner.py`` model calls on one cache; batch buckets with null-slot padding
  (``batching.py``); CUDA graphs keyed by ``GraphKey``
* ``sampler.py``   penalties, temperature / top-k / top-p / min-p, logprobs, per-request
  generators, greedy and lossless speculative acceptance over chains and trees
* ``spec/``        speculation: one module per drafter (n-gram, draft model, draft tree, MTP)
  and a registry (``prepare_drafter``); each drafter declares its graph shapes
* ``output_processor.py`` stop criteria, stop strings, finish reasons; ``detokenizer.py``
  incremental detokenization; ``outputs.py`` RequestOutput
* ``warmup.py``    one step of every kind before serving
* ``sequence.py``, ``inputs.py``, ``protocols.py``, ``cli.py``

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
