"""Greedy-decoding accuracy of a causal LM on a list of rows.

``greedy_accuracy`` generates one greedy response per row with HF
``generate`` on left-padded batches (pad and eos from the tokenizer),
decodes it with ``skip_special_tokens=True`` and scores it with the user's
``score(prompt, response, row)``; the accuracy is the mean score. The model
is put in eval mode under ``torch.inference_mode`` and its previous training
mode is restored afterwards, so this can be called in the middle of training.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from hpcrl.data.rows import Row
from hpcrl.model.hf_io import encode_prompt

log = logging.getLogger(__name__)

N_EXAMPLES = 8  # how many (prompt, response, answer, score) tuples an EvalResult keeps


@dataclass
class EvalResult:
    accuracy: float  # mean score over the rows
    n: int  # number of rows evaluated
    examples: list[tuple[str, str, str, float]] = field(default_factory=list)  # first few
    metrics: dict[str, float] = field(default_factory=dict)  # more "eval/..." entries for the run's record


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of ``seqs`` padded on the left to a common length."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def _generate_batch(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], gen: GenerationConfig
) -> list[str]:
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen)
    new_tokens = out[:, ids.shape[1]:].tolist()
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True)


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[Row],
    score: Callable[[str, str, Row], float],
    *,
    max_new_tokens: int = 8,
    batch_size: int = 256,
    chat_template: bool = False,
    after_batch: Callable[[int], None] | None = None,
) -> EvalResult:
    """Mean ``score`` of the greedy responses of ``model`` to ``rows``; ``after_batch(rows_done)`` is called
    after every batch (a heartbeat, a check for a stop request: whatever it raises ends the evaluation)."""
    if not rows:
        raise ValueError("rows: need at least one row to evaluate")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    was_training = model.training
    model.eval()
    total, examples = 0.0, []
    try:
        with torch.inference_mode():
            for start in range(0, len(rows), batch_size):
                batch = rows[start:start + batch_size]
                prompts = [encode_prompt(tokenizer, r.prompt, chat_template) for r in batch]
                for row, response in zip(batch, _generate_batch(model, tokenizer, prompts, gen)):
                    s = float(score(row.prompt, response, row))
                    total += s
                    if len(examples) < N_EXAMPLES:
                        examples.append((row.prompt, response, row.answer, s))
                if after_batch is not None:
                    after_batch(start + len(batch))
    finally:
        model.train(was_training)
    return EvalResult(accuracy=total / len(rows), n=len(rows), examples=examples)
