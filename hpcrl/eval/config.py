"""Configuration of held-out evaluation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalConfig:
    every_steps: int = 10  # greedy held-out accuracy every N trainer steps (0 = only at start and end)
    size: int = 500  # held-out rows evaluated (the first N of the eval split)
    at_start: bool = True  # evaluate the initial policy before the first step
    batch_size: int = 256  # prompts per greedy decoding batch

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"every_steps: must be >= 0, got {self.every_steps}")
        if self.size < 1:
            raise ValueError(f"size: must be >= 1, got {self.size}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")
