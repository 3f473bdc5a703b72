"""The hand-over between the trainer and the evaluation component (``eval.mode: component``).

Two files carry it, both under the run directory:

* ``eval/pending/v<N>-<instance>/``: a *snapshot*, the weights of version N as
  the trainer instance ``<instance>`` published them, with ``snapshot.json``
  (version, instance, the trainer's ``time/elapsed_s`` at that step). The
  trainer's rank 0 puts one for every version that is due for evaluation
  (:meth:`Snapshots.put`): a hard link to the published ``model.safetensors``
  when the weights went to disk (no copy, and pruning the published version
  does not take it away), a file written from the state dict otherwise. A
  snapshot appears whole (directory renamed into place) or not at all.
* ``logs/eval.jsonl``: one record per evaluated snapshot (:class:`EvalLog`),
  appended and fsynced by the evaluation component *before* it removes the
  snapshot. A component killed at any moment therefore evaluates a snapshot
  again only if its record never reached the disk, and records it at most
  once (:meth:`EvalLog.recorded` is checked first; a torn last line is cut
  off on open).

A trainer that restarts from a checkpoint publishes the versions after it
again, with other weights: each is a new snapshot (another instance), so the
weights actually evaluated are always named by ``eval/snapshot``. Readers
keep the last record of each step (:func:`hpcrl.metrics.writer.read_evals`).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from hpcrl.fs import atomic
from hpcrl.metrics.config import MetricsConfig
from hpcrl.metrics.writer import EVAL_LOG, MetricsWriter, read_metrics
from hpcrl.runtime.owner import Fence, NoFence
from hpcrl.weights.config import WEIGHTS_FILE

if TYPE_CHECKING:  # torch only where a snapshot is written: the supervisor and the audit read these files too
    import torch

log = logging.getLogger(__name__)

_META = "snapshot.json"


@dataclass(frozen=True)
class Snapshot:
    version: int
    instance: str  # the trainer instance that published these weights
    path: Path  # the snapshot directory
    elapsed_s: float  # the trainer's time/elapsed_s when it published the version
    put_at: float = 0.0  # unix time the snapshot appeared

    @property
    def id(self) -> str:
        return f"v{self.version}@{self.instance}"

    @property
    def weights(self) -> Path:
        return self.path / WEIGHTS_FILE


class Snapshots:
    """``<run_dir>/eval/pending``: versions waiting for evaluation."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def put(self, version: int, state_dict: Mapping[str, torch.Tensor] | None, instance: str, elapsed_s: float,
            published: Path | None = None, fence: Fence | NoFence | None = None) -> Snapshot:
        """Make version ``version`` (``published``: its ``model.safetensors`` on disk, if any) available."""
        from safetensors.torch import save_file

        from hpcrl.weights.version import storable_tensors

        self.root.mkdir(parents=True, exist_ok=True)
        snap = Snapshot(version, instance or "local", self.root / f"v{version:06d}-{instance or 'local'}", elapsed_s,
                        time.time())
        if snap.path.exists():
            return snap  # this instance put it already (a retried step)
        with atomic.directory(snap.path) as tmp:
            linked = False
            if published is not None and published.is_file():
                try:
                    os.link(published, tmp / WEIGHTS_FILE)
                    linked = True
                except OSError as e:  # another filesystem, or links not allowed: copy through the state dict
                    log.debug("cannot link %s (%s); writing the snapshot", published, e)
            if not linked:
                if state_dict is None:
                    raise ValueError(f"version {version}: neither a published file nor a state dict to snapshot")
                save_file(storable_tensors(state_dict), str(tmp / WEIGHTS_FILE), metadata={"version": str(version)})
            atomic.write_json(tmp / _META, {"version": version, "instance": snap.instance, "elapsed_s": elapsed_s,
                                            "time": snap.put_at, "linked": linked})
            (fence or NoFence()).check(f"evaluation snapshot of version {version}")
        return snap

    def pending(self) -> list[Snapshot]:
        """Complete snapshots, oldest version first (and, for one version, in the order they were put)."""
        out = []
        for d in self.root.glob("v*"):
            if atomic.is_temporary(d.name) or not (d / _META).is_file():
                continue
            meta = atomic.read_json(d / _META)
            out.append(Snapshot(int(meta["version"]), str(meta["instance"]), d, float(meta.get("elapsed_s", 0.0)),
                                float(meta.get("time", 0.0))))
        return sorted(out, key=lambda s: (s.version, s.put_at))

    def remove(self, snap: Snapshot) -> None:
        shutil.rmtree(snap.path, ignore_errors=True)

    def clean_tmp(self, older_than_s: float = 0.0) -> int:
        """Remove half-written snapshots of trainers that died while putting one: all of them while no trainer
        runs (``older_than_s`` 0), else those old enough that no live put can own them; how many."""
        removed = 0
        for d in self.root.glob("*"):
            try:
                old = time.time() - d.stat().st_mtime >= older_than_s
            except FileNotFoundError:
                continue
            if atomic.is_temporary(d.name) and old:
                shutil.rmtree(d, ignore_errors=True)
                removed += 1
        return removed


class EvalLog:
    """``logs/eval.jsonl`` (and TensorBoard), written by the one evaluation component of the run."""

    def __init__(self, log_dir: str | Path, tensorboard: bool = True, metrics: MetricsConfig | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.path = Path(log_dir) / EVAL_LOG
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair()
        records = read_metrics(self.path)
        self._ids = {r.get("eval/snapshot") for r in records}
        self.steps = {int(r.get("step", 0)) for r in records}  # steps evaluated at least once
        self.writer = MetricsWriter(log_dir, tensorboard, filename=EVAL_LOG, durable=True, trackers=metrics,
                                    component="eval", config=config)

    def _repair(self) -> None:
        """Cut a last line a killed writer left unfinished (it has no record: the snapshot is still pending)."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning("%s: dropping an unfinished last line (%d bytes) of a killed evaluation", self.path,
                        len(data) - end)
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())

    def recorded(self, snapshot_id: str) -> bool:
        return snapshot_id in self._ids

    def append(self, record: dict[str, Any], fence: Fence | NoFence | None = None) -> None:
        """Append one record durably (written and fsynced before this returns)."""
        (fence or NoFence()).check(f"evaluation record of step {record.get('step')}")
        self.writer.write(record)
        self._ids.add(record.get("eval/snapshot"))
        self.steps.add(int(record.get("step", 0)))

    def close(self) -> None:
        self.writer.close()
