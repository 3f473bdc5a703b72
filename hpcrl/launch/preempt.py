"""Preemption and walltime signals.

Slurm sends ``SIGUSR2`` (with ``--signal=B:USR2@<seconds>``) before a job's
time limit and ``SIGTERM`` on preemption; the local supervisor sends
``SIGTERM`` to stop a component. :class:`PreemptionFlag` turns either into a
flag the component polls at a safe point: the trainer checkpoints at the
next step boundary and exits with :data:`EXIT_REQUEUE`; a rollout hands its
unfinished tickets back to the ledger and exits 0.

:data:`EXIT_REQUEUE` (75, ``EX_TEMPFAIL``) tells the supervisor "stopped on
purpose, start me again": it restarts the component without charging its
failure budget. Under Slurm the component also asks for its own requeue
(``scontrol requeue $SLURM_JOB_ID``) when the job was submitted requeueable.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

log = logging.getLogger(__name__)
EXIT_REQUEUE = 75


class Preempted(Exception):
    """Raised at a safe point after a preemption signal."""


class PreemptionFlag:
    def __init__(self, signals: tuple[int, ...] = (signal.SIGUSR2, signal.SIGTERM)) -> None:
        self.signum: int | None = None
        for s in signals:
            signal.signal(s, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            log.warning("received %s: stopping at the next safe point", signal.Signals(signum).name)
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def check(self) -> None:
        if self.requested:
            raise Preempted(signal.Signals(self.signum).name)


def request_slurm_requeue() -> bool:
    """Ask Slurm to requeue this job (no-op outside Slurm); True if the request went through."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("HPCRL_SLURM_REQUEUE", "1") == "0":
        return False
    proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if proc.returncode != 0:
        log.warning("scontrol requeue %s failed: %s", job, proc.stderr.strip())
        return False
    log.info("requested requeue of Slurm job %s", job)
    return True
