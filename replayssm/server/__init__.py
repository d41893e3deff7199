"""OpenAI-compatible HTTP serving: ``replayssm serve MODEL_DIR``.

* ``app.py``         FastAPI routes (/v1/completions, /v1/chat/completions, /v1/models,
                     /health, /metrics), OpenAI-style errors, API key check
* ``engine_loop.py`` the async engine loop: one engine stepped on its own thread, requests
                     joining and leaving between steps, outputs fed to per-request queues
* ``protocol.py``    request bodies (pydantic, strict types) -> SamplingParams
* ``chat.py``        chat templates from tokenizer_config.json (jinja2, sandboxed)
* ``metrics.py``     Prometheus metrics
* ``cli.py``         ``replayssm serve``

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client).
"""

from .app import ServerConfig, build_app
from .engine_loop import AsyncEngine, StepEngine

__all__ = ["AsyncEngine", "ServerConfig", "StepEngine", "build_app"]
