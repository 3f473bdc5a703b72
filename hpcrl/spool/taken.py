"""The trainer's mark of the batch in hand: ``spool/taken``, one version number.

Why: a trainer at version ``v`` sets aside every ready file whose oldest token is more than ``eta`` versions behind
(:mod:`hpcrl.trainer.feed`). Once it has taken the batch that trains ``v``, its next batch is taken at ``v + 1`` or
later, so a group whose head is ``v - eta`` can no longer be trained: published, its file would only be listed,
opened, checked, set aside with a reason record and its ticket reissued, and the whole group generated again. A
rollout that knows the batch is in hand parks such a group instead and generates it again at its next weights
(:class:`~hpcrl.rollout.worker.RolloutWorker`), keeping its ticket.

Lifecycle:

* The trainer (rank 0) writes ``v - 1`` when it starts at version ``v``, before it reconciles the run directory
  (nothing in hand yet; this also replaces a mark that a trainer rewound to an older checkpoint left too high), and
  ``v`` after each batch it has taken for version ``v`` (:meth:`TakenMark.write`;
  :meth:`~hpcrl.trainer.feed.BatchFeed.next_batch`), never while the batch is still being assembled: a group the
  open batch could still take is never given up. Colocated mode writes none: its rollout generates only while its
  trainer waits.
* A rollout reads it (:meth:`TakenMark.read`) only when a group completes whose head it could doom, at most once
  per pass of its loop, and trusts it at most one version past its own weights.

It is a hint, never a decision: a mark that is missing, torn or unreadable reads as ``None`` (the rollout then goes
by its own weights alone, as without the mark), a write that fails is logged and skipped, and a wrong mark only
costs generation, since the trainer still decides what is stale at its claim. So it is cheap: the value is written
twice, at a fixed width, over the file in place (one open, write and close, no rename, no fsync, no fence check: a
replaced trainer stops at its next spool move anyway), and a read whose two halves differ (a write seen half done)
is no mark. Unlike the spool's files it is not renamed into place (design.md's rule for files readers act on):
on NFS a client may go on reading its cached old value for a while after a rewrite (Lustre's locks do not allow
that). A mark seen late is lower than the truth, which parks less, except across a trainer's restart: a mark the
replaced trainer wrote after its last claim, or one read before the new trainer's start mark, can be too high, and
groups the new trainer could train are parked until the next weights (generation lost, nothing else).
A worker without a weight source never parks (nothing would release the group).
Cost: one small write per trainer step; one read per rollout loop pass at most, only while a group it could doom
completes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

TAKEN = "taken"  # under the spool's root


class TakenMark:
    """``<spool>/taken``: the version whose batch the trainer has in hand (module docstring)."""

    def __init__(self, spool_root: str | Path) -> None:
        self.path = Path(spool_root) / TAKEN

    def write(self, version: int) -> None:
        """The trainer has the batch that trains ``version`` (``version - 1`` at its start: none yet)."""
        value = f"{int(version):020d}"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, f"{value} {value}\n".encode(), 0)
            finally:
                os.close(fd)
        except OSError as e:  # a hint: the rollouts go by their own weights meanwhile
            log.warning("could not write %s (%s); rollouts will publish what they would have parked", self.path, e)

    def read(self) -> int | None:
        """The version whose batch the trainer has in hand; None when there is no whole, readable mark."""
        try:
            halves = self.path.read_text().split()
            return int(halves[0]) if len(halves) == 2 and halves[0] == halves[1] else None
        except (OSError, ValueError):
            return None
