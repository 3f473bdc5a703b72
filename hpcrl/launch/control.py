"""Operating a run from outside: ``python -m hpcrl status|cancel <run_dir>``, ``python -m hpcrl scale <run_dir> N``.

Both read only what the run writes on the shared filesystem (the owner
epochs, ``jobs/registry.json`` and ``jobs/events.jsonl``, heartbeats,
``logs/metrics.jsonl``, the ledger and ``ckpt/``), so they work from any
host that sees the run directory, whichever scheduler started the run.

``status`` gathers one snapshot (:func:`run_status`): the run's state, its
supervisor (owner epoch, host, pid, last beat), every component (job, its
state as the scheduler or ``/proc`` reports it, restarts, heartbeat age),
the trainer's step and policy version, the newest committed checkpoint,
the ledger's counts, staleness and throughput, and storage: the run
directory's filesystem (free bytes and inodes) and the run's own footprint
by area (:mod:`hpcrl.launch.footprint`). ``--watch S`` redraws it
every S seconds; ``--json`` prints it as JSON.

``cancel`` stops a run cleanly and leaves it resumable:

1. it writes ``<run_dir>/CANCEL`` (who asked, when);
2. a live supervisor sees it within a second, asks every component to
   checkpoint and stop (SIGUSR2, as on a walltime signal), waits up to
   ``launch.preempt_grace_s``, does not ask Slurm to requeue, and exits
   with :data:`EXIT_CANCELLED`;
3. without a live supervisor (it was killed), ``cancel`` signals the
   components itself (SIGUSR2 to a local process group, ``scancel
   --signal=USR2`` to a Slurm job), waits the same grace, and kills what
   is left (a trainer killed then resumes from its previous checkpoint).

``scale`` writes the wanted rollout count for the supervisor, which starts or
drains replicas (:mod:`hpcrl.launch.fleet`); ``status`` shows the count, who
asked for it, and how many replicas run.

``cancel`` returns when nothing of the run runs any more (exit 0), or after
``--timeout`` saying what still runs (exit 1). ``python -m hpcrl.submit
--resume <run_dir>`` continues a cancelled run (it removes ``CANCEL``).
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from hpcrl.fs import atomic
from hpcrl.ckpt.store import committed
from hpcrl.config import RunConfig, load_saved
from hpcrl.launch.autoscale import last_assessment
from hpcrl.launch.fleet import describe, request_scale, scale_requested, wanted_replicas
from hpcrl.launch.footprint import format_storage, storage_status
from hpcrl.launch.registry import SLURM_JOBS, jobs_of
from hpcrl.launch.slurm_state import QUEUED
from hpcrl.launch.takeover import job_alive, kill_job, registry
from hpcrl.metrics.writer import read_evals, read_metrics
from hpcrl.runtime.heartbeat import read_heartbeats
from hpcrl.runtime.owner import RELEASED, current_epoch, epoch_file, owner_record

log = logging.getLogger(__name__)
CANCEL = "CANCEL"  # written by ``cancel``; the supervisor stops the run when it appears; --resume removes it
EXIT_CANCELLED = 4  # hpcrl.submit's exit code after a cancel: stopped on request, every component checkpointed


def cancel_requested(run_dir: Path) -> dict | None:
    """The cancel request of the run (who and when), or None."""
    try:
        return atomic.read_json(Path(run_dir) / CANCEL)
    except (FileNotFoundError, ValueError):
        return None


# -- status -------------------------------------------------------------------------------------------------------

def supervisor(run_dir: Path, cfg: RunConfig) -> dict:
    """The current owner: epoch, host, pid, seconds since its last beat, and its state: "running",
    "exited" (it released the run), "lost" (its process is gone, or it stopped beating), or "none"."""
    epoch = current_epoch(run_dir)
    if epoch == 0:
        return {"epoch": 0, "state": "none"}
    rec = owner_record(run_dir, epoch)
    path = epoch_file(run_dir, epoch)
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        age = float("inf")
    out = {"epoch": epoch, "host": rec.get("host", "?"), "pid": rec.get("pid"), "beat_age_s": round(age, 1),
           "slurm_job_id": rec.get("slurm_job_id"), "scheduler": rec.get("scheduler", cfg.launch.scheduler)}
    if path.with_name(path.name + RELEASED).exists():
        out["state"] = "exited"
    elif rec.get("host") == socket.gethostname() and rec.get("pid") and not _runs_hpcrl(int(rec["pid"])):
        out["state"] = "lost"
    else:  # it touches the epoch file every heartbeat interval (from any host)
        out["state"] = "running" if age < 3 * cfg.launch.heartbeat_interval_s + 10 else "lost"
    return out


def _runs_hpcrl(pid: int) -> bool:
    try:
        return b"hpcrl" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False


def components(run_dir: Path) -> dict[str, dict]:
    """Every component of the latest owner: its job, state, restarts and heartbeat age."""
    jobs = registry(run_dir)
    restarts: dict[str, int] = {}
    for event in _events(run_dir):
        if event.get("action") == "restart":
            restarts[event["component"]] = restarts.get(event["component"], 0) + 1
    states = _slurm_states([str(r["job_id"]) for r in jobs.values() if jobs_of(r) == SLURM_JOBS])
    beats = read_heartbeats(run_dir)
    out = {}
    for name, rec in jobs.items():
        alive = job_alive(run_dir, dict(rec))
        reach = "slurm" if jobs_of(rec) == SLURM_JOBS else \
            ("remote" if rec.get("host", socket.gethostname()) != socket.gethostname() else "local")
        state, why = states.get(str(rec["job_id"]), ("UNKNOWN", "")) if reach == "slurm" else \
            ("running" if alive else "ended", "") if reach == "local" else (f"on {rec.get('host')} (not checked)", "")
        beat_name = f"{'trainer-r0' if name == 'trainer' else name}@{rec.get('instance', '')}"
        beat = beats.get(beat_name, {})
        job = str(rec["job_id"]) if not rec.get("allocation") else \
            f"{rec['allocation']}:{rec.get('step_name')} (srun pid {rec['job_id']})"  # a step of the allocation
        out[name] = {"job_id": job, "scheduler": rec.get("scheduler"), "host": rec.get("host"),
                     "epoch": rec.get("epoch"), "state": state, "alive": alive, "restarts": restarts.get(name, 0),
                     # why a job waits in Slurm's queue (its pending reason: Resources, Priority, ...), else None
                     "waiting_for": why if state in QUEUED and why not in ("", "None") else None,
                     "heartbeat_age_s": round(time.time() - beat["time"], 1) if "time" in beat else None,
                     "infra_errors": beat.get("infra_errors", 0)}  # a rollout's failed scorings (held, retried)
    return out


def _slurm_states(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """Job id -> (state, reason) as Slurm reports them; {} where it cannot be asked."""
    if not job_ids:
        return {}
    from hpcrl.launch.slurm_state import read_states

    try:
        return read_states(job_ids)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not read the Slurm job states: %s", e)
        return {}


def _events(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "jobs" / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash
            continue
    return out


def progress(run_dir: Path, cfg: RunConfig) -> dict:
    """Where training stands: step, version, reward, accuracy, staleness, throughput, checkpoint, ledger."""
    records = read_metrics(run_dir / "logs" / "metrics.jsonl")
    steps = [r for r in records if "reward/mean" in r]
    last = steps[-1] if steps else {}
    evals = read_evals(run_dir / "logs")
    ckpts = committed(run_dir / "ckpt")
    admission = run_dir / "admission"
    return {
        "step": last.get("step", 0), "total_steps": cfg.trainer.total_steps, "version": last.get("version"),
        "leg": last.get("leg"), "reward_mean": last.get("reward/mean"),
        "accuracy": evals[-1]["eval/accuracy"] if evals else None, "accuracy_step": evals[-1]["step"] if evals else None,
        "staleness_max": last.get("staleness/max"), "staleness_mean_token": last.get("staleness/mean_token"),
        "samples_per_s": last.get("throughput/samples_per_s"), "elapsed_s": last.get("time/elapsed_s"),
        "metrics_age_s": _age(run_dir / "logs" / "metrics.jsonl"),
        "checkpoint": str(ckpts[-1][1]) if ckpts else None, "checkpoint_step": ckpts[-1][0] if ckpts else None,
        "tickets_admitted": _count(admission / "tickets"), "tickets_dropped": _count(admission / "dropped"),
        "reissues_waiting": sum(1 for n in _names(admission / "reissue") if n.startswith("t") and ".taken-" not in n),
    }


def _age(path: Path) -> float | None:
    try:
        return round(time.time() - path.stat().st_mtime, 1)
    except FileNotFoundError:
        return None


def _names(d: Path) -> list[str]:
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []


def _count(d: Path) -> int:
    return sum(1 for n in _names(d) if n.startswith("t"))


def run_status(run_dir: Path) -> dict:
    """One snapshot of a run (see the module docstring)."""
    run_dir = Path(run_dir).expanduser().resolve()
    cfg = load_saved(run_dir)
    sup, comps = supervisor(run_dir, cfg), components(run_dir)
    live = [n for n, c in comps.items() if c["alive"]]
    cancel = cancel_requested(run_dir)
    if (run_dir / "DONE").exists():
        state = "finished"
    elif (run_dir / "FAILED_START").exists():
        state = "failed to start"
    elif cancel is not None:
        state = "cancelling" if sup["state"] == "running" or live else "cancelled"
    elif sup["state"] == "running":
        state = "running"
    elif live:
        state = "orphaned (supervisor gone, components run)"
    elif sup["state"] == "none":
        state = "not started"
    else:
        state = "stopped (resume with --resume)"
    fleet = {"wanted": None if cfg.launch.mode == "colocated" else wanted_replicas(cfg, run_dir),
             "request": scale_requested(run_dir), "autoscale": cfg.launch.autoscale.enabled,
             "assessment": last_assessment(run_dir)}
    return {"run_dir": str(run_dir), "name": cfg.name, "state": state, "cancel": cancel, "supervisor": sup,
            "components": comps, "progress": progress(run_dir, cfg), "fleet": fleet,
            "storage": storage_status(run_dir, cfg.launch.min_free_gb)}


def format_status(st: dict) -> str:
    def v(x, spec="{}"):
        return "-" if x is None else spec.format(x)

    sup, p = st["supervisor"], st["progress"]
    lines = [f"run {st['name']}  {st['run_dir']}", f"state: {st['state']}"]
    if sup["state"] != "none":
        lines.append(f"supervisor: owner epoch {sup['epoch']}, pid {sup.get('pid')} on {sup.get('host')}, "
                     f"{sup['state']} (last beat {v(sup.get('beat_age_s'), '{:.0f}')}s ago)"
                     + (f", in Slurm job {sup['slurm_job_id']}" if sup.get("slurm_job_id") else ""))
    lines.append(f"step {p['step']}/{p['total_steps']}  policy version {v(p['version'])}  "
                 f"reward {v(p['reward_mean'], '{:.3f}')}  held-out acc {v(p['accuracy'], '{:.3f}')}"
                 f"{'' if p['accuracy_step'] is None else ' (step %d)' % p['accuracy_step']}")
    lines.append(f"staleness max {v(p['staleness_max'], '{:.0f}')} mean/token {v(p['staleness_mean_token'], '{:.2f}')}"
                 f"  {v(p['samples_per_s'], '{:.1f}')} samples/s  elapsed {v(p['elapsed_s'], '{:.0f}')}s"
                 f"  last metrics {v(p['metrics_age_s'], '{:.0f}')}s ago")
    lines.append(f"checkpoint: {v(p['checkpoint'])}  tickets admitted {p['tickets_admitted']}, "
                 f"dropped {p['tickets_dropped']}, reissues waiting {p['reissues_waiting']}")
    fleet = st.get("fleet") or {}
    if fleet.get("wanted") is not None:
        running = sum(1 for n, c in st["components"].items() if n.startswith("rollout-") and c.get("alive"))
        lines.append(f"rollout replicas: {fleet['wanted']} wanted ({describe(fleet.get('request'))}), "
                     f"{running} running")
    a = fleet.get("assessment")
    if fleet.get("autoscale") and a:
        share = "-" if a.get("wait_share") is None else f"{a['wait_share']:.0%}"
        last = a.get("last_decision")
        lines.append(f"autoscale: trainer waited {share} of the last {a.get('window_s', 0):.0f}s, ready groups "
                     f"{a.get('ready_groups')}/{a.get('bound_groups')}; last decision: "
                     + ("none" if not last else f"{last['wanted']} -> {last['decision']} ({last['reason']})"))
    if st["components"]:
        lines.append(f"{'component':<12} {'job':<10} {'state':<12} {'restarts':>8} {'heartbeat':>10}")
        for name, c in st["components"].items():
            beat = "-" if c["heartbeat_age_s"] is None else f"{c['heartbeat_age_s']:.0f}s ago"
            lines.append(f"{name:<12} {c['job_id']:<10} {c['state']:<12} {c['restarts']:>8} {beat:>10}"
                         + (f"  waiting for: {c['waiting_for']}" if c.get("waiting_for") else ""))
    failed = {n: c["infra_errors"] for n, c in st["components"].items() if c.get("infra_errors")}
    if failed:
        lines.append("scorings that failed for the scorer's own reasons (infra_error; held and scored again, never "
                     "trained as 0): " + ", ".join(f"{n} {k}" for n, k in failed.items()))
    if st.get("storage"):
        lines.append(format_storage(st["storage"]))
    if st["cancel"]:
        lines.append(f"cancel requested by {st['cancel'].get('user')} on {st['cancel'].get('host')} at "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st['cancel'].get('time', 0)))}")
    return "\n".join(lines)


# -- scale --------------------------------------------------------------------------------------------------------

def scale(run_dir: Path, replicas: int) -> str:
    """Ask the run for ``replicas`` rollout replicas (:mod:`hpcrl.launch.fleet`); what will happen, in words."""
    run_dir = Path(run_dir).expanduser().resolve()
    cfg = load_saved(run_dir)
    if cfg.launch.mode == "colocated":
        raise ValueError("a colocated run (launch.mode=colocated) has no rollout replicas to scale")
    if (run_dir / "DONE").exists():
        raise ValueError(f"{run_dir} has finished")
    if cfg.rollout.server_url and replicas > 1:
        raise ValueError("rollout.server_url is one server, which only one replica may drive")
    before = wanted_replicas(cfg, run_dir)
    request_scale(run_dir, replicas)
    sup = supervisor(run_dir, cfg)
    when = ("its supervisor acts on it within a second" if sup["state"] == "running"
            else "no supervisor runs: the run starts with it when resumed (python -m hpcrl.submit --resume)")
    return f"rollout replicas: {before} -> {replicas}; {when}"


# -- cancel -------------------------------------------------------------------------------------------------------

def cancel(run_dir: Path, timeout_s: float | None = None) -> bool:
    """Stop the run cleanly (see the module docstring); True when nothing of it runs any more."""
    run_dir = Path(run_dir).expanduser().resolve()
    cfg = load_saved(run_dir)
    if (run_dir / "DONE").exists():
        log.info("%s has finished; nothing to cancel", run_dir)
        return True
    atomic.write_json(run_dir / CANCEL, {"time": time.time(), "user": getpass.getuser(),
                                         "host": socket.gethostname(), "pid": os.getpid()})
    grace, t0 = cfg.launch.preempt_grace_s, time.time()
    deadline = t0 + (timeout_s if timeout_s is not None else grace + 60)
    sup = supervisor(run_dir, cfg)
    if sup["state"] == "running":
        log.info("asked the supervisor (epoch %d, pid %s on %s) to stop the run; every component checkpoints "
                 "and stops (grace %.0fs)", sup["epoch"], sup.get("pid"), sup.get("host"), grace)
        while supervisor(run_dir, cfg)["state"] == "running" and time.time() < deadline:
            time.sleep(0.5)
        if supervisor(run_dir, cfg)["state"] == "running":
            log.error("the supervisor is still running after %.0fs", time.time() - t0)
            return False
    live = _live_jobs(run_dir)
    if live:
        _stop_orphans(run_dir, live, min(deadline, time.time() + grace))
    left = [f"{n} ({r['job_id']}, {r.get('reach')})" for n, r in _live_jobs(run_dir).items()]
    if left:
        log.error("still running: %s (a process on another host stops when its owner stays silent for "
                  "launch.orphan_grace_s)", ", ".join(left))
        return False
    log.info("cancelled; nothing of %s runs. Continue with: python -m hpcrl.submit --resume %s", run_dir, run_dir)
    return True


def _stop_orphans(run_dir: Path, live: dict[str, dict], stop_at: float) -> None:
    """No supervisor runs: SIGUSR2 every live job (checkpoint and stop), wait until ``stop_at``, kill the rest."""
    log.info("no supervisor runs: asking %s to checkpoint and stop", ", ".join(live))
    for rec in live.values():
        _signal(rec, signal.SIGUSR2)
    t0 = time.time()
    while live and time.time() < stop_at:
        for name in [n for n, r in live.items() if not job_alive(run_dir, r)]:
            log.info("%s (%s) stopped", name, live.pop(name)["job_id"])
        time.sleep(0.2)
    for name, rec in live.items():
        log.warning("%s (%s) did not stop within %.0fs: killing it", name, rec["job_id"], time.time() - t0)
        kill_job(rec)
    end = time.time() + 30
    while any(job_alive(run_dir, r) for r in live.values()) and time.time() < end:
        time.sleep(0.2)


def _live_jobs(run_dir: Path) -> dict[str, dict]:
    """The registry's jobs that may still run, each marked with how it is reached (``job_alive``)."""
    out = {}
    for name, rec in registry(run_dir).items():
        rec = dict(rec)
        if job_alive(run_dir, rec):
            out[name] = rec
    return out


def _signal(rec: dict, sig: int) -> None:
    """Send ``sig`` to a recorded job that ``job_alive`` found: its local process group, or its Slurm steps."""
    if rec.get("reach") == "slurm":
        from hpcrl.launch.slurm import signal_job  # submitit only where Slurm is used

        signal_job(str(rec["job_id"]), sig)
    elif rec.get("reach") == "local":
        try:
            os.killpg(int(rec["job_id"]), sig)
        except (ProcessLookupError, PermissionError):
            pass
    else:
        log.warning("%s runs on %s and cannot be signalled from here", rec["job_id"], rec.get("host"))
