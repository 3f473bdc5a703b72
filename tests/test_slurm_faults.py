"""On the real local Slurm cluster: ``scancel`` of the rollout job and of the trainer job during
a run are each followed by a resubmission by the watchdog, jobs that reach their Slurm time
limit (component jobs, and the whole heterogeneous allocation) checkpoint, come back and
finish, a new owner cancels what the previous one left running, and every run completes with
its invariants intact (audit from the run directory)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chaos_script import load_chaos
from slurm_helpers import (ROOT, cluster_skip_reason, job_env, last_step, registry, run_args, sacct, stop_run,
                           submit_cmd, wait_for, wait_not_active)

from hpcrl.audit import audit
from hpcrl.metrics.writer import read_metrics

_reason = cluster_skip_reason()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(_reason is not None, reason=_reason or "")]








def hpcrl_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], capture_output=True, text=True, timeout=300,
                          env=job_env(), cwd=ROOT)


def test_scancel_of_rollout_and_trainer_jobs_is_survived_and_cancel_stops_orphaned_jobs(tmp_path) -> None:
    """Each scancel, and a SIGKILL of the trainer process itself, is followed by a resubmission (sacct shows
    the killed job FAILED 0:9 with its run and start in the comment); ``status`` shows the restarts and states;
    after a kill -9 of the supervisor, ``cancel`` signals the jobs itself (the trainer checkpoints), and
    ``--resume`` finishes the run from that checkpoint."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    cmd = submit_cmd(run, cache, "trainer.total_steps=400", "ckpt.every_steps=10", "eval.every_steps=0",
                     "watchdog.backoff_s=0.5")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "submit.log", "w"),
                            env=job_env(), cwd=ROOT)
    try:
        wait_for(lambda: last_step(run) >= 20, proc, "step 20", run=run)
        for name in ("rollout-0", "trainer"):
            old = registry(run)[name]["job_id"]
            subprocess.run(["scancel", old], check=True)
            wait_for(lambda: registry(run).get(name, {}).get("job_id") not in (None, old), proc,
                     f"resubmission of {name}", run=run)
            step = last_step(run)
            wait_for(lambda: last_step(run) >= step + 10, proc, f"progress after {name} came back", run=run)
        # a hard kill: SIGKILL of the trainer process itself, not through Slurm; it cannot checkpoint
        old, stops = registry(run)["trainer"]["job_id"], log_lines(run / "logs/trainer-r0.log", "preempted (")
        os.kill(load_chaos().run_processes(run)["trainer"][0], signal.SIGKILL)
        wait_for(lambda: registry(run)["trainer"]["job_id"] != old, proc, "resubmission of the killed trainer",
                 run=run)
        step = last_step(run)
        wait_for(lambda: last_step(run) >= step + 10, proc, "progress after the hard kill", run=run)
        assert log_lines(run / "logs/trainer-r0.log", "preempted (") == stops  # no checkpoint on the way out
        wait_not_active([old])  # slurmdbd may lag behind the supervisor, which waited for squeue
        rows = [ln.split("|") for ln in subprocess.run(
            ["sacct", "-n", "-P", "-o", "JobID,State,ExitCode,Comment", "-j", old], capture_output=True, text=True,
            check=True).stdout.splitlines()]
        jobs = {r[0]: r[1:] for r in rows}
        # what happened, not COMPLETED 0:0: the job failed, its step was killed by signal 9
        assert jobs[old][0] == "FAILED" and jobs[f"{old}.0"][1] == "0:9", jobs
        comment = jobs[old][2]
        assert comment.startswith(f"hpcrl,run={run},component=trainer,epoch=1,instance=e1n") and \
            comment.endswith(",start=2"), comment
        st = json.loads(hpcrl_cli("status", str(run), "--json").stdout)
        assert st["state"] == "running" and st["supervisor"]["scheduler"] == "slurm", st
        assert {n: (c["state"], c["restarts"]) for n, c in st["components"].items()} == \
            {"trainer": ("RUNNING", 2), "rollout-0": ("RUNNING", 1)}, st["components"]
        proc.kill()  # the supervisor only: its Slurm jobs run on
        proc.wait()
        cancelled = hpcrl_cli("cancel", str(run))
        assert cancelled.returncode == 0 and "no supervisor runs" in cancelled.stderr, cancelled.stderr[-3000:]
    finally:
        stop_run(proc, run)
    at = last_step(run)
    assert (run / "ckpt" / f"step_{at:06d}").is_dir()
    # the cancel's SIGUSR2 made it checkpoint and stop (after a step, or while it waited for a batch)
    assert len(log_lines(run / "logs/trainer-r0.log", "preempted (")) == len(stops) + 1
    assert log_lines(run / "logs/trainer-r0.log", "received SIGUSR2")
    assert "RUNNING" not in wait_not_active([r["job_id"] for r in registry(run).values()]).values()
    assert json.loads(hpcrl_cli("status", str(run), "--json").stdout)["state"] == "cancelled"
    done = subprocess.run([sys.executable, "-m", "hpcrl.submit", "--resume", str(run)], capture_output=True,
                          text=True, timeout=600, env=job_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(x) for x in (run / "jobs" / "events.jsonl").read_text().splitlines()]
    assert {e["component"] for e in events if e["action"] == "restart"} >= {"rollout-0", "trainer"}
    resumes = [ln for ln in (run / "logs" / "trainer-r0.log").read_text().splitlines() if "resumed from" in ln]
    # two resubmitted trainers (no other one requeued by Slurm beside them), then the resume after the cancel
    assert len(resumes) == 3 and f"step_{at:06d}" in resumes[2], resumes
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.steps == 400 and rep.unfinished == 0


def test_chaos_on_slurm(tmp_path) -> None:
    """A shorter chaos run with every component a Slurm job: SIGKILL through scancel at random moments, and
    one kill -9 of the supervisor followed by ``--resume``, which takes the run over from the jobs it left."""
    report = load_chaos().main(["--kills", "7", "--supervisor-kills", "1", "--steps", "300", "--replicas", "1",
                                "--run-dir", str(tmp_path / "run"), "--cache", str(tmp_path / "cache"), "--seed", "5",
                                "launch.scheduler=slurm"])
    assert report["exit_code"] == 0 and report["violations"] == []
    assert sum(report["kills"].values()) >= 7 and report["kills"]["supervisor"] == 1 and report["restarts"] >= 4
    assert report["peak_live"]["trainer"] == 1 and max(report["peak_live"].values()) == 1, report["crowded"]  # one owner
    assert report["steps"] == 300 and report["unfinished"] == 0 and report["quarantined"] == 0


def test_takeover_scancels_a_slurm_job_that_ignores_the_fence(tmp_path) -> None:
    """A previous owner's job that never checks the fence (here: a bare ``sleep``) is waited for
    ``launch.takeover_timeout_s``, then cancelled with ``scancel``; the new owner starts only after that.
    So is a job the previous owner started but did not record (killed in between): its comment names the run."""
    from hpcrl.config import load_config
    from hpcrl.launch.takeover import take_over

    def sbatch(*extra: str) -> str:
        job = subprocess.run(["sbatch", "--parsable", "-J", "hpcrl-takeover-test", "-o", "/dev/null", *extra,
                              "--wrap", f"sleep 300 # {tmp_path}"], capture_output=True, text=True, timeout=60,
                             check=True)
        return job.stdout.strip().split(";")[0]

    job_id = sbatch()
    unrecorded = sbatch(f"--comment=hpcrl,run={tmp_path.resolve()},component=trainer,epoch=1,instance=e1n2,start=1")
    try:
        (tmp_path / "jobs").mkdir()
        (tmp_path / "jobs" / "registry.json").write_text(json.dumps(
            {"rollout-0": {"job_id": job_id, "scheduler": "slurm", "epoch": 1, "instance": "e1n1"}}))
        cfg = load_config(ROOT / "configs/quickstart.yaml", ["launch.takeover_timeout_s=3"])
        t0 = time.time()
        assert take_over(cfg, tmp_path, epoch=2)
        assert time.time() - t0 >= 3  # it waited for the job to stop by itself first
        deadline = time.time() + 60
        for job in (job_id, unrecorded):
            while sacct(job).get(job, ("", "PENDING", ""))[1] in ("PENDING", "RUNNING", "COMPLETING"):
                assert time.time() < deadline, sacct(job)
                time.sleep(0.5)
            assert sacct(job)[job][1] == "CANCELLED"
    finally:
        subprocess.run(["scancel", job_id, unrecorded], capture_output=True)


def events_of(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "jobs" / "events.jsonl").read_text().splitlines()]


def log_lines(path: Path, needle: str) -> list[str]:
    return [ln for ln in path.read_text(errors="replace").splitlines() if needle in ln]


# Slurm checks time limits every 30 s and sends the warning signal once end < now + N + 30: with
# --time=2 and USR2@60 it comes 30-60 s after the start and the kill at >= 120 s, so a component
# always has >= 60 s to checkpoint and exit. The runs below need well over 60 s.
WALLTIME = ["launch.trainer.time_min=2", "launch.trainer.signal_s=60", "launch.rollout.time_min=2",
            "launch.rollout.signal_s=60"]
# ~90 s of training at the ~55 steps/s measured here (the 30-60 s signal always comes first, also on a
# machine 1.5x faster); a slower machine only sees more signalled jobs, each of which must be survived
STEPS = 5000
# The whole allocation gets USR2@30 instead (signal 60-90 s after the start, after 15-45 s of start-up):
# each requeue costs the 1-4 minutes Slurm keeps a requeued job pending, so fewer, longer segments. The
# run is sized in *seconds* of this machine's pipeline (about 100 s of training: longer than the 45-75 s
# before the signal, short enough for 2-3 segments), since machines here differ by 3x in speed.
HET_TRAIN_S = 100


@pytest.fixture(scope="module")
def het_steps(tmp_path_factory) -> int:
    """HET_TRAIN_S worth of steps, from a short local run of the same config on this machine."""
    run = tmp_path_factory.mktemp("calibrate") / "run"
    cmd = [sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
           *run_args(run, run.parent / "cache", "trainer.total_steps=300", "eval.every_steps=0")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r["time/step_s"] for r in read_metrics(run / "logs" / "metrics.jsonl") if "time/step_s" in r][50:]
    return int(HET_TRAIN_S * len(steps) / sum(steps))


@pytest.mark.long  # ~7 minutes of 2-minute jobs running out: opt-in with -m long
def test_component_jobs_reaching_their_time_limit_checkpoint_and_are_resubmitted(tmp_path) -> None:
    """Each component is a 2-minute Slurm job (USR2 60 s before the end): the run outlives every job."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    cmd = submit_cmd(run, cache, f"trainer.total_steps={STEPS}", "ckpt.every_steps=100", "eval.every_steps=0",
                     "watchdog.backoff_s=0.5", "launch.preempt_grace_s=20", *WALLTIME)
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=job_env(),
                          cwd=ROOT, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    restarts = [e for e in events_of(run) if e["action"] == "restart"]
    walltime = {e["component"] for e in restarts if "preemption/requeue (exit 75)" in e["reason"]}
    assert {"trainer", "rollout-0"} <= walltime, restarts
    trainer_log = run / "logs" / "trainer-r0.log"
    stopped = log_lines(trainer_log, "exiting for a restart")  # one per signalled trainer job
    assert stopped and len(log_lines(trainer_log, "resumed from")) >= len(stopped), trainer_log.read_text()[-3000:]
    # the signalled jobs ended by themselves before the limit: none was killed in state TIMEOUT
    states = sacct(*{e["job_id"] for e in restarts})
    assert {s for _, s, _ in states.values()} <= {"COMPLETED"}, states
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.steps == STEPS and rep.unfinished == 0


@pytest.mark.long  # 6-9 minutes, most of it a requeued job pending: opt-in with -m long
def test_het_allocation_reaching_its_walltime_is_requeued_and_resumes(tmp_path, het_steps) -> None:
    """``sbatch --time=2 --signal=B:USR2@30 sbatch/run_async_ppo.sh``: the supervisor stops every
    component at a checkpoint, requeues the job, and the requeued job resumes the run to the end."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    env = {**job_env(), "HPCRL_PYTHON": sys.executable, "HPCRL_RUN_DIR": str(run),
           "HPCRL_OVERRIDES": " ".join(run_args(run, cache, "ckpt.every_steps=100", "eval.every_steps=0",
                                                "launch.preempt_grace_s=20")[1:])}
    sub = subprocess.run(["sbatch", "--parsable", "--time=2", "--signal=B:USR2@30", f"--output={tmp_path}/b-%j.out",
                          str(ROOT / "sbatch/run_async_ppo.sh"), f"trainer.total_steps={het_steps}"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    deadline = time.time() + 700
    while sacct(job).get(f"{job}+0", ("", "PENDING", ""))[1] in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
        assert time.time() < deadline, f"job {job} still active after 700 s"
        time.sleep(2)
    batch_log = (run / "logs" / f"batch-{job}.log").read_text(errors="replace")
    assert sacct(job)[f"{job}+0"][1] == "COMPLETED", batch_log[-4000:]
    assert "restart 1" in batch_log and "Slurm requeues this job" in batch_log, batch_log[-4000:]
    assert (run / "DONE").exists()
    trainer_log = run / "logs" / "trainer-r0.log"
    assert log_lines(trainer_log, "received SIGUSR2") and log_lines(trainer_log, "resumed from")
    # every attempt's steps (-D): a component stopped at the walltime to be restarted ends its step
    # COMPLETED 0:0, not FAILED 75:0
    out = subprocess.run(["sacct", "-D", "-n", "-P", "-o", "JobID,JobName,State,ExitCode", "-j", job],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    steps = [ln.split("|") for ln in out.splitlines() if "|hpcrl-" in ln]
    assert not [s for s in steps if s[3] == "75:0"], out
    assert [s for s in steps if s[1] == "hpcrl-trainer" and s[2] == "COMPLETED"], out
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.steps == het_steps and rep.unfinished == 0
