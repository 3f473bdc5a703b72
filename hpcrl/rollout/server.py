"""An inference server the rollout job starts as its child (vLLM, SGLang).

Lifecycle: :meth:`ServerProcess.start` launches the server command under a
small guard process (``python -m hpcrl.rollout.server ARGV...``) in a new
process group, with the output in a log file (its pid beside it,
``<log>.pid``), then polls the health URL until it answers 200; if the
process exits first, or ``start_timeout_s`` passes, the group is killed and
:class:`EngineServerError` is raised carrying the end of the server's own log
(a bad model path or a port in use then reads as the server wrote it). While
the rollout runs, :meth:`ServerProcess.check` raises the same error once the
server has exited (the guard exits with the server's code).
:meth:`ServerProcess.stop` ends the whole group: SIGTERM, then SIGKILL after
a grace period.

Why a guard: a server's own children (vLLM's engine core and workers) do not
die with their parent, so a rollout killed with SIGKILL would leave them
running, holding cores or GPUs. The guard watches the rollout: once its
parent is gone it ends the group the same way :meth:`stop` does.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

class EngineServerError(RuntimeError):
    """The inference server could not start, died, or stopped answering; carries its log tail."""

    def __init__(self, what: str, log_path: Path | None = None, tail: str = "") -> None:
        self.what, self.log_path, self.tail = what, log_path, tail
        where = f" (log: {log_path})" if log_path else ""
        super().__init__(f"{what}{where}" + (f"\n--- last lines of the server log ---\n{tail}" if tail else ""))


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def end_group(pgid: int, grace_s: float, reap: Callable[[], object] = lambda: None) -> None:
    """SIGTERM process group ``pgid``, SIGKILL whatever is left after ``grace_s`` (``reap`` collects zombies)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return  # nobody left in the group
    deadline = time.time() + grace_s
    while time.time() < deadline and _group_alive(pgid):
        reap()
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def guard(parent: int, argv: list[str]) -> int:
    """Run ``argv`` (in this process group) until it exits, or until ``parent`` is gone: then end the group.

    The guard ignores SIGTERM, so that :meth:`ServerProcess.stop` (SIGTERM to the group) stops the server and
    the guard still reports its exit code; SIGKILL ends it with the group.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = subprocess.Popen(argv, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    while server.poll() is None:
        if os.getppid() != parent:  # the rollout died (even by SIGKILL): its server must not outlive it
            end_group(os.getpgrp(), 15.0, reap=server.poll)
        time.sleep(0.5)
    return server.returncode


class ServerProcess:
    """One inference server process (group); see the module docstring for its lifecycle."""

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
        guarded = [sys.executable, "-m", "hpcrl.rollout.server", str(os.getpid()), *self.argv]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(guarded, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env}, start_new_session=True)
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
        """SIGTERM the server's process group, SIGKILL what is left after the grace period.

        The whole group, even when the server itself is gone: its own children (vLLM's engine core and
        workers) are in it and do not exit with it.
        """
        if self.proc is None:
            return
        end_group(self.proc.pid, self.stop_timeout_s, reap=self.proc.poll)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            log.warning("inference server %d did not exit after SIGKILL", self.proc.pid)

    def _fail(self, what: str) -> None:
        raise EngineServerError(what, self.log_path, log_tail(self.log_path))


if __name__ == "__main__":  # the guard: python -m hpcrl.rollout.server PARENT_PID ARGV...
    sys.exit(guard(int(sys.argv[1]), sys.argv[2:]))
