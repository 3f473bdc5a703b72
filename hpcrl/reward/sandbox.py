"""A sandbox for model-written programs: each one contained, limited, and killed whole.

Lifecycle: :class:`Sandbox` is built once per scorer from ``reward.sandbox``
(:class:`~hpcrl.reward.config.SandboxConfig`); building it probes the
mechanism once and refuses clearly when the machine cannot provide it
(:class:`SandboxUnavailable`). :meth:`Sandbox.run` may then be called from
any number of threads; each call is one program in a fresh sandbox that is
gone when the call returns. There is nothing to close.

What one run gets with ``mechanism: bwrap`` (bubblewrap, the default):

* new user, PID, network, IPC, UTS and cgroup namespaces: no network but its
  own loopback (the job's ports on 127.0.0.1 are not reachable), no process
  outside the sandbox visible or signalable, no nested user namespace;
* a filesystem of ``/usr`` (and the ``/bin``, ``/lib`` links into it)
  read-only, a fresh ``/proc`` and a minimal ``/dev``, the task's files
  read-only in ``/task`` and a size-capped tmpfs as the working directory
  and ``$HOME`` (``/tmp``): nothing of the run directory, the spool,
  ``$HOME`` or the host's ``/tmp`` exists inside;
* an environment of ``PATH``, ``HOME``, ``LANG`` only (and the shell's ``SHLVL``);
* limits on CPU time, address space, file size, open files and processes
  (``RLIMIT_NPROC``, counted inside the sandbox's own user namespace), set
  by ``prlimit`` as the sandbox's first command;
* a wall-clock timeout that kills the sandbox's PID namespace, so every
  process the program started dies with it, daemonised or not;
* stdout and stderr capped at ``output_bytes`` each: a program that writes
  more is killed and its result says so.

A process of the ``root`` user first drops to ``run_as_uid`` (the kernel
exempts root's own user from ``RLIMIT_NPROC``, and files of the host's root
must not appear as the sandbox's own).

``mechanism: launcher`` runs the program under a site's own container
command (``launcher``: an Apptainer or enroot invocation that ends where the
program's command line begins; the image must have ``prlimit`` and ``bash`` on its
``PATH``, as util-linux gives it); hpcrl still applies the limits, the clean
environment, the timeout (killing the launcher's process group) and the
output caps, but the isolation of the filesystem, network and processes is
whatever the launcher gives: docs/reward.md says what to ask of it.

A run whose sandbox could not be set up reports ``infra_error``: the
program never ran, so the result says nothing of it (a scorer must not
turn it into a 0 reward). "Ran" is marked by a trusted shell that, after the
namespaces, mounts and limits, writes one byte on a descriptor it closes
before it becomes the program: no program can fake it, or hide it.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hpcrl.reward.config import SandboxConfig

__all__ = ["Sandbox", "SandboxResult", "SandboxUnavailable", "RunStatus"]

log = logging.getLogger(__name__)

# ok: exit 0; exit: another exit code; signal: killed by a signal (the CPU limit among them); timeout: the wall
# clock ran out; output_limit: it wrote more than output_bytes; infra_error: the sandbox never ran the program
RunStatus = Literal["ok", "exit", "signal", "timeout", "output_limit", "infra_error"]
_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


# the trial program: it must fork (the process limit leaves room for a few processes) and print
_PROBE = ("import os\nfor _ in range(3):\n    pid = os.fork()\n    if not pid:\n        os._exit(0)\n"
          "    os.waitpid(pid, 0)\nprint(42)")


def _kernel() -> tuple[int, int]:
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)
    except ValueError:
        return (0, 0)


class SandboxUnavailable(RuntimeError):
    """The configured mechanism does not work on this machine (said once, when the sandbox is built)."""


@dataclass
class SandboxResult:
    status: RunStatus
    returncode: int | None  # the program's exit code (128 + N for signal N); None when it never ended by itself
    stdout: bytes
    stderr: bytes
    wall_s: float
    detail: str = ""  # why, for anything but "ok"

    @property
    def infra_error(self) -> bool:
        return self.status == "infra_error"


class Sandbox:
    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self._tools = {name: shutil.which(name) for name in ("prlimit", "setpriv", "bwrap")}
        if not self._tools["prlimit"]:
            raise SandboxUnavailable("reward.sandbox: prlimit (util-linux) is not on PATH")
        if cfg.mechanism == "bwrap" and not self._tools["bwrap"]:
            raise SandboxUnavailable("reward.sandbox.mechanism=bwrap: bubblewrap is not installed (Debian/Ubuntu: "
                                     "apt install bubblewrap); or set reward.sandbox.mechanism=launcher with your "
                                     "site's container command (docs/reward.md)")
        if os.geteuid() == 0 and not self._tools["setpriv"]:
            raise SandboxUnavailable("reward.sandbox: running as root, the sandbox drops to run_as_uid with setpriv "
                                     "(util-linux), which is not on PATH")
        if cfg.mechanism == "bwrap" and _kernel() < (5, 14):
            log.warning("reward.sandbox: Linux %d.%d counts RLIMIT_NPROC over every process of the sandbox's user, "
                        "not per sandbox (5.14 and later do): reward.sandbox.processes=%d may refuse honest "
                        "programs a fork while many run", *_kernel(), cfg.processes)
        probe = self.run({}, ["python", "-c", _PROBE])
        if probe.status != "ok" or probe.stdout.strip() != b"42":
            hint = (" (user namespaces may be disabled: kernel.unprivileged_userns_clone, "
                    "user.max_user_namespaces; ask your site, or use mechanism=launcher)"
                    if cfg.mechanism == "bwrap" else "")
            raise SandboxUnavailable(f"reward.sandbox.mechanism={cfg.mechanism}: a trial program did not run "
                                     f"({probe.status}: {probe.detail or probe.stderr[-500:].decode(errors='replace')})"
                                     f"{hint}")

    def run(self, files: dict[str, str | bytes], argv: list[str], stdin: bytes = b"") -> SandboxResult:
        """Run ``argv`` (``python`` as its first word is the configured interpreter) in a fresh sandbox whose
        ``/task`` holds ``files`` (relative name -> content), read-only; ``stdin`` is its standard input (staged
        as a file, so a program that never reads it cannot block this call)."""
        t0 = time.perf_counter()
        for name in files:
            if Path(name).name != name or name in (".", "..", ".stdin"):
                raise ValueError(f"sandbox file {name!r}: must be a plain file name (not .stdin)")
        try:
            stage = tempfile.TemporaryDirectory(prefix="hpcrl-sandbox-", dir=self.cfg.scratch_dir or None)
        except OSError as e:
            return SandboxResult("infra_error", None, b"", b"", time.perf_counter() - t0, f"cannot stage: {e}")
        with stage as task:
            try:
                Path(task, ".stdin").write_bytes(stdin)
                for name, content in files.items():
                    path = Path(task, name)
                    path.write_bytes(content.encode() if isinstance(content, str) else content)
                    path.chmod(0o444)
                os.chmod(task, 0o555)  # readable by run_as_uid (a root rollout drops to it)
            except OSError as e:
                return SandboxResult("infra_error", None, b"", b"", time.perf_counter() - t0, f"cannot stage: {e}")
            argv = [self.cfg.python if argv[0] == "python" else argv[0], *argv[1:]]
            try:
                with open(Path(task, ".stdin"), "rb") as stdin_file:
                    return self._run(task, argv, stdin_file, t0)
            finally:
                os.chmod(task, 0o755)

    # -- internals -----------------------------------------------------------------------------------------------

    def _command(self, task: str, argv: list[str], status_fd: int, start_fd: int) -> list[str]:
        cfg, cpu = self.cfg, self.cfg.cpu_s
        limits = {"cpu": f"{cpu}:{cpu + 1}", "as": cfg.memory_mb * 2**20, "fsize": cfg.file_mb * 2**20,
                  "nofile": cfg.open_files, "nproc": cfg.processes, "core": 0}  # cpu: SIGXCPU, a second later SIGKILL
        # set inside the sandbox, as its first command: RLIMIT_NPROC then counts the sandbox's own user namespace
        # only (set outside, it would count every process of the user on the node, and creating the namespace
        # would fail for a user with more)
        prlimit = self._tools["prlimit"] if cfg.mechanism == "bwrap" else "prlimit"  # the launcher's image's own
        # then a trusted shell says "started" on start_fd, closes it and becomes the program: everything before
        # that byte (namespaces, mounts, limits) is the sandbox's, and a failure there an infra error the program
        # cannot fake (it never holds start_fd). bash: dash takes single-digit descriptors only
        started = f'printf s >&{start_fd} && exec "$@" {start_fd}>&-'
        limited = [prlimit, *(f"--{name}={value}" for name, value in limits.items()), "--",
                   "/bin/bash", "--norc", "--noprofile", "-c", started, "sh", *argv]
        cmd = []
        if os.geteuid() == 0:
            uid = cfg.run_as_uid
            cmd += [self._tools["setpriv"], f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        if cfg.mechanism == "launcher":
            return cmd + list(cfg.launcher) + limited
        cmd += [self._tools["bwrap"], "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                "--new-session", "--clearenv", "--ro-bind", "/usr", "/usr"]
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # merged /usr: links; otherwise the directory
            path = Path("/", top)
            if path.is_symlink():
                cmd += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                cmd += ["--ro-bind", str(path), str(path)]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--ro-bind", task, "/task",
                "--size", str(cfg.disk_mb * 2**20), "--tmpfs", "/tmp", "--chdir", "/tmp",
                "--json-status-fd", str(status_fd)]
        for key, value in _ENV.items():
            cmd += ["--setenv", key, value]
        return cmd + limited

    def _run(self, task: str, argv: list[str], stdin, t0: float) -> SandboxResult:
        (status_r, status_w), (start_r, start_w) = os.pipe(), os.pipe()
        try:
            proc = subprocess.Popen(self._command(task, argv, status_w, start_w), stdin=stdin,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(_ENV), cwd="/",
                                    start_new_session=True, pass_fds=(status_w, start_w), close_fds=True)
        except OSError as e:
            for fd in (status_r, status_w, start_r, start_w):
                os.close(fd)
            return SandboxResult("infra_error", None, b"", b"", time.perf_counter() - t0, f"could not start: {e}")
        os.close(status_w)
        os.close(start_w)
        try:
            outcome = self._communicate(proc, status_r, start_r)
        finally:
            _kill_group(proc)
            proc.wait()
            os.close(status_r)
            os.close(start_r)
        return self._result(proc, outcome, t0)

    def _communicate(self, proc: subprocess.Popen, status_r: int, start_r: int) -> dict:
        """Collect stdout, stderr and bwrap's status until the program's output ends (its sandbox is gone), the
        clock runs out or the output is too long."""
        cap, deadline = self.cfg.output_bytes, time.monotonic() + self.cfg.wall_s
        out = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray(), "start": bytearray(), "why": ""}
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        sel.register(status_r, selectors.EVENT_READ, "status")
        sel.register(start_r, selectors.EVENT_READ, "start")
        streams = {"stdout", "stderr"}
        try:
            while streams:
                left = deadline - time.monotonic()
                if left <= 0:
                    out["why"] = "timeout"
                    return out
                for key, _ in sel.select(min(left, 0.5)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        streams.discard(key.data)
                        continue
                    out[key.data] += chunk
                    if key.data in streams and len(out[key.data]) > cap:
                        out["why"] = "output_limit"
                        return out
            try:  # output closed: the sandbox is gone, or about to be
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out["why"] = "timeout"
                return out
            out["status"] += _drain(status_r)
            out["start"] += _drain(start_r)
        finally:
            sel.close()
        return out

    def _result(self, proc: subprocess.Popen, out: dict, t0: float) -> SandboxResult:
        cap, wall = self.cfg.output_bytes, time.perf_counter() - t0
        stdout, stderr = bytes(out["stdout"][:cap]), bytes(out["stderr"][:cap])
        started, code = bool(out["start"]), _exit_code(bytes(out["status"]))
        if self.cfg.mechanism == "launcher":
            code = proc.returncode
        if not started:  # the program never ran: whatever happened is the sandbox's
            why = (f"not started within {self.cfg.wall_s:g} s" if out["why"] == "timeout" else
                   stderr.decode(errors="replace").strip()[-500:] or f"exit {proc.returncode}")
            return SandboxResult("infra_error", None, stdout, stderr, wall, f"the sandbox did not start: {why}")
        if out["why"] == "timeout":
            return SandboxResult("timeout", None, stdout, stderr, wall, f"wall clock over {self.cfg.wall_s:g} s")
        if out["why"] == "output_limit":
            return SandboxResult("output_limit", None, stdout, stderr, wall,
                                 f"more than {cap} bytes of output")
        if code is None:
            code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        if code == 0:
            return SandboxResult("ok", 0, stdout, stderr, wall)
        if code > 128 and code - 128 < signal.NSIG:
            name = signal.Signals(code - 128).name if code - 128 in signal.valid_signals() else str(code - 128)
            hint = " (the CPU-time limit)" if code - 128 == signal.SIGXCPU else ""
            return SandboxResult("signal", code, stdout, stderr, wall, f"killed by {name}{hint}")
        return SandboxResult("exit", code, stdout, stderr, wall, f"exit code {code}")


def _exit_code(raw: bytes) -> int | None:
    """The program's exit code from bwrap's --json-status-fd documents (None: not reported)."""
    code, decoder, text, i = None, json.JSONDecoder(), raw.decode(errors="replace"), 0
    while i < len(text):
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            break
        try:
            doc, i = decoder.raw_decode(text, i)
        except ValueError:
            break
        if isinstance(doc, dict):
            code = doc.get("exit-code", code)
    return code


def _drain(fd: int) -> bytes:
    os.set_blocking(fd, False)
    data = bytearray()
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    return bytes(data)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's process group: bwrap's PID namespace dies with it, and everything in it. Only while
    its leader is not reaped: a reaped one's group id may belong to another process by now."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
