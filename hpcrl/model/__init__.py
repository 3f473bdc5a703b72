"""Model and tokenizer IO (offline HuggingFace folders) and the tiny test model.

Every name is resolved lazily: loading a config must not import torch, and ``python -m hpcrl.model.tiny``
does not import its own module twice.
"""

from typing import Any

_TINY = ("CHARSET", "TinyModelConfig", "build_char_tokenizer", "build_tiny_model")
_IO = ("encode_prompt", "load_model", "load_tokenizer", "save_model", "unknown_characters")

__all__ = [
    *_TINY,
    "encode_prompt",
    "load_model",
    "load_tokenizer",
    "save_model",
    "unknown_characters",
]


def __getattr__(name: str) -> Any:
    if name in _TINY:
        from hpcrl.model import tiny

        return getattr(tiny, name)
    if name in _IO:  # imported on first use: the root config imports hpcrl.model.config, which must stay light
        from hpcrl.model import hf_io

        return getattr(hf_io, name)
    raise AttributeError(f"module 'hpcrl.model' has no attribute {name!r}")
