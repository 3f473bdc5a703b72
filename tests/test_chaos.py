"""Chaos: 20 kill -9 of random components at random moments (some aimed at checkpoint
writes and spool publishes) during a real local run; the watchdog resubmits each, the run
completes, and the run directory proves nothing was lost, duplicated or read half-written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def load_chaos():
    spec = importlib.util.spec_from_file_location("chaos", ROOT / "scripts" / "chaos.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_twenty_kills_lose_nothing(tmp_path) -> None:
    chaos = load_chaos()
    report = chaos.main(["--kills", "20", "--steps", "150", "--run-dir", str(tmp_path / "run"),
                         "--cache", str(tmp_path / "cache"), "--seed", "1"])
    assert report["exit_code"] == 0
    assert sum(report["kills"].values()) >= 20
    assert report["restarts"] >= 20  # every victim was resubmitted
    assert report["violations"] == []  # staleness bound and exactly-once, from the run directory
    assert report["steps"] == 150 and report["unfinished"] == 0
    assert report["quarantined"] == 0  # no reader ever saw a partial spool file
    assert report["trained_groups"] == 150 * 4


def test_trainer_kills_with_collective_weights(tmp_path) -> None:
    """Rollouts keep generating through trainer restarts and rejoin the new trainer's group."""
    chaos = load_chaos()
    report = chaos.main(["--kills", "4", "--steps", "600", "--only", "trainer", "--run-dir", str(tmp_path / "run"),
                         "--cache", str(tmp_path / "cache"), "--seed", "3", "weights.mode=collective"])
    assert report["exit_code"] == 0 and report["violations"] == []
    assert report["victims"].keys() == {"trainer-r0"} and report["restarts"] >= 4
    assert report["steps"] == 600 and report["unfinished"] == 0
