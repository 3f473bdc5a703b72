"""Warm start on demonstrated conversations: multi-turn, tool-using transcripts in OpenAI's message format.

With ``sft.demonstrations: "pkg.module:function"`` the warm start does not
train ``prompt -> answer`` pairs: it calls ``function(data) -> {"messages":
[...], "tools": [...]}`` on every dataset row (``data`` as an agent gets it:
``prompt``, ``answer``, ``index`` and the row's other fields) and trains the
returned conversation, rendered with the tokenizer's chat template (``tools``
listed as the template lists them, assistant ``tool_calls`` written as the
template writes them). Only the assistant turns are trained, each up to and
including the template's end-of-turn eos; system, user and tool messages and
the template's own text are context.

The text is rendered turn by turn and each piece tokenised on its own, the
way the agent proxy builds a continued conversation's prompt, so the tokens
trained here are the tokens the proxy will feed the policy. A template that
does not render turn by turn (a later render not extending an earlier one)
is an error naming the row.

Accuracy (the warm start's stopping criterion) is the fraction of rows whose
every assistant turn, generated greedily after the demonstrated conversation
before it, equals the demonstrated turn token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from hpcrl.data.rows import Row
from hpcrl.eval.accuracy import left_pad

__all__ = ["Demonstration", "Demonstrate", "call_demonstrate", "tokenize_demonstration", "tokenize_demonstrations",
           "turn_accuracy"]

Demonstrate = Callable[[dict], dict]


@dataclass
class Demonstration:
    """One rendered conversation: token ids and the trained spans ``[start, end)`` (assistant turns)."""

    ids: list[int]
    turns: list[tuple[int, int]]

    def labels(self) -> list[int]:
        """``ids`` where trained, -100 elsewhere."""
        out = [-100] * len(self.ids)
        for start, end in self.turns:
            out[start:end] = self.ids[start:end]
        return out


def _where(row: Row) -> str:
    return f"row {row.index} ({row.prompt!r})"


def _check(demo: object, where: str) -> tuple[list[dict], list[dict] | None]:
    if not isinstance(demo, dict) or not isinstance(demo.get("messages"), list) or not demo["messages"]:
        raise ValueError(f"sft.demonstrations: {where}: expected a dict with a non-empty 'messages' list, "
                         f"got {type(demo).__name__}")
    messages, tools = demo["messages"], demo.get("tools")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ValueError(f"sft.demonstrations: {where}: every message needs a 'role'")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"sft.demonstrations: {where}: no assistant message to train")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"sft.demonstrations: {where}: 'tools' must be a list, got {type(tools).__name__}")
    return messages, tools or None


def tokenize_demonstration(tok: PreTrainedTokenizerBase, demo: dict, where: str = "row") -> Demonstration:
    """Render ``demo`` with the tokenizer's chat template turn by turn; the assistant turns are the trained spans."""
    if not getattr(tok, "chat_template", None):
        raise ValueError("sft.demonstrations: the tokenizer has no chat template to render conversations with")
    messages, tools = _check(demo, where)

    def render(upto: int, generation_prompt: bool) -> str:
        return tok.apply_chat_template(messages[:upto], tools=tools, add_generation_prompt=generation_prompt,
                                       tokenize=False)

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False)) if text else []

    ids: list[int] = []
    turns: list[tuple[int, int]] = []
    done = ""  # the text already tokenised
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        asked, said = render(i, True), render(i + 1, False)
        if not (asked.startswith(done) and said.startswith(asked)):
            raise ValueError(f"sft.demonstrations: {where}: the chat template does not render message {i} as a "
                             "continuation of the messages before it (it must render turn by turn)")
        ids += encode(asked[len(done):])
        turn = encode(said[len(asked):])
        if tok.eos_token_id in turn:  # the model's turn ends at its eos; what the template adds after is context
            turn_len = turn.index(tok.eos_token_id) + 1
        else:
            turn_len = len(turn)
        if turn_len == 0:
            raise ValueError(f"sft.demonstrations: {where}: assistant message {i} renders to no tokens")
        turns.append((len(ids), len(ids) + turn_len))
        ids += turn
        done = said
    return Demonstration(ids, turns)


def call_demonstrate(rows: list[Row], demonstrate: Demonstrate) -> list[dict]:
    """The function's demonstration of each row, checked for shape; an error names the row."""
    out = []
    for row in rows:
        where = _where(row)
        try:
            demo = demonstrate(row.data())
        except Exception as e:  # the user's function: name the row it failed on
            raise ValueError(f"sft.demonstrations: {where}: {type(e).__name__}: {e}") from e
        _check(demo, where)
        out.append(demo)
    return out


def tokenize_demonstrations(tok: PreTrainedTokenizerBase, rows: list[Row], demos: list[dict]) -> list[Demonstration]:
    return [tokenize_demonstration(tok, d, _where(r)) for r, d in zip(rows, demos)]


@torch.inference_mode()
def turn_accuracy(model: PreTrainedModel, tok: PreTrainedTokenizerBase, demos: list[Demonstration], *,
                  batch_size: int = 256) -> float:
    """Fraction of ``demos`` whose every assistant turn is generated greedily, token for token, after the
    demonstrated conversation before it."""
    if not demos:
        raise ValueError("turn_accuracy: need at least one demonstration")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    items = [(d, s, e) for d, demo in enumerate(demos) for s, e in demo.turns]
    right = [True] * len(demos)
    try:
        for lo in range(0, len(items), batch_size):
            chunk = items[lo:lo + batch_size]
            width = max(e - s for _, s, e in chunk)
            gen = GenerationConfig(do_sample=False, max_new_tokens=width, pad_token_id=tok.pad_token_id,
                                   eos_token_id=tok.eos_token_id)  # a turn stopped early is padded: not equal
            ids, mask = left_pad([demos[d].ids[:s] for d, s, _ in chunk], tok.pad_token_id)
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen)
            new = out[:, ids.shape[1]:].tolist()
            for (d, s, e), got in zip(chunk, new):
                right[d] = right[d] and got[:e - s] == demos[d].ids[s:e]
    finally:
        model.train(was_training)
    return sum(right) / len(right)
