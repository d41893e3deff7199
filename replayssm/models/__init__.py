"""HF-compatible models: Mamba-2, Nemotron-H and Qwen3-Next with cached replay decoding."""

from .base import CausalLM
from .cache import ModelCache
from .config import ConfigError, Mamba2Config, NemotronHConfig, Qwen3NextConfig, parse_config, read_config
from .loader import HubError, WeightError, is_hub_id, load_model, load_tokenizer, resolve_model_dir

__all__ = ["load_model", "load_tokenizer", "resolve_model_dir", "is_hub_id", "HubError", "CausalLM", "ModelCache", "ConfigError", "WeightError",
           "Mamba2Config", "NemotronHConfig", "Qwen3NextConfig", "parse_config", "read_config"]
