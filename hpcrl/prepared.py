"""What preparation (:mod:`hpcrl.prepare`) left for the components: ``prepared.json`` and the run's datasets.

Every component reads the same :class:`Prepared` record and loads the same rows
with :func:`load_datasets` (the bad rows are the same everywhere, so the
admission ledger's row count agrees across processes). This module is what a
component imports of the preparation; it imports none of the preparation's own
steps (data generation, the SFT warm start).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hpcrl.fs import atomic
from hpcrl.config import RunConfig
from hpcrl.data.rows import Row, load_rows
from hpcrl.model.hf_io import encode_prompt, unknown_characters
from hpcrl.model.limits import ModelLimits, Rejected

__all__ = ["Prepared", "load_datasets", "load_prepared"]


@dataclass
class Prepared:
    """``<run_dir>/prepared.json``: what the run starts from."""

    init_model: str  # the policy at version 0 (SFT output or the base model)
    base_model: str
    train_path: str
    eval_path: str
    sft_accuracy: float | None = None  # greedy accuracy the warm start stopped at (its own eval subset)
    sft_steps: int = 0
    sft_cached: bool = False
    init_from: dict | None = None  # started from another run's checkpoint: which, what was restored (--from)


def load_prepared(run_dir: str | Path) -> Prepared:
    return Prepared(**atomic.read_json(Path(run_dir) / "prepared.json"))


def load_datasets(cfg: RunConfig, tokenizer, train_path: Path, eval_path: Path,
                  model_path: str | Path) -> tuple[list[Row], list[Row]]:
    """Rows of both splits; rows the tokenizer cannot represent, and prompts that leave the model's context no
    room for ``rollout.max_new_tokens``, count as bad rows (the same rows in every component)."""
    too_long = _context_check(cfg, tokenizer, ModelLimits.of_dir(model_path))

    def validate(row: Row) -> str | None:
        bad = unknown_characters(tokenizer, row.prompt + row.answer)
        if bad:
            return f"characters not in the tokenizer's vocabulary: {sorted(bad)}"
        return too_long(row.prompt)

    kw = dict(prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
              on_bad_row=cfg.data.on_bad_row, validate=validate)
    return load_rows(train_path, **kw), load_rows(eval_path, **kw)


def _context_check(cfg: RunConfig, tokenizer, limits: ModelLimits) -> Callable[[str], str | None]:
    """Why a prompt is too long for the context with ``rollout.max_new_tokens`` after it (None: it fits). Every
    prompt is tokenised as the rollout will (no bound on tokens per byte holds for every tokenizer: a
    SentencePiece prefix, Unicode normalisation)."""
    if limits.context is None:
        return lambda prompt: None

    def check(prompt: str) -> str | None:
        n = len(encode_prompt(tokenizer, prompt, cfg.data.chat_template))
        try:
            limits.check_length(n, cfg.rollout.max_new_tokens, param="prompt")
        except Rejected as e:
            return f"{e.message} (rollout.max_new_tokens)"
        return None
    return check
