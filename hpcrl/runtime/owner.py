"""Run ownership: one supervisor owns a run at a time, and every component is fenced to its owner.

Lifecycle: a supervisor :func:`claim`\\ s the run before it starts anything:
it creates ``<run_dir>/owner/e<N>`` with ``O_CREAT | O_EXCL`` where ``N`` is
one more than the newest epoch there (a lost race retries with the next
number), so epochs are contiguous and strictly increasing, and exactly one
claimant gets each. It starts every component with ``HPCRL_EPOCH=N`` and a
per-submission ``HPCRL_INSTANCE``, touches ``e<N>`` while it supervises
(:meth:`Owner.beat`) and writes ``e<N>.released`` when it exits.

A component builds a :class:`Fence` from its environment (one started by
hand adopts the current epoch) and calls :meth:`Fence.check` before every
state-changing write: checkpoint commit, weight publish, spool publish and
claim, ledger records. The check is one ``stat`` of ``e<N+1>``: once a newer
owner exists it raises :class:`Fenced` and the component exits with
:data:`EXIT_FENCED` without writing anything more. Between a check and the
write it guards there is a window of one filesystem operation; the new
owner closes it by stopping the previous owner's processes and jobs before
it starts its own (``hpcrl.launch.supervisor``), so fencing is the second
line: it stops what the new owner cannot reach (a process on another host,
a job that was still pending).

A component started by a supervisor also watches it (:meth:`Fence.orphaned`):
when ``e<N>`` has not been touched for ``launch.orphan_grace_s`` seconds, or
the owner released the run, the supervisor is gone and the component stops
cleanly the way it does on a preemption signal (the trainer checkpoints), so
a dead login-node supervisor does not leave jobs burning an allocation.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
EXIT_FENCED = 3
ENV_EPOCH, ENV_INSTANCE = "HPCRL_EPOCH", "HPCRL_INSTANCE"
RELEASED = ".released"


class Fenced(RuntimeError):
    """A newer owner took the run over: this process must stop without writing anything more."""


def owner_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "owner"


def epoch_file(run_dir: str | Path, epoch: int) -> Path:
    return owner_dir(run_dir) / f"e{epoch:09d}"


def current_epoch(run_dir: str | Path) -> int:
    """The newest owner epoch of the run (0: never owned)."""
    try:
        names = os.listdir(owner_dir(run_dir))
    except FileNotFoundError:
        return 0
    return max((int(n[1:]) for n in names if n.startswith("e") and n[1:].isdigit()), default=0)


def owner_record(run_dir: str | Path, epoch: int) -> dict:
    """What the owner of ``epoch`` recorded about itself ({} if unreadable)."""
    try:
        return json.loads(epoch_file(run_dir, epoch).read_text() or "{}")
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


@dataclass
class Owner:
    """The supervisor's claim on a run (epoch ``epoch``)."""

    run_dir: Path
    epoch: int
    submissions: int = 0  # components started so far (numbers their instance ids)
    starts: dict[str, int] = field(default_factory=dict)  # component -> times this owner started it
    _beat_at: float = 0.0

    @property
    def path(self) -> Path:
        return epoch_file(self.run_dir, self.epoch)

    def superseded(self) -> bool:
        return epoch_file(self.run_dir, self.epoch + 1).exists()

    def beat(self, interval_s: float = 5.0) -> None:
        """Touch the epoch file (at most once per ``interval_s``): components see their owner alive."""
        now = time.time()
        if now - self._beat_at >= interval_s:
            try:
                os.utime(self.path)
            except FileNotFoundError:  # removed by hand: recreate it rather than orphan the components
                self.path.write_text("{}")
            self._beat_at = now

    def release(self) -> None:
        """The supervisor is exiting: its components must not wait out the orphan grace."""
        (self.run_dir / "owner" / f"{self.path.name}{RELEASED}").touch()


def claim(run_dir: str | Path, **info) -> Owner:
    """Take ownership of the run with the next epoch (atomic, exactly one claimant per epoch)."""
    d = owner_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "argv": sys.argv,
              "slurm_job_id": os.environ.get("SLURM_JOB_ID"), **info}
    while True:
        epoch = current_epoch(run_dir) + 1
        try:
            fd = os.open(epoch_file(run_dir, epoch), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue  # another claimant took this epoch: try the next
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({**record, "epoch": epoch}))
        return Owner(Path(run_dir), epoch)


class Fence:
    """A component's view of its owner: :meth:`check` before writes, :meth:`orphaned` now and then."""

    def __init__(self, run_dir: str | Path, epoch: int, instance: str = "", supervised: bool = False,
                 orphan_grace_s: float = 0.0) -> None:
        self.run_dir, self.epoch = Path(run_dir), epoch
        self.instance = instance or secrets.token_hex(3)
        self.supervised, self.orphan_grace_s = supervised, orphan_grace_s
        self._next = epoch_file(run_dir, epoch + 1)
        self._orphan_checked, self._orphaned = 0.0, False

    @classmethod
    def from_env(cls, run_dir: str | Path, orphan_grace_s: float = 0.0) -> Fence:
        """The epoch and instance a supervisor gave this process; a process started by hand adopts the
        current epoch (a later supervisor fences it like any other) and watches no supervisor."""
        epoch = os.environ.get(ENV_EPOCH)
        if epoch is None:
            return cls(run_dir, current_epoch(run_dir))
        return cls(run_dir, int(epoch), os.environ.get(ENV_INSTANCE, ""), supervised=True,
                   orphan_grace_s=orphan_grace_s)

    def superseded(self) -> bool:
        return self._next.exists()

    def check(self, what: str = "write") -> None:
        """Raise :class:`Fenced` if a newer owner exists (one ``stat``)."""
        if self._next.exists():
            newer = current_epoch(self.run_dir)
            rec = owner_record(self.run_dir, newer)
            raise Fenced(f"owner epoch {newer} (pid {rec.get('pid')} on {rec.get('host')}) took the run over "
                         f"from epoch {self.epoch}; this process stops before its {what}")

    def orphaned(self, every_s: float = 2.0) -> bool:
        """True when the supervisor that started this process released the run or has not been seen for
        ``orphan_grace_s`` (checked at most every ``every_s``; never true for an unsupervised process)."""
        if not self.supervised or self.orphan_grace_s <= 0:
            return False
        now = time.time()
        if self._orphaned or now - self._orphan_checked < every_s:
            return self._orphaned
        self._orphan_checked = now
        mine = epoch_file(self.run_dir, self.epoch)
        try:
            age = now - mine.stat().st_mtime
        except FileNotFoundError:
            age = float("inf")
        released = mine.with_name(mine.name + RELEASED).exists()
        if released or age > self.orphan_grace_s:
            self._orphaned = True
            log.warning("the supervisor of owner epoch %d is gone (%s): stopping cleanly", self.epoch,
                        "it released the run" if released else f"not seen for {age:.0f}s > launch.orphan_grace_s")
        return self._orphaned


class NoFence:
    """For code that runs outside any run (unit tests, tools): never fenced, never orphaned."""

    epoch, instance = 0, ""

    def superseded(self) -> bool:
        return False

    def check(self, what: str = "write") -> None:
        return None

    def orphaned(self, every_s: float = 2.0) -> bool:
        return False


def find_fenced(error: BaseException | None) -> Fenced | None:
    """The :class:`Fenced` behind ``error`` (itself, or a cause or context of it), if any."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, Fenced):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


@contextmanager
def exit_when_fenced():
    """Turn a :class:`Fenced` (also one raised while cleaning up) into exit code :data:`EXIT_FENCED`."""
    try:
        yield
    except BaseException as e:
        fenced = find_fenced(e)
        if fenced is None:
            raise
        log.error("fenced: %s", fenced)
        raise SystemExit(EXIT_FENCED) from None
