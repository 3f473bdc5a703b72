"""Configuration of trainer checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class CheckpointConfig:
    every_steps: int = 50  # checkpoint after every N training steps (0 = off)
    every_seconds: float = 0.0  # also checkpoint when this much wall time passed since the last one (0 = off)
    keep_last: int = 2  # committed checkpoints kept (older ones are pruned)
    keep_every: int = 0  # additionally keep every checkpoint whose step is a multiple of this (0 = none)
    at_end: bool = True  # checkpoint after the last step

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"every_steps: must be >= 0, got {self.every_steps}")
        if self.every_seconds < 0:
            raise ValueError(f"every_seconds: must be >= 0, got {self.every_seconds}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last: must be >= 1, got {self.keep_last}")
        if self.keep_every < 0:
            raise ValueError(f"keep_every: must be >= 0, got {self.keep_every}")


@dataclass
class InitConfig:
    """Where a new run's policy starts (``python -m hpcrl.submit --from <ckpt_dir>``; :mod:`hpcrl.init_from`)."""

    checkpoint: str = ""  # another run's checkpoint (<run_dir>/ckpt/step_N, or a run dir: its newest); "" = model.*
    # what else continues from it: the optimizer state, the learning-rate schedule's position, the data position
    restore: list[Literal["optimizer", "scheduler", "data"]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.restore and not self.checkpoint:
            raise ValueError(f"restore: {self.restore} needs init.checkpoint (--from)")
        if len(set(self.restore)) != len(self.restore):
            raise ValueError(f"restore: {self.restore} names an item twice")
