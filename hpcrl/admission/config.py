"""Configuration of the global admission ledger (design.md §3.2)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdmissionConfig:
    batch_size: int = 16  # B: prompt groups the trainer consumes per step
    max_staleness: int = 2  # eta: a group trained at version v was started at version >= v - eta; 0 = synchronous RL

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
