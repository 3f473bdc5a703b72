"""The supervisor: start every component of a run, watch them, stop them.

Lifecycle: build the component list from the config (trainer ranks and
rollout replicas, or the one colocated process) -> submit each through the
scheduler and record its job id in ``<run_dir>/jobs/`` -> loop: print a
progress line from ``logs/metrics.jsonl``, check every job -> the run ends
when the trainer ranks exit 0 after writing ``DONE`` (rollouts then exit by
themselves, or are stopped after a grace period) -> or it fails when any
component exits non-zero: the others are stopped and :class:`ComponentFailed`
carries the failing log's tail. (Resubmission of failed components comes
with the watchdog.)
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

from hpcrl import atomic
from hpcrl.config import RunConfig
from hpcrl.launch.dist import free_port
from hpcrl.launch.scheduler import ComponentFailed, ComponentSpec, LocalScheduler, log_tail, python_module
from hpcrl.metrics.writer import read_metrics

log = logging.getLogger(__name__)


def component_specs(cfg: RunConfig, run_dir: Path) -> list[ComponentSpec]:
    logs = run_dir / "logs"
    rd = ["--run-dir", str(run_dir)]
    if cfg.launch.mode == "colocated":
        return [ComponentSpec("colocated", python_module("hpcrl.launch.colocated", *rd), logs / "colocated.log")]
    world, port = cfg.trainer.world_size, str(free_port())
    specs = [ComponentSpec(f"trainer-r{r}", python_module("hpcrl.trainer", *rd), logs / f"trainer-r{r}.log",
                           {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(world)]
    specs += [ComponentSpec(f"rollout-{k}", python_module("hpcrl.rollout", *rd, "--replica", str(k)),
                            logs / f"rollout-{k}.log") for k in range(cfg.rollout.replicas)]
    return specs


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
        acc = next((x["eval/accuracy"] for x in reversed(records) if x.get("eval/accuracy") is not None), None)
        log.info("step %d/%d | reward %s | held-out acc %s | staleness max %s | %s samples/s | %.0fs",
                 r.get("step", 0), self.total, _fmt(r.get("reward/mean")), _fmt(acc),
                 _fmt(r.get("staleness/max"), "{:.0f}"), _fmt(r.get("throughput/samples_per_s"), "{:.1f}"),
                 r.get("time/elapsed_s", 0.0))


def _fmt(v, spec: str = "{:.3f}") -> str:
    return "-" if v is None else spec.format(v)


def supervise(cfg: RunConfig, run_dir: Path, scheduler: LocalScheduler | None = None) -> None:
    """Run all components to completion; raise ComponentFailed if one fails."""
    scheduler = scheduler or LocalScheduler()
    jobs: dict[str, tuple[str, ComponentSpec]] = {}
    for spec in component_specs(cfg, run_dir):
        jobs[spec.name] = (scheduler.submit(spec), spec)
        log.info("started %s (pid %s), log %s", spec.name, jobs[spec.name][0], spec.log_path)
    (run_dir / "jobs").mkdir(exist_ok=True)
    atomic.write_json(run_dir / "jobs" / "registry.json", {n: {"job_id": j, "argv": s.argv} for n, (j, s) in jobs.items()})
    progress = Progress(run_dir / "logs" / "metrics.jsonl", cfg.trainer.total_steps, cfg.launch.progress_interval_s)
    trainers = [n for n in jobs if n.startswith(("trainer", "colocated"))]
    try:
        while True:
            progress.maybe_print()
            codes = {n: scheduler.poll(j) for n, (j, _) in jobs.items()}
            for name, code in codes.items():
                if code not in (None, 0):
                    raise ComponentFailed(name, jobs[name][0], code, log_tail(jobs[name][1].log_path))
            if all(codes[n] == 0 for n in trainers):
                if not (run_dir / "DONE").exists():
                    raise ComponentFailed(trainers[0], jobs[trainers[0]][0], 0, "exited without writing DONE")
                break
            time.sleep(0.5)
        progress.maybe_print(force=True)
        _stop_rollouts(scheduler, jobs, cfg.launch.shutdown_timeout_s)
    finally:
        for job_id, _ in jobs.values():
            scheduler.cancel(job_id, signal.SIGKILL)


def _stop_rollouts(scheduler: LocalScheduler, jobs: dict, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    for name, (job_id, spec) in jobs.items():
        code = scheduler.wait(job_id, max(0.1, deadline - time.time()))
        if code is None:
            log.warning("%s did not exit %.0fs after the run ended; stopping it", name, timeout_s)
            scheduler.cancel(job_id)
        elif code != 0:
            raise ComponentFailed(name, job_id, code, log_tail(spec.log_path))
