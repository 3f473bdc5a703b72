"""The global admission ledger: which prompt groups may be generated, and when.

Lifecycle and ordering rules (design.md §3.2):

* A rollout process asks :meth:`AdmissionLedger.try_admit` for the next
  ticket, passing the policy version of the weights it generates with. Ticket
  ``n`` is the file ``tickets/t<n>``, created exclusively (:func:`create_exclusive`), so
  any number of rollout processes on any number of nodes share one counter
  without locks, and tickets are contiguous from 0.
* The bound: a ticket, new or reissued, is handed out only while
  ``created - pending - dropped < (v + eta + 1) * B``, where ``created`` is
  the number of tickets created so far, ``pending`` the reissued tickets
  waiting for a taker, ``dropped`` the groups the trainer discarded (which
  would otherwise never arrive and stall the bound), ``v`` the generating
  version and ``eta`` the maximum staleness. Each term counts groups that
  will be trained: a waiting reissue frees the slot of the generation it
  replaces, and taking it fills the slot again. So regenerated work never
  exceeds what the trainer consumes by ``v + eta``, and a burst of reissues
  (a trainer restart, a dead rollout) is drained at the trainer's pace
  instead of going stale and being reissued again (a regeneration storm).
  Concurrent takers may overshoot by at most one ticket each.
* Ticket ``n`` maps deterministically to a dataset row: with ``m = n +
  offset``, epoch ``m // N``, position ``perm(seed, epoch)[m % N]``. The
  data order is reproducible, and the ledger on disk *is* the dataloader
  state: nothing to checkpoint. ``offset`` is 0 unless the run continues
  another run's data position (``meta.json``, written before any component
  starts: :mod:`hpcrl.init_from`).
* The trainer records a dropped group with :meth:`record_drop` (one file per
  ticket, created exclusively, so a repeated drop is counted once).
* A ticket whose work was lost (its rollout died, or its trajectories came
  from a policy version lost in a trainer restart) is *reissued*:
  :meth:`reissue` creates ``reissue/t<n>``, and the next :meth:`try_admit`
  of any rollout takes it by renaming it to ``reissue/t<n>.taken-<writer>``
  (one rename succeeds, so exactly one rollout regenerates it). Reissues are
  taken before new tickets, under the same bound.
* Only the current holder of a ticket (:meth:`holder`: its creator, or the
  latest taker of its reissue) changes its outcome: the trainer records a
  drop or a reissue for a file only when the file's writer holds the ticket
  and the ticket has no outcome yet (``hpcrl.trainer.feed``).
* A rollout's ledger has a space floor (``launch.min_free_gb``,
  :class:`hpcrl.fs.space.SpaceFloor`): below it ``try_admit`` starts nothing.
* Every state-changing call checks the ownership fence first
  (:class:`hpcrl.runtime.owner.Fence`): a component of a replaced owner
  cannot change the ledger. Records carry the writer's owner epoch.
* ``meta.json`` records the dataset size, seed and offset, so tools (the audit) map
  tickets to dataset positions without the dataset.

Cost, flat in the run's length (``scripts/bench_fs.py``): ``try_admit``
reads ``dropped.count`` and lists ``reissue/`` on every call (never cached in
the process: a cached count could miss a drop and stall the bound), and
finds ``created`` by galloping forward from the last ticket it saw (O(log
gap) lookups). ``dropped.count`` is rewritten by the one process that records
drops (the trainer) after each record it creates and recounted at its start,
so it can lag the records after a crash, never lead them; a count that is not
the one this trainer wrote (a fenced-off trainer's) is recounted at its next
drop record or checkpoint (:meth:`check_drop_count`).
Retention: :meth:`compact_reissues` folds taken reissue files of finished
tickets into ``reissue.jsonl``, so ``reissue/`` holds only live ones.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from hpcrl.fs import atomic
from hpcrl.admission.config import AdmissionConfig
from hpcrl.runtime.owner import Fence, NoFence
from hpcrl.fs.faults import guarded
from hpcrl.fs.space import SpaceFloor

log = logging.getLogger(__name__)
DROP_COUNT = "dropped.count"  # the number of drop records, for the bound (num_dropped)
TMP_DIR = "tmp"  # records being written before they are linked into tickets/, reissue/, dropped/


def create_exclusive(path: Path, record: dict) -> bool:
    """Create ``path`` holding ``record`` (+ time) unless it exists; True if this call created it.

    Exactly one of any number of concurrent creators wins, and the record is whole before it appears
    (:func:`hpcrl.fs.atomic.create_exclusive`: written and fsynced in the ledger's ``tmp/``, then linked).
    """
    data = json.dumps({**record, "time": time.time()}).encode()
    return atomic.create_exclusive(path, data, path.parent.parent / TMP_DIR)


def incarnation(writer: str, restarts: int) -> str:
    """The writer id of a job instance that Slurm has requeued ``restarts`` times (``SLURM_RESTART_COUNT``:
    preemption with ``PreemptMode=REQUEUE`` runs the same job again, with the same instance id): each run of
    the job writes as its own writer, so a run never inherits the tickets of the one before."""
    return f"{writer}q{restarts}" if restarts else writer


def _requeue_of(w: str, writer: str) -> bool:
    return w.startswith(f"{writer}q") and w[len(writer) + 1:].isdigit()


@dataclass(frozen=True)
class Ticket:
    index: int  # global ticket number
    epoch: int  # pass over the dataset
    row: int  # dataset row this ticket generates from


class AdmissionLedger:
    def __init__(self, root: str | Path, cfg: AdmissionConfig, num_rows: int, seed: int = 0,
                 fence: Fence | NoFence | None = None, floor: SpaceFloor | None = None) -> None:
        if num_rows < 1:
            raise ValueError("num_rows: the training dataset is empty")
        self.root = Path(root)
        self.cfg = cfg
        self.num_rows = num_rows
        self.seed = seed
        self.tickets_dir = self.root / "tickets"
        self.dropped_dir = self.root / "dropped"
        self.reissue_dir = self.root / "reissue"
        for d in (self.tickets_dir, self.dropped_dir, self.reissue_dir, self.root / TMP_DIR):
            d.mkdir(parents=True, exist_ok=True)
        self._cursor = 0
        self._drops: int | None = None  # drop records, as this process last counted them (record_drop)
        self.recounts = 0  # times check_drop_count found records this process did not make (a fenced-off trainer's)
        self._refused: tuple[int, float] | None = None  # (version, monotonic time) of the last refusal at the bound
        self._perms: dict[int, np.ndarray] = {}
        self.fence = fence or NoFence()
        self.floor = floor  # below it no new group is started (a rollout's ledger; launch.min_free_gb)
        meta = self.root / "meta.json"
        self.offset = 0  # a run started from another run's data position (``init.restore: [data]``)
        if meta.exists():
            self.offset = int(atomic.read_json(meta).get("offset", 0))
        elif num_rows > 1:  # num_rows=1: a tool that needs no dataset mapping
            atomic.write_json(meta, {"num_rows": num_rows, "seed": seed})

    def _record(self, **fields) -> dict:
        return {**fields, "epoch": self.fence.epoch}

    # -- the bound -------------------------------------------------------
    def limit(self, version: int, pending: list[int] | None = None) -> int:
        """``created`` may grow up to this while generating with ``version`` (see the bound above);
        ``pending``: the waiting reissues, if the caller listed them already."""
        pending = self.pending_reissues() if pending is None else pending
        return (version + self.cfg.max_staleness + 1) * self.cfg.batch_size + self.num_dropped() + len(pending)

    def _exists(self, index: int) -> bool:
        return os.path.exists(self.tickets_dir / f"t{index:09d}")

    def num_created(self) -> int:
        """Tickets created so far. They are contiguous from 0 (ticket k+1 is created only by a writer that saw
        ticket k exist), so the first missing one is found by galloping forward from the last one seen and
        bisecting: O(log gap) lookups instead of one per ticket the other writers created meanwhile."""
        lo = self._cursor  # every ticket below lo exists
        if not self._exists(lo):
            return lo
        step = 1
        while self._exists(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step  # ticket lo exists, ticket hi did not when probed
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._exists(mid) else (lo, mid)
        self._cursor = hi
        return hi

    def try_admit(self, version: int, writer: str) -> Ticket | None:
        """A reissued ticket if any, else the next new ticket, if the bound allows one; else None. After a
        refusal, asking again at the same version within ``admission.recheck_s`` is refused without a look."""
        if self._refused is not None and self._refused[0] == version and \
                time.monotonic() - self._refused[1] < self.cfg.recheck_s:
            return None  # refused at this version a moment ago: the filesystem is not asked again yet
        self.fence.check("admission")
        if self.floor is not None and not self.floor.ok():
            return None  # the run directory's filesystem is below launch.min_free_gb: nothing new is started
        pending = self.pending_reissues()  # listed once: for the bound and for taking one
        limit = self.limit(version, pending)
        if self.num_created() >= limit:
            self._refused = (version, time.monotonic())
            return None
        self._refused = None
        reissued = self._take_reissued(writer, pending)
        if reissued is not None:
            return reissued
        while self._cursor < limit:
            index = self._cursor
            won = create_exclusive(self.tickets_dir / f"t{index:09d}", self._record(writer=writer, version=version))
            self._cursor = index + 1  # after the create: a create that raised leaves no hole behind the cursor
            if won:
                return self.ticket(index)
        return None

    def reissue(self, index: int, reason: str) -> None:
        """Hand ticket ``index`` out again (idempotent while it waits)."""
        self.fence.check("reissue")
        create_exclusive(self.reissue_dir / f"t{index:09d}", self._record(reason=reason))

    def admitted(self, index: int) -> bool:
        """Whether ticket ``index`` was created. Tickets are contiguous from 0 (:meth:`num_created`), so one found
        answers for every ticket below it without a look (the trainer asks first for the newest ticket of a pass,
        then for each file it claims)."""
        if index < self._cursor:
            return True
        if self._exists(index):
            self._cursor = index + 1
            return True
        return False

    def is_dropped(self, index: int) -> bool:
        return os.path.exists(self.dropped_dir / f"t{index:09d}")

    def reissue_pending(self, index: int) -> bool:
        return os.path.exists(self.reissue_dir / f"t{index:09d}")

    def holder(self, index: int) -> str | None:
        """The writer that owns ticket ``index``'s generation now (None: never admitted)."""
        prefix = f"t{index:09d}.taken-"
        taken = [n[len(prefix):] for n in os.listdir(self.reissue_dir) if n.startswith(prefix)]
        if taken:
            return max(taken, key=lambda rest: int(rest.rsplit("-", 1)[1])).rsplit("-", 1)[0]
        try:
            return json.loads((self.tickets_dir / f"t{index:09d}").read_text() or "{}").get("writer", "")
        except FileNotFoundError:
            return None
        except json.JSONDecodeError:  # being written by its creator right now
            return ""

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

    def reclaim(self, writer: str, finished: set[int], incarnations: bool = False) -> list[int]:
        """Reissue every ticket ``writer`` (a dead rollout) held and did not finish; returns them. With
        ``incarnations``, also those of the writers Slurm's requeues of the same job ran as
        (:func:`incarnation`: ``<writer>q<N>``)."""
        waiting = set(self.pending_reissues())
        done = finished | set(self.dropped()) | waiting
        lost = sorted(n for n, w in self.holders().items()
                      if (w == writer or (incarnations and _requeue_of(w, writer))) and n not in done)
        for n in lost:
            self.reissue(n, f"rollout {writer} died holding it")
        return lost

    def _take_reissued(self, writer: str, pending: list[int]) -> Ticket | None:
        for index in pending:
            src = self.reissue_dir / f"t{index:09d}"
            try:
                os.rename(src, self.reissue_dir / f"t{index:09d}.taken-{writer}-{time.time_ns()}")
            except FileNotFoundError:
                continue  # another rollout took it first
            return self.ticket(index)
        return None

    def ticket(self, index: int) -> Ticket:
        epoch, pos = divmod(index + self.offset, self.num_rows)
        return Ticket(index=index, epoch=epoch, row=int(self._perm(epoch)[pos]))

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        return self._perms[epoch]

    # -- accounting --------------------------------------------------------
    def num_admitted(self) -> int:
        return sum(1 for n in os.listdir(self.tickets_dir) if n.startswith("t"))

    def num_dropped(self) -> int:
        """Drop records so far, as the bound counts them: ``dropped.count`` (one small read, whatever the run's
        length), which the one process recording drops (the trainer) rewrites after each record it creates.
        It may lag the records by the ones a crash cut off (never ahead: records are never removed), which only
        tightens the bound until the trainer's next start recounts (:meth:`sync_drop_count`). A ledger from
        before the count file is counted by listing ``dropped/``."""
        written = self._read_drop_count()
        return self.count_drop_records() if written is None else written

    def _read_drop_count(self) -> int | None:
        try:
            with open(self.root / DROP_COUNT) as f:
                return int(f.read())
        except (FileNotFoundError, ValueError):
            return None

    def drop_records(self) -> set[int]:
        """The tickets with a drop record, listed (O(drops), names only): the trainer's feed, at its first check
        and again after a recount (:meth:`check_drop_count`)."""
        return {int(n[1:]) for n in os.listdir(self.dropped_dir) if n.startswith("t") and n[1:].isdigit()}

    def count_drop_records(self) -> int:
        """The drop records in ``dropped/``, listed (O(drops)): for a start and for tools, not per ticket."""
        return sum(1 for n in os.listdir(self.dropped_dir) if n.startswith("t") and n[1:].isdigit())

    def sync_drop_count(self) -> int:
        """Count the drop records and write ``dropped.count``: the trainer's rank 0 at every start (its count
        then follows its own records)."""
        self.fence.check("drop count")
        self._drops = self.count_drop_records()
        self._write_drop_count()
        return self._drops

    def check_drop_count(self) -> None:
        """Recount if ``dropped.count`` is not what this process last wrote (one read): a fenced-off trainer
        that wrote its own count after this one took over. Before each drop record and at each checkpoint,
        so such a lag lasts at most until then."""
        if self._drops is None:
            return
        written = self._read_drop_count()
        if written != self._drops:
            log.warning("dropped.count read %s, this trainer wrote %d: recounting the drop records", written,
                        self._drops)
            self.sync_drop_count()
            self.recounts += 1

    def _write_drop_count(self) -> None:
        # atomic (rename over it), not fsynced: a count lost in a crash is recounted at the next start
        tmp = atomic.temporary_name(self.root / DROP_COUNT)
        try:
            with guarded("drop count write", tmp), open(tmp, "w") as f:
                f.write(str(self._drops))
            os.replace(tmp, self.root / DROP_COUNT)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def record_drop(self, index: int, reason: str) -> bool:
        """Record that ticket ``index`` will never be trained (idempotent); False (and nothing recorded)
        for a ticket that was never admitted: a made-up ticket must not loosen the bound."""
        self.fence.check("drop record")
        if not self.admitted(index):
            log.warning("not recording a drop for ticket %d: it was never admitted (%s)", index, reason)
            return False
        self.check_drop_count()
        if not create_exclusive(self.dropped_dir / f"t{index:09d}", self._record(reason=reason)):
            return False
        if self._drops is None:  # the first record of this process: count what earlier processes recorded
            self._drops = self.count_drop_records()
        else:
            self._drops += 1
        self._write_drop_count()  # after the record: the count never runs ahead of the records
        return True

    def compact_reissues(self, finished: Callable[[int], bool]) -> int:
        """Fold taken reissue files of finished tickets (trained or dropped: ``finished(ticket)``) into
        ``reissue.jsonl``; returns how many. Pending reissues and those of unfinished tickets stay: they name
        holders. Costs a listing of ``reissue/`` and one check per taken file, not per ticket of the run."""
        self.fence.check("reissue compaction")
        done = [n for n in os.listdir(self.reissue_dir)
                if ".taken-" in n and n[1:10].isdigit() and finished(int(n[1:10]))]
        if not done:
            return 0
        with open(self.root / "reissue.jsonl", "a") as f:
            for name in done:
                ticket, rest = name.split(".taken-", 1)
                try:
                    record = json.loads((self.reissue_dir / name).read_text() or "{}")
                except (FileNotFoundError, json.JSONDecodeError):
                    record = {}
                f.write(json.dumps({**record, "ticket": int(ticket[1:]), "taker": rest.rsplit("-", 1)[0]}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for name in done:  # after the fsync: a crash in between leaves a line twice, never a loss
            (self.reissue_dir / name).unlink(missing_ok=True)
        return len(done)

    def num_reissued(self) -> int:
        """Reissue events so far: waiting, taken, and compacted ones."""
        try:
            with open(self.root / "reissue.jsonl") as f:
                compacted = sum(1 for _ in f)
        except FileNotFoundError:
            compacted = 0
        return compacted + sum(1 for n in os.listdir(self.reissue_dir) if n.startswith("t"))

    def dropped(self) -> dict[int, str]:
        out = {}
        for p in self.dropped_dir.iterdir():
            if p.name.startswith("t") and p.name[1:].isdigit():
                out[int(p.name[1:])] = json.loads(p.read_text() or "{}").get("reason", "")
        return out
