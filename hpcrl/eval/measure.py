"""How a run measures held-out accuracy, for the trainer and the evaluation component alike."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from hpcrl.config import RunConfig
from hpcrl.data.rows import Row
from hpcrl.reward.scorer import Scorer

if TYPE_CHECKING:
    from hpcrl.eval.accuracy import EvalResult

__all__ = ["Measure", "held_out", "scorer"]


def scorer(runner: Scorer):
    """Adapt the reward runner to the ``score(prompt, response, row)`` the evaluators take."""
    def score(prompt: str, response: str, row: Row) -> float:
        return runner.score(prompt, response, {"answer": row.answer, **row.extra}).reward
    return score


Measure = Callable[..., "EvalResult"]  # (model, rows, after_batch=None) -> EvalResult


def held_out(cfg: RunConfig, tokenizer, runner: Scorer) -> Measure:
    """How the run measures held-out accuracy: one greedy completion per prompt scored by the reward
    function, or with ``eval.agent`` the agent function's episodes over greedy completions."""
    from hpcrl.eval.accuracy import greedy_accuracy

    if cfg.eval.agent:
        from hpcrl.agent.runner import load_agent_fn
        from hpcrl.eval.agent import agent_accuracy

        fn = load_agent_fn(cfg.agent.fn)
        return lambda model, rows, after_batch=None: agent_accuracy(
            model, tokenizer, rows, fn, max_new_tokens=cfg.rollout.max_new_tokens, timeout_s=cfg.agent.timeout_s,
            concurrency=cfg.agent.max_concurrent_episodes, batch_size=cfg.eval.batch_size, after_batch=after_batch,
            cfg=cfg.agent)
    score = scorer(runner)
    return lambda model, rows, after_batch=None: greedy_accuracy(
        model, tokenizer, rows, score, max_new_tokens=cfg.rollout.max_new_tokens, batch_size=cfg.eval.batch_size,
        chat_template=cfg.data.chat_template, after_batch=after_batch)
