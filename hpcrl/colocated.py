"""Colocated mode: one process alternates generation and training.

``python -m hpcrl.colocated --run-dir DIR``. The trainer's schedule
(:func:`hpcrl.trainer.main.train_loop`) runs unchanged; while it waits for a
batch it pumps an in-process rollout worker. A new version is handed to
that worker's engine in memory (no disk, no collective), and each group the
worker publishes reaches the trainer's read-ahead in memory too (the file is
still written, claimed and committed as in every mode; only its parse is
saved). With ``admission.max_staleness=0`` this is classic synchronous RL on
one device, the baseline the asynchronous modes are measured against.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrl.fs import atomic
from hpcrl.trainer.checkpoint import Checkpointer
from hpcrl.config import config_hash, load_saved
from hpcrl.runtime.dist import init_from_env
from hpcrl.runtime.heartbeat import Heartbeat
from hpcrl.fs.space import SpaceFloor
from hpcrl.runtime.exits import component_exit
from hpcrl.runtime.owner import Fence
from hpcrl.runtime.preempt import EXIT_REQUEUE, Preempted
from hpcrl.runtime.logs import setup_logging
from hpcrl.prepared import load_prepared
from hpcrl.model.hf_io import load_tokenizer
from hpcrl.rollout.main import build_worker, write_stats
from hpcrl.trainer.engine import build_train_engine
from hpcrl.trainer.main import build_rank0, resume, train_loop
from hpcrl.weights.transport import DiskWeights
from hpcrl.weights.version import WeightVersion

log = logging.getLogger(__name__)


def run(run_dir: Path) -> None:
    with component_exit():
        _run(run_dir)


def _run(run_dir: Path) -> None:
    cfg, prep = load_saved(run_dir), load_prepared(run_dir)
    setup_logging("colocated")
    fence = Fence.from_env(run_dir, cfg.launch.orphan_grace_s)
    fence.check("start")
    if cfg.trainer.world_size != 1:
        raise ValueError("trainer.world_size: colocated mode runs a single process; set it to 1")
    ctx = init_from_env(cfg.trainer.backend)
    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(prep.init_model)
    engine = build_train_engine(cfg.trainer.engine, prep.init_model, cfg.trainer, cfg.algo, ctx,
                                tokenizer.pad_token_id, cfg.model.dtype)
    worker = build_worker(cfg, run_dir, prep, 0, writer=f"c-{fence.instance}", fence=fence)
    feed, reporter, runner = build_rank0(cfg, run_dir, prep, tokenizer, fence)
    if feed.ahead is not None:  # the groups this process writes need no parse to be read back
        worker.spool.on_publish = feed.ahead.offer
    heartbeat = Heartbeat(run_dir, f"colocated@{fence.instance}", cfg.launch.heartbeat_interval_s)

    seen = [worker.stats.groups_published]

    def wait() -> int:  # generating the batch is not hanging: the heartbeat goes on
        heartbeat.beat()
        if fence.orphaned():
            raise Preempted("the supervisor is gone")
        if not worker.pump():
            time.sleep(cfg.rollout.poll_interval_s)
        published = worker.stats.groups_published  # counted by the writer thread once a group is in ready/
        news, seen[0] = published - seen[0], published
        return news  # the feed looks at the spool once enough arrived to complete its batch

    checkpointer = Checkpointer(run_dir / "ckpt", cfg.ckpt, ctx, config_hash(cfg), fence,
                                SpaceFloor(run_dir, int(cfg.launch.min_free_gb * 1e9), "checkpointing"))
    try:
        start = resume(cfg, ctx, engine, checkpointer, feed, reporter,
                       DiskWeights(run_dir / "weights", cfg.weights, fence), fence)
        def publish(state, version: int) -> None:
            worker.engine.update_weights(WeightVersion(version, state=state))

        if start:
            publish(engine.full_state_dict(), start)
        train_loop(cfg, ctx, engine, feed, reporter, publish, wait=wait, heartbeat=heartbeat,
                   checkpointer=checkpointer, start_version=start, fence=fence)
        fence.check("DONE")
        feed.sync()  # the last steps' commits, if no checkpoint came after them
        atomic.write_json(run_dir / "DONE", {"version": cfg.trainer.total_steps, "time": time.time()})
        write_stats(run_dir / "logs" / "colocated.stats.json", worker)
    except Preempted as e:
        log.warning("stopped (%s): checkpoint committed, exiting for a restart", e)
        raise SystemExit(EXIT_REQUEUE) from None
    finally:
        feed.close()
        reporter.close()
        runner.close()
        try:
            worker.close()
        finally:
            worker.engine.close()
            worker.reward.close()
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.colocated", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    run(parser.parse_args(argv).run_dir)


if __name__ == "__main__":
    main()
