"""``metrics``: where a run's metrics go besides ``logs/*.jsonl`` (hpcrl/metrics/trackers.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

BUILTIN_TRACKERS = ("tensorboard", "wandb", "mlflow")


@dataclass
class MetricsConfig:
    # tensorboard, wandb, mlflow, or "package.module:factory" (hpcrl/metrics/trackers.py); [] = the JSONL logs only.
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
            if name not in BUILTIN_TRACKERS and ":" not in name:
                raise ValueError(f"trackers: {name!r} is not one of {', '.join(BUILTIN_TRACKERS)} nor "
                                 "'package.module:factory'")
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"trackers: each at most once, got {self.trackers}")
        if self.wandb_mode not in ("offline", "online"):
            raise ValueError(f"wandb_mode: offline or online, got {self.wandb_mode!r}")
        for name, module in (("wandb", "wandb"), ("mlflow", "mlflow")):
            if name in self.trackers:
                import importlib.util
                if importlib.util.find_spec(module) is None:
                    raise ValueError(f"trackers: {name} needs the {module} package: pip install -e '.[trackers]'")
