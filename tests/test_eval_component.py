"""Held-out evaluation as its own component (``eval.mode: component``, ``python -m hpcrl.eval``).

Real runs of ``python -m hpcrl.submit`` on this machine: the trainer hands
each due version over as a snapshot and evaluates nothing itself; the
evaluation process records every due version once, with the accuracy of
the weights the trainer published (checked against an evaluation of the
published file in this process), and the run ends only after the final
version is recorded. Then the states a killed evaluation process can leave
behind (a record written but its snapshot not removed, a half-written
record) are recreated on that run and a new process is started on it: it
evaluates only what has no record, and records each snapshot once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_e2e import check_ok, submit

from hpcrl.audit import audit
from hpcrl.config import load_saved
from hpcrl.eval.snapshots import EVAL_LOG, EvalLog, Snapshots
from hpcrl.metrics.writer import read_evals, read_metrics

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
COMPONENT = ("eval.mode=component", "trainer.total_steps=8", "eval.every_steps=4")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eval-cache")


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache) -> Path:
    run_dir = tmp_path_factory.mktemp("eval-run") / "run"
    check_ok(submit(run_dir, cache, *COMPONENT, "weights.keep_last=10"))
    return run_dir


def published_accuracy(run_dir: Path, version: int) -> float:
    """Greedy accuracy of the published weights of ``version``, evaluated in this process."""
    from safetensors.torch import load_file

    from hpcrl.eval.accuracy import greedy_accuracy
    from hpcrl.model.hf_io import load_model, load_tokenizer
    from hpcrl.eval.measure import scorer
    from hpcrl.prepared import load_datasets, load_prepared
    from hpcrl.reward.runner import RewardRunner

    cfg, prep = load_saved(run_dir), load_prepared(run_dir)
    tokenizer = load_tokenizer(prep.init_model)
    model = load_model(prep.init_model)
    model.load_state_dict(load_file(str(run_dir / "weights" / f"v{version:06d}" / "model.safetensors")), strict=False)
    _, rows = load_datasets(cfg, tokenizer, Path(prep.train_path), Path(prep.eval_path), prep.init_model)
    runner = RewardRunner(cfg.reward)
    try:
        return greedy_accuracy(model, tokenizer, rows[: cfg.eval.size], scorer(runner),
                               max_new_tokens=cfg.rollout.max_new_tokens).accuracy
    finally:
        runner.close()


def test_the_component_evaluates_every_due_version_once_and_the_trainer_none(run) -> None:
    trainer = read_metrics(run / "logs" / "metrics.jsonl")
    assert not [r for r in trainer if "eval/accuracy" in r]  # the trainer evaluated nothing
    assert [r["step"] for r in trainer if "time/snapshot_s" in r] == [4, 8]  # it handed these over
    evals = read_metrics(run / "logs" / EVAL_LOG)
    assert [r["step"] for r in evals] == [0, 4, 8]
    assert evals[0]["eval/snapshot"] == "v0@initial" and all(r["eval/n"] == 40 for r in evals)
    for r in evals[1:]:  # the weights the trainer published at that step, evaluated by the component
        assert r["eval/accuracy"] == pytest.approx(published_accuracy(run, r["step"]), abs=1e-9)
    assert Snapshots(run / "eval" / "pending").pending() == []
    summary = __import__("json").loads((run / "summary.json").read_text())
    assert summary["initial_accuracy"] == evals[0]["eval/accuracy"]
    assert summary["final_accuracy"] == evals[-1]["eval/accuracy"]
    rep = audit(run)
    assert rep.ok and rep.evaluations == 3, rep.violations


def test_colocated_runs_hand_over_snapshots_written_from_memory(tmp_path, cache) -> None:
    run = tmp_path / "colocated"
    check_ok(submit(run, cache, *COMPONENT, "launch.mode=colocated"))
    assert [r["step"] for r in read_evals(run / "logs")] == [0, 4, 8]
    published = sorted(p.name for p in (run / "weights").glob("v*"))
    assert "v000004" not in published and "v000008" not in published, published  # so the snapshots were written
    rep = audit(run)
    assert rep.ok and rep.evaluations == 3, rep.violations


def test_a_restarted_evaluation_records_each_snapshot_once(run, tmp_path) -> None:
    """What a kill -9 can leave: a snapshot recorded but not removed, and a record cut off mid-line."""
    work = tmp_path / "run"
    shutil.copytree(run, work, symlinks=True)
    (work / "config.yaml").write_text((work / "config.yaml").read_text().replace(str(run), str(work)))
    snaps, published = Snapshots(work / "eval" / "pending"), work / "weights" / "v000008" / "model.safetensors"
    done = snaps.put(8, None, "killed", 1.0, published)  # evaluated, recorded, then the process was killed
    todo = snaps.put(8, None, "again", 2.0, published)  # a restarted trainer published version 8 again
    elog = EvalLog(work / "logs", tensorboard=False)
    elog.append({"step": 8, "eval/accuracy": 0.125, "eval/snapshot": done.id})
    elog.close()
    with open(work / "logs" / EVAL_LOG, "a") as f:
        f.write('{"step": 8, "eval/accuracy": 0.5, "eval/snap')  # the record of `todo`, cut off by the kill

    def evaluate() -> list[dict]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HPCRL_")}  # started by hand: no owner
        proc = subprocess.run([sys.executable, "-m", "hpcrl.eval", "--run-dir", str(work)], capture_output=True,
                              text=True, timeout=120, env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return read_metrics(work / "logs" / EVAL_LOG)

    records = evaluate()
    assert [r["eval/snapshot"] for r in records] == ["v0@initial", "v4@e1n1", "v8@e1n1", done.id, todo.id]
    assert records[3]["eval/accuracy"] == 0.125  # recorded before the kill: not evaluated again
    assert records[4]["eval/accuracy"] == pytest.approx(published_accuracy(work, 8), abs=1e-9)
    assert (work / "logs" / EVAL_LOG).read_text().endswith("}\n")  # the torn line is gone
    assert snaps.pending() == []
    assert evaluate() == records  # nothing pending: a further start evaluates nothing
    rep = audit(work)
    assert rep.ok and rep.evaluations == 5, rep.violations
    assert read_evals(work / "logs")[-1]["eval/snapshot"] == todo.id  # the last record of a step stands


def test_a_resume_with_evaluation_in_the_trainer_evaluates_what_the_component_left(run, tmp_path) -> None:
    """eval.* may change on --resume: snapshots a component never got to are evaluated by the trainer."""
    from hpcrl.eval.config import EvalConfig
    from hpcrl.model.hf_io import load_tokenizer
    from hpcrl.eval.measure import held_out
    from hpcrl.prepared import load_datasets, load_prepared
    from hpcrl.reward.runner import RewardRunner
    from hpcrl.trainer.report import Reporter

    work = tmp_path / "run"
    shutil.copytree(run, work, symlinks=True)
    snaps = Snapshots(work / "eval" / "pending")
    left = snaps.put(8, None, "unevaluated", 3.0, work / "weights" / "v000008" / "model.safetensors")
    cfg, prep = load_saved(work), load_prepared(work)
    tokenizer = load_tokenizer(prep.init_model)
    _, rows = load_datasets(cfg, tokenizer, Path(prep.train_path), Path(prep.eval_path), prep.init_model)
    runner = RewardRunner(cfg.reward)
    reporter = Reporter(work / "logs", EvalConfig(every_steps=4, size=40), 8, model_path=prep.init_model,
                        eval_rows=rows, measure=held_out(cfg, tokenizer, runner))
    try:
        reporter.start(8)
    finally:
        reporter.close()
        runner.close()
    record = read_metrics(work / "logs" / "metrics.jsonl")[-1]
    assert record["eval/snapshot"] == left.id and record["step"] == 8
    assert record["eval/accuracy"] == pytest.approx(published_accuracy(work, 8), abs=1e-9)
    assert snaps.pending() == []
