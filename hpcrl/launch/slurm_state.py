"""What Slurm says of jobs: their states from ``sacct``/``squeue``, and what became of a job after one of its runs.

Light (no submitit): the Slurm scheduler (:mod:`hpcrl.launch.slurm`) polls with it.
"""

from __future__ import annotations

import subprocess
import time

# job states after which a job will never run again (sacct's first word of State)
ENDED_BADLY = {"FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE",
               "PREEMPTED", "REVOKED", "SPECIAL_EXIT"}
# states of a job that waits in the queue (submitted, or requeued by a preemption) and will run
QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING"}
# pending reasons that no amount of waiting fixes. Not ReqNodeNotAvail: a node the job asks for is in use,
# reserved for a preempting job or a maintenance window, or completing its last job (a rollout pinned to a node
# from which it was just preempted waits with it until the preemptor is done)
HOPELESS_REASONS = {"BadConstraints", "PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig",
                    "InvalidAccount", "InvalidQOS", "QOSMaxWallDurationPerJobLimit", "AccountNotAllowed",
                    "QOSNotAllowed", "PartitionDown", "PartitionInactive", "DependencyNeverSatisfied"}


def hopeless(reason: str) -> bool:
    """Whether a job pending for ``reason`` can never start as submitted: a reason of
    :data:`HOPELESS_REASONS`, or a per-job or per-node maximum (``AssocMax*PerJob*``, ``QOSMax*PerNode``, ...)
    or a minimum of the association or QOS that the request itself breaks. Not the aggregate and per-user
    limits (``AssocGrp*``, ``QOSGrp*``, ``QOSMaxJobsPerUserLimit``): those free up as other jobs end."""
    word = reason.split(",")[0].strip()
    if word in HOPELESS_REASONS:
        return True
    limit = word.startswith(("AssocMax", "QOSMax")) and ("PerJob" in word or "PerNode" in word)
    return limit or word.startswith("QOSMin")


def still_listed(job_id: str) -> bool:
    """Whether ``squeue`` still lists the job (e.g. COMPLETING: its processes have not all ended)."""
    try:
        proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0 and bool(proc.stdout.strip())


def after_run(job_id: str, t: float) -> tuple[str, str]:
    """What ``squeue`` shows of a job one run of which ended at time ``t``: ("ended", "") once it is no longer
    listed, ("requeued", how) when Slurm queued it again (pending again, or running again with a later start),
    or ("ending", state) while that run's processes still stop."""
    try:
        proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T|%S"], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "ending", "squeue did not answer"
    state, _, start = (proc.stdout.strip().splitlines() or [""])[0].partition("|")
    if proc.returncode != 0 or not state:
        return "ended", ""
    if state in QUEUED:
        return "requeued", state
    try:
        started = time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return "ending", state
    return ("requeued", f"{state} again since {start}") if started > t + 1 else ("ending", state)





def read_states(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """Job id -> (state, reason). sacct knows every job, finished ones too, but slurmdbd lags the controller by
    seconds and more under load: a job running for a while can still read PENDING there (and a supervisor then
    took it for queued and restarted its heartbeat clock), a requeued one PREEMPTED. squeue asks the controller
    and lists only jobs that are not over (one line per array task with ``-r``): its word wins for every job it
    lists. A controller that does not answer leaves sacct's word."""
    if not job_ids:
        return {}
    out: dict[str, tuple[str, str]] = {}
    for cmd, first_word in ((["sacct", "-n", "-P", "-X", "-o", "JobID,State,Reason", "-j"], True),
                            (["squeue", "-h", "-r", "-o", "%i|%T|%r", "-j"], False)):
        try:
            proc = subprocess.run([*cmd, ",".join(job_ids)], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        for line in proc.stdout.splitlines():
            jid, state, reason = (line.split("|") + ["", ""])[:3]
            if jid in job_ids or first_word:
                out[jid] = (state.split(" ")[0] if first_word else state, reason)
    return out
