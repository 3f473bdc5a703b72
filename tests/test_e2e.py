"""End-to-end runs of ``python -m hpcrl.submit`` on this machine (real processes).

Small runs (tiny model, no SFT) that check the invariants from the run
directory: the staleness bound on every trained token, exactly-once
training, eta = 0 reproducing synchronous RL batch for batch, colocated mode,
2 trainer ranks, and a failing component stopping the run with exit code 1.
"""

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
from light import heavy_modules, light_command

from hpcrl.audit import audit
from hpcrl.ckpt.store import committed
from hpcrl.config import load_saved
from hpcrl.metrics.writer import read_metrics
from hpcrl.spool.format import read_group, write_group
from hpcrl.spool.store import Spool
from hpcrl.spool.taken import TakenMark

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def submit_args(run_dir: Path, cache: Path, *overrides: str) -> list[str]:
    return [f"run_dir={run_dir}", f"model.cache_dir={cache}/models", f"data.synthetic_dir={cache}/data",
            "model.tiny_hidden_size=32", "model.tiny_layers=2", "data.n_train=2000", "data.n_eval=40",
            "sft.enabled=false", "admission.batch_size=4", "rollout.group_size=4", "rollout.max_batch_size=8",
            "rollout.max_new_tokens=4", "trainer.total_steps=8", "eval.every_steps=4", "eval.size=40",
            "launch.progress_interval_s=1", *overrides]


def submit(run_dir: Path, cache: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    args = submit_args(run_dir, cache, *overrides)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
                           *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_a_failed_start_leaves_a_directory_that_a_corrected_rerun_reuses(tmp_path, cache) -> None:
    run = tmp_path / "failed"
    bad = submit(run, cache, "model.tiny=false", f"model.path={tmp_path / 'nowhere'}")
    assert bad.returncode == 2 and "nothing was admitted or trained" in bad.stderr, bad.stderr[-3000:]
    assert (run / "config.yaml").exists() and (run / "FAILED_START").exists()
    fixed = submit(run, cache, "trainer.total_steps=2", "eval.every_steps=0")  # the same run_dir, config fixed
    check_ok(fixed)
    assert "its previous start failed before any work" in fixed.stderr and not (run / "FAILED_START").exists()
    assert audit(run).ok and audit(run).steps == 2
    again = submit(run, cache)  # a directory with work in it is never replaced
    assert again.returncode == 2 and "already holds a run" in again.stderr


def test_async_run_respects_staleness_and_trains_each_group_once(tmp_path, cache) -> None:
    run = tmp_path / "async"
    check_ok(submit(run, cache, "admission.max_staleness=1"))
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.steps == 8 and rep.trained_groups == 8 * 4
    assert rep.max_token_staleness <= 1
    assert sum(rep.reward_status.values()) == 8 * 4 * load_saved(run).rollout.group_size
    assert set(rep.reward_status) <= {"ok", "error", "timeout", "invalid"}
    forged = sorted(Spool(run / "spool").trained().items())[0][1][0].path  # a group trained on failed scorings
    group = read_group(forged)
    group.meta["reward_status"] = ["infra_error"] * len(group.samples)
    write_group(forged, group)
    assert any("infra_error" in v for v in audit(run).violations)
    records = read_metrics(run / "logs" / "metrics.jsonl")
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    for key in ("reward/mean", "staleness/max", "time/elapsed_s", "throughput/samples_per_s"):
        assert all(key in r for r in steps), key
    evals = [r["step"] for r in records if r.get("eval/accuracy") is not None]
    assert evals == [0, 4, 8]
    assert list((run / "logs" / "tensorboard").glob("events.out.tfevents.*"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["initial_accuracy"] is not None
    assert (run / "weights" / "LATEST").read_text().strip() == "8"
    assert TakenMark(run / "spool").read() == 7  # the batch that trained version 7 was the last one taken


def trained_by_step(run: Path) -> dict[int, list[tuple[int, list[list[int]]]]]:
    out = {}
    for step, entries in Spool(run / "spool").trained().items():
        groups = [read_group(e.path) for e in entries]
        out[step] = sorted((g.ticket, [s.versions.tolist() for s in g.samples]) for g in groups)
    return out


def test_eta_zero_is_synchronous_rl_and_matches_colocated(tmp_path, cache) -> None:
    sync_async = tmp_path / "eta0"
    colocated = tmp_path / "colocated"
    # uniform groups are trained too (zero advantage), so every step measures the train-inference mismatch
    check_ok(submit(sync_async, cache, "admission.max_staleness=0", "trainer.total_steps=5",
                    "algo.drop_uniform_groups=false"))
    check_ok(submit(colocated, cache, "admission.max_staleness=0", "trainer.total_steps=5", "launch.mode=colocated",
                    "algo.drop_uniform_groups=false"))
    a, c = trained_by_step(sync_async), trained_by_step(colocated)
    for step in range(5):
        assert [t for t, _ in a[step]] == list(range(4 * step, 4 * step + 4))  # batch v = tickets [vB, (v+1)B)
        assert all(v == step for _, samples in a[step] for s in samples for v in s)  # generated by version v
    assert a == c
    ra = [r["reward/mean"] for r in read_metrics(sync_async / "logs/metrics.jsonl") if "reward/mean" in r]
    rc = [r["reward/mean"] for r in read_metrics(colocated / "logs/metrics.jsonl") if "reward/mean" in r]
    assert ra == rc  # same samples, same rewards: the disaggregated eta=0 run *is* synchronous RL
    assert TakenMark(sync_async / "spool").read() == 4  # a disaggregated trainer's mark: its last batch ...
    assert not (colocated / "spool" / "taken").exists()  # ... a colocated one none (its rollout waits for it)
    # the colocated trainer reads back what its own rollout worker wrote without parsing it (Spool.on_publish)
    reads = [(r["spool/read_ahead_offered"], r["spool/read_ahead_hits"], r["spool/read_ahead_misses"])
             for r in read_metrics(colocated / "logs/metrics.jsonl") if "spool/read_ahead_hits" in r]
    assert len(reads) == 5 and [sum(r[k] for r in reads) for k in range(3)] == [20, 20, 0], reads
    # every token was generated by the trainer's own step-start weights: the engine/trainer logprob gap is numerics
    steps = [r for r in read_metrics(sync_async / "logs/metrics.jsonl") if "mismatch/tokens" in r]
    assert len(steps) == 5 and all(r["mismatch/tokens"] > 0 and r["mismatch/abs_max"] < 1e-4 for r in steps)


def test_two_trainer_ranks_and_two_rollouts(tmp_path, cache) -> None:
    run = tmp_path / "fsdp2"
    # an even share of the tickets: the first replica up cannot hold them all while the second starts (with
    # fill it could, and at this toy speed it made every group of a 6-step run alone)
    check_ok(submit(run, cache, "trainer.world_size=2", "rollout.replicas=2", "admission.max_staleness=2",
                    "trainer.total_steps=10", "rollout.ticket_share=even"))
    rep = audit(run)
    assert rep.ok, rep.violations
    writers = {e.writer for entries in Spool(run / "spool").trained().values() for e in entries}
    assert rep.steps == 10 and rep.max_token_staleness <= 2
    assert {w.split("-")[0] for w in writers} == {"r0", "r1"}  # both replicas contributed


def test_failing_component_stops_the_run_with_its_log(tmp_path, cache) -> None:
    run = tmp_path / "fail"
    # no CUDA here: the trainer fails at start, is restarted once, fails again and spends its budget
    proc = submit(run, cache, "trainer.backend=nccl", "watchdog.max_restarts=1", "watchdog.backoff_s=0.5",
                  timeout=120)
    assert proc.returncode == 1
    assert "exited with code" in proc.stderr and ("trainer-r0" in proc.stderr or "rollout-0" in proc.stderr)
    assert "restart budget spent (1/1)" in proc.stderr, proc.stderr[-3000:]
    registry = json.loads((run / "jobs" / "registry.json").read_text())
    for job in registry.values():
        status = Path(f"/proc/{job['job_id']}/status")
        assert not status.exists() or "State:\tZ" in status.read_text()  # nothing left running


# Ctrl-C is the same resume as after a crash (tested by the chaos runs): opt-in with -m long
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, marks=pytest.mark.long), signal.SIGUSR2])
def test_resume_a_stopped_run(tmp_path, cache, sig) -> None:
    """Ctrl-C kills every component; SIGUSR2 (walltime of the supervisor's job) makes every component
    checkpoint and stop first (exit 75). Either way ``--resume`` finishes the run, exactly once."""
    run = tmp_path / "stopped"
    steps = 400
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
                             *submit_args(run, cache, f"trainer.total_steps={steps}",
                                          # SIGUSR2 must checkpoint by itself; Ctrl-C resumes from a periodic one
                                          f"ckpt.every_steps={10 * steps if sig == signal.SIGUSR2 else 20}",
                                          "eval.every_steps=0")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
                            # as a script's background job gets it: SIGINT ignored; hpcrl.submit must take it back
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.time() + 120
    while not any(r.get("step", 0) >= 60 for r in read_metrics(run / "logs/metrics.jsonl")):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert not (run / "DONE").exists(), err[-3000:]
    assert not Spool(run / "spool").dropped()  # nothing given up: the run was not closed, only stopped
    if sig == signal.SIGUSR2:
        assert proc.returncode == 75 and f"--resume {run}" in err, err[-3000:]
        stopped_at = max(r["step"] for r in read_metrics(run / "logs/metrics.jsonl") if "step" in r)
        assert (run / "ckpt" / f"step_{stopped_at:06d}").is_dir()  # checkpointed where it stopped
        assert "stopped (exit 75)" in err
    else:
        assert proc.returncode == 130
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}

    def resume(*args: str) -> subprocess.CompletedProcess:
        out = subprocess.run(light_command("hpcrl.submit", "--resume", *args), capture_output=True, text=True,
                             timeout=300, env={**env, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}, cwd=ROOT)
        assert heavy_modules(out.stderr) == []  # the supervisor stays light: its components do the heavy work
        return out

    bad = resume(str(run), "trainer.lr=1", "eval.every_steps=0")
    assert bad.returncode == 2 and "--resume cannot change trainer.lr:" in bad.stderr, bad.stderr[-2000:]
    ckpts = [c for _, c in committed(run / "ckpt")]  # Ctrl-C may have cut a save short: step_N.tmp
    if sig == signal.SIGUSR2:  # resume from the checkpoint directory itself, and train longer than planned
        assert ckpts[-1].name == f"step_{stopped_at:06d}"
        done = resume(str(ckpts[-1]), f"trainer.total_steps={steps + 20}")
        steps += 20
    else:
        older = resume(str(ckpts[0]))  # an older checkpoint than the newest: its later training would be lost
        assert older.returncode == 2 and f"not the newest valid checkpoint ({ckpts[-1].name})" in older.stderr
        assert "add --rewind" in older.stderr
        done = resume(str(ckpts[0]), "--rewind")  # go back: what was trained after it returns to the queue
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = [ln for ln in (run / "logs" / "trainer-r0.log").read_text().splitlines() if "resumed from" in ln]
    expected = ckpts[-1] if sig == signal.SIGUSR2 else ckpts[0]
    assert resumed and expected.name in resumed[0], resumed
    events = [json.loads(x) for x in (run / "jobs" / "events.jsonl").read_text().splitlines()]
    if sig == signal.SIGUSR2:
        assert [e.get("overrides") for e in events if e["action"] in ("resume", "rewind")] == \
            [[f"trainer.total_steps={steps}"]]
    else:
        rewinds = [e for e in events if e["action"] == "rewind"]
        assert len(rewinds) == 1 and rewinds[0]["set_aside"] == [int(c.name[5:]) for c in ckpts[1:]], events
        assert [c.name for c in ckpts[1:]] == \
            sorted(p.name for p in (run / "ckpt" / "rewound").glob("*/step_*") if ".tmp" not in p.name)
    rep = audit(run)
    assert rep.ok and rep.steps == steps and rep.unfinished == 0, rep.violations
    if sig == signal.SIGUSR2:  # a new run from this one's newest checkpoint, where its data left off
        new = tmp_path / "continued"
        started = subprocess.run([sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
                                  "--from", str(run), "--restore", "data,optimizer",
                                  *submit_args(new, cache, "trainer.total_steps=10", "eval.every_steps=0")],
                                 capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        assert started.returncode == 0, started.stderr[-3000:]
        taken = json.loads((new / "prepared.json").read_text())["init_from"]
        assert taken["checkpoint"].endswith(f"step_{steps:06d}") and taken["data_offset"] >= steps * 4, taken
        rep = audit(new)  # every trained group sits at its ticket's position, shifted by the offset
        assert rep.ok and rep.steps == 10, rep.violations


def hpcrl_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m hpcrl ...``, which never imports torch or transformers (checked at every call)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    out = subprocess.run(light_command("hpcrl", *args), capture_output=True, text=True, timeout=timeout, env=env,
                         cwd=ROOT)
    assert heavy_modules(out.stderr) == []
    return out


def status_of(run: Path) -> dict:
    out = hpcrl_cli("status", str(run), "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not any(r.get("step", 0) >= step for r in read_metrics(run / "logs/metrics.jsonl")):
        assert time.time() < deadline and proc.poll() is None, proc.poll()
        time.sleep(0.2)


def last_step(run: Path) -> int:
    return max(r["step"] for r in read_metrics(run / "logs/metrics.jsonl") if "reward/mean" in r)


def test_status_and_cancel_with_and_without_a_live_supervisor(tmp_path, cache) -> None:
    """``python -m hpcrl status`` shows a running run; ``cancel`` stops it through its supervisor (exit 4, every
    component checkpoints, no requeue); after ``--resume`` and a kill -9 of that supervisor, ``cancel`` stops
    the orphaned components itself, and the trainer checkpoints again. The audit stays clean."""
    run, steps = tmp_path / "cancel", 1000
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    assert hpcrl_cli("status", str(tmp_path)).returncode == 2  # not a run directory: said, not a traceback
    first = subprocess.Popen([sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
                              *submit_args(run, cache, f"trainer.total_steps={steps}", f"ckpt.every_steps={10 * steps}",
                                           "eval.every_steps=0")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    wait_for_step(run, 30, first)
    st = status_of(run)
    assert st["state"] == "running" and st["supervisor"]["state"] == "running", st
    assert st["supervisor"]["pid"] == first.pid and st["progress"]["step"] >= 30
    assert st["progress"]["total_steps"] == steps and st["progress"]["checkpoint"] is None
    assert {n: c["state"] for n, c in st["components"].items()} == {"trainer-r0": "running", "rollout-0": "running"}
    assert st["progress"]["tickets_admitted"] >= 4 * st["progress"]["step"]
    storage = st["storage"]
    assert storage["footprint"]["spool"] > 0 and storage["footprint"]["weights"] > 0, storage
    assert storage["filesystem"]["free_bytes"] > 0 and Path(storage["filesystem"]["mount"]).is_dir(), storage
    text = hpcrl_cli("status", str(run)).stdout
    assert "state: running" in text and "trainer-r0" in text and f"/{steps}" in text, text
    assert f"filesystem {storage['filesystem']['mount']}: " in text and "run footprint" in text, text

    cancelled = hpcrl_cli("cancel", str(run))
    assert cancelled.returncode == 0, cancelled.stderr[-3000:]
    _, err = first.communicate(timeout=60)
    assert first.returncode == 4 and "cancelled by" in err and f"--resume {run}" in err, err[-3000:]
    at = last_step(run)
    assert (run / "ckpt" / f"step_{at:06d}").is_dir()  # checkpointed where it stopped, not requeued
    st = status_of(run)
    assert st["state"] == "cancelled" and st["supervisor"]["state"] == "exited", st
    assert not any(c["alive"] for c in st["components"].values()) and st["progress"]["checkpoint_step"] == at

    second = subprocess.Popen([sys.executable, "-m", "hpcrl.submit", "--resume", str(run)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, cwd=ROOT, env=env)
    wait_for_step(run, at + 30, second)
    assert status_of(run)["state"] == "running"  # --resume cleared the cancel request
    second.kill()  # the supervisor only: its trainer and rollout run on
    second.wait()
    st = status_of(run)
    assert st["supervisor"]["state"] == "lost" and st["state"].startswith("orphaned"), st
    cancelled = hpcrl_cli("cancel", str(run))
    assert cancelled.returncode == 0 and "no supervisor runs" in cancelled.stderr, cancelled.stderr[-3000:]
    again = last_step(run)
    assert again > at and (run / "ckpt" / f"step_{again:06d}").is_dir()
    assert not load_chaos().run_processes(run)
    assert status_of(run)["state"] == "cancelled"
    rep = audit(run)
    assert rep.ok and rep.steps == again, rep.violations
    cli = subprocess.run(light_command("hpcrl.audit", str(run)), capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**env, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    assert cli.returncode == 0 and heavy_modules(cli.stderr) == [], cli.stdout + cli.stderr[-2000:]


def test_resume_after_a_supervisor_crash_never_runs_two_owners(tmp_path, cache) -> None:
    """kill -9 of the supervisor leaves its trainer and rollout running; ``--resume`` fences them (new owner
    epoch), waits for them to stop, and only then starts its own: sampled every 20 ms, there is never more
    than one trainer or one rollout-0 process, and the run completes with the audit clean."""
    run, steps = tmp_path / "crash", 1000
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
                              *submit_args(run, cache, f"trainer.total_steps={steps}", "ckpt.every_steps=50",
                                           "eval.every_steps=0")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=env)
    monitor = load_chaos().Monitor(run)  # samples the live trainer and rollout processes every 20 ms
    monitor.start()
    deadline = time.time() + 180
    while not any(r.get("step", 0) >= 40 for r in read_metrics(run / "logs/metrics.jsonl")):
        assert time.time() < deadline and first.poll() is None
        time.sleep(0.2)
    first.kill()  # the supervisor only: its components run on, orphaned
    first.wait()
    old = load_chaos().run_processes(run)
    assert {role: len(pids) for role, pids in old.items()} == {"trainer": 1, "rollout-0": 1}, old
    try:
        done = subprocess.run([sys.executable, "-m", "hpcrl.submit", "--resume", str(run)], capture_output=True,
                              text=True, timeout=600, env=env, cwd=ROOT)
    finally:
        monitor.stopped.set()
        monitor.join()
    assert done.returncode == 0, done.stderr[-4000:]
    assert monitor.peak == {"trainer": 1, "rollout-0": 1}, (monitor.peak, monitor.crowded, old, done.stderr[-3000:])
    assert "taking over from owner epoch 1" in done.stderr and "stopped by itself" in done.stderr, done.stderr[-3000:]
    assert all(not Path(f"/proc/{p}").exists() for p in old["trainer"] + old["rollout-0"])
    assert "fenced:" in (run / "logs" / "trainer-r0.log").read_text()
    assert sorted(p.name for p in (run / "owner").iterdir())[:2] == ["e000000001", "e000000002"]
    rep = audit(run)
    assert rep.ok and rep.steps == steps and rep.unfinished == 0, rep.violations
