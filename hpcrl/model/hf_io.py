"""Loading and saving HuggingFace models and tokenizers, strictly offline.

Everything here reads local folders only (``local_files_only=True``): compute
nodes of an HPC cluster usually have no route to a model hub, and a silent
download attempt would hang a job until its time limit.

Ordering rules:
- ``save_model`` builds the folder under a temporary name and renames it into
  place (``hpcrl.fs.atomic.directory``), so a reader that sees the folder sees a
  complete model. The target must not exist: published models are immutable.
- ``load_tokenizer`` prefers ``tokenizer.json`` through
  ``PreTrainedTokenizerFast`` because transformers 5.x ``AutoTokenizer`` may
  substitute a model-type-specific tokenizer class (qwen2) that drops a custom
  character vocabulary's spaces.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from hpcrl.fs import atomic

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def stored_weights(model_path: str | Path) -> dict[str, torch.Tensor]:
    """An HF folder's weights as stored (every ``*.safetensors`` file), without building the model. A folder
    without them is a ValueError (a FileNotFoundError means a pruned weight version to its readers)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_path}: no *.safetensors weights")
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def _existing_dir(path: str | Path, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{what} path does not exist: {p}")
    if not p.is_dir():
        raise ValueError(f"{what} path is not a directory: {p}")
    return p


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in the local folder ``path``.

    Guarantees an eos token; when the tokenizer has no pad token, eos is used
    as pad (generation with left padding needs one).
    """
    p = _existing_dir(path, "tokenizer")
    if not any((p / name).exists() for name in _TOKENIZER_FILES):
        raise ValueError(f"tokenizer: no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {p}")
    if (p / "tokenizer.json").exists():
        tok = PreTrainedTokenizerFast.from_pretrained(str(p), local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    if tok.eos_token is None:
        raise ValueError(f"tokenizer: {p} defines no eos token (needed to end generations)")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype that ``model.dtype`` names."""
    if name not in DTYPES:
        raise ValueError(f"model.dtype: unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(path: str | Path, dtype: torch.dtype | str = torch.float32) -> PreTrainedModel:
    """Load a causal LM from the local folder ``path`` (config.json + weights) with parameters in ``dtype``."""
    dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    p = _existing_dir(path, "model")
    if not (p / "config.json").exists():
        raise ValueError(f"model: no config.json in {p}")
    return AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, local_files_only=True)


def save_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    path: str | Path,
    *,
    extra_json: dict[str, Any] | None = None,
) -> Path:
    """Save ``model`` (safetensors) and ``tokenizer`` to the new folder ``path``, atomically.

    ``extra_json`` maps file names to objects written as JSON into the folder
    before it is published (e.g. a ``result.json`` that travels with it).
    """
    p = Path(path).expanduser()
    if p.exists():
        raise ValueError(f"model: refusing to overwrite existing path {p}")
    with atomic.directory(p) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        for name, obj in (extra_json or {}).items():
            atomic.write_json(tmp / name, obj)
    log.info("saved model to %s", p)
    return p


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, chat_template: bool = False) -> list[int]:
    """Token ids of ``prompt``: as a user turn of the chat template, or plain text."""
    if not chat_template:
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_template: the tokenizer has no chat template; set chat_template=false")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def unknown_characters(tokenizer: PreTrainedTokenizerBase, text: str) -> set[str]:
    """Characters of ``text`` that the tokenizer maps to its unk token.

    One tokenizer call per text (with offsets); only the spans that came out
    as unk are checked character by character.
    """
    unk = tokenizer.unk_token_id
    if unk is None or not text:
        return set()
    if not tokenizer.is_fast:
        return {ch for ch in set(text) if unk in tokenizer.encode(ch, add_special_tokens=False)}
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [(a, b) for tid, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if tid == unk]
    if not spans:
        return set()
    suspects = {ch for a, b in spans for ch in text[a:b]}
    return {ch for ch in suspects if unk in tokenizer.encode(ch, add_special_tokens=False)}
