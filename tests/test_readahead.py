"""The spool read-ahead: the trainer's files parsed during the step, handed over only for the very same file."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from hpcrl.admission.config import AdmissionConfig
from hpcrl.admission.ledger import AdmissionLedger
from hpcrl.spool.format import Sample, TrajectoryGroup, read_group
from hpcrl.spool.readahead import ReadAhead
from hpcrl.spool.store import Spool
from hpcrl.trainer.feed import BatchFeed
from tests.test_spool import assert_same_group, make_group


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the read-ahead did not get there"
        time.sleep(0.005)


class CountingReader:
    def __init__(self) -> None:
        self.paths: list[str] = []

    def __call__(self, path: Path) -> TrajectoryGroup:
        self.paths.append(Path(path).name)
        return read_group(path)


def test_a_claimed_file_is_read_once_by_the_worker_and_handed_over(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    written = {g.ticket: g for g in (make_group(ticket=t, seed=t) for t in range(5))}
    for g in written.values():
        spool.publish(g)
    reader = CountingReader()
    ahead = ReadAhead(spool.ready_dir, limit=3, reader=reader)
    try:
        ahead.kick()
        wait_for(lambda: len(ahead) == 3)  # the limit: three of the five
        passes = ahead.passes
        wait_for(lambda: ahead.passes >= passes + 2)  # listed again meanwhile: still three kept, none read again
        assert len(ahead) == 3 and len(reader.paths) == 3
        ahead.hold()  # as the feed does before it claims
        for entry in spool.claim(spool.ready()):
            assert_same_group(spool.load(entry, ahead.read), written[entry.ticket])
        assert (ahead.hits, ahead.misses) == (3, 2)
        assert sorted(reader.paths) == sorted(e.name for e in spool.claimed())  # each file read exactly once
        assert len(ahead) == 0
    finally:
        ahead.close()


def test_groups_offered_by_their_writer_are_handed_over_without_a_parse(tmp_path: Path) -> None:
    """Colocated mode: the process that publishes a file gives the read-ahead its group; nothing parses it."""
    spool = Spool(tmp_path / "spool")
    reader = CountingReader()
    ahead = ReadAhead(spool.ready_dir, limit=2, reader=reader)
    spool.on_publish = ahead.offer
    written = {g.ticket: g for g in (make_group(ticket=t, seed=t) for t in range(3))}
    try:
        for g in written.values():
            spool.publish(g)
        assert ahead.offered == 2 and len(ahead) == 2  # the limit: the third is left to the worker or the claim
        ahead.kick()  # the worker lists ready/: the offered files are taken as parsed
        passes = ahead.passes
        wait_for(lambda: ahead.passes >= passes + 2)
        ahead.hold()
        assert reader.paths == []  # the worker had no room for the third
        for entry in spool.claim(spool.ready()):
            assert_same_group(spool.load(entry, ahead.read), written[entry.ticket])
        assert (ahead.hits, ahead.misses) == (2, 1)
        assert reader.paths == [e.name for e in spool.claimed() if e.ticket == 2]  # the offered ones: never parsed
    finally:
        ahead.close()


def test_an_offered_group_whose_file_was_replaced_is_read_and_a_failing_reader_costs_no_publish(
        tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    ahead = ReadAhead(spool.ready_dir, limit=8)
    spool.on_publish = ahead.offer
    try:
        path = spool.publish(make_group(ticket=1, seed=1))
        replacement = make_group(ticket=1, seed=1)
        replacement.samples[0].reward = 42.0  # same name, other content, written by someone else
        os.unlink(path)
        spool.on_publish = None
        spool.publish(replacement)
        os.utime(path, ns=(1, 1))  # a different identity even where the inode number is reused
        assert_same_group(ahead.read(path), replacement)
        assert (ahead.offered, ahead.hits, ahead.misses) == (1, 0, 1)

        def broken(*_) -> None:
            raise RuntimeError("reader gone")
        spool.on_publish = broken
        assert_same_group(read_group(spool.publish(make_group(ticket=2, seed=2))), make_group(ticket=2, seed=2))
        ahead.close()
        spool.on_publish = ahead.offer
        spool.publish(make_group(ticket=3, seed=3))
        assert ahead.offered == 1  # nothing kept after close
    finally:
        ahead.close()


def test_another_file_under_the_same_name_is_read_again(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    path = spool.publish(make_group(ticket=1, seed=1))
    ahead = ReadAhead(spool.ready_dir, limit=8)
    try:
        ahead.kick()
        wait_for(lambda: len(ahead) == 1)
        ahead.hold()
        replacement = make_group(ticket=1, seed=1)
        replacement.samples[0].reward = 42.0  # same name (ticket, versions, writer), other content
        os.unlink(path)
        spool.publish(replacement)
        os.utime(path, ns=(1, 1))  # a different identity even where the inode number is reused
        assert_same_group(ahead.read(path), replacement)
        assert (ahead.hits, ahead.misses) == (0, 1)
    finally:
        ahead.close()


def test_a_file_that_changes_hands_while_it_is_parsed_is_not_kept(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    first, second = make_group(ticket=1, seed=1), make_group(ticket=1, seed=1)
    second.samples[0].reward = 42.0
    path = spool.publish(first)

    def claim_and_republish_then_read(p: Path) -> TrajectoryGroup:
        if Path(p).parent == spool.ready_dir and not spool.claimed():  # between the worker's stat and its read:
            spool.claim(spool.ready())  # the trainer claims the first file,
            spool.publish(second)  # a second with the same name is published
            ahead.hold()  # (and the trainer goes on to its next claim: no further pass)
        return read_group(p)

    ahead = ReadAhead(spool.ready_dir, limit=8, reader=claim_and_republish_then_read)
    try:
        ahead.kick()
        wait_for(lambda: ahead.passes >= 1)
        assert len(ahead) == 0  # parsed the second file under the first one's identity: not kept
        assert_same_group(ahead.read(spool.claimed()[0].path), first)
        assert (ahead.hits, ahead.misses) == (0, 1)
    finally:
        ahead.close()
    assert path.exists()  # the second file, still ready


def _ledger_and_groups(tmp_path: Path, n: int) -> tuple[AdmissionLedger, list[TrajectoryGroup]]:
    ledger = AdmissionLedger(tmp_path / "admission", AdmissionConfig(batch_size=2, max_staleness=4), 100)
    groups = []
    for _ in range(n):
        t = ledger.try_admit(0, "w")
        samples = [Sample(np.full(3, 5, np.int32), np.full(3, -1.0, np.float32), np.zeros(3, np.int32),
                          np.ones(3, np.uint8), float(r), "stop") for r in (0.0, 1.0)]
        groups.append(TrajectoryGroup(ticket=t.index, writer="w", prompt_ids=np.array([7], np.int32),
                                      samples=samples, meta={"epoch": t.epoch, "row": t.row}))
    return ledger, groups


def test_the_feed_reads_the_next_batch_during_the_step_and_quarantines_as_before(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    ledger, groups = _ledger_and_groups(tmp_path, 5)
    for g in groups:
        spool.publish(g)
    bad = spool.ready()[2].path
    bad.write_bytes(b"not HDF5 at all")  # ticket 2's file, corrupted after publication
    feed = BatchFeed(spool, ledger, batch_size=2, max_staleness=4, timeout_s=5, read_ahead=True)
    try:
        assert [g.ticket for g in feed.next_batch(0)] == [0, 1]  # no step trained before: read at the claim
        assert (feed.ahead.hits, feed.ahead.misses) == (0, 2) and feed.spool_s > 0
        feed.commit(0)
        wait_for(lambda: len(feed.ahead) == 2)  # during "step 0": tickets 3 and 4; ticket 2's file is left alone
        assert [g.ticket for g in feed.next_batch(1)] == [3, 4]
        assert (feed.ahead.hits, feed.ahead.misses) == (2, 3)
        timings, counts = feed.step_report()
        assert timings["spool"] == feed.spool_s and timings["read_ahead"] > 0
        assert counts == {"spool/read_ahead_hits": 2, "spool/read_ahead_misses": 3, "spool/read_ahead_offered": 0}
        assert [e.ticket for e in spool.quarantined()] == [2]
        assert "unreadable" in spool.reason(spool.quarantined()[0])["reason"]
        assert ledger.dropped() == {2: "quarantined"}
    finally:
        feed.ahead.close()


def test_without_read_ahead_the_feed_reads_every_file_itself(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    ledger, groups = _ledger_and_groups(tmp_path, 2)
    for g in groups:
        spool.publish(g)
    feed = BatchFeed(spool, ledger, batch_size=2, max_staleness=4, timeout_s=5)
    assert feed.ahead is None
    assert [g.ticket for g in feed.next_batch(0)] == [0, 1]


def test_the_feed_tells_the_pass_that_completed_the_batch_from_those_that_waited_for_groups(tmp_path: Path) -> None:
    """spool_tail is the pass that completed the batch: what the step waited for once its last group was there."""
    spool = Spool(tmp_path / "spool")
    ledger, groups = _ledger_and_groups(tmp_path, 2)
    spool.publish(groups[0])
    feed = BatchFeed(spool, ledger, batch_size=2, max_staleness=4, timeout_s=5)
    arrivals = [groups[1]]

    def wait() -> bool:  # the second group is generated while the feed waits
        if arrivals:
            spool.publish(arrivals.pop())
        return True

    assert [g.ticket for g in feed.next_batch(0, wait)] == [0, 1]
    timings, _ = feed.step_report()
    assert 0 < timings["spool_tail"] < timings["spool"], timings  # two passes: the first one's claim is not the tail


def test_the_first_batch_is_read_ahead_while_the_trainer_starts(tmp_path: Path) -> None:
    """After resume the trainer starts the read-ahead, so the first batch is parsed during its start-up."""
    spool = Spool(tmp_path / "spool")
    ledger, groups = _ledger_and_groups(tmp_path, 2)
    for g in groups:
        spool.publish(g)
    feed = BatchFeed(spool, ledger, batch_size=2, max_staleness=4, timeout_s=5, read_ahead=True)
    try:
        feed.start_reading()
        wait_for(lambda: len(feed.ahead) == 2)
        assert [g.ticket for g in feed.next_batch(0)] == [0, 1]
        assert (feed.ahead.hits, feed.ahead.misses) == (2, 0)
    finally:
        feed.close()
    BatchFeed(spool, ledger, batch_size=2, max_staleness=4, read_ahead=False).start_reading()  # nothing to start


def test_an_unchanged_ready_directory_is_not_listed_again(tmp_path: Path, monkeypatch) -> None:
    """Between arrivals the worker looks at ready/'s modification time only; a new file is listed and parsed. A
    directory modified within the last second is listed anyway (coarse timestamps)."""
    import hpcrl.spool.readahead as readahead

    spool = Spool(tmp_path / "spool")
    for t in range(2):
        spool.publish(make_group(ticket=t, seed=t))
    ahead = ReadAhead(spool.ready_dir, limit=8, relist_s=0.005)
    try:
        ahead.kick()
        wait_for(lambda: len(ahead) == 2)
        passes = ahead.passes
        wait_for(lambda: ahead.passes >= passes + 3)
        assert ahead.skipped == 0, "listed under two seconds after a change: listed every time"
        monkeypatch.setattr(readahead, "_RACY_NS", 0)
        wait_for(lambda: ahead.skipped >= 3)
        spool.publish(make_group(ticket=2, seed=2))
        wait_for(lambda: len(ahead) == 3)  # the new file changed the directory: listed and parsed
    finally:
        ahead.close()


def publish_within_the_tick(spool: Spool, ahead: ReadAhead, stamp: int) -> None:
    """Ticket 1 arrives while the worker is idle and ready/ keeps the modification time ``stamp``, as a one-second
    timestamp would show it."""
    ahead.hold()
    time.sleep(0.05)  # the worker is idle: it must not look between the publish and the utime
    spool.publish(make_group(ticket=1, seed=1))
    os.utime(spool.ready_dir, ns=(stamp, stamp))


def test_a_file_that_arrives_within_the_directory_timestamp_s_tick_is_still_parsed(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """With a coarse timestamp a file can arrive without changing ready/'s mtime; a pass that listed ready/ within
    the racy window of its mtime does not let later passes skip the listing (a review found that race)."""
    import hpcrl.spool.readahead as readahead

    spool = Spool(tmp_path / "spool")
    spool.publish(make_group(ticket=0, seed=0))
    stamp = os.stat(spool.ready_dir).st_mtime_ns
    ahead = ReadAhead(spool.ready_dir, limit=8, relist_s=0.005)
    try:
        ahead.kick()
        wait_for(lambda: len(ahead) == 1)
        publish_within_the_tick(spool, ahead, stamp)
        monkeypatch.setattr(readahead, "_RACY_NS", 0)  # from now on a listing is never racy: the first one was
        ahead.kick()
        wait_for(lambda: len(ahead) == 2)
        ahead.hold()
        late = [e for e in spool.ready() if e.ticket == 1]
        [claimed] = spool.claim(late)
        assert_same_group(spool.load(claimed, ahead.read), make_group(ticket=1, seed=1))
        assert (ahead.hits, ahead.misses) == (1, 0), "the late file was parsed by the worker, not at the claim"
    finally:
        ahead.close()


def test_while_the_batch_waits_the_feed_claims_what_the_worker_has_parsed_and_reads_only_the_last(
        tmp_path: Path) -> None:
    """Groups arriving while the batch waits are parsed by the worker and claimed once parsed (not left in ready/
    until the batch is complete: a group dropped at its claim frees its admission slot then); the loop reads only
    what completes the batch."""
    spool = Spool(tmp_path / "spool")
    ledger, groups = _ledger_and_groups(tmp_path, 3)
    feed = BatchFeed(spool, ledger, batch_size=3, max_staleness=4, timeout_s=10, read_ahead=True)
    arrivals = list(groups)

    def wait() -> None:  # no count of arrivals (a disaggregated trainer's wait): the feed looks after each call
        # the next group is generated only once the last one was claimed
        if arrivals and not spool.ready():
            spool.publish(arrivals.pop(0))
            return
        time.sleep(0.002)

    try:
        feed.relook_s = 0.005
        assert [g.ticket for g in feed.next_batch(0, wait)] == [0, 1, 2]
        assert feed.ahead.hits >= 2 and feed.ahead.hits + feed.ahead.misses == 3, (feed.ahead.hits,
                                                                                  feed.ahead.misses)
    finally:
        feed.close()


def test_a_waiting_pass_names_what_it_listed_and_the_worker_parses_it_without_a_look_of_its_own(
        tmp_path: Path) -> None:
    """The worker looks at ready/ by itself only every relist_s (here never after its first look): the groups that
    arrive while the batch waits are read ahead because each waiting pass names them to it; only the group that
    completes the batch is read by the pass that claims it."""
    spool = Spool(tmp_path / "spool")
    ledger, groups = _ledger_and_groups(tmp_path, 3)
    feed = BatchFeed(spool, ledger, batch_size=3, max_staleness=4, timeout_s=10, read_ahead=True)
    feed.ahead.relist_s = 3600.0
    spool.publish(groups[0])
    arrivals = list(groups[1:])

    def wait() -> None:
        if arrivals and not spool.ready():  # the next group once the last one was claimed
            spool.publish(arrivals.pop(0))
        time.sleep(0.05)  # the worker's parse of what the last pass named

    try:
        feed.start_reading()
        wait_for(lambda: len(feed.ahead) == 1)  # its first (and only) look parsed the first group
        assert [g.ticket for g in feed.next_batch(0, wait)] == [0, 1, 2]
        assert (feed.ahead.hits, feed.ahead.misses) == (2, 1)
    finally:
        feed.close()


def test_named_files_with_no_room_left_make_the_worker_list_ready_whatever_its_timestamp(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """With ``limit`` parses kept, files the feed names have no room: the worker lists ready/ instead (even with its
    timestamp unchanged since a complete look), which drops the parse of a file that left ready/ unclaimed and
    makes room for the named one."""
    import hpcrl.spool.readahead as readahead

    monkeypatch.setattr(readahead, "_RACY_NS", 0)
    spool = Spool(tmp_path / "spool")
    gone = spool.publish(make_group(ticket=0, seed=0))
    ahead = ReadAhead(spool.ready_dir, limit=1, relist_s=3600.0)
    try:
        ahead.kick()
        wait_for(lambda: ahead.has(gone.name))
        stamp = os.stat(spool.ready_dir).st_mtime_ns
        ahead.hold()
        time.sleep(0.05)
        gone.unlink()  # set aside: left ready/ without a claim that asks for its parse
        new = spool.publish(make_group(ticket=1, seed=1))
        os.utime(spool.ready_dir, ns=(stamp, stamp))
        ahead._listed_mtime = stamp  # as after a complete look: the timestamp alone would skip the listing
        ahead.kick([new.name])
        wait_for(lambda: ahead.has(new.name))
        assert not ahead.has(gone.name) and len(ahead) == 1
    finally:
        ahead.close()


def test_a_corrupt_file_arriving_while_the_batch_waits_is_quarantined_then_not_at_the_end(tmp_path: Path) -> None:
    """The worker cannot parse it, which counts as seen: the feed claims and quarantines it (its ticket dropped,
    its admission slot free) while the batch still waits."""
    spool = Spool(tmp_path / "spool")
    ledger, groups = _ledger_and_groups(tmp_path, 3)
    feed = BatchFeed(spool, ledger, batch_size=2, max_staleness=4, timeout_s=10, read_ahead=True)
    feed.relook_s = 0.005
    bad = spool.publish(groups[0])
    bad.write_bytes(b"not HDF5 at all")
    arrivals = list(groups[1:])
    seen_quarantined: list[bool] = []

    def wait() -> None:  # no count of arrivals: the feed looks after each call
        # the good groups come only once the corrupt one is out of ready/
        if arrivals and not spool.ready():
            seen_quarantined.append(bool(spool.quarantined()))
            spool.publish(arrivals.pop(0))
            return
        time.sleep(0.002)

    try:
        assert [g.ticket for g in feed.next_batch(0, wait)] == [1, 2]
        assert seen_quarantined[0] and ledger.dropped() == {0: "quarantined"}
    finally:
        feed.close()


def test_files_the_feed_names_are_parsed_at_once_without_a_listing(tmp_path: Path, monkeypatch) -> None:
    """A file the feed has listed and waits on is handed to the worker by name: parsed at once, even one that
    arrived within ready/'s timestamp tick (its own look skips the unchanged directory), and before the worker's
    next look would be due."""
    import hpcrl.spool.readahead as readahead

    monkeypatch.setattr(readahead, "_RACY_NS", 0)
    spool = Spool(tmp_path / "spool")
    spool.publish(make_group(ticket=0, seed=0))
    stamp = os.stat(spool.ready_dir).st_mtime_ns
    ahead = ReadAhead(spool.ready_dir, limit=8, relist_s=0.005)
    try:
        ahead.kick()
        wait_for(lambda: ahead.skipped >= 2)  # everything parsed: only the mtime is looked at
        publish_within_the_tick(spool, ahead, stamp)
        skipped = ahead.skipped
        ahead.kick()
        wait_for(lambda: ahead.skipped >= skipped + 3)
        assert len(ahead) == 1, "unseen: the directory's timestamp did not move"
        ahead.relist_s = 3600.0  # no look of its own is due any more: only the names can get the file parsed
        name = spool.ready()[-1].name
        assert not ahead.has(name)
        ahead.kick([name, "not-a-spool-file.txt"])
        wait_for(lambda: ahead.has(name))
        assert len(ahead) == 2 and ahead.read(spool.ready_dir / name).ticket == 1 and ahead.hits == 1
        ahead.hold()
        ahead._wanted = ["left-over.h5"]
        ahead.kick()  # a kick without names drops the last ones (the batch they waited for is taken) ...
        assert ahead._wanted == []
        ahead._wanted = ["left-over.h5"]
        ahead.hold()  # ... and so does a hold
        assert ahead._wanted == []
    finally:
        ahead.close()
