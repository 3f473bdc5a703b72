"""The accelerator a process runs on: the one place that knows CUDA, Ascend NPUs and the CPU.

An :class:`Accelerator` names the torch device type, the process-group
backend that goes with it (NCCL, HCCL, gloo), the variable through which
Slurm and the driver say which devices a job may use
(``CUDA_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``), and the calls
that differ between them: select a device, count them, peak memory. :func:`detect` picks one for a
requested backend (``auto``: CUDA, else an Ascend NPU, else the CPU).
``torch_npu`` is imported only when an NPU is asked for or looked for, and
only once; on a machine without it nothing Ascend is touched.

:func:`place` turns a device setting (``rollout.device``: ``auto``, ``cpu``,
``cuda``, ``cuda:1``, ``npu``, ...) into a torch device, and :func:`limit_memory`
caps a process's share of it, so that a trainer and a rollout can share one
accelerator.

Used by the trainer's rank bootstrap (:func:`hpcrl.runtime.dist.pick_device`),
the collective weight transport's groups, the rollout job's device count and
the trainer's ``memory/peak_mb`` metric.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
from dataclasses import dataclass
from types import ModuleType

import torch

log = logging.getLogger(__name__)

__all__ = ["Accelerator", "CPU", "CUDA", "NPU", "detect", "limit_memory", "npu_available", "of", "place",
           "visible_device_count"]


@dataclass(frozen=True)
class Accelerator:
    kind: str  # torch device type: "cuda" | "npu" | "cpu"
    backend: str  # process-group backend: "nccl" | "hccl" | "gloo"
    visible_var: str | None  # the visible-devices variable Slurm/the driver sets (None: the CPU)

    @property
    def module(self) -> ModuleType | None:
        """``torch.cuda`` / ``torch.npu`` (None for the CPU)."""
        if self.kind == "cuda":
            return torch.cuda
        if self.kind == "npu":
            _import_torch_npu()
            return torch.npu  # type: ignore[attr-defined]
        return None

    def device(self, index: int | None = None) -> torch.device:
        if self.module is None:
            return torch.device("cpu")
        return torch.device(self.kind, self.module.current_device() if index is None else index)

    def set_device(self, index: int) -> torch.device:
        """Make device ``index`` this process's current one (a no-op on the CPU); returns it."""
        if self.module is not None:
            self.module.set_device(index)
        return self.device(index)

    def device_count(self) -> int:
        return self.module.device_count() if self.module is not None else 0

    def set_memory_fraction(self, fraction: float, device: torch.device) -> None:
        """Cap this process's allocations on ``device`` at ``fraction`` of its memory (a no-op on the CPU)."""
        if self.module is not None:
            self.module.set_per_process_memory_fraction(fraction, device)

    def peak_memory_bytes(self) -> int:
        """Peak memory of this process: device memory allocated by torch, or on the CPU the peak resident set."""
        if self.module is not None:
            return int(self.module.max_memory_allocated())
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


CUDA = Accelerator("cuda", "nccl", "CUDA_VISIBLE_DEVICES")
NPU = Accelerator("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES")
CPU = Accelerator("cpu", "gloo", None)
_BY_BACKEND = {"nccl": CUDA, "hccl": NPU, "gloo": CPU}


@functools.cache
def _import_torch_npu() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu and the HCCL backend)
    except ImportError:
        return False
    except Exception as e:  # noqa: BLE001 - installed but broken (CANN's environment not sourced, say)
        log.warning("torch_npu is installed but does not import (%s: %s): no Ascend device", type(e).__name__, e)
        return False
    return True


def npu_available() -> bool:
    return _import_torch_npu() and torch.npu.is_available()  # type: ignore[attr-defined]


def detect(backend: str = "auto", what: str = "backend") -> Accelerator:
    """The accelerator for a requested process-group backend (``auto``, ``nccl``, ``hccl``, ``gloo``);
    ``what`` names the config key in the error when the requested one is not there."""
    if backend not in ("auto", *_BY_BACKEND):
        raise ValueError(f"{what}: unknown backend {backend!r} (auto, nccl, hccl, gloo)")
    if backend in ("auto", "nccl") and torch.cuda.is_available():
        return CUDA
    if backend == "nccl":
        raise ValueError(f"{what}: nccl requested but CUDA is not available")
    if backend in ("auto", "hccl") and npu_available():
        return NPU
    if backend == "hccl":
        raise ValueError(f"{what}: hccl requested but torch_npu/an Ascend device is not available")
    return CPU


def place(setting: str, what: str = "device") -> torch.device:
    """The torch device a setting names: ``auto`` (the first visible accelerator, else the CPU), ``cpu``, or an
    accelerator kind with an optional index (``cuda``, ``cuda:1``, ``npu:0``), which must be there; ``what`` names
    the config key in the error."""
    kind, _, index = setting.partition(":")
    if setting == "auto":
        return detect("auto").device(0)
    by_kind = {"cpu": CPU, "cuda": CUDA, "npu": NPU}
    if kind not in by_kind or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise ValueError(f"{what}: expected auto, cpu, cuda[:N] or npu[:N], got {setting!r}")
    if kind == "cpu":
        return CPU.device()
    acc = by_kind[kind]
    available = torch.cuda.is_available() if acc is CUDA else npu_available()
    i, n = int(index or 0), acc.device_count() if available else 0
    if i >= n:
        raise ValueError(f"{what}: {setting} asked for, but this process sees {n} {kind} device(s)")
    return acc.device(i)


def limit_memory(device: torch.device, fraction: float) -> None:
    """Cap this process's allocations on an accelerator at ``fraction`` of its memory (0: no cap; the CPU: none)."""
    if fraction and device.type != "cpu":
        of(device).set_memory_fraction(fraction, device)


def of(device: torch.device) -> Accelerator:
    """The accelerator a torch device belongs to."""
    return {"cuda": CUDA, "npu": NPU}.get(device.type, CPU)


def visible_device_count(requested: int = 0) -> int:
    """Accelerators this job may use: the visible-devices list Slurm/the driver set, else ``requested``,
    else what torch sees."""
    for acc in (CUDA, NPU):
        ids = os.environ.get(acc.visible_var or "")
        if ids is not None:
            return len([i for i in ids.split(",") if i.strip()])
    if requested:
        return requested
    acc = detect("auto")
    return acc.device_count()
