"""The reward service: scoring as a component of its own, fed through the run directory.

With ``reward.service: true`` the rollouts do not score: each rollout's scorer is a :class:`ServiceClient`
that hands its items to the reward component (``python -m hpcrl.reward --run-dir DIR``; a local process, or a
Slurm job with the resources of ``launch.reward``, e.g. a CPU partition), which scores them with the scorer
``reward.scorer`` names (the code sandbox, a function) and hands the results back. Several rollout replicas
share one service. The held-out evaluation and the SFT warm start still score in their own processes.

Files, under ``<run_dir>/reward/`` (every one written atomically):

* ``requests/<writer>-<digest>.json``: one item (prompt, response, row); ``digest`` is a hash of the item, so
  asking again for the same item (a held group scored again) names the same request;
* ``results/<writer>-<digest>.json``: its :class:`~hpcrl.reward.scorer.RewardResult`, written before the
  request is removed; the client removes the result once it has read it.

Lifecycle of the service: read ``config.yaml`` -> build the scorer -> loop: take up to ``reward.max_workers``
x 4 requests, oldest first, score them together, write each result, then remove its request; beat the
heartbeat; exit 0 once the trainer wrote ``DONE``. A killed service loses nothing: a request stays until its
result exists, so the next instance (the watchdog restarts it like any component) scores what is pending,
again if it was scored but its request not yet removed (scoring is a pure function of the item). It is fenced
to its owner epoch (:mod:`hpcrl.runtime.owner`) and stops when its supervisor is gone.

The client waits for its results at most ``reward.service_wait_s`` (not at all after a call that got no answer,
until the service answers again); items still unscored then are results of
status ``infra_error`` (the service is down or behind), which the rollout loop holds and scores again, never
trains as 0 (:mod:`hpcrl.rollout.worker`). Their requests stay, so the retry finds the results the restarted
service wrote meanwhile.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

from hpcrl.fs import atomic
from hpcrl.reward.config import RewardConfig
from hpcrl.reward.scorer import Item, RewardResult, Scorer

__all__ = ["RewardService", "ServiceClient", "main"]

log = logging.getLogger(__name__)

HEARTBEAT = "reward"  # heartbeats/reward@<instance>.json


def _dirs(run_dir: Path) -> tuple[Path, Path]:
    root = Path(run_dir) / "reward"
    return root / "requests", root / "results"


def _names(d: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(d) if n.endswith(".json") and not atomic.is_temporary(n))
    except FileNotFoundError:
        return []


class ServiceClient:
    """A rollout's :class:`~hpcrl.reward.scorer.Scorer` when ``reward.service`` is on (module docstring)."""

    def __init__(self, cfg: RewardConfig, run_dir: Path, writer: str) -> None:
        self.cfg, self.writer, self.done = cfg, writer, Path(run_dir) / "DONE"
        self.requests, self.results = _dirs(run_dir)
        self.requests.mkdir(parents=True, exist_ok=True)
        self.results.mkdir(parents=True, exist_ok=True)
        self._counts: dict[str, int] = {}
        self._down = False  # the last call found no answer: the service is down or far behind

    def score(self, prompt: str, response: str, row: dict) -> RewardResult:
        return self.score_many([(prompt, response, row)])[0]

    def score_many(self, items: list[Item]) -> list[RewardResult]:
        names = [self._name(item) for item in items]
        got: dict[str, RewardResult] = {}
        try:
            for name, (prompt, response, row) in zip(names, items):
                if not (self.results / name).exists() and not (self.requests / name).exists():
                    atomic.write_json(self.requests / name, {"prompt": prompt, "response": response, "row": row})
            # a service that let the last call down gets no wait until it answers again: the rollout loop holds
            # the group and asks later, instead of blocking generation service_wait_s per group
            deadline = time.monotonic() + (0.0 if self._down else self.cfg.service_wait_s)
            while True:
                for name in set(names) - set(got):
                    try:
                        got[name] = RewardResult(**atomic.read_json(self.results / name))
                    except FileNotFoundError:
                        continue
                if len(got) == len(set(names)) or time.monotonic() >= deadline or self.done.exists():
                    break  # (once the run is done the service exits: nothing more will be scored)
                time.sleep(self.cfg.service_poll_s)
            for name in got:
                (self.results / name).unlink(missing_ok=True)
            why = ("the run ended before the reward service scored it" if self.done.exists() else
                   f"the reward service did not score it within {self.cfg.service_wait_s:g} s (reward.service_wait_s)")
        except (OSError, ValueError, TypeError) as e:  # the run directory failed us: not the samples' fault
            why = f"the reward service's files: {type(e).__name__}: {e}"
        self._down = bool(names) and not got
        out = [got.get(name, RewardResult(0.0, "infra_error", why)) for name in names]
        for r in out:
            self._counts[r.status] = self._counts.get(r.status, 0) + 1
        return out

    @property
    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def close(self) -> None:
        """Nothing to stop: pending requests stay for the service (their results are pruned if never read)."""

    def _name(self, item: Item) -> str:
        digest = hashlib.sha256(json.dumps(item, sort_keys=True, default=str).encode()).hexdigest()[:32]
        return f"{self.writer}-{digest}.json"


class RewardService:
    """Scores the pending requests of one run (module docstring)."""

    def __init__(self, run_dir: Path, cfg: RewardConfig, scorer: Scorer, fence=None) -> None:
        self.cfg, self.scorer, self.fence = cfg, scorer, fence
        self.requests, self.results = _dirs(run_dir)
        self.requests.mkdir(parents=True, exist_ok=True)
        self.results.mkdir(parents=True, exist_ok=True)
        self.scored = 0
        self._pruned = 0.0

    def pump(self) -> int:
        """Score up to one batch of pending requests, oldest first; how many were taken."""
        names = self._oldest(4 * self.cfg.max_workers)
        items, taken = [], []
        for name in names:
            try:
                req = atomic.read_json(self.requests / name)
                items.append((str(req["prompt"]), str(req["response"]), dict(req["row"])))
                taken.append(name)
            except FileNotFoundError:
                continue  # read by a replaced instance meanwhile
            except (ValueError, KeyError, TypeError) as e:  # not a request this project wrote: answer it
                self._answer(name, RewardResult(0.0, "invalid", f"unreadable request: {e}"))
        if items:
            try:
                results = self.scorer.score_many(items)
            except Exception:  # a scorer must not raise; if it does, find the item and answer it alone
                results = [self._score_alone(item) for item in items]
            for name, result in zip(taken, results):
                self._answer(name, result)
            self.scored += len(items)
        self._prune()
        return len(names)

    def _score_alone(self, item: Item) -> RewardResult:
        try:
            return self.scorer.score(*item)
        except Exception as e:
            log.exception("the scorer raised on an item; answered as an error")
            return RewardResult(0.0, "error", f"the scorer raised {type(e).__name__}: {e}")

    def _oldest(self, n: int) -> list[str]:
        """The ``n`` oldest requests (every rollout is served in turn, whatever its name)."""
        aged = []
        for name in _names(self.requests):
            try:
                aged.append(((self.requests / name).stat().st_mtime, name))
            except FileNotFoundError:
                continue
        return [name for _, name in sorted(aged)[:n]]

    def _answer(self, name: str, result: RewardResult) -> None:
        if self.fence is not None:
            self.fence.check("reward result")
        atomic.write_json(self.results / name, asdict(result))
        (self.requests / name).unlink(missing_ok=True)

    def _prune(self, every_s: float = 60.0) -> None:
        """Results nobody read for an hour (their rollout is gone: a restart asks under a new writer)."""
        now = time.time()
        if now - self._pruned < every_s:
            return
        self._pruned = now
        for name in _names(self.results):
            try:
                if now - (self.results / name).stat().st_mtime > 3600:
                    (self.results / name).unlink(missing_ok=True)
            except FileNotFoundError:
                pass


def run(run_dir: Path) -> None:
    from hpcrl.runtime.exits import component_exit

    with component_exit():
        _run(run_dir)


def _run(run_dir: Path) -> None:
    from hpcrl.config import load_saved
    from hpcrl.reward.registry import build_scorer
    from hpcrl.runtime.heartbeat import Heartbeat
    from hpcrl.runtime.logs import setup_logging
    from hpcrl.runtime.owner import Fence
    from hpcrl.runtime.preempt import EXIT_REQUEUE, PreemptionFlag

    preempt = PreemptionFlag()  # first: a walltime signal during start-up must not kill the process
    cfg = load_saved(run_dir)
    fence = Fence.from_env(run_dir, cfg.launch.orphan_grace_s)
    fence.check("start")
    setup_logging("reward")
    heartbeat = Heartbeat(run_dir, f"{HEARTBEAT}@{fence.instance}", cfg.launch.heartbeat_interval_s)
    heartbeat.beat(force=True, state="starting")
    scorer = build_scorer(cfg.reward)
    service = RewardService(run_dir, cfg.reward, scorer, fence)
    log.info("reward service started (scorer %s, %d pending)", cfg.reward.scorer, len(_names(service.requests)))
    try:
        while not (run_dir / "DONE").exists():
            busy = service.pump()
            heartbeat.beat(scored=service.scored, counts=scorer.counts)
            fence.check("poll")
            if preempt.requested or fence.orphaned():
                log.warning("stopping (%s): pending requests stay for the next instance",
                            "signal" if preempt.requested else "the supervisor is gone")
                raise SystemExit(EXIT_REQUEUE)
            if not busy:
                time.sleep(cfg.reward.service_poll_s)
        log.info("done: %d items scored by this instance (%s)", service.scored, scorer.counts)
    finally:
        scorer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.reward", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    run(parser.parse_args(argv).run_dir)
