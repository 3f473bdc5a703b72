"""The trainer's mark of the batch in hand (hpcrl.spool.taken): written by the feed, read by the rollout, which parks
a group that batch leaves stale instead of publishing it, and generates it again at the next weights."""

from __future__ import annotations

from pathlib import Path

from hpcrl.spool.format import read_group
from hpcrl.spool.store import Spool
from hpcrl.spool.taken import TakenMark
from hpcrl.trainer.feed import BatchFeed
from tests.test_episodes import Versions, make_worker
from tests.test_readahead import _ledger_and_groups


def test_the_mark_reads_what_the_trainer_wrote_and_nothing_when_missing_or_torn(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    mark = TakenMark(spool.root)
    assert mark.read() is None
    mark.write(-1)
    assert mark.read() == -1
    mark.write(7)
    assert mark.read() == 7 and not list(spool.tmp_dir.iterdir())
    mark.path.write_text("")  # a torn or foreign mark is no mark: the rollout goes by its own weights
    assert mark.read() is None


def test_the_feed_marks_its_start_and_a_batch_only_once_it_is_complete(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    ledger, groups = _ledger_and_groups(tmp_path, 2)
    feed = BatchFeed(spool, ledger, batch_size=2, max_staleness=4, timeout_s=5)
    mark = TakenMark(spool.root)
    feed.start(3)
    assert mark.read() == 2  # resumed at version 3: no batch of it in hand yet
    feed.start(0)
    spool.publish(groups[0])
    seen = []

    def wait() -> int:  # the batch is short of a group: the mark must not say it is taken yet
        seen.append(mark.read())
        spool.publish(groups[1])
        return 1

    assert [g.ticket for g in feed.next_batch(0, wait)] == [0, 1]
    assert seen == [-1] and mark.read() == 0


def test_a_group_the_taken_batch_leaves_stale_is_parked_and_generated_again_at_new_weights(tmp_path: Path) -> None:
    """eta = 0: groups generated under version 0 that complete after the trainer took the batch of version 0 could
    only be set aside. They are not published; at version 1 all their episodes start again, and the groups are
    published whole under version 1. The mark is read at most once per pass."""
    source, reads = {}, []
    taken = {"v": 0}

    def read_mark() -> int:
        reads.append(taken["v"])
        return taken["v"]

    worker, spool = make_worker(tmp_path, weights=lambda m: source.setdefault("v", Versions(m, 0)), taken=read_mark)
    pumps = 0
    while pumps < 200 and not (worker.groups and all(g.parked for g in worker.groups.values())):
        worker.pump()
        pumps += 1
    parked = sorted(worker.groups)
    assert parked == [0, 1] and not spool.ready(), "the two groups of version 0 were not parked"
    assert worker.stats.groups_published == 0 and 0 < len(reads) <= pumps
    for _ in range(5):  # parked, waiting for new weights: nothing is generated or published meanwhile
        worker.pump()
    assert not spool.ready() and worker.unfinished() == 0
    source["v"].latest = 1
    while worker.pump() or worker.unfinished():
        pass
    worker.close()
    groups = {g.ticket: g for g in (read_group(e.path) for e in spool.ready())}
    assert set(parked) <= set(groups) and worker.stats.samples_restarted == 3 * len(parked)
    for ticket in parked:  # every sample of a parked group was generated again under version 1
        assert all(s.versions.min() == 1 for s in groups[ticket].samples)


def test_without_a_taken_batch_a_complete_group_is_published(tmp_path: Path) -> None:
    """The same groups with the trainer still waiting for the batch of version 0 (mark -1), or with no mark: they
    can still be trained, and are published at once."""
    for mark in (lambda: -1, lambda: None):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        worker, spool = make_worker(root, weights=lambda m: Versions(m, 0), taken=mark)
        while worker.pump() or worker.unfinished():
            pass
        worker.close()
        assert [e.ticket for e in spool.ready()] == [0, 1] and worker.stats.samples_restarted == 0
