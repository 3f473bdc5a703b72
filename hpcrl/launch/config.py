"""Configuration of how the components are started and supervised."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class LaunchConfig:
    scheduler: Literal["local"] = "local"  # local: every component is a local process
    mode: Literal["async", "colocated"] = "async"  # async: separate trainer and rollout processes; colocated: one process alternates
    progress_interval_s: float = 5.0  # seconds between progress lines on the terminal
    shutdown_timeout_s: float = 30.0  # grace period for components to exit after the run ends
    heartbeat_interval_s: float = 5.0  # how often each component process writes its heartbeat

    def __post_init__(self) -> None:
        if self.progress_interval_s <= 0:
            raise ValueError(f"progress_interval_s: must be > 0, got {self.progress_interval_s}")
        if self.shutdown_timeout_s <= 0:
            raise ValueError(f"shutdown_timeout_s: must be > 0, got {self.shutdown_timeout_s}")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s: must be > 0, got {self.heartbeat_interval_s}")
