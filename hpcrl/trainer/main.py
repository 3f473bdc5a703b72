"""The trainer component: ``python -m hpcrl.trainer --run-dir DIR`` (one process per rank).

Lifecycle: read ``config.yaml`` and ``prepared.json`` from the run directory
-> join the process group -> build the FSDP2 engine from the initial policy
-> evaluate the initial policy -> the schedule below -> write ``DONE`` (rank
0), which tells every rollout to exit.

The whole schedule (one iteration = one policy version)::

    groups  = feed.next_batch(v)            # rank 0: B groups, head version >= v - eta
    groups  = broadcast(groups)             # every rank sees the same batch
    stats   = engine.train_step(sequences)  # prox recompute + decoupled PPO updates
    weights = engine.full_state_dict()      # collective
    publish(weights, v + 1); feed.commit(v) # rank 0: new version visible, files -> trained/step_v
    reporter.step(v + 1, ...)               # rank 0: metrics.jsonl, eval when due

Colocated mode runs this same loop in the rollout's process, with ``wait``
pumping the rollout worker and ``publish`` handing weights to its engine.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from hpcrl import atomic
from hpcrl.admission.ledger import AdmissionLedger
from hpcrl.config import RunConfig, load_saved
from hpcrl.launch.dist import DistContext, init_from_env
from hpcrl.launch.heartbeat import Heartbeat
from hpcrl.launch.logs import setup_logging
from hpcrl.launch.prepare import Prepared, load_datasets, load_prepared, scorer
from hpcrl.model.hf_io import load_tokenizer
from hpcrl.reward.runner import RewardRunner
from hpcrl.spool.store import Spool
from hpcrl.trainer.batch import to_sequences
from hpcrl.trainer.feed import BatchFeed
from hpcrl.trainer.fsdp import FSDPEngine
from hpcrl.trainer.report import Reporter
from hpcrl.weights.transport import DiskWeights

log = logging.getLogger(__name__)

Publish = Callable[[Mapping[str, torch.Tensor], int], None]


def train_loop(cfg: RunConfig, ctx: DistContext, engine: FSDPEngine, feed: BatchFeed | None,
               reporter: Reporter | None, publish: Publish, wait: Callable[[], None] | None = None,
               heartbeat: Heartbeat | None = None) -> None:
    if reporter:
        reporter.start(0)
    for version in range(cfg.trainer.total_steps):
        t0 = time.time()
        groups = feed.next_batch(version, wait) if ctx.is_main else None
        if ctx.world_size > 1:
            box = [groups]
            dist.broadcast_object_list(box, src=0)
            groups = box[0]
        t1 = time.time()
        seqs, n_uniform = to_sequences(groups, cfg.algo)
        stats = engine.train_step(seqs)
        t2 = time.time()
        state = engine.full_state_dict()
        if ctx.is_main:
            publish(state, version + 1)
            feed.commit(version)
        t3 = time.time()
        if reporter:
            extra = {"groups/uniform": n_uniform, "version": version + 1,
                     **{f"groups/dropped_{k}": v for k, v in feed.dropped.items()}}
            reporter.step(version + 1, groups, stats, {"wait": t1 - t0, "train": t2 - t1, "publish": t3 - t2,
                                                       "step": time.time() - t0}, state, extra)
        if heartbeat:
            heartbeat.beat(version=version + 1)


def build_rank0(cfg: RunConfig, run_dir: Path, prep: Prepared, tokenizer) -> tuple[BatchFeed, Reporter, RewardRunner]:
    """The pieces only rank 0 owns: the spool feed and the reporter."""
    train_rows, eval_rows = load_datasets(cfg, tokenizer, Path(prep.train_path), Path(prep.eval_path))
    ledger = AdmissionLedger(run_dir / "admission", cfg.admission, len(train_rows), cfg.seed)
    feed = BatchFeed(Spool(run_dir / "spool"), ledger, cfg.admission.batch_size, cfg.admission.max_staleness,
                     cfg.trainer.batch_timeout_s)
    runner = RewardRunner(cfg.reward)
    reporter = Reporter(run_dir / "logs", cfg.eval, cfg.trainer.total_steps, model_path=prep.init_model,
                        tokenizer=tokenizer, eval_rows=eval_rows, score=scorer(runner),
                        max_new_tokens=cfg.rollout.max_new_tokens, chat_template=cfg.data.chat_template)
    return feed, reporter, runner


def run(run_dir: Path) -> None:
    cfg, prep = load_saved(run_dir), load_prepared(run_dir)
    ctx = init_from_env(cfg.trainer.backend)
    setup_logging(f"trainer r{ctx.rank}")
    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(prep.init_model)
    engine = FSDPEngine(prep.init_model, cfg.trainer, cfg.algo, ctx, tokenizer.pad_token_id)
    feed = reporter = runner = None
    if ctx.is_main:
        feed, reporter, runner = build_rank0(cfg, run_dir, prep, tokenizer)
    weights = DiskWeights(run_dir / "weights", cfg.weights)
    heartbeat = Heartbeat(run_dir, f"trainer-r{ctx.rank}", cfg.launch.heartbeat_interval_s)
    try:
        train_loop(cfg, ctx, engine, feed, reporter, weights.publish, heartbeat=heartbeat)
        if ctx.is_main:
            atomic.write_json(run_dir / "DONE", {"version": cfg.trainer.total_steps, "time": time.time()})
            log.info("done: %d steps", cfg.trainer.total_steps)
    finally:
        if reporter:
            reporter.close()
        if runner:
            runner.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    run(parser.parse_args(argv).run_dir)
