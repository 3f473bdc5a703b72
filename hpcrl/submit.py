"""Start a run: ``python -m hpcrl.submit --config configs/X.yaml [key=value ...]``.

``python -m hpcrl.submit --config X --from <ckpt_dir> [--restore
optimizer,scheduler,data]`` starts a new run whose policy starts from another
run's checkpoint (:mod:`hpcrl.init_from`).

``python -m hpcrl.submit --resume <run_dir>`` continues a stopped or crashed
run with its frozen config: preparation is skipped when done, the trainer
resumes from its newest valid checkpoint and the rollouts from the ledger.
The target may also be that checkpoint's directory, or with ``--rewind`` an
older checkpoint's (the groups trained after it return to the queue), and
overrides may change how long and where the run goes on, never what it
trains (:mod:`hpcrl.launch.resume`).
On SIGUSR2/SIGTERM (walltime or preemption of the job it runs in) every
component checkpoints and stops; inside a requeueable Slurm job the job is
requeued (``sbatch/run_async_ppo.sh`` then resumes), and the exit code is 75.
On SIGINT (Ctrl-C, also when started in the background where the shell
ignores it) every component is killed at once and the exit code is 130; the
run resumes from its last periodic checkpoint.

Order: load and validate the config (any error names its key and exits 2
before anything is created) -> create the run directory and freeze the
resolved ``config.yaml`` in it -> prepare data, model and SFT warm start
(``prepared.json``) -> start and supervise the components -> print a summary
(initial and final held-out accuracy, wall time, throughput) and write it to
``<run_dir>/summary.json``. Exit 0 when the run completed, 1 when a component
failed, 2 on a bad config, 3 when another ``--resume`` took the run over,
4 when ``python -m hpcrl cancel`` stopped it, 74 when a storage fault (a
full or failing filesystem) stopped it before its components started or
while it closed the run (a fault in between is waited out), 75 when stopped by a signal
(resume any of them with ``--resume``, which also clears the cancel request).

A new run that fails before any work (a bad model path, a partition Slurm
rejects: no ticket admitted, no checkpoint) leaves ``FAILED_START`` in its
directory, and rerunning the command with the config fixed reuses that
directory instead of refusing it; any other existing run directory is
refused (continue it with ``--resume``).

``--resume`` is safe while parts of the run still live (a supervisor was
killed, its components were not): the new supervisor claims a new owner
epoch, which fences everything the previous owner started, stops those
processes and jobs (waiting for them to exit by themselves, killing what
does not), says what it did, and only then starts its own.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from hpcrl.fs import atomic
from hpcrl.fs.faults import EXIT_STORAGE, as_storage_error, storage_fault
from hpcrl.config import ConfigError, RunConfig, load_config, save
from hpcrl.runtime.logs import setup_logging
from hpcrl.runtime.preempt import EXIT_REQUEUE, PreemptionFlag, request_slurm_requeue
from hpcrl.launch.scheduler import ComponentFailed
from hpcrl.launch.control import CANCEL, EXIT_CANCELLED
from hpcrl.launch.dry_run import dry_run
from hpcrl.launch.resume import open_resumed
from hpcrl.launch.supervisor import RunCancelled, RunPreempted, RunTakenOver, supervise
from hpcrl.runtime.owner import EXIT_FENCED
from hpcrl.metrics.writer import read_evals, read_metrics

log = logging.getLogger("hpcrl.submit")


FAILED_START = "FAILED_START"  # written when a new run fails before any work; a rerun may reuse the directory


def has_work(run_dir: Path) -> bool:
    """Whether a run directory holds work a new run must not replace: an admitted ticket, a checkpoint, DONE."""
    return (run_dir / "DONE").exists() or any((run_dir / "admission" / "tickets").glob("t*")) \
        or any(p.name != "step_000000" for p in (run_dir / "ckpt").glob("step_*"))  # step 0: nothing trained


def create_run_dir(cfg: RunConfig) -> RunConfig:
    run_dir = Path(cfg.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}").expanduser().resolve()
    if (run_dir / "config.yaml").exists():
        if not (run_dir / FAILED_START).exists() or has_work(run_dir):
            raise ConfigError(f"run_dir: {run_dir} already holds a run; choose another run_dir, or continue it "
                              f"with --resume {run_dir}")
        why = atomic.read_json(run_dir / FAILED_START).get("error", "?")
        log.warning("reusing %s: its previous start failed before any work (%s); replacing its config", run_dir, why)
        for stale in ("config.yaml", "prepared.json", "summary.json", "admission/meta.json", CANCEL, FAILED_START):
            (run_dir / stale).unlink(missing_ok=True)
        for stale in ("ckpt/step_000000", "init"):  # a start from another run's checkpoint (--from)
            shutil.rmtree(run_dir / stale, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = replace(cfg, run_dir=str(run_dir))
    save(cfg, run_dir / "config.yaml")
    return cfg


def record_failed_start(run_dir: Path, error: str) -> None:
    """After a new run failed: if nothing was trained or admitted, say so, so that a corrected rerun of the
    same command may reuse the directory (``create_run_dir``)."""
    if has_work(run_dir):
        return
    atomic.write_json(run_dir / FAILED_START, {"error": error, "time": time.time()})
    log.error("nothing was admitted or trained; rerunning with the config fixed reuses %s", run_dir)


def summarize(run_dir: Path, started: float) -> dict:
    records = read_metrics(run_dir / "logs" / "metrics.jsonl")
    evals = read_evals(run_dir / "logs")
    steps = [r for r in records if "reward/mean" in r]
    summary = {
        "run_dir": str(run_dir), "wall_s": time.time() - started, "steps": steps[-1]["step"] if steps else 0,
        "run_wall_s": steps[-1].get("time/elapsed_s") if steps else None,
        "train_s": steps[-1].get("time/train_s") if steps else None,
        "legs": steps[-1].get("leg", 1) if steps else 0,
        "initial_accuracy": evals[0]["eval/accuracy"] if evals else None,
        "final_accuracy": evals[-1]["eval/accuracy"] if evals else None,
        "samples_per_s": steps[-1].get("throughput/samples_per_s") if steps else None,
        "staleness_max": max((r.get("staleness/max", 0) for r in steps), default=None),
    }
    if evals:
        summary["accuracy_gain"] = summary["final_accuracy"] - summary["initial_accuracy"]
    atomic.write_json(run_dir / "summary.json", summary)
    return summary


def report(summary: dict) -> None:
    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    legs = summary.get("legs", 1)
    log.info("run finished: %d steps, %.1f samples/s over %.0fs of training in %d trainer leg%s; %.0fs since the "
             "first trainer started (this supervisor: %.0fs); max staleness %s", summary["steps"],
             summary["samples_per_s"] or 0.0, summary.get("train_s") or 0.0, legs, "" if legs == 1 else "s",
             summary.get("run_wall_s") or 0.0, summary["wall_s"], summary["staleness_max"])
    log.info("held-out greedy accuracy: start %s -> final %s (%+.1f points)", pct(summary["initial_accuracy"]),
             pct(summary["final_accuracy"]), 100 * summary.get("accuracy_gain", 0.0))
    log.info("metrics: %s/logs/metrics.jsonl (TensorBoard: %s/logs/tensorboard)", summary["run_dir"],
             summary["run_dir"])


def main(argv: list[str] | None = None) -> int:
    """The steps: parse -> take signals -> open the run (or just check it: ``--dry-run``) -> prepare ->
    supervise -> report; the exit code says how it ended (module docstring)."""
    args = parser().parse_args(argv)
    setup_logging("submit")
    started = time.time()
    take_interrupts()
    preempt = PreemptionFlag()  # before anything slow: Slurm may signal a short job within seconds
    try:
        if args.dry_run:
            return 0 if dry_run(load_config(args.config, run_overrides(args))) else 1
        cfg = open_run(args)
    except ConfigError as e:
        log.error("config error: %s", e)
        return 2
    run_dir = Path(cfg.run_dir)
    log.info("run directory: %s%s", run_dir, " (resumed)" if args.resume else "")
    code = run(cfg, run_dir, preempt, resumed=bool(args.resume))
    if code == 0:
        report(summarize(run_dir, started))
    return code


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpcrl.submit", description="Start an hpcrl run.")
    p.add_argument("--config", type=Path, help="YAML config (see configs/)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR|CKPT_DIR",
                   help="continue a stopped, cancelled or crashed run (overrides: only trainer.total_steps, "
                        "trainer.world_size, rollout.replicas, launch.*, watchdog.*, eval.*)")
    p.add_argument("--rewind", action="store_true",
                   help="with --resume <run_dir>/ckpt/step_N older than the newest checkpoint: go back to it (the "
                        "newer checkpoints are set aside in ckpt/rewound/, the groups trained after step N "
                        "return to the queue)")
    p.add_argument("--from", dest="start_from", metavar="CKPT_DIR",
                   help="a new run (--config) whose policy starts from another run's checkpoint "
                        "(<run_dir>/ckpt/step_N, or a run directory: its newest); sets init.checkpoint")
    p.add_argument("--restore", metavar="PARTS",
                   help="with --from, what else continues: a comma list of optimizer, scheduler, data; sets "
                        "init.restore")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config, model, data and (Slurm) each job with sbatch --test-only; print what "
                        "would be submitted; create and submit nothing")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=50")
    return p


def take_interrupts() -> None:
    """Ctrl-C or ``kill -INT`` stops the run even when a script started it in the background: the shell then
    leaves SIGINT ignored, Python keeps that, and the run would go on unstoppable by it."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run_overrides(args: argparse.Namespace) -> list[str]:
    """The command line's overrides, with ``--from``/``--restore`` as ``init.*``; ConfigError for flags that do
    not go together."""
    overrides = list(args.overrides)
    if args.start_from or args.restore:
        if args.resume or not args.start_from:
            raise ConfigError("--from starts a new run (--config ... --from CKPT_DIR [--restore PARTS]); a resumed "
                              "run keeps where it started from")
        overrides += [f"init.checkpoint={args.start_from}", f"init.restore=[{args.restore or ''}]"]
    if args.rewind and not args.resume:
        raise ConfigError("--rewind goes with --resume <run_dir>/ckpt/step_N")
    if args.dry_run and args.resume:
        raise ConfigError("--dry-run checks a new run (--config); a resumed run was checked when it started")
    return overrides


def open_run(args: argparse.Namespace) -> RunConfig:
    """The run's config, its directory created (a new run) or taken over (``--resume``)."""
    overrides = run_overrides(args)
    if args.resume:
        return open_resumed(args.resume, overrides, args.rewind)
    return create_run_dir(load_config(args.config, overrides))


def run(cfg: RunConfig, run_dir: Path, preempt: PreemptionFlag, resumed: bool) -> int:
    """Prepare (once) and supervise the run; the exit code."""
    try:
        if not (run_dir / "prepared.json").exists():
            from hpcrl.prepare import prepare  # torch and transformers: only where a run is prepared

            prepare(cfg, run_dir)
        supervise(cfg, run_dir, preempt=preempt)
        return 0
    except ComponentFailed as e:
        log.error("%s", e)
        if not resumed:
            record_failed_start(run_dir, str(e))
        return 1
    except RunTakenOver as e:
        log.error("%s", e)
        return EXIT_FENCED
    except OSError as e:  # a storage fault before the components started, or while closing the run
        fault = storage_fault(e)
        if fault is None:
            raise
        log.error("stopped on a storage fault: %s. Once there is room, continue with: python -m hpcrl.submit "
                  "--resume %s", as_storage_error(fault), run_dir)
        return EXIT_STORAGE
    except RunCancelled as e:
        log.warning("%s. Continue with: python -m hpcrl.submit --resume %s", e, run_dir)
        return EXIT_CANCELLED
    except RunPreempted as e:
        if request_slurm_requeue():
            log.warning("%s; Slurm requeues this job and it resumes %s", e, run_dir)
        else:
            log.warning("%s. Continue with: python -m hpcrl.submit --resume %s", e, run_dir)
        return EXIT_REQUEUE
    except KeyboardInterrupt:
        log.warning("stopped; every component was stopped. Continue with: python -m hpcrl.submit --resume %s",
                    run_dir)
        return 130
    except ValueError as e:
        log.error("%s", e)
        if not resumed:
            record_failed_start(run_dir, str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
