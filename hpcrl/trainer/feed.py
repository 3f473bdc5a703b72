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
* With ``mark_taken`` (not in colocated mode), once the batch is complete
  (never while it is assembled) ``spool/taken`` says so
  (:mod:`hpcrl.spool.taken`; :meth:`BatchFeed.start` writes the version
  before the first one), so rollouts park rather than publish a group that
  batch leaves stale.
* A ready file with tokens newer than the trainer's version came from a
  policy lost when the trainer restarted from a checkpoint: it is set aside
  and its ticket reissued (see :mod:`hpcrl.trainer.reconcile`).
* After the step, :meth:`BatchFeed.commit` moves the claimed files into
  ``trained/step_<v>/`` where ``v`` is the version that trained them; claims
  and commits are renames only, made durable by :meth:`BatchFeed.sync`
  before a checkpoint covers them (resume releases the rest anyway).
* Only admitted work is trained (design.md §4.8): every claimed file is checked
  against the ledger before it joins the batch (:meth:`BatchFeed.verdict`:
  its ticket was admitted, the dataset position in the file is the ticket's,
  the ticket is neither trained nor dropped nor already in this batch; the
  drop records are listed once and then followed through the feed's own,
  since the trainer is the only process that records drops while it runs).
  Anything else is quarantined with the reason. A file changes the ledger
  (a drop record, a reissue) only when its writer is the ticket's current
  holder and the ticket has no outcome yet (:meth:`BatchFeed.owns_outcome`),
  so a foreign or duplicate file can never mark a real ticket dropped or
  regenerate a made-up one. Stale and lost-policy files are opened and
  checked the same way before their ticket is reissued.

Claiming is not overlapped with training on purpose: claiming the next
batch during step ``v`` would select it against ``v`` instead of the version
that trains it (``v + 1``: a file can turn stale in between). Reading is:
with ``trainer.read_ahead`` (default on) a :class:`~hpcrl.spool.readahead.ReadAhead`
parses the ready files during the step and while the batch waits for
groups, deciding nothing, and the claim takes its parse when the claimed
file is the one it read. While fewer eligible files are there than the
batch needs, a pass claims only the oldest ones the read-ahead has parsed
(they still leave ``ready/`` once parsed, so a group dropped at its
claim frees its admission slot within a look or two) and, once its claims
are made, names the rest it listed to the read-ahead, which parses them at
once (:meth:`ReadAhead.kick`); the pass that can complete the
batch holds the read-ahead and claims all it needs, reading what was not
parsed yet. A ``wait`` that counts the groups published (the colocated loop,
whose generation runs in this thread) has the spool looked at only once
enough arrived to complete the batch (see :meth:`BatchFeed.next_batch`).
``spool_s`` is the
time the last :meth:`BatchFeed.next_batch` spent on the spool and the ledger
(claims, reads, checks; its waits for rollouts left out); :meth:`BatchFeed.step_report`
adds what the read-ahead did meanwhile.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Callable

from hpcrl.admission.ledger import AdmissionLedger
from hpcrl.fs.faults import StorageError
from hpcrl.fs.space import SpaceFloor
from hpcrl.spool.format import TrajectoryGroup, read_group
from hpcrl.spool.readahead import ReadAhead
from hpcrl.spool.store import Spool, SpoolEntry
from hpcrl.spool.taken import TakenMark

log = logging.getLogger(__name__)


def lost_policy_reason(entry: SpoolEntry, version: int) -> str:
    return f"lost policy: tokens up to version {entry.max_version} > trainer version {version}; ticket reissued"


class BatchTimeout(RuntimeError):
    """No full batch arrived within ``trainer.batch_timeout_s``."""


def _no_room(floor: SpaceFloor, version: int, timeout_s: float) -> StorageError:
    cause = OSError(errno.ENOSPC, f"no batch for version {version} in {timeout_s:.0f}s while the filesystem is "
                    "below launch.min_free_gb: the rollouts wait for storage", str(floor.path))
    return StorageError("waiting for a batch", floor.path, cause)


class BatchFeed:
    def __init__(self, spool: Spool, ledger: AdmissionLedger, batch_size: int, max_staleness: int,
                 timeout_s: float = 600.0, poll_s: float = 0.01, relook_s: float = 0.1,
                 keep: Callable[[TrajectoryGroup], bool] | None = None, read_ahead: bool = False,
                 mark_taken: bool = False) -> None:
        self.spool, self.ledger = spool, ledger
        # files parsed during the step, up to four batches ahead (more are rarely trainable before they go stale)
        self.ahead = ReadAhead(spool.ready_dir, 4 * batch_size) if read_ahead else None
        self._read = self.ahead.read if self.ahead is not None else read_group
        self.spool_s = 0.0  # the last next_batch's time on the spool and the ledger, waits left out
        self.spool_tail_s = 0.0  # of it, the pass that completed the batch (the rest overlapped the rollouts' work)
        self._ahead_seen = (0.0, 0, 0, 0)  # the read-ahead's (busy_s, hits, misses, offered) at the last step_report
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.timeout_s, self.poll_s, self.relook_s = timeout_s, poll_s, relook_s
        self._pending: list[SpoolEntry] = []
        self.keep = keep  # dynamic sampling: groups it rejects are dropped as "uniform"
        self.dropped = {"stale": 0, "quarantined": 0, **({"uniform": 0} if keep else {})}
        self._trained: set[int] | None = None  # tickets in trained/, read on first use (after reconcile)
        # tickets with a drop record: listed on first use, then followed through this feed's own records (while a
        # trainer runs it is the only process that records drops, as it is for the ledger's drop count)
        self._drop_records: set[int] | None = None
        self._recounts_seen = 0  # the ledger's recounts when they were listed: a recount lists them again
        self._relisted = False  # listed again at the first checkpoint (retain)
        self._batch: set[int] = set()  # tickets of the batch being assembled
        # tells the rollouts which batch is in hand (not in colocated mode, whose rollout generates while it waits)
        self.taken = TakenMark(spool.root) if mark_taken else None

    @property
    def trained(self) -> set[int]:
        if self._trained is None:
            self._trained = {e.ticket for entries in self.spool.trained().values() for e in entries}
        return self._trained

    @property
    def drop_records(self) -> set[int]:
        if self._drop_records is None or self._recounts_seen != self.ledger.recounts:
            # a recount means records this feed did not make (a fenced-off trainer's, in the window before its fence
            # check stopped it): listed again
            self._recounts_seen, self._drop_records = self.ledger.recounts, self.ledger.drop_records()
        return self._drop_records

    def record_drop(self, ticket: int, reason: str) -> None:
        """Record ticket ``ticket`` dropped in the ledger (nothing for a ticket never admitted) and follow it."""
        if self.ledger.record_drop(ticket, reason) or self.ledger.admitted(ticket):
            self.drop_records.add(ticket)

    def verdict(self, entry: SpoolEntry, group: TrajectoryGroup | None = None) -> str | None:
        """Why this file must not be trained (None: it may be). With ``group``, its content is checked too."""
        n = entry.ticket
        if not self.ledger.admitted(n):
            return f"ticket {n} was never admitted"
        if n in self.trained or n in self._batch:
            return f"ticket {n} is trained already (a duplicate)"
        if n in self.drop_records:
            return f"ticket {n} is recorded as dropped"
        if group is not None:
            want = self.ledger.ticket(n)
            got = (group.meta.get("epoch"), group.meta.get("row"))
            if got != (want.epoch, want.row):
                return (f"dataset position (epoch, row)={got} is not ticket {n}'s "
                        f"({want.epoch}, {want.row})")
        return None

    def owns_outcome(self, entry: SpoolEntry) -> bool:
        """Whether this file may change its ticket's ledger state: admitted, no outcome yet, not waiting
        for a reissue, and written by the ticket's current holder."""
        n = entry.ticket
        return (self.verdict(entry) is None and not self.ledger.reissue_pending(n)
                and self.ledger.holder(n) == entry.writer)

    def quarantine(self, entry: SpoolEntry, reason: str) -> None:
        """Set a file aside as invalid; its ticket is recorded dropped only if the file owned its outcome."""
        owned = self.owns_outcome(entry)
        if entry.path.exists():
            self.spool.quarantine(entry, reason)
        log.warning("quarantined %s: %s%s", entry.name, reason, "; ticket dropped" if owned else "")
        if owned:
            self.record_drop(entry.ticket, f"quarantined: {reason}")
        self.dropped["quarantined"] += 1

    def regenerate(self, entry: SpoolEntry, kind: str, reason: str) -> None:
        """Set aside a valid file that can no longer be trained (stale, lost policy) and reissue its
        ticket, after the same checks as a trainable file; a file that fails them is quarantined."""
        group = self.spool.load(entry, self._read)  # a corrupt file is quarantined here
        if group is None:
            if self.owns_outcome(entry):
                self.record_drop(entry.ticket, "quarantined: unreadable")
            self.dropped["quarantined"] += 1
            return
        why = self.verdict(entry, group)
        if why is None and not self.owns_outcome(entry):
            why = f"written by {entry.writer}, not by the current holder of ticket {entry.ticket}"
        if why is not None:
            self.quarantine(entry, f"{kind} file not regenerated: {why}")
            return
        self.spool.drop(entry, reason)
        self.ledger.reissue(entry.ticket, reason)
        self.dropped[kind] = self.dropped.get(kind, 0) + 1
        log.warning("set aside ticket %d (%s)", entry.ticket, reason)

    def next_batch(self, version: int, wait: Callable[[], int | None] | None = None) -> list[TrajectoryGroup]:
        """B valid groups trainable at ``version``; ``wait`` is called while blocked (default: sleep). ``wait`` may
        return how many groups were published since its last call as far as it knows (the colocated loop publishes
        its own): the spool is then looked at again once that many arrived as could complete the batch (with
        ``keep``, at every arrival: a group it rejects frees its admission slot at its claim), and at the latest
        every ``relook_s``. A ``wait`` returning None (or no ``wait``) has the spool looked at after each call."""
        groups: list[TrajectoryGroup] = []
        entries: list[SpoolEntry] = []
        start = time.monotonic()
        deadline, waited, news, look_at, last_pass = start + self.timeout_s, 0.0, None, 0.0, 0.0
        arrived, short = 0, 1  # groups published since the last pass, and how many it takes to complete the batch
        self._batch = set()
        while len(groups) < self.batch_size:
            if news is None or arrived >= short or time.monotonic() >= look_at:
                look_at = t_pass = time.monotonic()
                look_at += self.relook_s
                eligible = self._eligible(version)
                chosen = self._to_take(eligible, self.batch_size - len(groups))
                self._take(chosen, groups, entries)
                arrived, left = 0, len(eligible) - len(chosen)
                short = 1 if self.keep is not None else max(self.batch_size - len(groups) - left, 1)
                if self.ahead is not None and len(groups) < self.batch_size:
                    # still waiting (rejected groups, or too few yet): it reads on meanwhile, first what this pass
                    # saw and it had not parsed (once the claims are made: out of their way)
                    self.ahead.kick([e.name for e in eligible[len(chosen):] if not self.ahead.has(e.name)])
                last_pass = time.monotonic() - t_pass
            if len(groups) < self.batch_size:
                if time.monotonic() > deadline:
                    self._below_floor(version)
                    raise BatchTimeout(f"only {len(groups)} of {self.batch_size} groups arrived for version "
                                       f"{version} in {self.timeout_s:.0f}s: are the rollouts alive?")
                t = time.monotonic()
                news = wait() if wait else time.sleep(self.poll_s)
                waited += time.monotonic() - t
                arrived += news or 0
        self._pending = entries
        if self.taken is not None:  # the groups this batch leaves stale are parked, not published
            self.taken.write(version)
        if self.ahead is not None:
            self.ahead.kick()  # the next batch's files are read while this one trains
        self.spool_s = time.monotonic() - start - waited
        self.spool_tail_s = last_pass  # the pass that completed the batch: what the step waited for once it could
        return groups

    def _to_take(self, eligible: list[SpoolEntry], need: int) -> list[SpoolEntry]:
        """What this pass claims of ``eligible`` (oldest first). With ``need`` files there the batch can be completed:
        they are claimed now, the read-ahead held out of the way and what it has not parsed read here. With fewer,
        only the oldest it has parsed already: the rest are left to it while the batch waits (it keeps reading
        during the wait), so the loop reads only what completes the batch, and a group dropped or quarantined at
        its claim still frees its admission slot as soon as it is parsed."""
        if self.ahead is None or len(eligible) >= need:
            if self.ahead is not None and eligible:
                self.ahead.hold()
            return eligible[:need]
        n = 0
        while n < len(eligible) and self.ahead.has(eligible[n].name):
            n += 1
        return eligible[:n]

    def start(self, version: int) -> None:
        """The trainer starts (or resumed) at ``version``: the rollouts are told no batch of it is in hand yet
        (:mod:`hpcrl.spool.taken`; before the run directory is reconciled, so no mark a rewound trainer left parks
        what this one can train)."""
        if self.taken is not None:
            self.taken.write(version - 1)

    def start_reading(self) -> None:
        """Start parsing ready files now (after resume: the first batch's, while the trainer starts up); a no-op
        without the read-ahead. :meth:`next_batch` holds it in the pass that completes the batch."""
        if self.ahead is not None:
            self.ahead.kick()

    def step_report(self) -> tuple[dict[str, float], dict[str, float]]:
        """The last batch's timings (``spool``: its time on the spool and the ledger, waits left out; ``spool_tail``:
        of it, the pass that completed the batch, the rest having happened while the batch waited for groups not
        generated yet; with the read-ahead, ``read_ahead``: the worker's seconds since the last report, off the
        loop) and counts
        (``spool/read_ahead_hits``, ``spool/read_ahead_misses``: files handed over / read at the claim;
        ``spool/read_ahead_offered``: groups handed over by their writer in this process, colocated mode)."""
        if self.ahead is None:
            return {"spool": self.spool_s, "spool_tail": self.spool_tail_s}, {}
        now = (self.ahead.busy_s, self.ahead.hits, self.ahead.misses, self.ahead.offered)
        last, self._ahead_seen = self._ahead_seen, now
        return ({"spool": self.spool_s, "spool_tail": self.spool_tail_s, "read_ahead": now[0] - last[0]},
                {"spool/read_ahead_hits": now[1] - last[1], "spool/read_ahead_misses": now[2] - last[2],
                 "spool/read_ahead_offered": now[3] - last[3]})

    def _below_floor(self, version: int) -> None:
        """A batch that does not come while the run directory's filesystem is below its floor is a storage fault
        (the trainer then stops with exit 74 and restarts once there is room), not a dead rollout."""
        floor = self.ledger.floor
        if floor is not None and not floor.ok():
            raise _no_room(floor, version, self.timeout_s)

    def close(self) -> None:
        """Stop the read-ahead's worker (the trainer's exit)."""
        if self.ahead is not None:
            self.ahead.close()

    def _take(self, fresh: list[SpoolEntry], groups: list[TrajectoryGroup], entries: list[SpoolEntry]) -> None:
        """Claim ``fresh`` and add the valid, kept groups to the batch; quarantine or drop the rest."""
        if fresh:  # tickets are contiguous: one found answers for all below it (one look, not one per file)
            self.ledger.admitted(max(e.ticket for e in fresh))
        for entry in self.spool.claim(fresh) if fresh else ():
            group = self.spool.load(entry, self._read)  # a corrupt file is quarantined here
            if group is None:
                if self.owns_outcome(entry):  # asked only now: it reads the ledger, not the file
                    self.record_drop(entry.ticket, "quarantined")
                self.dropped["quarantined"] += 1
                continue
            why = self.verdict(entry, group)
            if why is not None:
                self.quarantine(entry, why)
                continue
            if self.keep is not None and not self.keep(group):
                self.spool.drop(entry, "uniform")
                self.record_drop(entry.ticket, "uniform")
                self.dropped["uniform"] = self.dropped.get("uniform", 0) + 1
                continue
            groups.append(group)
            entries.append(entry)
            self._batch.add(entry.ticket)

    def _eligible(self, version: int) -> list[SpoolEntry]:
        out = []
        for entry in self.spool.ready():
            if entry.max_version > version:  # from a policy lost in a trainer restart: generate it again
                self.regenerate(entry, "lost_policy", lost_policy_reason(entry, version))
            elif entry.min_version < version - self.max_staleness:
                self.regenerate(entry, "stale", f"stale: head version {entry.min_version} < {version} - "
                                                f"{self.max_staleness}; regenerated")
            else:
                out.append(entry)
        return out

    def retain(self, keep_dropped_files: int) -> dict[str, int]:
        """Retention (after a checkpoint): prune old set-aside data, compact finished tickets' reissues; its cost
        follows what changed since the last checkpoint, not the run's length. The first one after this feed
        started also lists the drop records again (names only, once): a fenced-off trainer's record whose count
        this trainer overwrote in the same moment fires no recount, and such a trainer writes, if at all, around
        the takeover (unless it was paused between its fence check and its record)."""
        finished = lambda n: n in self.trained or self.ledger.is_dropped(n)  # noqa: E731
        self.ledger.check_drop_count()
        if not self._relisted:
            self._drop_records, self._relisted = None, True
        return {"dropped_data_pruned": self.spool.prune_set_aside(keep_dropped_files),
                "reissues_compacted": self.ledger.compact_reissues(finished)}

    def sync(self) -> None:
        """Make the claims and commits so far durable (before a checkpoint covers them; :meth:`Spool.sync`)."""
        self.spool.sync()

    def commit(self, version: int) -> None:
        self.spool.mark_trained(self._pending, version)
        self.trained.update(e.ticket for e in self._pending)
        self._pending, self._batch = [], set()
