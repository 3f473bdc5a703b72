"""Per-step metrics and held-out evaluation, on the trainer's rank 0.

After every step :meth:`Reporter.step` writes one record to
``logs/metrics.jsonl`` (and TensorBoard): rewards, staleness of the trained
tokens, losses, timings and throughput. Every ``eval.every_steps`` steps, and
at the start and the end, it loads the full weights into a plain (unsharded)
copy of the model and measures greedy accuracy on the held-out split.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import numpy as np
import torch

from hpcrl.data.rows import Row
from hpcrl.eval.accuracy import greedy_accuracy
from hpcrl.eval.config import EvalConfig
from hpcrl.metrics.writer import MetricsWriter
from hpcrl.model.hf_io import load_model
from hpcrl.spool.format import TrajectoryGroup

log = logging.getLogger(__name__)


def group_stats(groups: list[TrajectoryGroup], version: int) -> dict[str, float]:
    """Reward, length and staleness statistics of the groups trained at ``version``."""
    rewards = np.array([s.reward for g in groups for s in g.samples], dtype=np.float64)
    lengths = np.array([len(s.response_ids) for g in groups for s in g.samples])
    versions = np.concatenate([s.versions for g in groups for s in g.samples if len(s.versions)] or [np.zeros(0)])
    heads = np.array([g.min_version for g in groups])
    stale = version - versions if len(versions) else np.zeros(1)
    return {
        "reward/mean": rewards.mean(), "reward/std": rewards.std(),
        "response/len_mean": lengths.mean(), "response/len_max": lengths.max(),
        "staleness/max": float(version - heads.min()), "staleness/mean_token": float(stale.mean()),
        "staleness/max_token": float(stale.max()),
        "samples": float(len(rewards)), "tokens": float(lengths.sum()),
    }


class Reporter:
    def __init__(self, log_dir, eval_cfg: EvalConfig, total_steps: int, *, model_path: str, tokenizer,
                 eval_rows: list[Row], score, max_new_tokens: int, chat_template: bool = False) -> None:
        self.writer = MetricsWriter(log_dir)
        self.cfg, self.total_steps = eval_cfg, total_steps
        self.model = load_model(model_path)
        self.tokenizer, self.rows, self.score = tokenizer, eval_rows[: eval_cfg.size], score
        self.max_new_tokens, self.chat_template = max_new_tokens, chat_template
        self.t0 = time.time()
        self.loop_start: float | None = None
        self.samples_total = 0.0
        self.last: dict[str, Any] = {}

    def evaluate(self, state_dict: Mapping[str, torch.Tensor] | None) -> float:
        if state_dict is not None:
            self.model.load_state_dict(state_dict, strict=False)
        res = greedy_accuracy(self.model, self.tokenizer, self.rows, self.score, max_new_tokens=self.max_new_tokens,
                              batch_size=self.cfg.batch_size, chat_template=self.chat_template)
        return res.accuracy

    def start(self, version: int) -> None:
        if self.cfg.at_start:
            t = time.time()
            acc = self.evaluate(None)
            self.write({"step": version, "eval/accuracy": acc, "time/eval_s": time.time() - t})
            log.info("step %d: held-out greedy accuracy %.3f", version, acc)
        self.loop_start = time.time()

    def due(self, step: int) -> bool:
        every = self.cfg.every_steps
        return step == self.total_steps or (every > 0 and step % every == 0)

    def step(self, step: int, groups: list[TrajectoryGroup], stats: dict[str, float], timings: dict[str, float],
             state_dict: Mapping[str, torch.Tensor] | None, extra: dict[str, float]) -> None:
        record: dict[str, Any] = {"step": step, **group_stats(groups, step - 1), **stats, **extra}
        record.update({f"time/{k}_s": v for k, v in timings.items()})
        self.samples_total += record["samples"]
        elapsed = time.time() - (self.loop_start or self.t0)
        record["throughput/samples_per_s"] = self.samples_total / max(elapsed, 1e-9)
        if self.due(step) and state_dict is not None:
            t = time.time()
            record["eval/accuracy"] = self.evaluate(state_dict)
            record["time/eval_s"] = time.time() - t
        self.write(record)

    def write(self, record: dict[str, Any]) -> None:
        record.setdefault("time/elapsed_s", time.time() - self.t0)
        self.last = record
        self.writer.write(record)

    def close(self) -> None:
        self.writer.close()
