"""The global admission ledger: which prompt groups may be generated, and when.

Lifecycle and ordering rules (DESIGN 3.2):

* A rollout process asks :meth:`AdmissionLedger.try_admit` for the next
  ticket, passing the policy version of the weights it generates with. Ticket
  ``n`` is the file ``tickets/t<n>`` created with ``O_CREAT | O_EXCL``, so
  any number of rollout processes on any number of nodes share one counter
  without locks, and tickets are contiguous from 0.
* Ticket ``n`` may be created only while ``n - dropped < (v + eta + 1) * B``,
  where ``v`` is the generating version, ``eta`` the maximum staleness and
  ``dropped`` the groups the trainer discarded (quarantined or stale), which
  would otherwise never arrive and stall the bound.
* Ticket ``n`` maps deterministically to a dataset row: epoch ``n // N``,
  position ``perm(seed, epoch)[n % N]``. The data order is reproducible, and
  the ledger on disk *is* the dataloader state: nothing to checkpoint.
* The trainer records a dropped group with :meth:`record_drop` (one file per
  ticket, created exclusively, so a repeated drop is counted once).
* A ticket whose work was lost (its rollout died, or its trajectories came
  from a policy version lost in a trainer restart) is *reissued*:
  :meth:`reissue` creates ``reissue/t<n>``, and the next :meth:`try_admit`
  of any rollout takes it by renaming it to ``reissue/t<n>.taken-<writer>``
  (one rename succeeds, so exactly one rollout regenerates it). A reissued
  ticket is already counted as admitted, so it is handed out regardless of
  the bound.

Cost: ``try_admit`` lists ``reissue/`` and ``dropped/`` on every call (the
counters are files, so they are never cached: a cached count could miss a
drop and stall the bound), with ``os.listdir`` rather than ``Path`` objects.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcrl.admission.config import AdmissionConfig


def create_exclusive(path: Path, record: dict) -> bool:
    """Create ``path`` holding ``record`` (+ time) unless it exists; True if this call created it.

    ``O_CREAT | O_EXCL`` makes exactly one of any number of concurrent creators win.
    """
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps({**record, "time": time.time()}).encode())
    return True


@dataclass(frozen=True)
class Ticket:
    index: int  # global ticket number
    epoch: int  # pass over the dataset
    row: int  # dataset row this ticket generates from


class AdmissionLedger:
    def __init__(self, root: str | Path, cfg: AdmissionConfig, num_rows: int, seed: int = 0) -> None:
        if num_rows < 1:
            raise ValueError("num_rows: the training dataset is empty")
        self.root = Path(root)
        self.cfg = cfg
        self.num_rows = num_rows
        self.seed = seed
        self.tickets_dir = self.root / "tickets"
        self.dropped_dir = self.root / "dropped"
        self.reissue_dir = self.root / "reissue"
        for d in (self.tickets_dir, self.dropped_dir, self.reissue_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._cursor = 0
        self._perms: dict[int, np.ndarray] = {}

    # -- the bound -------------------------------------------------------
    def limit(self, version: int) -> int:
        """Number of tickets that may exist while generating with ``version``."""
        return (version + self.cfg.max_staleness + 1) * self.cfg.batch_size + self.num_dropped()

    def try_admit(self, version: int, writer: str) -> Ticket | None:
        """A reissued ticket if any, else the next ticket if the staleness bound allows it, else None."""
        reissued = self._take_reissued(writer)
        if reissued is not None:
            return reissued
        limit = self.limit(version)
        while self._cursor < limit:
            index, self._cursor = self._cursor, self._cursor + 1
            if create_exclusive(self.tickets_dir / f"t{index:09d}", {"writer": writer, "version": version}):
                return self.ticket(index)
        return None

    def reissue(self, index: int, reason: str) -> None:
        """Hand ticket ``index`` out again (idempotent while it waits)."""
        create_exclusive(self.reissue_dir / f"t{index:09d}", {"reason": reason})

    def pending_reissues(self) -> list[int]:
        return sorted(int(n[1:]) for n in os.listdir(self.reissue_dir) if n[1:].isdigit())

    def holders(self) -> dict[int, str]:
        """Ticket -> the writer that currently owns its generation (the latest taker of a reissue)."""
        out = {}
        for p in self.tickets_dir.iterdir():
            if p.name[1:].isdigit():
                try:
                    out[int(p.name[1:])] = json.loads(p.read_text() or "{}").get("writer", "")
                except json.JSONDecodeError:  # being written by its creator right now: not dead
                    continue
        taken = [p.name.split(".taken-", 1) for p in self.reissue_dir.iterdir() if ".taken-" in p.name]
        for name, rest in sorted(taken, key=lambda x: int(x[1].rsplit("-", 1)[1])):
            out[int(name[1:])] = rest.rsplit("-", 1)[0]
        return out

    def reclaim(self, writer: str, finished: set[int]) -> list[int]:
        """Reissue every ticket ``writer`` (a dead rollout) held and did not finish; returns them."""
        waiting = set(self.pending_reissues())
        done = finished | set(self.dropped()) | waiting
        lost = sorted(n for n, w in self.holders().items() if w == writer and n not in done)
        for n in lost:
            self.reissue(n, f"rollout {writer} died holding it")
        return lost

    def _take_reissued(self, writer: str) -> Ticket | None:
        for index in self.pending_reissues():
            src = self.reissue_dir / f"t{index:09d}"
            try:
                os.rename(src, self.reissue_dir / f"t{index:09d}.taken-{writer}-{time.time_ns()}")
            except FileNotFoundError:
                continue  # another rollout took it first
            return self.ticket(index)
        return None

    def ticket(self, index: int) -> Ticket:
        epoch, pos = divmod(index, self.num_rows)
        return Ticket(index=index, epoch=epoch, row=int(self._perm(epoch)[pos]))

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        return self._perms[epoch]

    # -- accounting --------------------------------------------------------
    def num_admitted(self) -> int:
        return sum(1 for n in os.listdir(self.tickets_dir) if n.startswith("t"))

    def num_dropped(self) -> int:
        return sum(1 for n in os.listdir(self.dropped_dir) if n.startswith("t"))

    def record_drop(self, index: int, reason: str) -> None:
        """Record that ticket ``index`` will never be trained (idempotent)."""
        create_exclusive(self.dropped_dir / f"t{index:09d}", {"reason": reason})

    def dropped(self) -> dict[int, str]:
        out = {}
        for p in self.dropped_dir.iterdir():
            if p.name.startswith("t") and p.name[1:].isdigit():
                out[int(p.name[1:])] = json.loads(p.read_text() or "{}").get("reason", "")
        return out
