"""OpenAI-compatible HTTP serving: ``replayssm serve MODEL_DIR``.

* ``app.py``         FastAPI routes (/v1/completions, /v1/chat/completions, /v1/models,
                     /tokenize, /detokenize, /health, /metrics, /version), OpenAI-style
                     errors, API key check, request logging
* ``engine_loop.py`` the async engine loop: one engine stepped on its own thread, requests
                     joining and leaving between steps, outputs fed to per-request queues
* ``protocol.py``    request bodies (pydantic, strict types) -> SamplingParams
* ``chat.py``        chat templates from tokenizer_config.json (jinja2, sandboxed)
* ``metrics.py``     Prometheus metrics (vLLM's names, prefix ``replayssm:``)
* ``stats_log.py``   the periodic stats line
* ``cli.py``         ``replayssm serve`` (``--config`` YAML, startup summary, graceful shutdown)
* ``dp.py``          ``--data-parallel-size N``: replica processes behind one app (the pool);
                     ``dp_client.py`` a replica's handle and engine loop (faults, restarts);
                     ``dp_replica.py`` the replica process and the step wire format;
                     ``dp_router.py`` prefix-affinity routing; ``dp_metrics.py`` per-replica
                     metrics; ``dp_torchrun.py`` replicas on other torchrun ranks / hosts

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client).  The exports load on first
use, so ``replayssm serve`` can say so clearly when the extra is missing.
"""

import importlib

_EXPORTS = {"ServerConfig": "app", "build_app": "app", "AsyncEngine": "engine_loop", "StepEngine": "engine_loop"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'replayssm.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
