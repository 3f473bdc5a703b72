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
    assert mark.read() == 7
    assert mark.path.read_text().split()[0] == "00000000000000000007"  # fixed width: a write covers the last one
    for torn in ("", "00000000000000000008 00000000000000000007\n", "3"):  # half written, or foreign: no mark
        mark.path.write_text(torn)
        assert mark.read() is None, torn
    mark.path.unlink()
    mark.path.mkdir()  # a write that fails is logged, never the trainer's end: it is a hint
    mark.write(9)
    assert mark.read() is None


def test_the_feed_marks_its_start_and_a_batch_only_once_it_is_complete(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    ledger, groups = _ledger_and_groups(tmp_path, 2)
    feed = BatchFeed(spool, ledger, batch_size=2, max_staleness=4, timeout_s=5, mark_taken=True)
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


def test_colocated_mode_writes_no_mark(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    ledger, groups = _ledger_and_groups(tmp_path, 2)
    feed = BatchFeed(spool, ledger, batch_size=2, max_staleness=4, timeout_s=5)
    feed.start(0)
    for g in groups:
        spool.publish(g)
    feed.next_batch(0)
    assert not TakenMark(spool.root).path.exists()


def test_a_group_the_taken_batch_leaves_stale_is_parked_and_generated_again_whole_at_new_weights(
        tmp_path: Path) -> None:
    """eta = 1, weights at version 0, the trainer holding the batch of version 1: groups whose oldest token is of
    version 0 could only be set aside. They are not published; at version 1 all their episodes start again (none
    of them is doomed by version 1 alone: eta = 1 still allows version-0 tokens), and the groups are published
    whole under version 1. The mark is read at most once per pass."""
    source, reads = {}, []

    def read_mark() -> int:
        reads.append(1)
        return 1

    worker, spool = make_worker(tmp_path, weights=lambda m: source.setdefault("v", Versions(m, 0)), max_staleness=1,
                                taken=read_mark)
    per_pass = []

    def pump() -> bool:
        before = len(reads)
        busy = worker.pump()
        per_pass.append(len(reads) - before)
        return busy

    while len(per_pass) < 300 and not (len(worker.groups) == 4 and all(g.parked for g in worker.groups.values())):
        pump()
    assert sorted(worker.groups) == [0, 1, 2, 3] and not spool.ready(), "version 0's four groups were not parked"
    assert worker.stats.groups_published == 0 and max(per_pass) == 1
    for _ in range(5):  # parked, waiting for new weights: nothing is generated or published meanwhile
        pump()
    assert not spool.ready() and worker.unfinished() == 0
    source["v"].latest = 1
    while pump() or worker.unfinished():
        pass
    worker.close()
    groups = {g.ticket: g for g in (read_group(e.path) for e in spool.ready())}
    assert sorted(groups) == [0, 1, 2, 3, 4, 5] and worker.stats.samples_restarted == 3 * 4
    for g in groups.values():  # every sample of every group, the parked ones included, generated under version 1
        assert all(s.versions.min() == 1 for s in g.samples)
    assert max(per_pass) == 1


def test_without_a_taken_batch_or_a_weight_source_a_complete_group_is_published(tmp_path: Path) -> None:
    """The same groups with the trainer still waiting for the batch of version 0 (mark -1), with no mark, or with
    no weight source to release a parked group: published at once."""
    for mark, weights in ((lambda: -1, lambda m: Versions(m, 0)), (lambda: None, lambda m: Versions(m, 0)),
                          (lambda: 5, None)):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        worker, spool = make_worker(root, weights=weights, taken=mark)
        while worker.pump() or worker.unfinished():
            pass
        worker.close()
        assert [e.ticket for e in spool.ready()] == [0, 1] and worker.stats.samples_restarted == 0
