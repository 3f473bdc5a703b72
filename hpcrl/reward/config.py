"""Configuration of the reward function and how it is contained (kept free of heavy imports: loading a config must not pull in torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hpcrl.reward.registry import check_scorer


@dataclass
class RewardConfig:
    # what scores the samples (hpcrl/reward/registry.py): function = the function `fn` below, contained as
    # `isolation` says; or "module:attr" of a factory (RewardConfig) -> Scorer of your own
    scorer: str = "function"
    # import path 'package.module:function'; called as fn(prompt, response, **row)
    # where row has at least 'answer'
    fn: str = "hpcrl.reward.math_verify:math_reward"
    # a call that takes longer scores 0 (status "timeout")
    timeout_s: float = 10.0
    # process: calls run in a worker subprocess that is killed and restarted on timeout
    isolation: Literal["thread", "process"] = "thread"
    # calls in flight at once in score_many (process mode: worker processes)
    max_workers: int = 4

    def __post_init__(self) -> None:
        check_scorer(self.scorer, key="scorer")
        module, sep, attr = str(self.fn).partition(":")
        if not sep or not module.strip() or not attr.strip():
            raise ValueError(f"fn: must be an import path 'package.module:function', got {self.fn!r}")
        if not isinstance(self.timeout_s, (int, float)) or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be a finite number > 0, got {self.timeout_s!r}")
        if self.isolation not in ("thread", "process"):
            raise ValueError(f"isolation: must be one of 'thread', 'process', got {self.isolation!r}")
        if isinstance(self.max_workers, bool) or not isinstance(self.max_workers, int) or self.max_workers < 1:
            raise ValueError(f"max_workers: must be an integer >= 1, got {self.max_workers!r}")
