"""The admission ledger: the staleness bound, exclusive tickets, deterministic data order."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from hpcrl.admission.config import AdmissionConfig
from hpcrl.admission.ledger import AdmissionLedger, incarnation


def ledger(tmp_path, b=4, eta=1, rows=10, seed=0) -> AdmissionLedger:
    return AdmissionLedger(tmp_path / "admission", AdmissionConfig(batch_size=b, max_staleness=eta), rows, seed)


def admit_all(led: AdmissionLedger, version: int, writer: str = "w") -> list[int]:
    out = []
    while (t := led.try_admit(version, writer)) is not None:
        out.append(t.index)
    return out


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_bound_is_v_plus_eta_plus_one_batches(tmp_path, eta: int) -> None:
    led = ledger(tmp_path, b=4, eta=eta)
    assert admit_all(led, 0) == list(range((eta + 1) * 4))
    assert admit_all(led, 0) == []  # nothing more until the version moves
    assert admit_all(led, 1) == list(range((eta + 1) * 4, (eta + 2) * 4))
    assert led.num_admitted() == (eta + 2) * 4


def test_dropped_groups_free_their_slot(tmp_path) -> None:
    led = ledger(tmp_path, b=4, eta=0)
    assert admit_all(led, 0) == [0, 1, 2, 3]
    led.record_drop(2, "quarantined")
    led.record_drop(2, "quarantined")  # idempotent
    assert led.num_dropped() == 1
    assert admit_all(led, 0) == [4]
    assert led.dropped() == {2: "quarantined"}


def test_the_drop_count_is_one_read_lags_a_cut_record_and_is_recounted_at_the_trainers_start(
        tmp_path, monkeypatch) -> None:
    """The bound reads dropped.count instead of listing dropped/ (flat in the run's length); a record whose count
    a crash cut off leaves the count behind (a tighter bound), never ahead, until the next start recounts."""
    import os

    led = ledger(tmp_path, b=4, eta=0, rows=100)
    admit_all(led, 0)
    for n in (0, 1):
        led.record_drop(n, "uniform")
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda d=".": (_ for _ in ()).throw(AssertionError(d))
                        if str(d).endswith("dropped") else real(d))
    assert led.num_dropped() == 2 and admit_all(led, 0) == [4, 5]  # no listing of dropped/ on the way
    monkeypatch.setattr(os, "listdir", real)
    (led.dropped_dir / f"t{2:09d}").write_text("{}")  # a record whose count update a crash cut off
    assert led.num_dropped() == 2 and led.count_drop_records() == 3
    assert ledger(tmp_path, b=4, eta=0, rows=100).sync_drop_count() == 3  # the trainer's next start
    assert led.num_dropped() == 3
    (led.root / "dropped.count").unlink()  # a ledger from before the count file: listed
    assert led.num_dropped() == 3
    trainer = ledger(tmp_path, b=4, eta=0, rows=100)
    trainer.sync_drop_count()
    (led.root / "dropped.count").write_text("1")  # a fenced-off trainer wrote its own, older count meanwhile
    trainer.check_drop_count()  # the trainer's next drop record or checkpoint notices and recounts
    assert led.num_dropped() == 3
    trainer.record_drop(3, "uniform")
    (led.root / "dropped.count").write_text("2")
    trainer.record_drop(4, "uniform")
    assert led.num_dropped() == 5 == led.count_drop_records()


def test_the_ticket_count_gallops_past_other_writers_tickets(tmp_path) -> None:
    """num_created finds the first missing ticket in O(log gap) lookups, not one per ticket created since."""
    a, b = ledger(tmp_path, b=1000, eta=0, rows=5000), ledger(tmp_path, b=1000, eta=0, rows=5000)
    assert len(admit_all(b, 0, "wb")) == 1000
    probes = []
    real = a._exists
    a._exists = lambda i: probes.append(i) or real(i)
    assert a.num_created() == 1000 and len(probes) <= 2 * 10 + 2, len(probes)
    assert a.try_admit(1, "wa").index == 1000 and b.try_admit(1, "wb").index == 1001
    for gap in (0, 1, 2, 3, 7, 64):  # a's cursor is behind by gap tickets
        for _ in range(gap):
            b.try_admit(1, "wb")
        assert a.num_created() == b.num_created() == b.num_admitted()


def test_a_ticket_found_admitted_answers_for_every_ticket_below_it(tmp_path) -> None:
    """The trainer's ledger asks for every claimed file: tickets are contiguous, so one look covers the older ones;
    a ticket never created stays unadmitted."""
    rollout, trainer = ledger(tmp_path, b=8, eta=0), ledger(tmp_path, b=8, eta=0)
    assert len(admit_all(rollout, 0)) == 8
    probes = []
    real = trainer._exists
    trainer._exists = lambda i: probes.append(i) or real(i)
    assert trainer.admitted(5) and probes == [5]
    assert all(trainer.admitted(i) for i in range(6)) and probes == [5], "no look for tickets below one found"
    assert trainer.admitted(7) and not trainer.admitted(8) and not trainer.admitted(10**6)
    assert probes == [5, 7, 8, 10**6]
    assert admit_all(trainer, 1, "t") == list(range(8, 16)), "its next ticket is still the first missing one"


def test_a_refused_rollout_asks_the_filesystem_again_only_after_recheck_s(tmp_path, monkeypatch) -> None:
    led = AdmissionLedger(tmp_path / "admission", AdmissionConfig(batch_size=2, max_staleness=0, recheck_s=0.3), 10)
    assert admit_all(led, 0) == [0, 1]
    looks = []
    real = led.pending_reissues
    led.pending_reissues = lambda: looks.append(1) or real()
    assert [led.try_admit(0, "w") for _ in range(50)] == [None] * 50 and looks == []  # refused a moment ago
    led.record_drop(0, "uniform")
    assert led.try_admit(1, "w").index == 2 and len(looks) == 1  # new weights: asked at once
    assert admit_all(led, 1) == [3, 4] and len(looks) == 4  # (1 + 1) x 2 + 1 dropped = 5 tickets, then refused
    assert led.try_admit(1, "w") is None and len(looks) == 4
    led.record_drop(1, "uniform")
    assert led.try_admit(1, "w") is None and len(looks) == 4  # the freed slot waits for the recheck
    monkeypatch.setattr("time.monotonic", lambda: 1e12)  # recheck_s later
    assert led.try_admit(1, "w").index == 5 and len(looks) == 5


def test_ticket_to_row_is_a_reproducible_permutation_per_epoch(tmp_path) -> None:
    led = ledger(tmp_path, rows=10, seed=3)
    epoch0 = [led.ticket(i).row for i in range(10)]
    epoch1 = [led.ticket(i).row for i in range(10, 20)]
    assert sorted(epoch0) == list(range(10)) and sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    assert led.ticket(13).epoch == 1
    other = AdmissionLedger(tmp_path / "other", led.cfg, 10, seed=3)
    assert [other.ticket(i).row for i in range(20)] == epoch0 + epoch1


def _worker(root, version, q) -> None:
    led = AdmissionLedger(root, AdmissionConfig(batch_size=8, max_staleness=2), 100, 0)
    q.put(admit_all(led, version, writer=str(mp.current_process().pid)))


def test_concurrent_processes_share_one_counter(tmp_path) -> None:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(tmp_path / "adm", 3, q)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [q.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
    flat = sorted(i for part in got for i in part)
    assert flat == list(range((3 + 2 + 1) * 8))  # contiguous, no ticket twice, bound respected


def test_reissued_ticket_is_taken_once_and_reclaim_finds_dead_holders(tmp_path) -> None:
    led = ledger(tmp_path, b=2, eta=0)
    a = [led.try_admit(0, "dead-1").index for _ in range(2)]
    assert a == [0, 1] and led.try_admit(0, "alive-2") is None  # bound reached
    assert led.reclaim("dead-1", finished={1}) == [0]  # ticket 1 was published, ticket 0 was lost
    assert led.reclaim("dead-1", finished={1}) == []  # already waiting for a taker
    other = AdmissionLedger(led.root, led.cfg, led.num_rows, led.seed)
    t = other.try_admit(0, "alive-2")
    assert t is not None and t.index == 0  # reissued tickets bypass the bound
    assert led.try_admit(0, "alive-3") is None  # taken exactly once
    assert led.holders()[0] == "alive-2"
    assert led.reclaim("alive-2", finished=set()) == [0]  # the taker died too: reissued again
    assert led.num_admitted() == 2  # reissues never create new tickets


def test_reclaim_of_a_requeued_job_takes_what_each_of_its_runs_held(tmp_path) -> None:
    """A job Slurm requeued runs again as the same instance, writing as ``<writer>q<N>``: the rollout's start,
    and the supervisor's reclaim, hand back what every run held, and nothing of another instance."""
    led = ledger(tmp_path, b=4, eta=0)
    for w in ("r0-e1n2", incarnation("r0-e1n2", 1), "r0-e1n21", incarnation("r0-e1n2", 2)):
        led.try_admit(0, w)
    assert incarnation("r0-e1n2", 0) == "r0-e1n2" and incarnation("r0-e1n2", 2) == "r0-e1n2q2"
    assert led.reclaim("r0-e1n2", finished={3}) == [0]  # only that writer, without its incarnations
    assert led.reclaim("r0-e1n2", finished={3}, incarnations=True) == [1]  # ticket 3 was published
    assert led.holders()[2] == "r0-e1n21"  # another instance's ticket is left alone
