"""scripts/bench_fs.py, small (opt-in: ``pytest -m bench tests/test_bench_fs.py``, ~2 minutes).

The filesystem protocol's benchmark on a short run of each of its modes: many writers admit and publish
while the trainer stand-in takes batches (every group accounted for, none twice), the per-group cost stays
flat over the run's length, and the metadata operations per group are what the protocol says (one ticket
create, one publish create + rename + two fsyncs per group on the writer's side). Counts, not wall time.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench
ROOT = Path(__file__).resolve().parents[1]


def bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_fs.py"), *args, "--dir", str(tmp_path / "d"),
                           "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_many_writers_feed_one_trainer(tmp_path) -> None:
    r = bench(tmp_path, "--writers", "4", "--seconds", "8", "--rate", "4", "--tokens", "512,2048")["concurrency"][0]
    assert r["writers"] == 4 and r["groups_trained"] >= 8 and r["admit_ms"]["p50"] > 0
    assert r["tickets"] >= r["groups_trained"]  # nothing trained that was not admitted
    assert r["batch_complete_to_claimed_ms"]["p50"] > 0 and r["trainer_polls_per_step"] is not None


def test_the_cost_per_group_is_flat_over_the_run(tmp_path) -> None:
    r = bench(tmp_path, "--length", "3000", "--length-writers", "2", "--ckpt-every", "20")["length"]
    admit = [w["ms"] for w in r["writer_admit_ms_per_group"]]
    assert len(admit) >= 3 and max(admit[1:]) < 3 * min(admit[1:]) + 0.5, admit  # no growth with the drops


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_metadata_operations_per_group(tmp_path) -> None:
    r = bench(tmp_path, "--ops", "--ops-writers", "2", "--seconds", "6", "--rate", "4", "--tokens", "256,1024")["ops"]
    w = r["per_group_writer"]
    assert r["groups_published"] >= 16
    assert 1.9 <= w["create"] <= 2.3 and 0.95 <= w["rename"] <= 1.1 and 1.9 <= w["fsync"] <= 2.3, w
    assert w.get("listdir dropped/", 0) < 0.1, w  # the bound reads the drop count, it does not list the records
    t = r["per_group_trainer"]
    assert 1.0 <= t["rename"] <= 4.0, t  # claim, commit (and a drop now and then)
    assert t.get("fsync", 0) <= 0.4, t  # reason files only: claims and commits are synced before checkpoints
