"""Configuration of weight publication from trainer to rollouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpcrl.weights.registry import transport_spec

WEIGHTS_FILE = "model.safetensors"  # one published version's tensors, HuggingFace names


@dataclass
class WeightsConfig:
    # the transport (hpcrl/weights/registry.py): disk = safetensors under <run_dir>/weights/v<N>/; collective = a
    # broadcast from trainer rank 0 (hpcrl/weights/collective.py); or "module:attr" of a TransportSpec of your own
    mode: str = "disk"
    keep_last: int = 3  # published versions kept on disk (older ones are deleted)
    bucket_mb: float = 64.0  # collective: size of one flat broadcast bucket (MiB)
    collective_backend: Literal["auto", "gloo", "nccl", "hccl"] = "auto"  # collective: auto = NCCL on CUDA, HCCL on Ascend, else gloo
    collective_host: str = ""  # collective: address rollouts use to reach the trainer's store ("" = this host's name)
    collective_timeout_s: float = 120.0  # collective: timeout of the store and of one transfer
    join_timeout_s: float = 30.0  # collective: a member that does not answer a re-formation within this is dropped
    rendezvous_timeout_s: float = 600.0  # collective: how long a rollout waits for the trainer to admit it
    collective_poll_s: float = 0.02  # collective: how often the host thread looks for joins and leaves, and a rollout for a new version

    def __post_init__(self) -> None:
        transport_spec(self.mode, key="mode")
        if self.keep_last < 2:
            raise ValueError(f"keep_last: must be >= 2 (a rollout may still be reading the previous one), got {self.keep_last}")
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb: must be > 0, got {self.bucket_mb}")
        for name in ("collective_timeout_s", "join_timeout_s", "rendezvous_timeout_s", "collective_poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
