"""Configuration of the policy model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ModelConfig:
    path: str = ""  # local HuggingFace folder (config.json, safetensors, tokenizer); "" with tiny=true uses a cached tiny model
    tiny: bool = False  # build a tiny Qwen3 model with a character tokenizer at `path` (or in the cache) if missing
    tiny_hidden_size: int = 128  # width of the tiny model
    tiny_layers: int = 4  # decoder layers of the tiny model
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter dtype on the rollout and trainer
    cache_dir: str = "~/.cache/hpcrl/models"  # where built tiny models live

    def __post_init__(self) -> None:
        if not self.path and not self.tiny:
            raise ValueError("path: set model.path to a local HuggingFace folder, or model.tiny=true")
        if self.tiny_hidden_size < 8 or self.tiny_layers < 1:
            raise ValueError("tiny_hidden_size: tiny_hidden_size must be >= 8 and tiny_layers >= 1")
