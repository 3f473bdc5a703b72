"""Run ownership (design.md §4.7) and only-admitted training (design.md §4.8), below the process level.

Epochs are claimed exclusively and in order; a fenced ledger, spool, weight publisher or checkpoint
commit refuses to change the run; the feed quarantines never-admitted, duplicate, dropped and
misplaced files without touching the ledger state of a real ticket; reissued tickets respect the
admission bound (no regeneration storm); retention compacts and prunes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcrl.admission.config import AdmissionConfig
from hpcrl.admission.ledger import AdmissionLedger
from hpcrl.runtime.owner import EXIT_FENCED, Fence, Fenced, claim, current_epoch, exit_when_fenced
from hpcrl.spool.format import Sample, TrajectoryGroup
from hpcrl.spool.store import Spool
from hpcrl.trainer.feed import BatchFeed, BatchTimeout
from hpcrl.weights.config import WeightsConfig
from hpcrl.weights.transport import DiskWeights

ROOT = Path(__file__).resolve().parents[1]


def group(ledger: AdmissionLedger, ticket: int, writer: str, version: int = 0, position=None) -> TrajectoryGroup:
    t = ledger.ticket(ticket)
    epoch, row = position or (t.epoch, t.row)
    samples = [Sample(np.array([5, 6], np.int32), np.array([-1.0, -1.0], np.float32),
                      np.array([version, version], np.int32), np.ones(2, np.uint8), float(i), "stop")
               for i in range(2)]
    return TrajectoryGroup(ticket=ticket, writer=writer, prompt_ids=np.array([7], np.int32), samples=samples,
                           meta={"epoch": epoch, "row": row})


def test_epochs_are_claimed_exclusively_and_in_order(tmp_path) -> None:
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(claim(tmp_path).epoch)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(1, 9)) and current_epoch(tmp_path) == 8
    assert json.loads((tmp_path / "owner" / "e000000003").read_text())["pid"] == os.getpid()


def test_fence_stops_every_writer_of_a_replaced_owner(tmp_path) -> None:
    owner = claim(tmp_path)
    fence = Fence(tmp_path, owner.epoch)
    ledger = AdmissionLedger(tmp_path / "admission", AdmissionConfig(batch_size=2, max_staleness=0), 10,
                             fence=fence)
    spool = Spool(tmp_path / "spool", fence=fence)
    weights = DiskWeights(tmp_path / "weights", WeightsConfig(), fence)
    ticket = ledger.try_admit(0, "r0-a")
    assert ticket is not None and json.loads((ledger.tickets_dir / "t000000000").read_text())["epoch"] == 1
    weights.publish({"w": torch.zeros(2)}, 1)
    spool.publish(group(ledger, 0, "r0-a"))

    newer = claim(tmp_path)
    assert newer.epoch == 2 and owner.superseded()
    with pytest.raises(Fenced, match="epoch 2"):
        ledger.try_admit(0, "r0-a")
    with pytest.raises(Fenced):
        ledger.record_drop(0, "x")
    with pytest.raises(Fenced):
        ledger.reissue(0, "x")
    with pytest.raises(Fenced):
        spool.publish(group(ledger, 0, "r0-a", version=1))
    with pytest.raises(Fenced):
        spool.claim(spool.ready())
    with pytest.raises(Fenced):
        weights.publish({"w": torch.ones(2)}, 2)
    # nothing of the refused writes is visible
    assert weights.latest_version() == 1 and not (tmp_path / "weights" / "v000002").exists()
    assert [e.max_version for e in spool.ready()] == [0] and not list(spool.tmp_dir.iterdir())
    assert ledger.dropped() == {} and ledger.pending_reissues() == []


def test_fenced_process_exits_with_its_own_code(tmp_path) -> None:
    code = ("import sys; from hpcrl.runtime.owner import Fenced, exit_when_fenced\n"
            "with exit_when_fenced():\n"
            "    try:\n        raise Fenced('newer owner')\n    finally:\n        raise RuntimeError('cleanup')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == EXIT_FENCED, proc.stderr
    with pytest.raises(RuntimeError):
        with exit_when_fenced():
            raise RuntimeError("not fenced")


def test_orphaned_when_the_supervisor_is_silent_or_released(tmp_path) -> None:
    owner = claim(tmp_path)
    fence = Fence(tmp_path, owner.epoch, supervised=True, orphan_grace_s=30)
    assert not fence.orphaned(every_s=0)
    old = time.time() - 60
    os.utime(owner.path, (old, old))
    assert fence.orphaned(every_s=0)
    owner2 = claim(tmp_path)
    fence2 = Fence(tmp_path, owner2.epoch, supervised=True, orphan_grace_s=30)
    owner2.release()
    assert fence2.orphaned(every_s=0)
    assert not Fence(tmp_path, owner2.epoch).orphaned(every_s=0)  # started by hand: no supervisor to lose


def _feed(tmp_path, b=2, eta=0):
    ledger = AdmissionLedger(tmp_path / "admission", AdmissionConfig(batch_size=b, max_staleness=eta), 50, 1)
    spool = Spool(tmp_path / "spool")
    return ledger, spool, BatchFeed(spool, ledger, b, eta, timeout_s=2, poll_s=0.001)


def test_only_admitted_work_is_trained(tmp_path) -> None:
    ledger, spool, feed = _feed(tmp_path, b=2)
    a, b = ledger.try_admit(0, "r0-a"), ledger.try_admit(0, "r0-a")
    spool.publish(group(ledger, a.index, "r0-a"))
    spool.publish(group(ledger, b.index, "r0-a"))
    spool.publish(group(ledger, 7, "intruder"))  # well formed, never admitted
    spool.publish(group(ledger, b.index, "r9-x", position=(0, (b.row + 1) % 50)))  # b's ticket, wrong row
    batch = feed.next_batch(0)
    feed.commit(0)
    assert sorted(g.ticket for g in batch) == [a.index, b.index]

    # a truncated copy of a trained group under another writer's name: quarantined, no drop record
    c = ledger.try_admit(1, "r0-a")
    spool.publish(group(ledger, c.index, "r0-a", version=1))
    src = spool.publish(group(ledger, a.index, "r1-b", version=1))
    src.write_bytes(src.read_bytes()[:100])
    d = ledger.try_admit(1, "r0-a")
    spool.publish(group(ledger, d.index, "r0-a", version=1))
    batch = feed.next_batch(1)
    assert sorted(g.ticket for g in batch) == [c.index, d.index]
    reasons = {e.writer: spool.reason(e)["reason"] for e in spool.quarantined()}
    assert "never admitted" in reasons["intruder"]  # (stale by now: checked before any reissue)
    assert "trained already" in reasons["r9-x"]
    assert "r1-b" in reasons  # the truncated copy
    assert ledger.dropped() == {} and ledger.pending_reissues() == []  # no foreign file touched a real ticket
    assert a.index in feed.trained
    # a garbage file named at a stale version never gets its made-up ticket reissued
    (spool.ready_dir / "g000000033_v000000-000000_junk.h5").write_bytes(b"garbage")
    feed.commit(1)
    with pytest.raises(BatchTimeout):
        feed.next_batch(5)
    assert ledger.pending_reissues() == [] and ledger.dropped() == {}


def test_a_ticket_recorded_dropped_is_never_trained(tmp_path) -> None:
    """The feed lists the drop records at its first look and then follows its own: a file of a ticket dropped
    before it started, or dropped by it (a group left out as uniform), is quarantined, not trained."""
    ledger = AdmissionLedger(tmp_path / "admission", AdmissionConfig(batch_size=3, max_staleness=0), 50, 1)
    spool = Spool(tmp_path / "spool")
    feed = BatchFeed(spool, ledger, 1, 0, timeout_s=2, poll_s=0.001,
                     keep=lambda g: g.samples[0].reward != 9.0)
    early, uniform, good = (ledger.try_admit(0, "r0-a") for _ in range(3))
    ledger.record_drop(early.index, "run ended before it was trained")  # by an earlier process
    spool.publish(group(ledger, early.index, "r0-a"))
    bad = group(ledger, uniform.index, "r0-a")
    for s in bad.samples:
        s.reward = 9.0
    spool.publish(bad)
    spool.publish(group(ledger, good.index, "r0-a"))
    assert [g.ticket for g in feed.next_batch(0)] == [good.index]
    feed.commit(0)
    assert ledger.dropped() == {early.index: "run ended before it was trained", uniform.index: "uniform"}
    spool.publish(group(ledger, uniform.index, "r0-a", version=1))  # the dropped ticket's file again
    with pytest.raises(BatchTimeout):
        feed.next_batch(1)
    reasons = {e.ticket: spool.reason(e)["reason"] for e in spool.quarantined()}
    assert "recorded as dropped" in reasons[early.index] and "recorded as dropped" in reasons[uniform.index]

    # a fenced-off trainer records a drop (in the window before its fence check stops it) and rewrites the count:
    # not followed at once, but the ledger's recount (at the next drop record or checkpoint) has them listed again
    late = ledger.try_admit(1, "r0-a")
    old = AdmissionLedger(tmp_path / "admission", AdmissionConfig(batch_size=3, max_staleness=0), 50, 1)
    old.sync_drop_count()
    old.record_drop(late.index, "uniform")
    assert late.index not in feed.drop_records
    feed.retain(keep_dropped_files=10)  # after a checkpoint: the count is checked
    assert ledger.recounts == 1 and late.index in feed.drop_records
    # its record and count written between this trainer's check and its own count, which overwrites theirs: no
    # recount fires; the feed lists its drop records again at its first checkpoint (once: not a cost of run length)
    later, last = ledger.try_admit(1, "r0-a"), ledger.try_admit(1, "r0-a")
    fresh = BatchFeed(spool, ledger, 1, 0, timeout_s=2, poll_s=0.001)  # a feed yet to make its first checkpoint
    assert later.index not in fresh.drop_records  # listed at its first look
    count = (tmp_path / "admission" / "dropped.count").read_text()
    old.record_drop(later.index, "uniform")
    (tmp_path / "admission" / "dropped.count").write_text(count)
    assert later.index not in fresh.drop_records
    fresh.retain(keep_dropped_files=10)
    assert ledger.recounts == 1 and later.index in fresh.drop_records
    old.record_drop(last.index, "uniform")
    (tmp_path / "admission" / "dropped.count").write_text(count)
    fresh.retain(keep_dropped_files=10)
    assert last.index not in fresh.drop_records  # not listed at the checkpoints after


def test_stale_file_is_reissued_only_by_its_holder(tmp_path) -> None:
    ledger, spool, feed = _feed(tmp_path, b=1, eta=0)
    t = ledger.try_admit(0, "r0-a")
    ledger.reissue(t.index, "rollout r0-a died holding it")
    assert ledger.try_admit(0, "r1-b").index == t.index  # taken by r1-b: the holder now
    assert ledger.holder(t.index) == "r1-b"
    spool.publish(group(ledger, t.index, "r0-a"))  # the presumed-dead writer publishes late, now stale
    spool.publish(group(ledger, t.index, "r1-b"))  # ...and so does the holder
    with pytest.raises(BatchTimeout):
        feed.next_batch(3)
    assert ledger.pending_reissues() == [t.index]  # reissued once, by the holder's file
    assert {e.writer for e in spool.quarantined()} == {"r0-a"}


def test_reissues_respect_the_bound(tmp_path) -> None:
    """A burst of reissues (e.g. a trainer restart) is handed out at the trainer's pace, not all at once."""
    ledger, _, _ = _feed(tmp_path, b=2, eta=0)
    tickets = [ledger.try_admit(v, "r0-a") for v in range(3) for _ in range(2)]
    assert [t.index for t in tickets] == list(range(6)) and ledger.try_admit(2, "r0-a") is None
    for t in tickets[2:]:  # versions 1 and 2 were lost: 4 tickets to regenerate at version 1
        ledger.reissue(t.index, "lost policy")
    taken = [ledger.try_admit(1, "r0-a") for _ in range(4)]
    # at version 1 with eta 0, 2 groups more than the trainer consumed (2) may be in the making
    assert [t.index for t in taken if t] == [2, 3] and taken[2:] == [None, None]
    assert [t.index for t in (ledger.try_admit(2, "r0-a"), ledger.try_admit(2, "r0-a"))] == [4, 5]
    assert ledger.try_admit(2, "r0-a") is None and ledger.num_created() == 6


def test_retention_compacts_reissues_and_prunes_set_aside_data(tmp_path) -> None:
    ledger, spool, feed = _feed(tmp_path, b=1, eta=0)
    for v in range(4):
        t = ledger.try_admit(v, "r0-a")
        spool.publish(group(ledger, t.index, "r0-a", version=v))
    with pytest.raises(BatchTimeout):  # at version 4 every file is stale: set aside and reissued
        feed.next_batch(4)
    assert len(ledger.pending_reissues()) == 4 and len(spool.dropped()) == 4
    for _ in range(4):
        ledger.try_admit(10, "r1-b")
    for n in range(4):
        ledger.record_drop(n, "test")
    counts = feed.retain(keep_dropped_files=1)
    assert counts == {"dropped_data_pruned": 3, "reissues_compacted": 4}
    assert ledger.num_reissued() == 4 and not [n for n in os.listdir(ledger.reissue_dir)]
    assert len(list(spool.dropped_dir.glob("*.reason.json"))) == 4  # the reasons stay


def test_a_recorded_process_is_known_by_its_start_time_not_its_command_line(tmp_path) -> None:
    """A take-over kills a recorded pid only while it is the process the registry recorded: an
    exiting one (its command line already empty) still counts, a reused pid never does."""
    from hpcrl.launch.takeover import job_alive, start_ticks

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # names no run dir
    try:
        # the kernel fills in the new command line a moment after exec has closed Popen's pipe
        deadline = time.monotonic() + 30
        while not Path(f"/proc/{proc.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        started = start_ticks(proc.pid)
        assert started is not None
        rec = {"job_id": proc.pid, "scheduler": "local"}
        assert not job_alive(tmp_path, dict(rec))  # no start time recorded: judged by its command line
        assert job_alive(tmp_path, {**rec, "start_ticks": started})
        assert not job_alive(tmp_path, {**rec, "start_ticks": started - 1})  # the pid now runs another process
    finally:
        proc.kill()
        proc.wait()
    assert start_ticks(proc.pid) is None and not job_alive(tmp_path, {**rec, "start_ticks": started})


def test_a_takeover_stops_processes_of_earlier_owners_the_registry_does_not_name(tmp_path) -> None:
    """An owner killed between starting a component and recording it leaves a process nobody recorded: the
    next owner finds it by its owner epoch and run directory and stops it; its own epoch's processes, other
    runs' and a recorded process's children are left alone."""
    from hpcrl.config import load_config
    from hpcrl.launch.takeover import take_over, unrecorded

    run, other = tmp_path / "run", tmp_path / "other"
    (run / "jobs").mkdir(parents=True)
    sleep = [sys.executable, "-c", "import time; time.sleep(60)", "--run-dir"]

    def start(run_dir: Path, epoch: int) -> subprocess.Popen:
        return subprocess.Popen([*sleep, str(run_dir)], env={**os.environ, "HPCRL_EPOCH": str(epoch)},
                                start_new_session=True)

    orphan, recorded, current, foreign = start(run, 1), start(run, 1), start(run, 2), start(other, 1)
    (run / "jobs" / "registry.json").write_text(json.dumps(
        {"trainer": {"job_id": recorded.pid, "scheduler": "local", "epoch": 1}}))
    procs = [orphan, recorded, current, foreign]
    try:
        deadline = time.monotonic() + 30  # the kernel fills in a command line a moment after exec
        while not all(Path(f"/proc/{p.pid}/cmdline").read_bytes() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.01)
        found = unrecorded(run, 2, json.loads((run / "jobs" / "registry.json").read_text()))
        assert [rec["job_id"] for rec in found.values()] == [orphan.pid], found
        cfg = load_config(ROOT / "configs/quickstart.yaml", ["launch.takeover_timeout_s=1"])
        assert take_over(cfg, run, epoch=2)
        assert orphan.wait(timeout=30) == -9 and recorded.wait(timeout=30) == -9
        assert current.poll() is None and foreign.poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()
