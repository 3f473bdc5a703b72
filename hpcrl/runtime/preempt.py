"""Preemption and walltime signals.

Slurm sends ``SIGUSR2`` (with ``--signal=B:USR2@<seconds>``) before a job's
time limit and ``SIGTERM`` on preemption; the local supervisor sends
``SIGTERM`` to stop a component. :class:`PreemptionFlag` turns either into a
flag the component polls at a safe point: the trainer checkpoints at the
next step boundary and exits with :data:`EXIT_REQUEUE`; a rollout hands its
unfinished tickets back to the ledger and exits 0.

:data:`EXIT_REQUEUE` (75, ``EX_TEMPFAIL``) tells the supervisor "stopped on
purpose, start me again": it restarts the component without charging its
failure budget. A component under a supervisor never asks Slurm for its own
requeue (``HPCRL_SLURM_REQUEUE=0``: the watchdog resubmits it); one started
alone does (``scontrol requeue $SLURM_JOB_ID``) when the job is requeueable.

The supervisor itself reacts to the same signals (its own job's walltime, or
preemption of the allocation that holds the whole run): it forwards SIGUSR2
to every component, waits for them to checkpoint and exit, asks Slurm to
requeue its job and exits with :data:`EXIT_REQUEUE`; the requeued job
continues with ``python -m hpcrl.submit --resume`` (see
``sbatch/run_async_ppo.sh``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

log = logging.getLogger(__name__)
EXIT_REQUEUE = 75
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
_early: int | None = None  # a stop signal that came before the process's PreemptionFlag existed


def catch_early() -> None:
    """Record SIGUSR2/SIGTERM from the very start of a component process, before its slow imports (torch):
    its :class:`PreemptionFlag` then starts with the signal, so a preemption or a walltime signal while it is
    starting stops it cleanly (exit 75) instead of killing it. Each component's ``__main__`` calls it first."""
    def record(signum: int, frame) -> None:
        global _early
        _early = _early or signum

    for s in STOP_SIGNALS:
        signal.signal(s, record)


class Preempted(Exception):
    """Raised at a safe point after a preemption signal."""


class PreemptionFlag:
    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.signum: int | None = _early if set(signals) >= set(STOP_SIGNALS) else None
        self._previous = {s: signal.signal(s, self._handle) for s in signals}
        if self.signum is not None:
            log.warning("received %s while starting: stopping at the first safe point", signal.Signals(self.signum).name)

    def close(self) -> None:
        """Put back the handlers that were there before."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        # under Slurm a signal may arrive twice (from slurmstepd and forwarded by the job's wrapper)
        first, self.signum = self.signum is None, self.signum or signum
        if first:
            log.warning("received %s: stopping at the next safe point", signal.Signals(signum).name)

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
