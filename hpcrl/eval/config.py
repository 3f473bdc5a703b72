"""Configuration of held-out evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class EvalConfig:
    every_steps: int = 10  # greedy held-out accuracy every N trainer steps (0 = only at start and end)
    size: int = 500  # held-out rows evaluated (the first N of the eval split)
    at_start: bool = True  # evaluate the initial policy before the first step
    batch_size: int = 256  # prompts per greedy decoding batch
    # trainer: rank 0 evaluates between steps (the other ranks wait); component: its own process/Slurm job
    # (python -m hpcrl.eval, resources launch.eval) evaluates the due versions the trainer hands over, so the
    # trainer never stalls on it (docs/trainer.md#held-out-evaluation)
    mode: Literal["trainer", "component"] = "trainer"
    poll_s: float = 1.0  # component: how often it looks for a new version to evaluate
    threads: int = 1  # component: torch threads of the evaluation process
    # run the agent function (agent.fn) on each held-out row against greedy completions; the accuracy is the
    # mean of its rewards (false: one greedy completion of the prompt, scored by the reward function)
    agent: bool = False

    def due(self, step: int, total_steps: int) -> bool:
        """Whether the version after trainer step ``step`` is evaluated (every ``every_steps``, and the last)."""
        return step == total_steps or (self.every_steps > 0 and step % self.every_steps == 0)

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"every_steps: must be >= 0, got {self.every_steps}")
        if self.size < 1:
            raise ValueError(f"size: must be >= 1, got {self.size}")
        if self.poll_s <= 0:
            raise ValueError(f"poll_s: must be > 0, got {self.poll_s}")
        if self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")
