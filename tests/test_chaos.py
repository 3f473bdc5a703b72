"""Chaos: 20 kill -9 of random components at random moments (some aimed at checkpoint
writes and spool publishes, some at a trainer and a rollout together, one at the supervisor)
and bad files fed to the trainer during a real local run; the watchdog (or ``--resume``)
resubmits each victim, the run completes, and the run directory proves nothing was lost,
duplicated, read half-written or trained without admission."""

from __future__ import annotations

import pytest
from chaos_script import load_chaos

pytestmark = pytest.mark.slow


def test_twenty_kills_a_supervisor_crash_and_bad_files_lose_nothing(tmp_path) -> None:
    """20 kill -9: random and aimed, two trainer+rollout pairs, and the supervisor once (followed by
    ``--resume``); plus two rounds of bad files dropped into spool/ready (a valid group under a ticket
    never admitted, garbage named at a stale version, a truncated copy under another writer's name)."""
    chaos = load_chaos()
    report = chaos.main(["--kills", "20", "--supervisor-kills", "1", "--paired-kills", "2", "--injections", "2",
                         "--steps", "400", "--run-dir", str(tmp_path / "run"), "--cache", str(tmp_path / "cache"),
                         "--seed", "1"])
    kills = {kind: n for kind, n in report["kills"].items() if kind != "inject"}
    assert report["exit_code"] == 0
    assert sum(kills.values()) >= 20 and kills["supervisor"] == 1 and report["kills"]["inject"] >= 1
    assert report["restarts"] >= 15  # victims were resubmitted (those orphaned by the supervisor kill: by --resume)
    assert report["peak_live"]["trainer"] == 1 and max(report["peak_live"].values()) == 1, report["crowded"]  # one owner
    assert report["violations"] == []  # staleness bound, exactly-once, admitted-only, from the run directory
    assert report["steps"] == 400 and report["unfinished"] == 0
    assert report["trained_groups"] == 400 * 4
    assert report["injected_placed"] == {"quarantine": report["injected"]}  # every bad file set aside...
    assert report["quarantined"] == report["injected"]  # ...and nothing else: no reader saw a partial file


@pytest.mark.long  # ~2 minutes: opt-in with -m long
def test_trainer_kills_with_collective_weights(tmp_path) -> None:
    """Rollouts keep generating through trainer restarts and rejoin the new trainer's group."""
    chaos = load_chaos()
    report = chaos.main(["--kills", "4", "--steps", "600", "--only", "trainer", "--run-dir", str(tmp_path / "run"),
                         "--cache", str(tmp_path / "cache"), "--seed", "3", "weights.mode=collective"])
    assert report["exit_code"] == 0 and report["violations"] == []
    assert report["victims"].keys() == {"trainer-r0"} and report["restarts"] >= 4
    assert report["steps"] == 600 and report["unfinished"] == 0


def test_a_child_whose_environment_cannot_be_read_is_still_its_parents(monkeypatch) -> None:
    """Between vfork and exec a component's child shows the component's command line, its parent waits in state D,
    and its environ may refuse to be read: the monitor must still count the pair as one instance (it once saw two)."""
    import os
    from pathlib import Path

    chaos = load_chaos()
    read_bytes = Path.read_bytes

    def refuse_environ(self):
        if self.name == "environ":
            raise PermissionError(13, "Permission denied", str(self))
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", refuse_environ)
    who = chaos._who(os.getpid(), "R")
    assert who == {"state": "R", "ppid": os.getppid()}


def test_a_process_gone_between_two_reads_of_proc_is_not_counted(monkeypatch) -> None:
    """The monitor reads a process's state, then its parent: a child that exits in between (seen running, its stat
    gone a moment later) was not running beside the others, and is left out rather than counted as a second
    instance of its role (CI once saw a trainer and such a child, its parent unread, as two trainers)."""
    import os
    from pathlib import Path

    chaos = load_chaos()
    read_text = Path.read_text

    def gone(self, *args, **kwargs):
        if self.name == "stat" and self.parent.name == str(os.getpid()):
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", gone)
    assert chaos._who(os.getpid(), "R") is None
    assert chaos._who(os.getppid(), "S")["ppid"] > 0  # another process is read as before

