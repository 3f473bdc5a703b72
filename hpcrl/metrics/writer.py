"""Run metrics: ``<run_dir>/logs/metrics.jsonl`` plus TensorBoard events.

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
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_LOG = "metrics.jsonl"  # the trainer's records
EVAL_LOG = "eval.jsonl"  # the evaluation component's records (eval.mode: component)


class MetricsWriter:
    """Appends records to ``<log_dir>/<filename>`` (``durable``: fsynced before :meth:`write` returns)."""

    def __init__(self, log_dir: str | Path, tensorboard: bool = True, filename: str = METRICS_LOG,
                 durable: bool = False) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.durable = durable
        self._file = open(self.log_dir / filename, "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.log_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self.durable:
            os.fsync(self._file.fileno())
        if self._tb is not None:
            step = int(record.get("step", 0))
            for key, value in clean.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


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
