"""The supervisor's terminal lines while it watches (hpcrl/launch/progress.py): a job waiting in the queue."""

from __future__ import annotations

import logging
from pathlib import Path

from hpcrl.launch.progress import QueueWait


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_job_waiting_in_the_queue_is_said_after_a_while_again_later_and_when_it_starts(caplog) -> None:
    clock = Clock()
    waits = QueueWait(Path("/runs/r1"), after_s=60, every_s=600, clock=clock)
    caplog.set_level(logging.INFO, logger="hpcrl.launch.supervisor")
    said = []
    for t, job, queued in [(0, "7", True), (30, "7", True), (61, "7", True), (70, "7", True), (600, "7", True),
                           (661, "7", True), (700, "7", False), (701, "7", False)]:
        clock.t = t
        said.append(waits.see("rollout-0", job, queued))
    assert said == [None, None,
                    "rollout-0: job 7 has waited 61 s in the scheduler's queue (see: python -m hpcrl status /runs/r1)",
                    None, None,
                    "rollout-0: job 7 has waited 661 s in the scheduler's queue (see: python -m hpcrl status /runs/r1)",
                    "rollout-0: job 7 started after 700 s in the queue", None]
    assert [r.getMessage() for r in caplog.records] == [s for s in said if s]


def test_a_short_wait_an_ended_job_and_a_resubmission_say_nothing_of_the_old_wait() -> None:
    clock = Clock()
    waits = QueueWait(Path("/r"), after_s=60, clock=clock)
    assert waits.see("trainer", "1", True) is None
    clock.t = 30
    assert waits.see("trainer", "1", False) is None  # started within a minute: nothing said, ever
    clock.t = 40
    assert waits.see("rollout-0", "2", True) is None
    clock.t = 120
    assert waits.see("rollout-0", "2", True).startswith("rollout-0: job 2 has waited 80 s")
    clock.t = 130
    assert waits.see("rollout-0", "2", False, ended=True) is None  # cancelled in the queue: it did not start
    clock.t = 140
    assert waits.see("rollout-0", "3", True) is None  # its resubmission waits afresh
    clock.t = 199
    assert waits.see("rollout-0", "3", True) is None
    clock.t = 200
    assert waits.see("rollout-0", "3", True).startswith("rollout-0: job 3 has waited 60 s")
    clock.t = 210
    assert waits.see("rollout-0", "4", True) is None  # a new job while the old one was said: a new wait
    clock.t = 220
    assert waits.see("rollout-0", "4", False) is None  # never said, so its start is not said either


def test_status_says_why_a_slurm_job_waits_in_the_queue(tmp_path, monkeypatch) -> None:
    """``status``: a Slurm job pending (or requeued) carries its reason, shown after its row; a running one, a
    pending one without a reason and a local process carry none."""
    import json

    from hpcrl.launch import control

    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "registry.json").write_text(json.dumps({
        "trainer": {"scheduler": "slurm", "job_id": "10"}, "rollout-0": {"scheduler": "slurm", "job_id": "11"},
        "rollout-1": {"scheduler": "slurm", "job_id": "12"}, "rollout-2": {"scheduler": "slurm", "job_id": "13"},
        "eval": {"scheduler": "local", "job_id": "99"}}))
    states = {"10": ("RUNNING", "None"), "11": ("PENDING", "Resources"), "12": ("PENDING", "None"),
              "13": ("REQUEUED", "BeginTime")}
    monkeypatch.setattr(control, "_slurm_states", lambda ids: {j: states[j] for j in ids})
    monkeypatch.setattr(control, "job_alive", lambda run_dir, rec: False)
    comps = control.components(tmp_path)
    assert {n: c["waiting_for"] for n, c in comps.items()} == \
        {"trainer": None, "rollout-0": "Resources", "rollout-1": None, "rollout-2": "BeginTime", "eval": None}
    keys = ("step", "total_steps", "version", "reward_mean", "accuracy", "accuracy_step", "staleness_max",
            "staleness_mean_token", "samples_per_s", "elapsed_s", "metrics_age_s", "checkpoint",
            "tickets_admitted", "tickets_dropped", "reissues_waiting")
    st = {"name": "r", "run_dir": str(tmp_path), "state": "running", "cancel": None, "supervisor": {"state": "none"},
          "progress": dict.fromkeys(keys, 0), "components": comps}
    rows = {ln.split()[0]: ln for ln in control.format_status(st).splitlines()[5:]}
    assert rows["rollout-0"].endswith("  waiting for: Resources") and "PENDING" in rows["rollout-0"], rows
    assert rows["rollout-2"].endswith("  waiting for: BeginTime"), rows
    assert not any("waiting for" in rows[n] for n in ("trainer", "rollout-1", "eval")), rows
