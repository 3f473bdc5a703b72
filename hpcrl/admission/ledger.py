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
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcrl.admission.config import AdmissionConfig


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
        self.tickets_dir.mkdir(parents=True, exist_ok=True)
        self.dropped_dir.mkdir(parents=True, exist_ok=True)
        self._cursor = 0
        self._perms: dict[int, np.ndarray] = {}

    # -- the bound -------------------------------------------------------
    def limit(self, version: int) -> int:
        """Number of tickets that may exist while generating with ``version``."""
        return (version + self.cfg.max_staleness + 1) * self.cfg.batch_size + self.num_dropped()

    def try_admit(self, version: int, writer: str) -> Ticket | None:
        """Create the next ticket if the staleness bound allows it, else None."""
        limit = self.limit(version)
        while self._cursor < limit:
            path = self.tickets_dir / f"t{self._cursor:09d}"
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._cursor += 1
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"writer": writer, "version": version, "time": time.time()}, f)
            index, self._cursor = self._cursor, self._cursor + 1
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
        return sum(1 for p in self.tickets_dir.iterdir() if p.name.startswith("t"))

    def num_dropped(self) -> int:
        return sum(1 for p in self.dropped_dir.iterdir() if p.name.startswith("t"))

    def record_drop(self, index: int, reason: str) -> None:
        """Record that ticket ``index`` will never be trained (idempotent)."""
        try:
            fd = os.open(self.dropped_dir / f"t{index:09d}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as f:
            json.dump({"reason": reason, "time": time.time()}, f)

    def dropped(self) -> dict[int, str]:
        out = {}
        for p in self.dropped_dir.iterdir():
            if p.name.startswith("t") and p.name[1:].isdigit():
                out[int(p.name[1:])] = json.loads(p.read_text() or "{}").get("reason", "")
        return out
