"""An inference server the rollout job starts as its child (vLLM, SGLang).

Lifecycle: :meth:`ServerProcess.start` launches the server command in its
own process group with its output in a log file, then polls its health URL
until it answers 200; if the process exits first, or ``start_timeout_s``
passes, the process group is killed and :class:`EngineServerError` is raised
carrying the end of the server's own log (a bad model path or a port in use
then reads as the server wrote it). The server's pid is written next to its
log (``<log>.pid``). While the rollout runs,
:meth:`ServerProcess.check` raises the same error once the server has died.
:meth:`ServerProcess.stop` ends the group: SIGTERM, then SIGKILL after a
grace period. The server never outlives the rollout job: it is stopped on
every exit path of the rollout, and a rollout killed with SIGKILL takes it
down through ``PR_SET_PDEATHSIG`` on Linux.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class EngineServerError(RuntimeError):
    """The inference server could not start, died, or stopped answering; carries its log tail."""

    def __init__(self, what: str, log_path: Path | None = None, tail: str = "") -> None:
        self.what, self.log_path, self.tail = what, log_path, tail
        where = f" (log: {log_path})" if log_path else ""
        super().__init__(f"{what}{where}" + (f"\n--- last lines of the server log ---\n{tail}" if tail else ""))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ServerProcess:
    def __init__(self, argv: list[str], *, health_url: str, log_path: Path, env: dict[str, str] | None = None,
                 start_timeout_s: float = 600.0, stop_timeout_s: float = 15.0) -> None:
        self.argv, self.health_url, self.log_path = argv, health_url, Path(log_path)
        self.env, self.start_timeout_s, self.stop_timeout_s = env or {}, start_timeout_s, stop_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self, on_wait: Callable[[], None] | None = None) -> None:
        """Launch and wait until healthy; ``on_wait`` is called every poll (the rollout's heartbeat)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting inference server: %s (log %s)", " ".join(self.argv), self.log_path)
        t0 = time.time()
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env}, preexec_fn=_die_with_parent)
        self.log_path.with_suffix(".pid").write_text(f"{self.proc.pid}\n")  # for operators (and the kill tests)
        while True:
            if self.proc.poll() is not None:
                self._fail(f"inference server exited with code {self.proc.returncode} before it was healthy")
            if self.healthy():
                log.info("inference server healthy after %.1f s (pid %d)", time.time() - t0, self.proc.pid)
                return
            if on_wait is not None:
                on_wait()
            if time.time() - t0 > self.start_timeout_s:
                self.stop()
                self._fail(f"inference server not healthy within {self.start_timeout_s:.0f} s "
                           f"(rollout.server_start_timeout_s)")
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def check(self) -> None:
        """Raise :class:`EngineServerError` if the server process has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            self._fail(f"inference server exited with code {self.proc.returncode}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def _fail(self, what: str) -> None:
        raise EngineServerError(what, self.log_path, log_tail(self.log_path))
