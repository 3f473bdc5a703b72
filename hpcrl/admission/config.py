"""Configuration of the global admission ledger (design.md §3.2)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdmissionConfig:
    batch_size: int = 16  # B: prompt groups the trainer consumes per step
    max_staleness: int = 2  # eta: a group trained at version v was started at version >= v - eta; 0 = synchronous RL
    # a rollout refused at the bound asks again at the same policy version only after this long (new weights: at
    # once). A refused ask costs the shared filesystem's metadata server 4 operations and a rollout at the bound
    # asks on every pass of its loop (~50/s): with hundreds of rollouts, 0.25 cuts that load ~12x for at most
    # 0.25 s before a slot freed by a drop or reissue is taken (docs/performance.md, scripts/bench_fs.py)
    recheck_s: float = 0.0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.recheck_s < 0:
            raise ValueError(f"recheck_s: must be >= 0, got {self.recheck_s}")
