"""Watchdog policy with a controlled clock: crashes, hangs, preemption, budget, back-off."""

from __future__ import annotations

from hpcrl.runtime.preempt import EXIT_REQUEUE
from hpcrl.watchdog.config import WatchdogConfig
from hpcrl.watchdog.policy import Watchdog


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_crash_restarts_with_exponential_backoff_until_budget() -> None:
    clock = Clock()
    w = Watchdog(WatchdogConfig(max_restarts=3, backoff_s=1, backoff_max_s=3), clock)
    w.started("rollout-0")
    delays = []
    for _ in range(3):
        d = w.assess("rollout-0", -9, None)
        assert d.action == "restart" and "exited with code -9" in d.reason
        delays.append(d.delay_s)
        w.started("rollout-0")
    assert delays == [1, 2, 3]
    final = w.assess("rollout-0", 1, None)
    assert final.action == "fail" and "budget spent" in final.reason


def test_preemption_exit_is_free() -> None:
    w = Watchdog(WatchdogConfig(max_restarts=0), Clock())
    for _ in range(5):
        assert w.assess("trainer", EXIT_REQUEUE, None).action == "restart"
    assert w.assess("trainer", 1, None).action == "fail"


def test_stale_heartbeat_is_hung_and_fresh_one_is_fine() -> None:
    clock = Clock()
    w = Watchdog(WatchdogConfig(heartbeat_timeout_s=30, startup_grace_s=60), clock)
    w.started("trainer")
    assert w.assess("trainer", None, None).action == "ok"  # starting up
    clock.t += 61
    d = w.assess("trainer", None, None)
    assert d.action == "restart" and d.hung and "no heartbeat" in d.reason
    w.started("trainer")
    clock.t += 10
    assert w.assess("trainer", None, clock.t - 5).action == "ok"
    clock.t += 40
    d = w.assess("trainer", None, clock.t - 40)
    assert d.action == "restart" and d.hung and "hung" in d.reason
    assert w.assess("trainer", 0, None).action == "ok"  # finished normally


def test_heartbeat_of_a_previous_incarnation_does_not_count() -> None:
    clock = Clock()
    w = Watchdog(WatchdogConfig(heartbeat_timeout_s=30, startup_grace_s=60), clock)
    w.started("rollout-1")
    old = clock.t - 10  # written before this start
    clock.t += 20
    assert w.assess("rollout-1", None, old).action == "ok"  # within grace, old beat ignored
    clock.t += 50
    assert w.assess("rollout-1", None, old).action == "restart"


def test_disabled_watchdog_fails_at_once() -> None:
    w = Watchdog(WatchdogConfig(enabled=False), Clock())
    assert w.assess("rollout-0", 1, None).action == "fail"


def test_a_stop_signal_while_a_component_starts_is_kept_for_its_preemption_flag() -> None:
    """Slurm may preempt a rollout while Python still imports torch: the component's ``__main__`` catches the
    signal first (``catch_early``), so the process is not killed by it and stops at its first safe point."""
    import subprocess
    import sys

    code = ("import os, signal\n"
            "from hpcrl.runtime.preempt import PreemptionFlag, catch_early\n"
            "catch_early()\n"
            "os.kill(os.getpid(), signal.SIGTERM)  # before the flag exists: the default action would kill it\n"
            "flag = PreemptionFlag()\n"
            "print(flag.requested, signal.Signals(flag.signum).name)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "SIGTERM"], proc.stderr
    assert "received SIGTERM while starting" in proc.stderr
