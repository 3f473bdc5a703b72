"""Weight publication from the trainer to the rollout engines.

Lifecycle and ordering rules:

* The trainer calls :meth:`WeightTransport.publish` after optimizer step
  ``v`` with the full (unsharded) state dict; version ``v`` becomes visible
  to readers only once complete.
* A rollout calls :meth:`latest_version` between engine polls (cheap) and,
  when it is newer than what it holds, :meth:`locate` for that version (a
  :class:`~hpcrl.weights.version.WeightVersion`: the published directory on
  disk, the received tensors in collective mode), then interrupts its engine
  with it. :meth:`fetch` gives the tensors themselves.
* Version 0 is the initial model itself: it is never published; a rollout
  that sees no published version generates with the initial weights.

:class:`DiskWeights` writes ``weights/v<N>/model.safetensors`` through a
temporary directory renamed as a whole, then replaces ``weights/LATEST``
(atomic rename). Built with an adapter config (``trainer.lora.publish:
adapter``) it publishes the LoRA adapters the trainer gives instead, in
PEFT's layout (:mod:`hpcrl.weights.adapter`); readers tell the two apart by
the directory's files. It keeps the last ``keep_last`` versions. A collective
transport (``hpcrl/weights/collective.py``: NCCL/HCCL/gloo broadcast from
trainer rank 0) implements the same Protocol; :func:`open_transport` picks
one by ``weights.mode``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Literal, Mapping, Protocol

import torch
from safetensors.torch import save_file

from hpcrl.fs import atomic
from hpcrl.runtime.owner import Fence, NoFence
from hpcrl.weights import adapter
from hpcrl.plugins import resolve
from hpcrl.weights.config import WeightsConfig
from hpcrl.weights.registry import TRANSPORTS, transport_spec
from hpcrl.weights.version import WEIGHTS_FILE, WeightVersion, storable_tensors, unique_tensors  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)


class WeightTransport(Protocol):
    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None: ...

    def latest_version(self) -> int: ...

    def fetch(self, version: int) -> dict[str, torch.Tensor]: ...

    def locate(self, version: int) -> WeightVersion: ...

    def published_file(self, version: int) -> Path | None:
        """The file that holds version ``version``'s published tensors where the transport keeps one (an
        evaluation snapshot links it instead of writing a copy); None when it keeps none."""
        ...

    def discard_after(self, version: int) -> int:
        """Withdraw every kept version above ``version`` (a trainer resumed at ``version`` lost the steps that made
        them: :mod:`hpcrl.trainer.reconcile`); how many were removed."""
        ...

    def close(self) -> None: ...


def open_transport(root: str | Path, cfg: WeightsConfig, role: Literal["host", "member"],
                   fence: Fence | NoFence | None = None, adapter: Mapping[str, Any] | None = None) -> WeightTransport:
    """The transport ``weights.mode`` names: the trainer's rank 0 is the host, a rollout a member.
    ``fence``: the publisher's ownership fence, checked before a version becomes visible; ``adapter``: the
    publisher gives LoRA adapters of this PEFT config (disk mode only)."""
    spec = transport_spec(cfg.mode)
    if adapter is not None and not spec.adapters:
        takers = [s.name for s in TRANSPORTS.values() if s.adapters]
        raise ValueError(f"weights.mode={cfg.mode}: it does not publish LoRA adapters ({', '.join(takers)} does)")
    return resolve(spec.build, "weights.mode")(root, cfg, role, fence, adapter)


def open_disk(root: str | Path, cfg: WeightsConfig, role: Literal["host", "member"],
              fence: Fence | NoFence | None = None, adapter: Mapping[str, Any] | None = None) -> DiskWeights:
    """``weights.mode: disk`` (:mod:`hpcrl.weights.registry`): host and members share the run's weights folder."""
    return DiskWeights(root, cfg, fence, adapter)


class DiskWeights:
    def __init__(self, root: str | Path, cfg: WeightsConfig, fence: Fence | NoFence | None = None,
                 adapter: Mapping[str, Any] | None = None) -> None:
        """``adapter``: PEFT's adapter config (:func:`hpcrl.weights.adapter.peft_config`) when the publisher gives
        LoRA adapters rather than whole policies."""
        self.root = Path(root)
        self.cfg = cfg
        self.fence = fence or NoFence()
        self.adapter = adapter
        self.root.mkdir(parents=True, exist_ok=True)

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def published_file(self, version: int) -> Path | None:
        return self.version_dir(version) / WEIGHTS_FILE

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        target = self.version_dir(version)
        if target.exists():
            shutil.rmtree(target)  # a crashed earlier attempt at the same version left it uncommitted by LATEST
        with atomic.directory(target) as tmp:
            if self.adapter is not None:
                adapter.write(tmp, state_dict, self.adapter, version)
            else:
                save_file(storable_tensors(state_dict), str(tmp / WEIGHTS_FILE), metadata={"version": str(version)})
            self.fence.check(f"weight publish of version {version}")  # raising here leaves no directory
        self.fence.check(f"weight publish of version {version}")
        atomic.write_text(self.root / "LATEST", f"{version}\n")
        self._prune(version)

    def latest_version(self) -> int:
        try:
            return int((self.root / "LATEST").read_text())
        except FileNotFoundError:
            return 0
        except ValueError:  # never partial (atomic rename); only a hand-edited file gets here
            log.warning("unreadable %s; treating as version 0", self.root / "LATEST")
            return 0

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        return self.locate(version).tensors()

    def locate(self, version: int) -> WeightVersion:
        return WeightVersion(version, path=self.version_dir(version))

    def discard_after(self, version: int) -> int:
        newer = [p for p in self.root.glob("v*") if p.name[1:].isdigit() and int(p.name[1:]) > version]
        for p in newer:
            shutil.rmtree(p, ignore_errors=True)
        return len(newer)

    def close(self) -> None:
        """Nothing to release: every version is a file."""

    def _prune(self, newest: int) -> None:
        for old in sorted(self.root.glob("v*")):
            if atomic.is_temporary(old.name) or not old.name[1:].isdigit():
                continue
            if int(old.name[1:]) <= newest - self.cfg.keep_last:
                shutil.rmtree(old, ignore_errors=True)
