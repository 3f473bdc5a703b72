"""Process-group bootstrap for trainer ranks.

A trainer rank learns its rank, world size and rendezvous address from the
environment (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
``MASTER_PORT``, as set by the local launcher or torchrun), picks its device
and backend (CUDA -> NCCL, Ascend -> HCCL, else gloo) and joins the group.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(backend: str, local_rank: int) -> tuple[torch.device, str]:
    """The device and backend for this rank; ``backend='auto'`` chooses by platform."""
    if backend in ("auto", "nccl") and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    if backend == "nccl":
        raise ValueError("trainer.backend: nccl requested but CUDA is not available")
    if backend in ("auto", "hccl") and _has_npu():
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]
        return torch.device("npu", local_rank), "hccl"
    if backend == "hccl":
        raise ValueError("trainer.backend: hccl requested but torch_npu/an Ascend device is not available")
    return torch.device("cpu"), "gloo"


def _has_npu() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return False
    return torch.npu.is_available()  # type: ignore[attr-defined]


def init_from_env(backend: str = "auto") -> DistContext:
    """Join the trainer's process group described by the environment."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if world > 1:
            raise ValueError("MASTER_PORT must be set for a trainer with world_size > 1")
        os.environ["MASTER_PORT"] = str(free_port())
    device, backend = pick_device(backend, local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    log.info("rank %d/%d joined (%s on %s)", rank, world, backend, device)
    return DistContext(rank, world, local_rank, device, backend)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
