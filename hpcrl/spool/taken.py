"""The trainer's mark of the batch in hand: ``spool/taken``, one version number.

Why: a trainer at version ``v`` sets aside every ready file whose oldest token is more than ``eta`` versions behind
(:mod:`hpcrl.trainer.feed`). Once it has taken the batch that trains ``v``, its next batch is taken at ``v + 1`` or
later, so a group whose head is ``v - eta`` can no longer be trained: published, its file would only be listed,
opened, checked, set aside with a reason record and its ticket reissued, and the whole group generated again. A
rollout that knows the batch is in hand starts those episodes again before it publishes them
(:class:`~hpcrl.rollout.worker.RolloutWorker`), keeping the ticket and the group's other samples.

Lifecycle:

* The trainer (rank 0) writes ``v - 1`` when it starts at version ``v`` (nothing in hand yet; this also replaces
  a mark that a trainer rewound to an older checkpoint left too high), and ``v`` after each batch it has taken
  for version ``v`` (:meth:`TakenMark.write`; :meth:`~hpcrl.trainer.feed.BatchFeed.next_batch`), never while
  the batch is still being assembled: a group the open batch could still take is never given up.
* A rollout reads it (:meth:`TakenMark.read`) only when an episode that finished could be doomed by it, at most
  once per pass of its loop, and trusts it at most one version past its own weights.

It is a hint, never a decision: a mark that is missing, half written or unreadable reads as ``None`` (the rollout
then goes by its own weights alone, as without the mark), and a mark that is wrong only costs generation, since
the trainer still decides what is stale at its claim. So it is written with a rename but not fsynced, and the
fence is checked first (a replaced trainer's mark could only cost generation, but it writes nothing).
Cost: one small write and rename per trainer step; one read per rollout loop pass at most, only while an episode
it could doom finishes.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpcrl.atomic import TMP_MARK
from hpcrl.runtime.owner import Fence, NoFence

TAKEN = "taken"  # under the spool's root


class TakenMark:
    """``<spool>/taken``: the version whose batch the trainer has in hand (module docstring)."""

    def __init__(self, spool_root: str | Path, fence: Fence | NoFence | None = None) -> None:
        self.path = Path(spool_root) / TAKEN
        self.fence = fence or NoFence()
        self._tmp = Path(spool_root) / "tmp" / f"{TAKEN}{TMP_MARK}{os.getpid()}"

    def write(self, version: int) -> None:
        """The trainer has the batch that trains ``version`` (``version - 1`` at its start: none yet)."""
        self.fence.check("taken mark")
        self._tmp.write_text(f"{int(version)}\n")
        os.replace(self._tmp, self.path)

    def read(self) -> int | None:
        """The version whose batch the trainer has in hand; None when there is no readable mark."""
        try:
            return int(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None
