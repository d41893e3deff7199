"""The model families, one line each: ``model_type`` -> (config class, model class).

A new family is one module (its config dataclass, parsed with :mod:`.config`'s readers, and
its :class:`~replayssm.models.base.CausalLM`) plus one line in :data:`FAMILIES`.
:func:`parse_config` / :func:`read_config` pick the config class from here.
"""

from __future__ import annotations

import json
import os

from .bamba import BambaConfig, BambaLM
from .config import ConfigError, Mamba2Config, NemotronHConfig, Qwen3NextConfig
from .falcon_h1 import FalconH1Config, FalconH1LM
from .granite_hybrid import GraniteMoeHybridConfig, GraniteMoeHybridLM
from .kimi_linear import KimiLinearConfig, KimiLinearLM
from .mamba2 import Mamba2LM
from .nemotron_h import NemotronHLM
from .qwen3_5 import QWEN3_5_TYPES, Qwen3_5Config, Qwen3_5LM
from .qwen3_next import Qwen3NextLM
from .zamba2 import Zamba2Config, Zamba2LM

#: ``model_type`` -> (config class, model class)
FAMILIES: dict[str, tuple[type, type]] = {
    "mamba2": (Mamba2Config, Mamba2LM),
    "nemotron_h": (NemotronHConfig, NemotronHLM),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextLM),
    **dict.fromkeys(QWEN3_5_TYPES, (Qwen3_5Config, Qwen3_5LM)),
    "falcon_h1": (FalconH1Config, FalconH1LM),
    "granitemoehybrid": (GraniteMoeHybridConfig, GraniteMoeHybridLM),
    "bamba": (BambaConfig, BambaLM),
    "zamba2": (Zamba2Config, Zamba2LM),
    "kimi_linear": (KimiLinearConfig, KimiLinearLM),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def model_class(cfg) -> type:
    """The model class of a parsed config."""
    return FAMILIES[cfg.model_type][1]


def parse_config(d: dict, where: str = "config.json"):
    """Config dataclass for ``d['model_type']`` (``ConfigError`` for unknown types)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(d).__name__}")
    mt = d.get("model_type")
    if mt is None:
        raise ConfigError(f"{where}: missing required key 'model_type'")
    if mt not in FAMILIES:
        raise ConfigError(f"{where}: unknown model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return FAMILIES[mt][0].from_dict(d, where)


def read_config(path: str):
    """Parse ``<path>/config.json``."""
    fn = os.path.join(path, "config.json")
    if not os.path.isfile(fn):
        raise FileNotFoundError(f"{fn}: no such file (a model directory needs config.json)")
    try:
        with open(fn, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{fn}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{fn}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{fn}: cannot be read ({e.strerror})") from None
    return parse_config(d, fn)
