"""Temporaries that writers leave behind: find them, tell whose they are, remove those of dead writers.

A writer killed mid-write (SIGKILL, a node lost, a full filesystem) leaves its temporary behind: a spool
file, a weight directory under construction (the size of the model), a ledger record. Every temporary is
named ``<name>.tmp.[<instance>.]<pid>`` (:mod:`hpcrl.fs.atomic`), so its writer's job instance
(``e<epoch>n<k>``) is known. Who removes what:

* the supervisor, a grace period after it retired a job instance (cancelled it for a restart, retired a
  drained replica), removes that instance's temporaries, and those of earlier owners' instances (a takeover
  stopped every one of them first): :meth:`Sweeper.tick`;
* a new owner, before it starts anything, and the end of the run (nothing writes any more) remove every
  temporary: :func:`remove_all`;
* checkpoint directories under construction (``ckpt/step_<N>.tmp``, written by every trainer rank) are the
  trainer's: a new trainer removes them before its first checkpoint (:mod:`hpcrl.trainer.checkpoint`).

A live writer's temporary is never touched: its instance is not retired (fencing, design.md §4.7).
:func:`temporaries` lists them all for the audit and ``status``.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from hpcrl.fs.atomic import TMP_MARK, temporary_writer

log = logging.getLogger(__name__)

# where writers publish (one level each), and the trees whose every level may hold a reason-file temporary
PLACES = (".", "jobs", "logs", "logs/trackers", "weights", "admission", "admission/tmp", "spool", "spool/tmp", "eval/pending",
          "ckpt", "heartbeats")
TREES = ("spool/dropped", "spool/quarantine")


def _area(run_dir: Path, path: Path) -> str:
    return path.relative_to(run_dir).parts[0] if path.parent != run_dir else "."


def temporaries(run_dir: Path) -> list[Path]:
    """Every temporary under ``run_dir`` (files or directories whose name holds ``.tmp.``, and checkpoint
    directories under construction)."""
    found: list[Path] = []
    for place in PLACES:
        d = run_dir / place
        if d.is_dir():
            found += [p for p in d.iterdir() if TMP_MARK in p.name or (place == "ckpt" and p.name.endswith(".tmp"))]
    for tree in TREES:
        d = run_dir / tree
        if d.is_dir():
            found += [p for p in d.rglob(f"*{TMP_MARK}*")]
    return found


def _remove(path: Path) -> bool:
    """Remove one temporary; False if it is gone or cannot be removed (said). A directory is first renamed to a
    name of its own: if its writer were still alive, either its publishing rename or this one wins, never a
    published directory half deleted."""
    try:
        if path.is_dir() and not path.is_symlink():
            dead = path.with_name(f"{path.name}.dead")
            path.rename(dead)
            shutil.rmtree(dead, onerror=_left)
        else:
            path.unlink()
        return True
    except FileNotFoundError:
        return False
    except OSError as e:  # e.g. a directory an NFS client still holds open (.nfsXXXX files): the next sweep retries
        log.warning("could not remove the temporary %s: %s", path, e)
        return False


def _left(func: Callable, path: str, exc_info: tuple) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        log.warning("could not remove %s (%s): a later sweep tries again", path, exc_info[1])


def remove(run_dir: Path, dead: Callable[[Path], bool]) -> Counter:
    """Remove the temporaries ``dead`` says are of dead writers; how many, by area of the run directory."""
    counts: Counter = Counter()
    for p in temporaries(run_dir):
        if dead(p) and _remove(p):
            counts[_area(run_dir, p)] += 1
    return counts


def remove_all(run_dir: Path) -> Counter:
    """Remove every temporary: only while no component of the run writes (a takeover, the run's end)."""
    return remove(run_dir, lambda p: True)


def instance_epoch(instance: str | None) -> int | None:
    """The owner epoch of a job instance id ``e<epoch>n<k>`` (None if it is not one)."""
    if not instance or not instance.startswith("e") or "n" not in instance:
        return None
    epoch = instance[1:].split("n", 1)[0]
    return int(epoch) if epoch.isdigit() else None


class Sweeper:
    """The supervisor's sweep of retired writers' temporaries (module docstring).

    :meth:`retired` records a job instance the supervisor cancelled or retired; :meth:`tick` (every loop of
    the supervisor) removes, once ``grace_s`` passed, that instance's temporaries and those of instances of
    earlier owner epochs. Temporaries without an instance (written outside a component) are left to
    :func:`remove_all`.
    """

    def __init__(self, run_dir: Path, epoch: int, grace_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir, self.epoch, self.grace_s, self.clock = run_dir, epoch, grace_s, clock
        self._retired: dict[str, float] = {}  # instance -> when it was retired
        self._due: float | None = None
        self.removed: Counter = Counter()

    def retired(self, instance: str) -> None:
        self._retired.setdefault(instance, self.clock())
        self._due = min(self._due or float("inf"), self.clock() + self.grace_s)

    def tick(self) -> Counter:
        if self._due is None or self.clock() < self._due:
            return Counter()
        now = self.clock()
        gone = {i for i, t in self._retired.items() if now - t >= self.grace_s}

        def dead(p: Path) -> bool:
            writer = temporary_writer(p.name)
            epoch = instance_epoch(writer)
            return writer in gone or (epoch is not None and epoch < self.epoch)

        counts = remove(self.run_dir, dead)
        pending = [t for i, t in self._retired.items() if i not in gone]
        self._due = min(pending) + self.grace_s if pending else None
        for i in gone:  # their temporaries are gone; the instances stay dead (never reused)
            self._retired[i] = float("-inf")
        if counts:
            self.removed.update(counts)
            log.warning("removed %d temporaries of writers that were stopped (%s)", sum(counts.values()),
                        ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
        return counts
