"""Per-step metrics and held-out evaluation, on the trainer's rank 0.

After every step :meth:`Reporter.step` writes one record to
``logs/metrics.jsonl`` (and TensorBoard): rewards, staleness of the trained
tokens, losses, timings and throughput. Every ``eval.every_steps`` steps, and
at the end, it loads the full weights into a plain (unsharded) copy of the
model and measures greedy accuracy on the held-out split; at the start of a
run (``eval.at_start``) it measures the initial policy.

A run may take several *legs*: a trainer restarted by the watchdog or a
``--resume`` continues from a checkpoint, and the reporter continues from the
counters kept in it (:meth:`Reporter.counters` / :meth:`Reporter.restore`):

* ``time/elapsed_s``: wall seconds since the run's first trainer started,
  downtime between legs included; ``time/unix``: when the record was written;
* ``staleness/tokens_behind_<k>``: response tokens of the trained groups (loss-masked ones too, as
  ``staleness/mean_token``) generated ``k`` versions
  before the step's version (``k`` = 32 counts 32 and more; zero counts left out);
* ``time/train_s``: seconds of training loop summed over legs; ``time/leg_s``
  and ``leg`` (1, 2, ...): this leg's;
* ``throughput/samples_per_s``: samples of committed steps over
  ``time/train_s``; ``throughput/leg_samples_per_s``: this leg's alone.

A resumed leg evaluates nothing at its start: the initial policy is not the
one being trained any more, and the next due step evaluates the trained
weights (the checkpoint's own step was evaluated if it was due).

With ``eval.mode: component`` the reporter evaluates nothing and loads no
model: at a due step it hands the version over to the evaluation component
as a snapshot (:mod:`hpcrl.eval.snapshots`; ``time/snapshot_s`` in the
step's record) and goes on; the accuracy arrives in ``logs/eval.jsonl``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from hpcrl.data.rows import Row
from hpcrl.eval.accuracy import EvalResult
from hpcrl.eval.config import EvalConfig
from hpcrl.eval.snapshots import Snapshots
from hpcrl.metrics.config import MetricsConfig
from hpcrl.metrics.writer import EVAL_LOG, MetricsWriter, read_metrics
from hpcrl.model.hf_io import load_model
from hpcrl.runtime.owner import Fence, NoFence
from hpcrl.spool.format import TrajectoryGroup

log = logging.getLogger(__name__)


def group_stats(groups: list[TrajectoryGroup], version: int) -> dict[str, float]:
    """Reward, length and staleness statistics of the groups trained at ``version``."""
    rewards = np.array([s.reward for g in groups for s in g.samples], dtype=np.float64)
    lengths = np.array([len(s.response_ids) for g in groups for s in g.samples])
    versions = np.concatenate([s.versions for g in groups for s in g.samples if len(s.versions)] or [np.zeros(0)])
    heads = np.array([g.min_version for g in groups])
    stale = version - versions if len(versions) else np.zeros(1)
    # the groups' response tokens by versions behind (the explorer's staleness panel); the last bucket holds >= 32
    behind = np.bincount(np.clip(stale.astype(np.int64), 0, 32), minlength=1) if len(versions) else np.zeros(0)
    return {
        **{f"staleness/tokens_behind_{k}": float(n) for k, n in enumerate(behind) if n},
        "reward/mean": rewards.mean(), "reward/std": rewards.std(),
        "response/len_mean": lengths.mean(), "response/len_max": lengths.max(),
        "staleness/max": float(version - heads.min()), "staleness/mean_token": float(stale.mean()),
        "staleness/max_token": float(stale.max()),
        "samples": float(len(rewards)), "tokens": float(lengths.sum()),
        # rollout replicas whose groups this step trained (writer r<K>-...): the fleet as the trainer sees it
        "fleet/replicas_in_batch": float(len({g.writer.split("-")[0] for g in groups})),
    }


class Reporter:
    def __init__(self, log_dir, eval_cfg: EvalConfig, total_steps: int, *, model_path: str, eval_rows: list[Row],
                 measure: Callable[..., EvalResult], instance: str = "",
                 fence: Fence | NoFence | None = None, metrics: MetricsConfig | None = None,
                 config: dict[str, Any] | None = None) -> None:
        """``measure(model, rows)``: the run's held-out accuracy (:func:`hpcrl.eval.measure.held_out`);
        ``metrics``: the run's trackers (None: TensorBoard), ``config``: the run's config for their run page."""
        self.writer = MetricsWriter(log_dir, trackers=metrics, component="trainer", config=config)
        self.cfg, self.total_steps = eval_cfg, total_steps
        component = eval_cfg.mode == "component"
        self.model = None if component else load_model(model_path)
        self.snapshots = Snapshots(Path(log_dir).parent / "eval" / "pending") if component else None
        self.instance, self.fence = instance, fence or NoFence()
        # version -> its published model.safetensors (disk weights: the snapshot links it instead of a copy)
        self.published: Callable[[int], Path | None] = lambda version: None
        # what the engine publishes -> the whole policy under HF names (the adapters merged into the base model
        # when the trainer publishes LoRA adapters, hpcrl.weights.adapter.adapter_merger)
        self.whole_policy: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]] = lambda state: state
        self.rows, self.measure = eval_rows[: eval_cfg.size], measure
        self.t0 = time.time()  # this leg's process start
        self.loop_start: float | None = None  # this leg's training loop start
        self.samples_total = 0.0  # over all legs, committed steps only
        self.leg_samples = 0.0
        self.train_before = 0.0  # training-loop seconds of earlier legs
        self.run_started: float | None = None  # unix time the run's first trainer started
        self.leg = 1
        self.last: dict[str, Any] = {}

    def restore(self, counters: Mapping[str, Any]) -> None:
        """Continue from the counters of a checkpoint (:meth:`counters` of an earlier leg)."""
        self.samples_total = float(counters.get("samples_total", 0.0))
        self.train_before = float(counters.get("train_s", 0.0))
        self.run_started = counters.get("run_started")
        self.leg = int(counters.get("legs", 0)) + 1

    def counters(self) -> dict[str, Any]:
        """What a checkpoint keeps so that the next leg's metrics continue these."""
        return {"samples_total": self.samples_total, "train_s": self.train_s(), "run_started": self.run_started,
                "legs": self.leg}

    def train_s(self) -> float:
        return self.train_before + (time.time() - self.loop_start if self.loop_start is not None else 0.0)

    def evaluate(self, state_dict: Mapping[str, torch.Tensor] | None) -> dict[str, float]:
        """The record's ``eval/...`` entries for ``state_dict`` (None: the model as loaded)."""
        if state_dict is not None:
            unexpected = self.model.load_state_dict(state_dict, strict=False).unexpected_keys
            if unexpected:  # not this model's weights (e.g. adapters not merged): evaluating would measure nothing
                raise ValueError(f"held-out evaluation: {len(unexpected)} weights the model does not have, e.g. "
                                 f"{unexpected[0]!r}")
        res = self.measure(self.model, self.rows)
        return {"eval/accuracy": res.accuracy, **res.metrics}

    def start(self, version: int) -> None:
        """The training loop begins at ``version`` (0 for a new run, the checkpoint's step for a resumed leg)."""
        if self.cfg.at_start and version == 0 and self.snapshots is None:
            t = time.time()
            evaluated = self.evaluate(None)
            self.write({"step": version, **evaluated, "time/eval_s": time.time() - t})
            log.info("step %d: held-out greedy accuracy %.3f", version, evaluated["eval/accuracy"])
        elif version > 0:
            log.info("leg %d resumes at step %d (%.0f samples and %.0fs of training before it)", self.leg, version,
                     self.samples_total, self.train_before)
        if self.snapshots is None:
            self.evaluate_left_over()
        self.loop_start = time.time()
        if self.run_started is None:
            self.run_started = self.t0

    def evaluate_left_over(self) -> None:
        """A run resumed with ``eval.mode: trainer`` after legs with ``component``: evaluate here what the
        evaluation component had not recorded yet, so no due version goes unevaluated."""
        from safetensors.torch import load_file

        pending = Snapshots(self.writer.log_dir.parent / "eval" / "pending")
        recorded = {r.get("eval/snapshot") for r in read_metrics(self.writer.log_dir / EVAL_LOG)}
        for snap in pending.pending():
            if snap.id not in recorded:
                t = time.time()
                evaluated = self.evaluate(load_file(str(snap.weights)))
                self.write({"step": snap.version, **evaluated, "time/eval_s": time.time() - t,
                            "eval/snapshot": snap.id, "time/elapsed_s": snap.elapsed_s})
                log.info("step %d: held-out greedy accuracy %.3f (left over by the evaluation component)",
                         snap.version, evaluated["eval/accuracy"])
            pending.remove(snap)

    def due(self, step: int) -> bool:
        return self.cfg.due(step, self.total_steps)

    def step(self, step: int, groups: list[TrajectoryGroup], stats: dict[str, float], timings: dict[str, float],
             state_dict: Mapping[str, torch.Tensor] | None, extra: dict[str, float]) -> None:
        record: dict[str, Any] = {"step": step, **group_stats(groups, step - 1), **stats, **extra}
        record.update({f"time/{k}_s": v for k, v in timings.items()})
        self.samples_total += record["samples"]
        self.leg_samples += record["samples"]
        now = time.time()
        leg_s, train_s = now - (self.loop_start or self.t0), self.train_s()
        record.update({"leg": self.leg, "time/leg_s": leg_s, "time/train_s": train_s,
                       "throughput/samples_per_s": self.samples_total / max(train_s, 1e-9),
                       "throughput/leg_samples_per_s": self.leg_samples / max(leg_s, 1e-9)})
        if self.due(step) and state_dict is not None:
            state_dict = self.whole_policy(state_dict)
        if self.due(step) and state_dict is not None and self.snapshots is not None:
            t = time.time()
            elapsed = time.time() - (self.run_started or self.t0)
            self.snapshots.put(step, state_dict, self.instance, elapsed, self.published(step), self.fence)
            record["time/snapshot_s"] = time.time() - t
        elif self.due(step) and state_dict is not None:
            t = time.time()
            record.update(self.evaluate(state_dict))
            record["time/eval_s"] = time.time() - t
        self.write(record)

    def write(self, record: dict[str, Any]) -> None:
        record.setdefault("time/elapsed_s", time.time() - (self.run_started or self.t0))
        record.setdefault("time/unix", time.time())  # when: places the step among the run's events
        self.last = record
        self.writer.write(record)

    def close(self) -> None:
        self.writer.close()
