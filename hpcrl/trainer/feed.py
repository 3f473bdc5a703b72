"""The trainer's side of the spool: take the next batch of B prompt groups.

Ordering rules (rank 0 only):

* A ready file whose oldest token (head version, in its name) is more than
  ``max_staleness`` versions behind the current trainer version is dropped
  with the reason ``stale`` and recorded in the admission ledger, so the
  admission bound frees its slot; it is never trained.
* Eligible files are taken oldest first (by head version, then ticket), by
  rename into ``claimed/``; a file that fails validation is quarantined by
  the spool and recorded as dropped in the ledger; taking continues until B
  valid groups are in hand.
* After the step, :meth:`BatchFeed.commit` moves the claimed files into
  ``trained/step_<v>/`` where ``v`` is the version that trained them.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from hpcrl.admission.ledger import AdmissionLedger
from hpcrl.spool.format import TrajectoryGroup
from hpcrl.spool.store import Spool, SpoolEntry

log = logging.getLogger(__name__)


class BatchTimeout(RuntimeError):
    """No full batch arrived within ``trainer.batch_timeout_s``."""


class BatchFeed:
    def __init__(self, spool: Spool, ledger: AdmissionLedger, batch_size: int, max_staleness: int,
                 timeout_s: float = 600.0, poll_s: float = 0.01) -> None:
        self.spool, self.ledger = spool, ledger
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._pending: list[SpoolEntry] = []
        self.dropped = {"stale": 0, "quarantined": 0}

    def next_batch(self, version: int, wait: Callable[[], None] | None = None) -> list[TrajectoryGroup]:
        """B valid groups trainable at ``version``; ``wait`` is called while blocked (default: sleep)."""
        groups: list[TrajectoryGroup] = []
        entries: list[SpoolEntry] = []
        deadline = time.monotonic() + self.timeout_s
        while len(groups) < self.batch_size:
            fresh = self._eligible(version)[: self.batch_size - len(groups)]
            for entry in self.spool.claim(fresh):
                group = self.spool.load(entry)
                if group is None:
                    self.ledger.record_drop(entry.ticket, "quarantined")
                    self.dropped["quarantined"] += 1
                    continue
                groups.append(group)
                entries.append(entry)
            if len(groups) < self.batch_size:
                if time.monotonic() > deadline:
                    raise BatchTimeout(f"only {len(groups)} of {self.batch_size} groups arrived for version "
                                       f"{version} in {self.timeout_s:.0f}s: are the rollouts alive?")
                wait() if wait else time.sleep(self.poll_s)
        self._pending = entries
        return groups

    def _eligible(self, version: int) -> list[SpoolEntry]:
        out = []
        for entry in self.spool.ready():
            if entry.min_version < version - self.max_staleness:
                reason = f"stale: head version {entry.min_version} < {version} - {self.max_staleness}"
                self.spool.drop(entry, reason)
                self.ledger.record_drop(entry.ticket, reason)
                self.dropped["stale"] += 1
                log.warning("dropped ticket %d (%s)", entry.ticket, reason)
            else:
                out.append(entry)
        return out

    def commit(self, version: int) -> None:
        self.spool.mark_trained(self._pending, version)
        self._pending = []
