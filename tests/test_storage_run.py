"""A whole run on a size-capped filesystem filled to the last byte at random steps (the fault-injection tier:
``scripts/faults/storage_faults.py``, real ENOSPC from the kernel): the supervisor lives through every fault,
what stopped on one restarts free of charge once space is back, and the run ends by itself with a clean audit
and no temporary left."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.tiny_hidden_size=32", "model.tiny_layers=2", "data.n_train=2000", "data.n_eval=40", "sft.enabled=false",
         "admission.batch_size=4", "rollout.group_size=4", "rollout.max_batch_size=8", "rollout.max_new_tokens=4",
         "eval.every_steps=60", "eval.size=40", "ckpt.every_steps=20"]


def test_a_run_whose_filesystem_fills_three_times_finishes_by_itself_with_a_clean_audit(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare for a private tmpfs")
    out = tmp_path / "report.json"
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/faults/storage_faults.py"), "--steps", "150",
                           "--faults", "3", "--hold-s", "5", "--size-mb", "200", "--seed", "4", "--timeout-s", "400",
                           "--out", str(out), "--", f"model.cache_dir={cache}/models",
                           f"data.synthetic_dir={cache}/data", *SMALL],
                          capture_output=True, text=True, timeout=480, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if not out.exists() and "Operation not permitted" in proc.stderr:
        pytest.skip(f"no private mount namespace here: {proc.stderr.strip()[-300:]}")
    report = json.loads(out.read_text())
    log = out.with_suffix(".log").read_text()
    assert proc.returncode == 0 and report["exit_code"] == 0, log[-6000:]
    assert len(report["faults"]) == 3 and all(f["filled_mb"] > 0 for f in report["faults"])
    # seed 4 fills at steps 28, 62 and 79 of 150: each comes while the run trains (this run makes ~25 steps a second)
    assert all(f["step_when_freed"] < 150 for f in report["faults"]), "every fault came while the run trained"
    assert report["restarts_for_storage"] >= 1 and report["other_restarts"] == [], report
    assert report["tracebacks_in_submit_log"] == 0, log[-6000:]
    first = [line for line in report["storage_lines"] if "ERROR" in line and "storage fault" in line]
    assert first and all(" free of " in line and "launch.min_free_gb" in line for line in first), first
    assert len(first) <= 3, "said once per fault (by a component's stop or the supervisor's own write)"
    assert report["audit"]["ok"], report["audit"]
    assert report["audit"]["steps"] == 150 and report["audit"]["unfinished"] == 0
    assert report["temporaries_left"] == []
