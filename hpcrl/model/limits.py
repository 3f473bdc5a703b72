"""What a model can take: its vocabulary and its context, read from its ``config.json`` without loading it.

Every path that hands token ids to an engine checks them here first, so that
a request the model cannot run is refused with a reason instead of failing
inside a decode step that serves other requests too:

- the agent proxy (:mod:`hpcrl.agent.proxy`): a 400 for that request alone;
- the embedded engine's ``submit`` (:class:`~hpcrl.rollout.torch_engine.TorchEngine`),
  the last line for any caller;
- the dataset loader (:func:`hpcrl.prepared.load_datasets`): a prompt too long
  for the context is a bad row (``path:line: why``), before any rollout or
  evaluation sees it.

Light on purpose: json only, no torch or transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["ModelLimits", "Rejected"]

# config.json keys that give the longest sequence, in the order architectures use them
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


class Rejected(ValueError):
    """A request the model cannot run; ``code`` and ``param`` in OpenAI's terms (``context_length_exceeded``,
    ``invalid_token_id``)."""

    def __init__(self, message: str, code: str, param: str) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int  # token ids must be in [0, vocab_size): the embedding's rows
    context: int | None  # prompt + output tokens the model's positions cover; None: not stated by the model

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size: must be >= 1, got {self.vocab_size}")
        if self.context is not None and self.context < 2:
            raise ValueError(f"context: must be >= 2 or None, got {self.context}")

    @classmethod
    def of_config(cls, config: Mapping[str, Any] | Any) -> ModelLimits:
        """From a HF config (a ``config.json`` mapping or a ``PretrainedConfig``); a multimodal model's
        ``text_config`` when the top level has no vocabulary."""
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        text = get("text_config")
        if get("vocab_size") is None and text is not None:
            return cls.of_config(text)
        vocab = get("vocab_size")
        if not isinstance(vocab, int):
            raise ValueError(f"model config: no integer vocab_size (got {vocab!r})")
        context = next((get(k) for k in _CONTEXT_KEYS if isinstance(get(k), int)), None)
        return cls(vocab_size=vocab, context=context)

    @classmethod
    def of_dir(cls, path: str | Path) -> ModelLimits:
        """From the ``config.json`` of a HuggingFace model folder."""
        file = Path(path) / "config.json"
        try:
            return cls.of_config(json.loads(file.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"model config: cannot read {file}: {e}") from None

    def check_ids(self, ids: Sequence[int], param: str = "prompt") -> None:
        """Raises :class:`Rejected` unless every id is a token of the vocabulary."""
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise Rejected(f"{param}: token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                           "invalid_token_id", param)

    def check_length(self, prompt_tokens: int, max_new_tokens: int, max_prompt_tokens: int | None = None,
                     param: str = "prompt") -> None:
        """Raises :class:`Rejected` (``context_length_exceeded``) when the prompt is longer than
        ``max_prompt_tokens`` or the prompt and ``max_new_tokens`` exceed the context."""
        if max_prompt_tokens is not None and prompt_tokens > max_prompt_tokens:
            raise Rejected(f"{param}: {prompt_tokens} prompt tokens, more than the {max_prompt_tokens} allowed "
                           f"(agent.max_prompt_tokens)", "context_length_exceeded", param)
        if self.context is not None and prompt_tokens + max_new_tokens > self.context:
            raise Rejected(f"{param}: {prompt_tokens} prompt tokens + {max_new_tokens} to generate exceed the "
                           f"model's context of {self.context} tokens", "context_length_exceeded", param)
