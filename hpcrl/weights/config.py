"""Configuration of weight publication from trainer to rollouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class WeightsConfig:
    mode: Literal["disk"] = "disk"  # disk: safetensors under <run_dir>/weights/v<N>/ (collective mode: see the performance issue)
    keep_last: int = 3  # published versions kept on disk (older ones are deleted)

    def __post_init__(self) -> None:
        if self.keep_last < 2:
            raise ValueError(f"keep_last: must be >= 2 (a rollout may still be reading the previous one), got {self.keep_last}")
