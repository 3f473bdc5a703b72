"""``metrics``: where a run's metrics go besides ``logs/*.jsonl`` (hpcrl/metrics/trackers.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hpcrl.metrics.registry import check_tracker


@dataclass
class MetricsConfig:
    # tensorboard, wandb, mlflow, or "package.module:SPEC" (a TrackerSpec, hpcrl/metrics/registry.py); [] = the JSONL
    # logs only.
    # Written by the trainer's rank 0 and by the evaluation component, one tracker run each, resumed after a restart
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    wandb_project: str = "hpcrl"
    wandb_entity: str = ""  # "" = your default entity
    # offline: compute nodes rarely reach the internet; `wandb sync <run_dir>/logs/wandb/*/wandb/offline-run-*` later
    wandb_mode: Literal["offline", "online"] = "offline"
    mlflow_tracking_uri: str = ""  # "" = a file store in <run_dir>/logs/mlruns
    mlflow_experiment: str = "hpcrl"

    def __post_init__(self) -> None:
        for name in self.trackers:
            check_tracker(name)
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"trackers: each at most once, got {self.trackers}")
        if self.wandb_mode not in ("offline", "online"):
            raise ValueError(f"wandb_mode: offline or online, got {self.wandb_mode!r}")
