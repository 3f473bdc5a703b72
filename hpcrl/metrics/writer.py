"""Run metrics: ``<run_dir>/logs/metrics.jsonl`` plus TensorBoard events.

One JSON object per line, appended and flushed by the trainer's rank 0 after
every step (keys such as ``step``, ``reward/mean``, ``eval/accuracy``,
``staleness/max``, ``time/elapsed_s``). A reader may see a last line that is
still being written: :func:`read_metrics` skips an incomplete last line.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class MetricsWriter:
    def __init__(self, log_dir: str | Path, tensorboard: bool = True) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.log_dir / "metrics.jsonl", "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.log_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
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
