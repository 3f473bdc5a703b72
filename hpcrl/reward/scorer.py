"""The reward seam: what scores the samples of a run.

A :class:`Scorer` turns ``(prompt, response, row)`` items into
:class:`RewardResult` records, one each, in order, and never raises because
of what it scores: a failure is a result with its status. The rollout loop's
single-turn episodes, the held-out evaluation and the SFT warm start's checks
score through it and know nothing else of it. ``reward.scorer`` names the
implementation (:mod:`hpcrl.reward.registry`); ``function``
(:class:`hpcrl.reward.runner.RewardRunner`, a user function by import path,
contained in threads or worker processes) and ``code``
(:class:`hpcrl.reward.code.CodeScorer`, model-written programs run in a
sandbox against hidden tests) are built in.

Lifecycle: built once per process (:func:`hpcrl.reward.registry.build_scorer`),
``score``/``score_many`` any number of times from one thread, ``close()`` at
the end (stops what it started); ``counts`` are the totals by status so far.

Light (no torch): the protocol and the result record only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

__all__ = ["Item", "RewardResult", "STATUSES", "Scorer", "Status"]

# infra_error: the scoring itself failed for a reason that is not the sample's (a sandbox that could not start):
# the result says nothing of the sample, and the rollout does not train it as a 0
Status = Literal["ok", "error", "timeout", "invalid", "infra_error"]
STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "invalid", "infra_error")
Item = tuple[str, str, dict]  # (prompt, response, row: the dataset row's answer and extra fields)


@dataclass
class RewardResult:
    reward: float  # 0.0 unless status is "ok"
    status: Status  # ok / error / timeout / invalid / infra_error
    detail: str = ""  # why, for anything but "ok"


@runtime_checkable
class Scorer(Protocol):
    """Scores samples (module docstring)."""

    def score(self, prompt: str, response: str, row: dict) -> RewardResult:
        """One item."""
        ...

    def score_many(self, items: list[Item]) -> list[RewardResult]:
        """Several items (concurrently where the scorer can), in their order."""
        ...

    @property
    def counts(self) -> dict[str, int]:
        """Results so far, by status."""
        ...

    def close(self) -> None:
        """Stop what the scorer started; no scoring afterwards."""
        ...
