"""What runs inside a component's Slurm job: the component's command line, once per task.

Kept free of heavy imports: submitit unpickles :class:`RunCommand` in every
task of the job before anything else. Each task appends its output to the
component's log (``{rank}`` in the path becomes ``SLURM_PROCID``), forwards
SIGTERM/SIGINT/SIGUSR2 to the component (submitit itself ignores SIGTERM),
and returns the component's exit code as the job's result (a negative code
is a signal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)


class RunCommand:
    def __init__(self, argv: list[str], env: dict[str, str], log_path: str) -> None:
        self.argv, self.env, self.log_path = list(argv), dict(env), log_path

    def __call__(self) -> int:
        rank = os.environ.get("SLURM_PROCID", "0")
        path = Path(self.log_path.replace("{rank}", rank))
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as log:
            proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **self.env})
        previous = {s: signal.signal(s, lambda sig, _f: proc.send_signal(sig)) for s in FORWARDED}
        try:
            return proc.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def append_note(log_path: str | Path, text: str) -> None:
    """Append a line from the scheduler to a component's log (so its tail explains what Slurm did)."""
    path = Path(str(log_path).replace("{rank}", "0"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"[{time.strftime('%H:%M:%S')}] [hpcrl.launch.slurm] {text}\n")
