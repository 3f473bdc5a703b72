"""Runs on the real local Slurm cluster (scripts/slurm_cluster.sh): submitit jobs and one het sbatch job.

Checks, from sacct and the run directory: the shortened quickstart completes
through ``python -m hpcrl.submit ... launch.scheduler=slurm`` with the trainer
(2 ranks on 2 nodes), the rollout and the evaluation component as separate jobs, and through
``sbatch sbatch/run_async_ppo.sh`` with trainer and rollout in separate het
groups; a second rollout job added mid-run contributes trajectories with the
staleness bound holding; bad input (missing partition, impossible
resources, an sbatch rejection) is found by ``--dry-run`` before anything is
queued, and fails a real submission with the component and Slurm's message,
leaving nothing running.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_helpers import (ROOT, cluster_skip_reason, job_env, run_args, sacct, stop_run, submit_cmd,
                           wait_not_active)

from hpcrl.audit import audit
from hpcrl.metrics.writer import read_evals, read_metrics
from hpcrl.spool.store import Spool

_reason = cluster_skip_reason()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(_reason is not None, reason=_reason or "")]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slurm-cache")


def steps_done(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run / "logs" / "metrics.jsonl") if "reward/mean" in r]


def test_submit_with_slurm_runs_each_component_as_its_own_job(tmp_path, cache) -> None:
    """Trainer (2 ranks on 2 nodes), rollout and the evaluation component each a job of their own."""
    run = tmp_path / "run"
    proc = subprocess.run(submit_cmd(run, cache, "trainer.total_steps=8", "trainer.world_size=2",
                                     "launch.trainer.nodes=2", "eval.mode=component", "eval.every_steps=4"),
                          capture_output=True, text=True, timeout=240, env=job_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    registry = json.loads((run / "jobs" / "registry.json").read_text())
    assert set(registry) == {"trainer", "rollout-0", "eval"}
    trainer, rollout, evaluator = (registry[n]["job_id"] for n in ("trainer", "rollout-0", "eval"))
    assert len({trainer, rollout, evaluator}) == 3
    jobs = sacct(trainer, rollout, evaluator)
    assert jobs[trainer][:2] == ("hpcrl-trainer", "COMPLETED")
    assert jobs[trainer][2] == "node[1-2]"  # the trainer's 2 ranks, one task per node
    assert jobs[rollout][:2] == ("hpcrl-rollout-0", "COMPLETED")
    assert jobs[evaluator][:2] == ("hpcrl-eval", "COMPLETED")
    assert (run / "logs" / "trainer-r1.log").exists()
    assert steps_done(run) == list(range(1, 9))
    assert [r["step"] for r in read_evals(run / "logs")] == [0, 4, 8]  # from the evaluation job
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.trained_groups == 8 * 4 and rep.evaluations == 3


def test_the_reward_service_is_a_slurm_job_of_its_own(tmp_path, cache) -> None:
    """``reward.service=true``: the reward service runs as its own job (resources ``launch.reward``), the rollout
    hands it every group to score, and the run ends with the service's job COMPLETED."""
    run = tmp_path / "run"
    proc = subprocess.run(submit_cmd(run, cache, "trainer.total_steps=8", "eval.every_steps=0", "reward.service=true",
                                     "launch.reward.partition=debug", "launch.reward.cpus_per_task=1"),
                          capture_output=True, text=True, timeout=240, env=job_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    registry = json.loads((run / "jobs" / "registry.json").read_text())
    assert set(registry) == {"trainer", "rollout-0", "reward"}
    wait_not_active([registry["reward"]["job_id"]])
    assert sacct(registry["reward"]["job_id"])[registry["reward"]["job_id"]][:2] == ("hpcrl-reward", "COMPLETED")
    assert "reward service started" in (run / "logs" / "reward.log").read_text()
    stats = json.loads((run / "logs" / "rollout-0.stats.json").read_text())
    # every group scored by the service; a group still waiting for its score when the run ended is an infra error,
    # never trained (the audit checks every trained sample's reward status)
    assert stats["reward"]["ok"] >= 8 * 4 * 4 and stats["samples_infra_error"] <= 4 * 4, stats
    # its threads' CPU, taken before closing ended the one that wrote the spool files
    assert stats["cpu_threads_s"]["MainThread"] > 0 and "spool-publisher" in stats["cpu_threads_s"], stats
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.steps == 8


def test_sbatch_het_job_runs_trainer_and_rollout_in_separate_het_groups(tmp_path, cache) -> None:
    """Through scripts/submit_sbatch.sh: it finds the checkout's Python by itself, checks the run (dry run,
    sbatch --test-only), then queues sbatch/run_async_ppo.sh with Slurm's output in the run directory."""
    run = tmp_path / "run"
    env = {**job_env(), "HPCRL_RUN_DIR": str(run), "HPCRL_OVERRIDES": " ".join(run_args(run, cache)[1:])}
    env.pop("HPCRL_PYTHON", None)
    wrapper = ["bash", str(ROOT / "scripts/submit_sbatch.sh"), "trainer.total_steps=6"]
    broken = subprocess.run(wrapper, capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**env, "HPCRL_PYTHON": "/bin/false"})
    assert broken.returncode == 2 and "cannot import hpcrl" in broken.stderr, broken.stderr
    bad = subprocess.run([*wrapper, "model.tiny=false", f"model.path={tmp_path}/nomodel"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env=env)
    assert bad.returncode == 1 and "[FAIL] model" in bad.stdout and "nothing was queued" in bad.stderr, bad.stderr
    assert not (run / "logs").exists()
    proc = subprocess.run(wrapper, capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**env, "HPCRL_SBATCH_ARGS": "--wait"})
    job = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    batch_log = next((run / "logs").glob("batch-*.log"), None)
    assert proc.returncode == 0, (proc.stderr, batch_log and batch_log.read_text()[-4000:])
    assert "[ok] trainer (srun): srun " in proc.stdout and "to start at" in proc.stderr  # checked before queueing
    assert (run / "logs" / f"slurm-{job}.out").exists() and (run / "logs" / f"batch-{job}.log").exists()
    registry = json.loads((run / "jobs" / "registry.json").read_text())
    assert registry["trainer"]["argv"][0] == f"{ROOT}/.venv/bin/python"  # the Python the wrapper found
    # each component a step of this allocation, named as sacct shows it (its job_id is the local srun pid)
    assert {n: (r["allocation"], r["step_name"]) for n, r in registry.items()} == \
        {"trainer": (job, "hpcrl-trainer"), "rollout-0": (job, "hpcrl-rollout-0")}
    jobs = sacct(job)
    assert jobs[f"{job}+0"][1] == "COMPLETED" and jobs[f"{job}+1"][1] == "COMPLETED"
    steps = {name: (jid, nodes) for jid, (name, _, nodes) in jobs.items() if "." in jid}
    trainer_step, rollout_step = steps["hpcrl-trainer"][0], steps["hpcrl-rollout-0"][0]
    assert trainer_step.startswith(f"{job}+0."), jobs  # trainer: het group 0
    assert rollout_step.startswith(f"{job}+1."), jobs  # rollout: het group 1
    assert steps["hpcrl-trainer"][1] != steps["hpcrl-rollout-0"][1]  # two nodes
    assert steps_done(run) == list(range(1, 7))
    rep = audit(run)
    assert rep.ok, rep.violations


def test_a_second_rollout_job_added_mid_run_contributes_within_the_staleness_bound(tmp_path, cache) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen(submit_cmd(run, cache, "trainer.total_steps=400", "admission.max_staleness=1",
                                       "rollout.max_new_tokens=8", "eval.every_steps=1000"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=job_env(), cwd=ROOT)
    try:
        deadline = time.time() + 120
        while not (run / "logs" / "metrics.jsonl").exists() or len(steps_done(run)) < 3:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-4000:] if proc.stderr else ""
            time.sleep(0.5)
        added = subprocess.run([sys.executable, "-m", "hpcrl.launch.slurm", "add-rollout", "--run-dir", str(run),
                                "--replica", "1"], capture_output=True, text=True, timeout=60, env=job_env(), cwd=ROOT)
        assert added.returncode == 0, added.stderr
        second = json.loads((run / "jobs" / "rollout-1.json").read_text())["job_id"]
        _, err = proc.communicate(timeout=240)
    finally:
        stop_run(proc, run)
    assert proc.returncode == 0, err[-4000:]
    writers: dict[str, set[int]] = {}
    for step, entries in Spool(run / "spool").trained().items():
        for e in entries:
            writer = e.path.stem.rsplit("_", 1)[-1].split("-")[0]  # r<replica>[-<incarnation>]
            writers.setdefault(writer, set()).add(step)
    assert set(writers) == {"r0", "r1"}, writers
    assert min(writers["r1"]) > 1  # r1 joined mid-run
    assert wait_not_active([second])[second] == "COMPLETED"
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.max_token_staleness <= 1


@pytest.mark.parametrize("override, component, slurm_says", [
    ("launch.rollout.partition=nosuchpartition", "rollout-0", "invalid partition"),
    ("launch.rollout.mem=900G", "rollout-0", "node configuration is not available"),
    ("launch.rollout.extra_sbatch=[--nodelist=nosuchnode]", "rollout-0", "invalid node name"),
])
def test_bad_input_names_component_and_slurm_message_and_leaves_nothing_running(
        tmp_path, cache, override, component, slurm_says) -> None:
    run = tmp_path / "run"
    # --dry-run finds it before anything is queued: sbatch --test-only of each component's script
    dry = subprocess.run([*submit_cmd(run, cache, "trainer.total_steps=50", override), "--dry-run"],
                         capture_output=True, text=True, timeout=120, env=job_env(), cwd=ROOT)
    assert dry.returncode == 1 and not run.exists(), dry.stdout[-3000:] + dry.stderr[-2000:]
    verdicts = {ln.split()[1]: ln for ln in dry.stdout.splitlines() if ln.startswith(("[ok]", "[FAIL]"))}
    assert verdicts[component].startswith("[FAIL]") and slurm_says in verdicts[component].lower(), dry.stdout
    assert "to start at" in verdicts["trainer"] and verdicts["trainer"].startswith("[ok]"), dry.stdout
    proc = subprocess.run(submit_cmd(run, cache, "trainer.total_steps=50", override),
                          capture_output=True, text=True, timeout=120, env=job_env(), cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = [ln for ln in proc.stderr.splitlines() if "ERROR" in ln]
    assert error and component in error[0] and slurm_says in error[0].lower(), proc.stderr[-3000:]
    registry = json.loads((run / "jobs" / "registry.json").read_text())
    assert list(registry) == ["trainer"]  # submitted before the rejection ...
    trainer = registry["trainer"]["job_id"]
    assert wait_not_active([trainer])[trainer] == "CANCELLED"  # ... and cancelled because of it
