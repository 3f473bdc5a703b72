"""The rollout's background spool writer: everything submitted is published, errors reach the caller."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from hpcrl.rollout.publisher import BackgroundPublisher, PublishError
from hpcrl.spool.format import read_group
from hpcrl.spool.store import Spool
from test_spool import assert_same_group, make_group


def test_every_submitted_group_is_published_after_drain(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    done = []
    pub = BackgroundPublisher(spool, lambda g, s: done.append((g.ticket, s)), max_pending=4)
    groups = [make_group(ticket=t, seed=t) for t in range(20)]
    for g in groups:
        pub.submit(g)
    pub.drain()
    assert pub.pending == 0
    assert sorted(t for t, _ in done) == list(range(20)) and all(s > 0 for _, s in done)
    ready = {e.ticket: e.path for e in spool.ready()}
    assert sorted(ready) == list(range(20))
    for g in groups:
        assert_same_group(read_group(ready[g.ticket]), g)
    assert not list((tmp_path / "spool" / "tmp").iterdir())
    pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.submit(groups[0])


def gated_spool(tmp_path: Path) -> tuple[Spool, threading.Event]:
    """A spool whose publish waits until the returned event is set."""
    spool, gate = Spool(tmp_path / "spool"), threading.Event()
    publish = spool.publish
    spool.publish = lambda g: gate.wait() and publish(g)
    return spool, gate


def test_close_publishes_what_is_pending(tmp_path: Path) -> None:
    spool, gate = gated_spool(tmp_path)
    pub = BackgroundPublisher(spool, max_pending=8)
    for t in range(5):
        pub.submit(make_group(ticket=t))
    assert pub.pending == 5 and not spool.ready()
    gate.set()
    pub.close()
    assert sorted(e.ticket for e in spool.ready()) == list(range(5))


def test_submit_blocks_while_max_pending_groups_wait(tmp_path: Path) -> None:
    spool, gate = gated_spool(tmp_path)
    pub = BackgroundPublisher(spool, max_pending=2)
    pub.submit(make_group(ticket=0))  # taken by the writer, which waits on the gate
    pub.submit(make_group(ticket=1))
    pub.submit(make_group(ticket=2))  # the queue now holds 2
    third = threading.Thread(target=pub.submit, args=(make_group(ticket=3),))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # held back until the writer makes room
    gate.set()
    third.join(10)
    assert not third.is_alive()
    pub.close()
    assert len(spool.ready()) == 4


def test_a_failed_write_is_raised_in_the_callers_thread(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    publish = spool.publish

    def flaky(g):
        if g.ticket == 1:
            raise OSError(28, "No space left on device")
        return publish(g)

    spool.publish = flaky
    pub = BackgroundPublisher(spool)
    for t in range(3):
        pub.submit(make_group(ticket=t))
    with pytest.raises(PublishError, match="No space left") as info:
        pub.drain()
    assert isinstance(info.value.__cause__, OSError)
    assert [e.ticket for e in spool.ready()] == [0]  # nothing after the failure is written
    with pytest.raises(PublishError):
        pub.submit(make_group(ticket=4))
    with pytest.raises(PublishError):
        pub.close()
