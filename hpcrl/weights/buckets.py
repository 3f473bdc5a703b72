"""The pieces of a collective weight transfer: tensors packed in flat buckets, and a side process group.

:class:`Layout` places named tensors in single-dtype buckets the same way on
every side (tied aliases sent once), :func:`new_group` builds a process group
over a store outside the default world (gloo, NCCL, HCCL), :func:`broadcast`
sends every bucket from rank 0 with the transfers overlapped. The protocol
that uses them (who joins, when a version is sent) is
:mod:`hpcrl.weights.collective`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from hpcrl.runtime.device import detect
from hpcrl.weights.version import aliases

__all__ = ["Layout", "TransferStats", "broadcast", "new_group", "pick_backend"]

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                               torch.uint8, torch.bool)}


@dataclass
class Layout:
    """How named tensors sit in flat single-dtype buckets (same on host and members)."""
    buckets: list[tuple[str, int]]  # (dtype, numel) per bucket
    tensors: list[tuple[str, int, int, list[int]]]  # (name, bucket, offset, shape)

    @staticmethod
    def of(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> "Layout":
        """Tied aliases point at their original's place: sent once, unpacked under both names."""
        buckets: list[list] = []
        tensors, open_bucket, placed = [], {}, {}
        dup = aliases(state)
        for name, t in state.items():
            if name in dup:
                tensors.append((name, *placed[dup[name]], list(t.shape)))
                continue
            key = str(t.dtype)
            b = open_bucket.get(key)
            if b is None or (buckets[b][1] and (buckets[b][1] + t.numel()) * t.element_size() > bucket_bytes):
                b = open_bucket[key] = len(buckets)
                buckets.append([key, 0])
            tensors.append((name, b, buckets[b][1], list(t.shape)))
            placed[name] = (b, buckets[b][1])
            buckets[b][1] += t.numel()
        return Layout([(d, n) for d, n in buckets], tensors)

    def pack(self, state: Mapping[str, torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        flat, done = self.empty(device), set()
        for name, b, off, shape in self.tensors:
            if (b, off, tuple(shape)) not in done:  # an alias has its original's place and shape
                t = state[name]
                flat[b][off:off + t.numel()].copy_(t.reshape(-1))
                done.add((b, off, tuple(shape)))
        return flat

    def empty(self, device: torch.device) -> list[torch.Tensor]:
        return [torch.empty(n, dtype=_DTYPES[d], device=device) for d, n in self.buckets]

    def unpack(self, flat: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        out, views = {}, {}
        for name, b, off, shape in self.tensors:
            n = 1
            for s in shape:
                n *= s
            key = (b, off, tuple(shape))  # an alias shares its original's tensor (a 0-size one shares nothing)
            if key not in views:
                views[key] = flat[b][off:off + n].view(shape).cpu()
            out[name] = views[key]
        return out

    def to_json(self) -> str:
        return json.dumps({"buckets": self.buckets, "tensors": self.tensors})

    @staticmethod
    def from_json(text: str) -> "Layout":
        d = json.loads(text)
        return Layout([tuple(b) for b in d["buckets"]], [tuple(t) for t in d["tensors"]])


def pick_backend(requested: str) -> tuple[str, torch.device]:
    """Backend and buffer device: auto = NCCL with CUDA, HCCL with an Ascend device, else gloo."""
    acc = detect(requested, "weights.collective_backend")
    return acc.backend, acc.device()


def new_group(backend: str, store: dist.Store, rank: int, size: int, timeout_s: float):
    """A process group over ``store`` alone (outside the default world)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # type: ignore  # Ascend only; untested here
    opts = ProcessGroupHCCL.Options()
    opts._timeout = timeout
    return ProcessGroupHCCL(store, rank, size, opts)


def broadcast(pg, flat: list[torch.Tensor]) -> None:
    """Broadcast every bucket from rank 0; all issued first, then awaited (transfers overlap)."""
    works = [pg.broadcast([t], dist.BroadcastOptions()) for t in flat]
    for w in works:
        w.wait()


@dataclass
class TransferStats:
    transfers: int = 0  # broadcasts completed (host) or received (member)
    seconds: float = 0.0  # wall time inside transfers
    bytes: int = 0  # payload moved (per receiver)
    reforms: int = 0  # process groups formed
    pack_seconds: float = 0.0  # host: time publish() spent copying into buckets
    failures: int = 0  # transfers or formations that failed and were retried
    extra: dict = field(default_factory=dict)
