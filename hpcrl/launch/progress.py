"""What the supervisor prints while it watches a run: a progress line from the newest metrics record.

Lifecycle: the supervisor builds one :class:`Progress` when it starts watching and calls
:meth:`Progress.maybe_print` on every pass of its loop (at most one line per ``launch.progress_interval_s``, and
only when the trainer reached a new step), and once more, forced, when the run ends.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from hpcrl.metrics.writer import read_evals, read_metrics

log = logging.getLogger("hpcrl.launch.supervisor")  # the supervisor's own lines, as they always were


class Progress:
    """Prints one line per interval from the newest metrics record."""

    def __init__(self, metrics_path: Path, total_steps: int, interval_s: float) -> None:
        self.path, self.total, self.interval = metrics_path, total_steps, interval_s
        self._last_print, self._last_step = 0.0, -1

    def maybe_print(self, force: bool = False) -> None:
        if not force and time.time() - self._last_print < self.interval:
            return
        records = read_metrics(self.path)
        if not records or records[-1].get("step", -1) == self._last_step:
            return
        self._last_print, r = time.time(), records[-1]
        self._last_step = r.get("step", -1)
        evals = read_evals(self.path.parent)
        acc = evals[-1]["eval/accuracy"] if evals else None
        log.info("step %d/%d | reward %s | held-out acc %s | staleness max %s | %s samples/s | %.0fs",
                 r.get("step", 0), self.total, _fmt(r.get("reward/mean")), _fmt(acc),
                 _fmt(r.get("staleness/max"), "{:.0f}"), _fmt(r.get("throughput/samples_per_s"), "{:.1f}"),
                 r.get("time/elapsed_s", 0.0))


def _fmt(v, spec: str = "{:.3f}") -> str:
    return "-" if v is None else spec.format(v)

