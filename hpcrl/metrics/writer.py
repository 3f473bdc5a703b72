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

from hpcrl.fs.atomic import temporary_name
from hpcrl.metrics.config import MetricsConfig
from hpcrl.metrics.trackers import Tracker, TrackerContext, open_tracker

log = logging.getLogger(__name__)

METRICS_LOG = "metrics.jsonl"  # the trainer's records
EVAL_LOG = "eval.jsonl"  # the evaluation component's records (eval.mode: component)


class MetricsWriter:
    """Appends records to ``<log_dir>/<filename>`` (``durable``: fsynced before :meth:`write` returns) and hands
    each step's scalars to the run's trackers (hpcrl/metrics/trackers.py): ``trackers`` is the run's
    ``metrics`` config (None: TensorBoard alone if ``tensorboard``), ``component`` names the tracker run.

    Each tracker gets each step once and none is skipped, across restarts: the last step it holds for sure
    is kept in ``logs/trackers/<component>-<tracker>.step`` (after every record for a tracker whose log is on
    disk when it returns, at a clean close for one that buffers, W&B), with the last evaluation's step; a new
    leg first hands each tracker the records of the JSONL file after its mark (what a killed leg logged but
    the tracker lost), then goes on; a tracker that can say what it holds (``held()``: MLflow) moves its mark
    up to that, so a leg killed between a store's write and the mark's does not hand that step over twice. A record of a step at or below the mark (recomputed from an older
    checkpoint) goes to the JSONL file only, unless it is an evaluation (``eval/accuracy``) of a step after
    the last evaluation handed over (a version evaluated late). A tracker that fails is left out for the rest
    of the leg with a warning (the JSONL file has every record; the next leg hands it what it missed)."""

    def __init__(self, log_dir: str | Path, tensorboard: bool = True, filename: str = METRICS_LOG,
                 durable: bool = False, trackers: MetricsConfig | None = None, component: str = "trainer",
                 config: dict[str, Any] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.durable = durable
        cfg = trackers if trackers is not None else MetricsConfig(trackers=["tensorboard"] if tensorboard else [])
        ctx = TrackerContext(self.log_dir, component, config or {})
        earlier = read_metrics(self.log_dir / filename) if cfg.trackers else []  # what the last legs wrote
        self._trackers: dict[str, Tracker] = {}
        self._failed: set[str] = set()  # left out for the rest of this leg (closed, but their marks stay)
        self._marks: dict[str, Path] = {}
        self._tracked: dict[str, dict[str, int]] = {}
        for name in cfg.trackers:
            self._marks[name] = self.log_dir / "trackers" / f"{component}-{re.sub(r'[^A-Za-z0-9]+', '_', name)}.step"
            self._tracked[name] = self._read_mark(name, earlier)
            try:
                self._trackers[name] = open_tracker(name, cfg, ctx)
                held = getattr(self._trackers[name], "held", None)  # what a store says it holds, past the mark
                if held is not None:
                    step, evaluation = held()
                    mark = self._tracked[name]
                    mark["step"], mark["eval"] = max(mark["step"], step), max(mark["eval"], evaluation)
            except Exception as e:  # noqa: BLE001 - an unreachable tracker server must not stop training
                log.warning("metrics tracker %s could not be opened (%s: %s): this leg writes %s only; the next "
                            "leg hands it what it missed", name, type(e).__name__, e, filename)
        for record in earlier:
            self._hand_over(record)
        self._file = open(self.log_dir / filename, "a")
        if _torn(self.log_dir / filename):  # an earlier leg stopped mid-line (killed, a full filesystem)
            self._file.write("\n")  # end it, so this leg's first record is not glued to it

    def _read_mark(self, name: str, earlier: list[dict[str, Any]]) -> dict[str, int]:
        path = self._marks[name]
        try:
            mark = json.loads(path.read_text())
            return {"step": int(mark["step"]), "eval": int(mark["eval"])}
        except FileNotFoundError:
            if name == "tensorboard" and earlier:  # a run from before the marks: TensorBoard got every record
                top = max(int(r.get("step", 0)) for r in earlier)
                return {"step": top, "eval": top}
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("%s unreadable (%s): tracker %s gets this component's records again", path, e, name)
        return {"step": -1, "eval": -1}

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self.durable:
            os.fsync(self._file.fileno())
        self._hand_over(clean)

    def _hand_over(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        evaluation = record.get("eval/accuracy") is not None
        scalars = {k: float(v) for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for name, tracker in self._trackers.items():
            mark = self._tracked[name]
            if name in self._failed or not (step > mark["step"] or (evaluation and step > mark["eval"])):
                continue
            try:
                tracker.log(scalars, step)
            except Exception as e:  # noqa: BLE001 - leave it out for the rest of this leg, keep training
                log.warning("metrics tracker %s failed at step %d (%s: %s): left out for the rest of this leg; "
                            "the next leg hands it what it missed", name, step, type(e).__name__, e)
                self._failed.add(name)
                continue
            mark["step"] = max(mark["step"], step)
            if evaluation:
                mark["eval"] = step
            if getattr(tracker, "durable", True):
                self._mark(name)

    def _mark(self, name: str) -> None:
        path = self._marks[name]
        path.parent.mkdir(exist_ok=True)
        # renamed whole, not fsynced (one per step): a lost node may leave an older or empty mark, and the next
        # leg then hands a tracker some steps again; a killed process loses nothing
        tmp = temporary_name(path)
        tmp.write_text(json.dumps(self._tracked[name]))
        os.replace(tmp, path)

    def close(self) -> None:
        self._file.close()
        for name, tracker in self._trackers.items():
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001
                log.warning("metrics tracker %s failed to close (%s: %s)", name, type(e).__name__, e)
                continue
            if name not in self._failed:
                self._mark(name)  # a buffering tracker holds everything once closed


def _torn(path: Path) -> bool:
    """Whether ``path`` ends inside a line."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


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
