"""Model and tokenizer IO (offline HuggingFace folders) and the tiny test model.

The tiny-model names are resolved lazily so that ``python -m hpcrl.model.tiny``
does not import its own module twice.
"""

from typing import Any

from hpcrl.model.hf_io import encode_prompt, load_model, load_tokenizer, save_model, unknown_characters

_TINY = ("CHARSET", "TinyModelConfig", "build_char_tokenizer", "build_tiny_model")

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
    raise AttributeError(f"module 'hpcrl.model' has no attribute {name!r}")
