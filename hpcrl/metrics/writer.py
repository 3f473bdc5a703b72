"""Run metrics: ``<run_dir>/logs/metrics.jsonl`` plus the run's trackers (TensorBoard by default; W&B, MLflow).

One JSON object per line, appended and flushed by the trainer's rank 0 after
every step (keys such as ``step``, ``reward/mean``, ``eval/accuracy``,
``staleness/max``, ``time/elapsed_s``). A reader may see a last line that is
still being written: :func:`read_metrics` skips an incomplete last line.

With ``eval.mode: component`` the held-out accuracy comes from the
evaluation component instead, in ``logs/eval.jsonl`` (same keys: ``step``,
``eval/accuracy``, ``time/eval_s``, ``time/elapsed_s``, plus
``eval/snapshot``, the weights evaluated): :func:`read_evals` reads the
evaluations of a run whichever mode wrote them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from hpcrl.metrics.config import MetricsConfig
from hpcrl.metrics.trackers import TrackerContext, open_trackers

log = logging.getLogger(__name__)

METRICS_LOG = "metrics.jsonl"  # the trainer's records
EVAL_LOG = "eval.jsonl"  # the evaluation component's records (eval.mode: component)


class MetricsWriter:
    """Appends records to ``<log_dir>/<filename>`` (``durable``: fsynced before :meth:`write` returns) and hands
    each step's scalars to the run's trackers (hpcrl/metrics/trackers.py): ``trackers`` is the run's
    ``metrics`` config (None: TensorBoard alone if ``tensorboard``), ``component`` names the tracker run.

    Each tracker gets each step once and none is skipped, across restarts: the last step a tracker holds for
    sure is kept in ``logs/trackers/<component>-<tracker>.step`` (after every record for a tracker whose log
    is on disk when it returns, at a clean close for one that buffers, W&B); a new leg first hands each
    tracker the records of the JSONL file after its mark (what a killed leg logged but the tracker lost),
    then goes on, and a record of a step at or below the mark (recomputed from an older checkpoint, or an
    evaluation of an earlier version) goes to the JSONL file only."""

    def __init__(self, log_dir: str | Path, tensorboard: bool = True, filename: str = METRICS_LOG,
                 durable: bool = False, trackers: MetricsConfig | None = None, component: str = "trainer",
                 config: dict[str, Any] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.durable = durable
        cfg = trackers if trackers is not None else MetricsConfig(trackers=["tensorboard"] if tensorboard else [])
        self._trackers = dict(zip(cfg.trackers, open_trackers(cfg, TrackerContext(self.log_dir, component,
                                                                                  config or {}))))
        self._marks = {name: self.log_dir / "trackers" / f"{component}-{re.sub(r'[^A-Za-z0-9]+', '_', name)}.step"
                       for name in self._trackers}
        self._tracked = {name: int(p.read_text()) if p.exists() else -1 for name, p in self._marks.items()}
        if self._trackers:
            for record in read_metrics(self.log_dir / filename):  # what the last leg wrote, trackers may lack
                self._hand_over(record)
        self._file = open(self.log_dir / filename, "a")

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self.durable:
            os.fsync(self._file.fileno())
        self._hand_over(clean)

    def _hand_over(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        scalars = {k: float(v) for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for name, tracker in self._trackers.items():
            if step > self._tracked[name]:
                tracker.log(scalars, step)
                self._tracked[name] = step
                if getattr(tracker, "durable", True):
                    self._mark(name)

    def _mark(self, name: str) -> None:
        path = self._marks[name]
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")  # renamed whole; read only by this component's next leg
        tmp.write_text(str(self._tracked[name]))
        os.replace(tmp, path)

    def close(self) -> None:
        self._file.close()
        for name, tracker in self._trackers.items():
            tracker.close()
            self._mark(name)  # a buffering tracker holds everything once closed


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a metrics.jsonl (missing file: empty list)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line being written right now
    return out


def read_evals(log_dir: str | Path) -> list[dict[str, Any]]:
    """The held-out evaluations of a run, by step: the trainer's (``metrics.jsonl``) and the evaluation
    component's (``eval.jsonl``). Where one step was evaluated more than once (a trainer that restarted from an
    earlier checkpoint published it again), the last record of that step stands (eval.jsonl's after
    metrics.jsonl's: a run resumed with another eval.mode has its later evaluations there)."""
    log_dir = Path(log_dir)
    by_step: dict[int, dict[str, Any]] = {}
    for name in (METRICS_LOG, EVAL_LOG):
        for r in read_metrics(log_dir / name):
            if r.get("eval/accuracy") is not None:
                by_step[int(r.get("step", 0))] = r
    return [by_step[k] for k in sorted(by_step)]
