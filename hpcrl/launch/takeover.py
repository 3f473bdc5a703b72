"""Taking a run over from its previous owner: stop what it left running, then clean up after it.

Called by the supervisor right after it claimed a new owner epoch
(:func:`hpcrl.runtime.owner.claim`), before it starts any component, so at
no moment do two trainers, or two writers for one rollout replica, act for
the run. Order:

1. Read ``jobs/registry.json``, the previous owner's record of every job it
   started (job id, scheduler, host, epoch, instance). An owner killed
   between starting a component and recording it leaves a job the registry
   does not name: those are found too (:func:`unrecorded`), as Slurm jobs
   whose comment names this run and an earlier epoch, and as processes on
   this host started for this run by an earlier epoch.
2. Each of those processes and jobs sees the new epoch at its next fence
   check and exits by itself without writing; the supervisor waits up to
   ``launch.takeover_timeout_s`` for that, then kills what is left: a local
   process group by pid (only on the host that started it, and only if it
   is the process recorded, by its start time, so a reused pid is never
   touched), a
   Slurm job by ``scancel``. A process on another host that cannot be
   signalled is reported; the fence stops it.
3. When nothing of the previous owner runs any more, the temporaries its
   writers left (spool ``tmp/``, reason-file temporaries, weight and
   checkpoint directories under construction, heartbeats of earlier
   instances) are removed (:func:`clean_temporaries`).

Every step is logged: what ran, how it stopped, what could not be reached.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from hpcrl.config import RunConfig
from hpcrl.launch.leftovers import remove_all
from hpcrl.launch.registry import PROCESS_JOBS, SLURM_JOBS, jobs_of
from hpcrl.runtime.owner import owner_record

log = logging.getLogger(__name__)
_PF_KTHREAD = 0x00200000  # /proc/<pid>/stat flags: a kernel thread (never one of our jobs)
_SLURM_LIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED",
               "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "STOPPED"}


def take_over(cfg: RunConfig, run_dir: Path, epoch: int) -> bool:
    """Stop every job of earlier owners; True when none is left that could still write."""
    previous = registry(run_dir)
    if previous:
        prev_epoch = max((rec.get("epoch", 0) for rec in previous.values()), default=0)
        rec = owner_record(run_dir, prev_epoch) if prev_epoch else {}
        log.info("taking over from owner epoch %s (supervisor pid %s on %s): %d jobs to check", prev_epoch or "?",
                 rec.get("pid", "?"), rec.get("host", "?"), len(previous))
    live = {name: rec for name, rec in previous.items() if rec.get("epoch", 0) < epoch and job_alive(run_dir, rec)}
    for name, rec in unrecorded(run_dir, epoch, previous).items():
        log.warning("%s: started by owner epoch %s but not in its registry", name, rec["epoch"])
        live[name] = rec
    unreachable = [n for n, rec in live.items() if rec.get("reach") == "remote"]
    for name in unreachable:
        rec = live.pop(name)
        log.warning("%s (pid %s on %s) cannot be signalled from %s; it is fenced and stops at its next check",
                    name, rec["job_id"], rec.get("host"), socket.gethostname())
    deadline = time.time() + cfg.launch.takeover_timeout_s
    if live:
        log.info("waiting up to %.0fs for %s of the previous owner to stop", cfg.launch.takeover_timeout_s,
                 ", ".join(f"{n} ({r['job_id']})" for n, r in live.items()))
    t0 = time.time()
    while live and time.time() < deadline:
        for name in [n for n, rec in live.items() if not job_alive(run_dir, rec)]:
            log.info("%s (%s) stopped by itself after %.1fs", name, live.pop(name)["job_id"], time.time() - t0)
        time.sleep(0.1)
    for name, rec in live.items():
        log.warning("%s (%s) still running after %.0fs: killing it", name, rec["job_id"], time.time() - t0)
        kill_job(rec)
    for name, rec in live.items():
        end = time.time() + 30
        while job_alive(run_dir, rec) and time.time() < end:
            time.sleep(0.1)
        if job_alive(run_dir, rec):
            log.error("%s (%s) survived a kill; it is fenced and cannot change the run", name, rec["job_id"])
            unreachable.append(name)
    return not unreachable


def clean_temporaries(run_dir: Path) -> dict[str, int]:
    """Remove what writers that no longer run left half-done (:func:`hpcrl.launch.leftovers.remove_all`) and
    the heartbeats of earlier instances; only call it while no component runs."""
    counts = dict(remove_all(run_dir))
    for p in (run_dir / "heartbeats").glob("*"):  # instances of earlier owners (each has its own file)
        p.unlink(missing_ok=True)
        counts["heartbeats"] = counts.get("heartbeats", 0) + 1
    if counts:
        log.info("removed what the previous owner's writers left: %s", counts)
    return counts


def registry(run_dir: Path) -> dict[str, dict]:
    """``jobs/registry.json``: component -> the job its latest owner started ({} if none)."""
    try:
        return json.loads((run_dir / "jobs" / "registry.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def unrecorded(run_dir: Path, epoch: int, known: dict[str, dict]) -> dict[str, dict]:
    """Live jobs of owners before ``epoch`` that ``known`` (the registry) does not name, as registry records
    (``reach`` marked): Slurm jobs of the user whose comment names this run (the supervisor's comment:
    ``hpcrl,run=...,component=...,epoch=N,...``), and processes on this host whose environment holds an
    earlier owner epoch and whose command line names this run. A process is not counted apart from the job
    it belongs to: a recorded process's children (its process group), the tasks of a Slurm job or ``srun``
    allocation that is recorded or found here."""
    known_ids = {str(rec.get(key)) for rec in known.values() for key in ("job_id", "allocation") if rec.get(key)}
    found: dict[str, dict] = {}
    for job_id, comment in _slurm_comments().items():
        fields = dict(kv.split("=", 1) for kv in comment.split(",") if "=" in kv)
        if (comment.startswith("hpcrl,") and fields.get("run") == "".join(str(run_dir.resolve()).split())
                and fields.get("epoch", "").isdigit() and int(fields["epoch"]) < epoch and job_id not in known_ids):
            found[f"{fields.get('component', '?')} (job {job_id})"] = {
                "job_id": job_id, "scheduler": "slurm", "jobs": SLURM_JOBS, "epoch": int(fields["epoch"]),
                "reach": "slurm"}
    known_ids |= {rec["job_id"] for rec in found.values()}
    names = {str(run_dir), str(run_dir.resolve())}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone, or another user's
            continue
        values = dict(kv.split(b"=", 1) for kv in env if kv.startswith((b"HPCRL_EPOCH=", b"SLURM_JOB_ID=")))
        owner, job = values.get(b"HPCRL_EPOCH", b"").decode(), values.get(b"SLURM_JOB_ID", b"").decode()
        if (not owner.isdigit() or int(owner) >= epoch or fields[0] == "Z" or not names & set(args)
                or known_ids & {pid, fields[2], job}):
            continue
        found[f"{' '.join(args[1:3])} (pid {pid})"] = {
            "job_id": int(pid), "scheduler": "local", "jobs": PROCESS_JOBS, "epoch": int(owner),
            "host": socket.gethostname(),
            "start_ticks": int(fields[19]), "reach": "local"}
    return found


def _slurm_comments() -> dict[str, str]:
    """Job id -> comment of the user's jobs that Slurm still lists ({} where there is no Slurm)."""
    if not shutil.which("squeue"):
        return {}
    try:
        proc = subprocess.run(["squeue", "-h", "-u", str(os.getuid()), "-o", "%i|%k"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("cannot list Slurm jobs to find unrecorded ones: %s", e)
        return {}
    return dict(ln.split("|", 1) for ln in proc.stdout.splitlines() if "|" in ln)


def job_alive(run_dir: Path, rec: dict) -> bool:
    """Whether the job may still run; marks ``rec["reach"]`` = "local" | "slurm" | "remote" (how its kind of
    job, :func:`hpcrl.launch.registry.jobs_of`, is reached from this host)."""
    if jobs_of(rec) == SLURM_JOBS:
        rec["reach"] = "slurm"
        return slurm_state(str(rec["job_id"])) in _SLURM_LIVE
    pid = int(rec["job_id"])
    if rec.get("host", socket.gethostname()) != socket.gethostname():
        rec["reach"] = "remote"
        return True
    rec["reach"] = "local"
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    state, flags, started = fields[0], int(fields[6]), int(fields[19])
    if state == "Z" or flags & _PF_KTHREAD:
        return False
    if rec.get("start_ticks") is not None:  # the same process, not a reused pid, whatever it shows now
        return started == int(rec["start_ticks"])
    # (a registry without start times) an exiting process has released its memory and shows an empty
    # command line before it becomes a zombie: it still runs until then; a reused pid runs something else
    return not cmdline or str(run_dir) in cmdline


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, /proc/<pid>/stat field 22); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def kill_job(rec: dict) -> None:
    """SIGKILL a recorded job (after ``job_alive`` marked how it is reached): its process group, or scancel."""
    if rec.get("reach") == "slurm":
        job = str(rec["job_id"])
        subprocess.run(["scontrol", "update", f"JobId={job}", "Requeue=0"], capture_output=True, timeout=60)
        subprocess.run(["scancel", "--signal=KILL", "--full", job], capture_output=True, timeout=60)
        subprocess.run(["scancel", job], capture_output=True, timeout=60)
        return
    try:
        os.killpg(int(rec["job_id"]), signal.SIGKILL)  # its own session: the whole process tree
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(int(rec["job_id"]), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def slurm_state(job_id: str) -> str:
    from hpcrl.launch.slurm_state import read_states

    return read_states([job_id]).get(job_id, ("UNKNOWN", ""))[0]
