"""The trainer's side of the spool: take the next batch of B prompt groups.

Ordering rules (rank 0 only):

* A ready file whose oldest token (head version, in its name) is more than
  ``max_staleness`` versions behind the current trainer version is never
  trained: it is set aside in ``spool/dropped/`` (reason ``stale``) and its
  ticket is reissued, so the prompt group is generated again, fresh.
* Eligible files are taken oldest first (by head version, then ticket), by
  rename into ``claimed/``; a file that fails validation is quarantined by
  the spool and recorded as dropped in the ledger; taking continues until B
  valid groups are in hand.
* With DAPO dynamic sampling (``keep`` given), a claimed group that ``keep``
  rejects (all rewards equal) is dropped with the reason ``uniform`` and
  recorded in the ledger, so admission lets a replacement in; taking goes on
  until B kept groups are in hand.
* A ready file with tokens newer than the trainer's version came from a
  policy lost when the trainer restarted from a checkpoint: it is set aside
  and its ticket reissued (see :mod:`hpcrl.ckpt.reconcile`).
* After the step, :meth:`BatchFeed.commit` moves the claimed files into
  ``trained/step_<v>/`` where ``v`` is the version that trained them.

Loading is not overlapped with training on purpose: B files take ~5-7 ms
to claim, read and commit (``scripts/bench_spool.py``), 1-2 % of a step,
while claiming the next batch during step ``v`` would select it against
``v`` instead of the version that trains it (``v + 1``: a file can turn
stale in between), and much of a file's read cost is Python (h5py's
wrappers, validation) holding the GIL, so a loader thread would compete with
the training loop rather than overlap it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from hpcrl.admission.ledger import AdmissionLedger
from hpcrl.ckpt.reconcile import reissue_lost
from hpcrl.spool.format import TrajectoryGroup
from hpcrl.spool.store import Spool, SpoolEntry

log = logging.getLogger(__name__)


class BatchTimeout(RuntimeError):
    """No full batch arrived within ``trainer.batch_timeout_s``."""


class BatchFeed:
    def __init__(self, spool: Spool, ledger: AdmissionLedger, batch_size: int, max_staleness: int,
                 timeout_s: float = 600.0, poll_s: float = 0.01,
                 keep: Callable[[TrajectoryGroup], bool] | None = None) -> None:
        self.spool, self.ledger = spool, ledger
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._pending: list[SpoolEntry] = []
        self.keep = keep  # dynamic sampling: groups it rejects are dropped as "uniform"
        self.dropped = {"stale": 0, "quarantined": 0, **({"uniform": 0} if keep else {})}

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
                if self.keep is not None and not self.keep(group):
                    self.spool.drop(entry, "uniform")
                    self.ledger.record_drop(entry.ticket, "uniform")
                    self.dropped["uniform"] = self.dropped.get("uniform", 0) + 1
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
            if entry.max_version > version:  # from a policy lost in a trainer restart: generate it again
                reissue_lost(self.spool, self.ledger, entry, version)
                self.dropped["lost_policy"] = self.dropped.get("lost_policy", 0) + 1
            elif entry.min_version < version - self.max_staleness:
                reason = f"stale: head version {entry.min_version} < {version} - {self.max_staleness}; regenerated"
                self.spool.drop(entry, reason)
                self.ledger.reissue(entry.ticket, reason)
                self.dropped["stale"] += 1
                log.warning("set aside ticket %d (%s)", entry.ticket, reason)
            else:
                out.append(entry)
        return out

    def commit(self, version: int) -> None:
        self.spool.mark_trained(self._pending, version)
        self._pending = []
