"""The evaluation component: ``python -m hpcrl.eval --run-dir DIR`` (``eval.mode: component``).

Held-out greedy accuracy measured apart from the trainer, so that no trainer
rank ever waits for it. The trainer's rank 0 hands each due version over as
a snapshot (:mod:`hpcrl.eval.snapshots`); this process evaluates them in
version order and appends one record per snapshot to ``logs/eval.jsonl``
(and TensorBoard) with the keys the trainer would have written (``step``,
``eval/accuracy``, ``time/eval_s``, ``time/elapsed_s``) plus ``eval/n``,
``eval/snapshot`` and ``eval/lag_s`` (seconds from the hand-over to the
record: how far the evaluation trails the trainer).

Lifecycle: read ``config.yaml`` and ``prepared.json`` -> load the initial
model, the tokenizer and the held-out rows -> evaluate the initial policy
(step 0, ``eval.at_start``) unless ``eval.jsonl`` has it -> loop: evaluate
every pending snapshot (record first, then remove the snapshot), beat the
heartbeat, sleep ``eval.poll_s`` -> exit 0 once the trainer wrote ``DONE``
and the final version (``trainer.total_steps``) is recorded.

Restarts: the watchdog resubmits this component like any other; a new
instance skips what ``eval.jsonl`` records and evaluates the rest, so each
snapshot is recorded exactly once. SIGUSR2/SIGTERM (walltime, preemption,
``hpcrl cancel``) stop it between two batches with exit 75: it keeps no
state of its own. It is fenced to its owner epoch like every component
(:mod:`hpcrl.runtime.owner`) and stops cleanly when its supervisor is gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path

import torch

from hpcrl.config import RunConfig, load_saved
from hpcrl.eval.snapshots import EvalLog, Snapshot, Snapshots
from hpcrl.model.hf_io import load_model, load_tokenizer
from hpcrl.eval.measure import held_out
from hpcrl.prepared import load_datasets, load_prepared
from hpcrl.reward.registry import build_scorer
from hpcrl.runtime.device import detect
from hpcrl.runtime.heartbeat import Heartbeat
from hpcrl.runtime.logs import setup_logging
from hpcrl.runtime.exits import component_exit
from hpcrl.runtime.owner import Fence
from hpcrl.runtime.preempt import EXIT_REQUEUE, Preempted, PreemptionFlag

log = logging.getLogger(__name__)

HEARTBEAT = "eval"  # heartbeats/eval@<instance>.json


class Evaluator:
    """Evaluates snapshots of one run, each recorded once."""

    def __init__(self, run_dir: Path, cfg: RunConfig, fence: Fence, heartbeat: Heartbeat,
                 preempt: PreemptionFlag) -> None:
        prep = load_prepared(run_dir)
        self.run_dir, self.cfg, self.fence, self.heartbeat, self.preempt = run_dir, cfg, fence, heartbeat, preempt
        self.snapshots = Snapshots(run_dir / "eval" / "pending")
        self.snapshots.clean_tmp(older_than_s=3600)  # a put takes seconds: an hour-old temporary has no writer
        self.log = EvalLog(run_dir / "logs", metrics=cfg.metrics, config=dataclasses.asdict(cfg))
        self.tokenizer = load_tokenizer(prep.init_model)
        self.device = detect("auto").device()
        self.model = load_model(prep.init_model).to(self.device)
        _, rows = load_datasets(cfg, self.tokenizer, Path(prep.train_path), Path(prep.eval_path), prep.init_model)
        self.rows = rows[: cfg.eval.size]
        self.runner = build_scorer(cfg.reward)
        self.measure = held_out(cfg, self.tokenizer, self.runner)
        self.evaluated = 0

    def _after_batch(self, done: int) -> None:
        self.heartbeat.beat(rows_done=done)
        self.preempt.check()
        if self.fence.orphaned():
            raise Preempted("the supervisor is gone")

    def evaluate(self, snap: Snapshot | None) -> None:
        """Evaluate ``snap`` (None: the initial policy, step 0) and record it."""
        version, ident = (0, "v0@initial") if snap is None else (snap.version, snap.id)
        t = time.time()
        if snap is not None:
            from safetensors.torch import load_file

            self.model.load_state_dict(load_file(str(snap.weights), device=str(self.device)), strict=False)
        res = self.measure(self.model, self.rows, after_batch=self._after_batch)
        self.log.append({"step": version, "eval/accuracy": res.accuracy, "eval/n": res.n, **res.metrics,
                         "time/eval_s": time.time() - t, "time/elapsed_s": snap.elapsed_s if snap else 0.0,
                         "eval/snapshot": ident, **({"eval/lag_s": time.time() - snap.put_at} if snap else {})},
                        self.fence)
        self.evaluated += 1
        log.info("step %d: held-out greedy accuracy %.3f (%s, %.1fs)", version, res.accuracy, ident, time.time() - t)

    def pass_once(self) -> None:
        """Evaluate what is due now: the initial policy (once), then every pending snapshot."""
        if self.cfg.eval.at_start and not self.log.recorded("v0@initial"):
            self.evaluate(None)
        for snap in self.snapshots.pending():
            if not self.log.recorded(snap.id):
                self.evaluate(snap)
            self.snapshots.remove(snap)  # recorded: by this instance just now, or by one killed before removing it

    def finished(self) -> bool:
        """The trainer is done, nothing is pending, and the final version is recorded."""
        if not (self.run_dir / "DONE").exists() or self.snapshots.pending():
            return False
        final = self.cfg.trainer.total_steps
        if final in self.log.steps:
            return True
        raise RuntimeError(f"the trainer finished but left no snapshot of its final version {final} in "
                           f"{self.snapshots.root} (was eval.mode changed to component after it started?)")

    def close(self) -> None:
        self.log.close()
        self.runner.close()


def run(run_dir: Path) -> None:
    with component_exit():
        _run(run_dir)


def _run(run_dir: Path) -> None:
    preempt = PreemptionFlag()  # first: a walltime signal during start-up must not kill the process
    cfg = load_saved(run_dir)
    fence = Fence.from_env(run_dir, cfg.launch.orphan_grace_s)
    fence.check("start")
    setup_logging("eval")
    torch.set_num_threads(cfg.eval.threads)
    heartbeat = Heartbeat(run_dir, f"{HEARTBEAT}@{fence.instance}", cfg.launch.heartbeat_interval_s)
    heartbeat.beat(force=True, state="loading")
    evaluator = Evaluator(run_dir, cfg, fence, heartbeat, preempt)
    log.info("evaluating %d held-out rows of each due version (every %d steps, final %d) on %s",
             len(evaluator.rows), cfg.eval.every_steps, cfg.trainer.total_steps, evaluator.device)
    try:
        while True:
            evaluator.pass_once()
            if evaluator.finished():
                log.info("done: %d evaluations by this instance", evaluator.evaluated)
                return
            heartbeat.beat(state="waiting")
            fence.check("poll")
            preempt.check()
            if fence.orphaned():
                raise Preempted("the supervisor is gone")
            time.sleep(cfg.eval.poll_s)
    except Preempted as e:
        log.warning("stopped (%s): nothing to save, exiting for a restart", e)
        raise SystemExit(EXIT_REQUEUE) from None
    finally:
        evaluator.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.eval", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    run(parser.parse_args(argv).run_dir)
