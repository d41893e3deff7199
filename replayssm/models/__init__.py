"""HF-compatible models with cached replay decoding: Mamba-2, Nemotron-H, Qwen3-Next, Qwen3.5,
Granite-4.0-H, Bamba and Falcon-H1 (``SUPPORTED_MODEL_TYPES`` lists their ``model_type``s)."""

from .base import CausalLM
from .cache import ModelCache
from .config import ConfigError, Mamba2Config, NemotronHConfig, Qwen3NextConfig
from .registry import SUPPORTED_MODEL_TYPES, parse_config, read_config
from .loader import HubError, WeightError, is_hub_id, load_model, load_tokenizer, resolve_model_dir
from .quantize import quantize_checkpoint, quantize_model_

__all__ = ["load_model", "load_tokenizer", "resolve_model_dir", "is_hub_id", "HubError", "CausalLM", "ModelCache",
           "ConfigError", "WeightError", "Mamba2Config", "NemotronHConfig", "Qwen3NextConfig", "parse_config",
           "read_config", "SUPPORTED_MODEL_TYPES", "quantize_checkpoint", "quantize_model_"]
