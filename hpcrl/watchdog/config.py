"""Configuration of the watchdog (resubmission of failed or hung components)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WatchdogConfig:
    enabled: bool = True  # resubmit failed components; false = the first failure stops the run
    max_restarts: int = 5  # restarts per component before the run is given up (preemption restarts are free)
    backoff_s: float = 1.0  # delay before the first restart; doubles with each further restart
    backoff_max_s: float = 60.0  # ceiling of the delay
    heartbeat_timeout_s: float = 300.0  # a component whose heartbeat is older than this is hung: cancel and restart (0 = off)
    startup_grace_s: float = 300.0  # time a (re)started component has to write its first heartbeat

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0, got {self.max_restarts}")
        if self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError(f"backoff_s: need 0 <= backoff_s <= backoff_max_s, got {self.backoff_s}, {self.backoff_max_s}")
        if self.heartbeat_timeout_s < 0 or self.startup_grace_s < 0:
            raise ValueError(f"heartbeat_timeout_s: must be >= 0, got {self.heartbeat_timeout_s}")
