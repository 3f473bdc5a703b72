"""Reward runner: calls a user reward function by import path and contains it.

``RewardRunner(cfg)`` imports ``cfg.fn`` once (a bad path is a ``ValueError``
before anything runs), then ``score(prompt, response, row)`` calls
``fn(prompt, response, **row)`` and always returns a ``RewardResult``; it never
raises because of the function. Outcomes, each counted in ``counts``:

- ``ok``: a finite real number (``True``/``False`` read as 1.0/0.0);
- ``invalid``: anything else (None, NaN, inf, a string) -> 0.0;
- ``error``: the function raised, or its worker process died -> 0.0;
- ``timeout``: no answer within ``timeout_s`` -> 0.0, and the run goes on.

Isolation (``cfg.isolation``):

- ``thread``: calls run on ``cfg.max_workers`` persistent daemon threads
  (:mod:`hpcrl.reward.threads`); a call past its deadline is abandoned
  (Python cannot kill a thread) and a fresh thread takes its place. Cheap,
  but a hung call keeps its thread and a crash that takes the interpreter
  down (segfault, ``os._exit``) takes the caller with it.
- ``process``: calls run in worker processes (multiprocessing ``spawn``) that
  import only the reward function. A worker past its deadline is killed with
  its whole process group and restarted on the next call; a worker that dies
  (segfault, ``os._exit``) gives ``error`` and is restarted. Note that
  ``spawn`` re-imports the parent's ``__main__`` module as ``__mp_main__``, so
  entry points keep heavy work under ``if __name__ == "__main__"``.

``score_many`` scores up to ``cfg.max_workers`` items concurrently and keeps
their order. ``close()`` stops the workers; the runner is a context manager.
Repeated identical warnings are rate-limited (see ``_WarningLimiter``).
"""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing
import numbers
import os
import pickle
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, Callable

from hpcrl.reward.config import RewardConfig  # noqa: F401 (re-exported)
from hpcrl.reward.scorer import STATUSES, RewardResult, Status  # noqa: F401 (re-exported)
from hpcrl.reward.threads import Call, CallThreads

logger = logging.getLogger(__name__)





def load_function(path: str, what: str = "reward function") -> Callable[..., float]:
    """Import ``'package.module:function'`` (``function`` may be dotted, e.g.
    ``Class.method``). ValueError naming the path and what is wrong."""
    module_name, sep, attr = str(path).partition(":")
    module_name, attr = module_name.strip(), attr.strip()
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(f"{what} {path!r}: bad format, expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ValueError(f"{what} {path!r}: module {module_name!r} not found") from exc
        raise ValueError(f"{what} {path!r}: importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:  # a user module failing at import: report it as a config error
        raise ValueError(
            f"{what} {path!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{what} {path!r}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{what} {path!r}: {attr!r} is not callable (it is {type(target).__name__})")
    return target


def to_reward(value: Any) -> tuple[float, Status, str]:
    """Classify a reward function's return value: (reward, status, detail)."""
    if not isinstance(value, (bool, numbers.Real)) and callable(getattr(value, "item", None)):
        try:  # numpy bools, 0-d numpy arrays, one-element torch tensors
            value = value.item()
        except (ValueError, TypeError, RuntimeError) as exc:
            return 0.0, "invalid", f"returned {type(value).__name__} that is not one number ({exc})"
    if isinstance(value, bool):
        return (1.0 if value else 0.0), "ok", ""
    if isinstance(value, numbers.Real):
        reward = float(value)
        if math.isfinite(reward):
            return reward, "ok", ""
        return 0.0, "invalid", f"returned non-finite {reward!r}"
    return 0.0, "invalid", f"returned {type(value).__name__} {_short(value)}, not a real number"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def call_reward(fn: Callable[..., Any], prompt: str, response: str, row: dict) -> tuple[float, str, str]:
    """Call ``fn`` and classify the outcome; exceptions become status "error"."""
    try:
        value = fn(prompt, response, **row)
    except (Exception, SystemExit) as exc:  # the function's failure is the result, not ours
        return 0.0, "error", f"raised {type(exc).__name__}: {exc}"
    return to_reward(value)


class _WarningLimiter:
    """Log a warning the first time a (status, detail) pair is seen, then at
    most once per ``interval_s`` per pair, with the number suppressed since."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def warn(self, fn_path: str, status: str, detail: str) -> bool:
        key, now = (status, detail), self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        more = f" (and {suppressed} more like it)" if suppressed else ""
        logger.warning("reward function %s: %s: %s%s", fn_path, status, detail, more)
        return True


class RewardRunner:
    """Scores responses with ``cfg.fn`` under ``cfg.isolation`` (see module doc): the ``function``
    :class:`~hpcrl.reward.scorer.Scorer`."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self._fn = load_function(cfg.fn)  # fail fast on a bad path, in both modes
        self._counts = {s: 0 for s in STATUSES if s != "infra_error"}  # infra_error: not a function call's
        self._lock = threading.Lock()
        self._warnings = _WarningLimiter()
        self._pool: _WorkerPool | None = None
        self._threads: CallThreads | None = None
        if cfg.isolation == "process":
            self._pool = _WorkerPool([_ProcessWorker(cfg.fn) for _ in range(cfg.max_workers)])
        else:
            self._threads = CallThreads(cfg.max_workers)
        self._closed = False

    def score(self, prompt: str, response: str, row: dict) -> RewardResult:
        """Score one response; never raises because of the reward function."""
        if self._closed:
            raise RuntimeError("RewardRunner.score called after close()")
        if self._pool is not None:
            return self._record(*self._pool.call(prompt, response, dict(row), self.cfg.timeout_s))
        return self._record(*self._thread_result(self._submit(prompt, response, row)))

    def _record(self, reward: float, status: str, detail: str) -> RewardResult:
        result = RewardResult(reward=reward, status=status, detail=detail)  # type: ignore[arg-type]
        with self._lock:
            self._counts[result.status] += 1
        if result.status != "ok":
            self._warnings.warn(self.cfg.fn, result.status, result.detail)
        return result

    def score_many(self, items: list[tuple[str, str, dict]]) -> list[RewardResult]:
        """Score ``(prompt, response, row)`` items concurrently; order preserved."""
        items = list(items)
        if self._threads is not None:  # all queued at once, up to max_workers run at a time
            if self._closed:
                raise RuntimeError("RewardRunner.score_many called after close()")
            calls = [self._submit(p, r, row) for p, r, row in items]
            return [self._record(*self._thread_result(c)) for c in calls]
        if len(items) <= 1 or self.cfg.max_workers == 1:
            return [self.score(p, r, row) for p, r, row in items]
        workers = min(self.cfg.max_workers, len(items))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward") as pool:
            return list(pool.map(lambda item: self.score(*item), items))

    @property
    def counts(self) -> dict[str, int]:
        """Totals per status: ok / error / timeout / invalid."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        """Stop worker processes; abandoned threads are daemons and die with us."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.close()
        if self._threads is not None:
            self._threads.close()

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _submit(self, prompt: str, response: str, row: dict) -> Call:
        return self._threads.submit(partial(call_reward, self._fn, prompt, response, dict(row)))

    def _thread_result(self, call: Call) -> tuple[float, str, str]:
        if self._threads.wait(call, self.cfg.timeout_s):
            if call.result is None:  # only a BaseException escapes call_reward
                return 0.0, "error", f"call ended without a result: {call.error}"
            return call.result
        logger.debug("reward function %s: %d call thread(s) abandoned so far", self.cfg.fn, self._threads.abandoned)
        return 0.0, "timeout", f"no result after {self.cfg.timeout_s:g} s; call thread abandoned"


# --- process isolation -------------------------------------------------------


def _worker_main(fn_path: str, conn: Connection) -> None:
    """Entry point of a spawned worker: load the function, serve calls until EOF.

    The worker leads its own process group so a timeout kills whatever the
    reward function started too (a sandboxed interpreter, a compiler)."""
    try:
        os.setpgrp()
    except OSError as exc:
        logger.debug("reward worker: setpgrp failed: %s", exc)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    try:
        fn = load_function(fn_path)
    except ValueError as exc:
        conn.send(("fatal", str(exc)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if request is None:
            return
        conn.send(call_reward(fn, *request))


class _ProcessWorker:
    """One spawned worker process, started lazily and restarted after it is
    killed (timeout) or dies (crash). Used by one caller at a time."""

    def __init__(self, fn_path: str, startup_timeout_s: float = 120.0) -> None:
        self.fn_path = fn_path
        self.startup_timeout_s = startup_timeout_s
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def call(self, prompt: str, response: str, row: dict, timeout_s: float) -> tuple[float, str, str]:
        if self._proc is None or not self._proc.is_alive():
            self._discard()
            failure = self._start()
            if failure:
                return 0.0, "error", failure
        assert self._conn is not None
        try:
            self._conn.send((prompt, response, row))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            return 0.0, "error", f"cannot send the call to the worker: {type(exc).__name__}: {exc}"
        except OSError:
            return 0.0, "error", f"worker process died (exit code {self._discard(2.0)}); restarting"
        if not self._conn.poll(timeout_s):
            self._discard()
            return 0.0, "timeout", f"no result after {timeout_s:g} s; worker killed"
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return 0.0, "error", f"worker process died (exit code {self._discard(2.0)}); restarting"

    def _start(self) -> str | None:
        """Spawn a worker and wait until it has loaded the function; None on
        success, else why it failed."""
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_worker_main, args=(self.fn_path, child_conn), name="reward-worker", daemon=True)
        proc.start()
        child_conn.close()  # so the parent sees EOF when the worker dies
        self._proc, self._conn = proc, parent_conn
        logger.debug("reward worker %d started for %s", proc.pid, self.fn_path)
        if not parent_conn.poll(self.startup_timeout_s):
            self._discard()
            return f"worker process did not start within {self.startup_timeout_s:g} s"
        try:
            kind, payload = parent_conn.recv()
        except (EOFError, OSError):
            return f"worker process died while starting (exit code {self._discard(2.0)})"
        if kind != "ready":
            self._discard()
            return f"worker process could not load the function: {payload}"
        return None

    def _discard(self, grace_s: float = 0.0) -> int | None:
        """Kill the worker (with its process group) if still alive after
        ``grace_s``; its exit code (negative: the signal that ended it)."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is None:
            return None
        if grace_s > 0:
            proc.join(grace_s)
        if proc.is_alive():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()  # not (yet) a group leader
        proc.join(5.0)
        return proc.exitcode

    def stop(self) -> None:
        """Ask the worker to exit; kill it if it does not within a second."""
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            try:
                self._conn.send(None)
            except OSError:
                pass  # already gone; _discard reaps it
            self._proc.join(1.0)
        self._discard()


class _WorkerPool:
    """Hands each call an idle worker; at most ``len(workers)`` calls at once."""

    def __init__(self, workers: list[_ProcessWorker]) -> None:
        self._workers = workers
        self._idle: queue.Queue[_ProcessWorker] = queue.Queue()
        for worker in workers:
            self._idle.put(worker)

    def call(self, prompt: str, response: str, row: dict, timeout_s: float) -> tuple[float, str, str]:
        worker = self._idle.get()
        try:
            return worker.call(prompt, response, row, timeout_s)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
