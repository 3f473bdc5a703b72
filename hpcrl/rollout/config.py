"""Configuration of the rollout component."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class RolloutConfig:
    replicas: int = 1  # independent rollout processes (all share the admission ledger)
    group_size: int = 8  # samples per prompt (a prompt group)
    max_batch_size: int = 64  # sequences decoded together (continuous batching slots)
    max_new_tokens: int = 8  # response length limit
    temperature: float = 1.0  # sampling temperature (the trainer uses the same one for logprobs)
    threads: int = 1  # torch threads per rollout process
    poll_interval_s: float = 0.02  # sleep when blocked on admission or new weights
    # new sequences enter the running batch only when this many slots are free (fewer, larger prefills); 0 = group_size
    admit_min_free: int = 0
    # on new weights: rebuild the KV cache of in-flight sequences by prefill (exact continuation under the new
    # weights), or keep the old cache (PipelineRL-style, no prefill; logprobs stay the sampling ones)
    kv_on_update: Literal["recompute", "keep"] = "recompute"

    def __post_init__(self) -> None:
        for name in ("replicas", "group_size", "max_batch_size", "max_new_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_batch_size < self.group_size:
            raise ValueError(f"max_batch_size: must be >= group_size ({self.group_size}), got {self.max_batch_size}")
        if not 0 <= self.admit_min_free <= self.max_batch_size:
            raise ValueError(f"admit_min_free: must be in [0, max_batch_size={self.max_batch_size}], "
                             f"got {self.admit_min_free}")
        if self.temperature <= 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")
