"""The trainer component: ``python -m hpcrl.trainer --run-dir DIR`` (one process per rank).

Lifecycle: read ``config.yaml`` and ``prepared.json`` from the run directory
-> join the process group -> build the train engine (``trainer.engine``) from the initial policy
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
pumping the rollout worker (and saying how many groups it published, so
the feed looks at the spool once they can complete the batch) and
``publish`` handing weights to its engine.

Ownership (:mod:`hpcrl.runtime.owner`): the process is fenced to the owner
epoch its supervisor started it with. Before each publish and commit rank 0
checks the fence; once a newer owner exists nothing more is published,
committed or checkpointed, every rank agrees on it at the step boundary and
the process exits with code 3. When its supervisor is gone (released the
run, or silent for ``launch.orphan_grace_s``) the trainer stops as on a
preemption signal: checkpoint, exit 75.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from hpcrl.fs import atomic
from hpcrl.admission.ledger import AdmissionLedger
from hpcrl.trainer.reconcile import reconcile
from hpcrl.trainer.checkpoint import Checkpointer
from hpcrl.config import RunConfig, config_hash, load_saved
from hpcrl.runtime.dist import DistContext, init_from_env
from hpcrl.runtime.device import of as device_of
from hpcrl.runtime.heartbeat import Heartbeat, beating
from hpcrl.runtime.logs import setup_logging
from hpcrl.fs.space import SpaceFloor
from hpcrl.runtime.exits import component_exit
from hpcrl.runtime.owner import Fence, Fenced, NoFence
from hpcrl.runtime.preempt import EXIT_REQUEUE, Preempted, PreemptionFlag, request_slurm_requeue
from hpcrl.eval.measure import held_out
from hpcrl.prepared import Prepared, load_datasets, load_prepared
from hpcrl.model.hf_io import load_tokenizer
from hpcrl.reward.registry import build_scorer
from hpcrl.reward.scorer import Scorer
from hpcrl.spool.format import TrajectoryGroup
from hpcrl.spool.store import Spool
from hpcrl.trainer.batch import informative_filter, to_sequences
from hpcrl.trainer.feed import BatchFeed
from hpcrl.trainer.engine import TrainEngine, build_train_engine
from hpcrl.trainer.report import Reporter
from hpcrl.weights.adapter import adapter_merger, peft_config
from hpcrl.weights.transport import WeightTransport, open_transport

log = logging.getLogger(__name__)

Publish = Callable[[Mapping[str, torch.Tensor], int], None]
_PREEMPTED, _FENCED = "preempted", "fenced"


def train_loop(cfg: RunConfig, ctx: DistContext, engine: TrainEngine, feed: BatchFeed | None,
               reporter: Reporter | None, publish: Publish, wait: Callable[[], int | None] | None = None,
               heartbeat: Heartbeat | None = None, checkpointer: Checkpointer | None = None,
               start_version: int = 0, preempt: PreemptionFlag | None = None,
               fence: Fence | NoFence | None = None) -> None:
    total, fence = cfg.trainer.total_steps, fence or NoFence()
    if reporter:
        reporter.start(start_version)
    for version in range(start_version, total):
        t0 = time.time()
        try:
            groups = take_batch(feed, ctx, version, wait, heartbeat)
        except Preempted:
            if checkpointer and not checkpointer.has(version):
                save(checkpointer, engine, version, feed, reporter)
            raise
        t1 = time.time()
        seqs, n_uniform = to_sequences(groups, cfg.algo)
        stats = engine.train_step(seqs, version=version)
        t2 = time.time()
        state = engine.full_state_dict()
        t_commit = 0.0
        fenced = ctx.is_main and fence.superseded()  # a newer owner: publish and commit nothing
        if ctx.is_main and not fenced:
            publish(state, version + 1)
            t_commit = time.time()
            feed.commit(version)
            t_commit = time.time() - t_commit
        if agree(ctx, fenced):
            fence.check(f"step {version + 1}")
            raise Fenced(f"owner epoch {fence.epoch} was replaced before step {version + 1} was published")
        t3 = time.time()
        if reporter:
            spool_timings, spool_counts = feed.step_report() if feed else ({}, {})
            extra = {"groups/uniform": n_uniform, "version": version + 1, **spool_counts,
                     "memory/peak_mb": device_of(ctx.device).peak_memory_bytes() / 2**20,
                     **{f"groups/dropped_{k}": v for k, v in feed.dropped.items()}}
            timings = {"wait": t1 - t0, "update": t2 - t1, "publish": t3 - t2 - t_commit, "commit": t_commit,
                       **spool_timings, "step": time.time() - t0}  # spool: part of wait
            reporter.step(version + 1, groups, stats, timings, state, extra)
        if heartbeat:
            heartbeat.beat(version=version + 1)
        stop = agree(ctx, (preempt is not None and preempt.requested) or fence.orphaned())
        if checkpointer and (stop or checkpointer.due(version + 1, total)):
            save(checkpointer, engine, version + 1, feed, reporter)
            if ctx.is_main:
                feed.retain(cfg.trainer.keep_dropped_files)
        if stop:
            why = f"signal {preempt.signum}" if preempt is not None and preempt.requested else "supervisor gone"
            raise Preempted(f"{why} after step {version + 1}")


def _rank0_publishes(state: Mapping[str, torch.Tensor], version: int) -> None:
    raise RuntimeError("only the trainer's rank 0 publishes weights")


def take_batch(feed: BatchFeed | None, ctx: DistContext, version: int, wait: Callable[[], int | None] | None,
               heartbeat: Heartbeat | None = None) -> list[TrajectoryGroup]:
    """Rank 0 takes the batch and shares it; a preemption while waiting reaches every rank. The other ranks beat
    ``heartbeat`` while they wait for it (as long as rank 0 waits for rollouts)."""
    groups: object = None
    if ctx.is_main:
        try:
            groups = feed.next_batch(version, wait)
        except Preempted:
            groups = _PREEMPTED
        except Fenced:
            if ctx.world_size == 1:
                raise
            groups = _FENCED
    if ctx.world_size > 1:
        box = [groups]
        with beating(heartbeat if not ctx.is_main else None):
            dist.broadcast_object_list(box, src=0)
        groups = box[0]
    if isinstance(groups, str) and groups == _PREEMPTED:
        raise Preempted(f"signal while waiting for the batch of version {version}")
    if isinstance(groups, str) and groups == _FENCED:
        raise Fenced(f"a newer owner took the run over while version {version} waited for its batch")
    return groups


def save(checkpointer: Checkpointer, engine: TrainEngine, version: int, feed: BatchFeed | None,
         reporter: Reporter | None) -> None:
    """Checkpoint ``version``: the spool's claims and commits are made durable first (rank 0), so a checkpoint
    never covers a commit that a crash of the machine could undo."""
    if feed is not None:
        feed.sync()
    checkpointer.save(engine, version, counters(feed, reporter))


def batch_wait(preempt: PreemptionFlag, fence: Fence, heartbeat: Heartbeat) -> Callable[[], None]:
    """What rank 0 does while its batch is not there yet: stop on a signal, a newer owner or a vanished supervisor,
    and keep its heartbeat going (waiting for rollouts, e.g. while the only one is preempted, is not hanging)."""
    def wait() -> None:
        heartbeat.beat()
        preempt.check()
        fence.check("batch")
        if fence.orphaned():
            raise Preempted("the supervisor is gone")
        time.sleep(0.01)
    return wait


def agree(ctx: DistContext, flag: bool) -> bool:
    """True on every rank if it is true on any."""
    if ctx.world_size == 1:
        return flag
    t = torch.tensor([int(flag)], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def counters(feed: BatchFeed | None, reporter: Reporter | None) -> dict:
    """Rank 0's running totals, kept in the checkpoint so metrics continue seamlessly."""
    return {"dropped": dict(feed.dropped) if feed else {}, **(reporter.counters() if reporter else {})}


def resume(cfg: RunConfig, ctx: DistContext, engine: TrainEngine, checkpointer: Checkpointer,
           feed: BatchFeed | None, reporter: Reporter | None, weights: WeightTransport | None,
           fence: Fence | NoFence | None = None) -> int:
    """Restore the newest valid checkpoint (if any) and reconcile the run directory; the start version."""
    fence = fence or NoFence()
    meta = checkpointer.restore(engine)
    start = meta["step"] if meta else 0
    state = engine.full_state_dict()
    if agree(ctx, fence.superseded()):  # a replaced owner's trainer must not reconcile
        raise Fenced(f"owner epoch {fence.epoch} was replaced before this trainer resumed")
    if ctx.is_main:
        if meta:
            feed.dropped.update(meta.get("dropped", {}))
            reporter.restore(meta)
        feed.ledger.sync_drop_count()  # the bound's drop count recounted (a crash may have cut it short)
        feed.start(start)  # no batch of this version in hand yet (spool/taken), before a rewind republishes weights
        reconcile(start, feed, weights, state)
        feed.start_reading()  # the first batch's files are parsed meanwhile (the initial evaluation, say)
    if ctx.world_size > 1:
        dist.barrier()
    return start


def build_rank0(cfg: RunConfig, run_dir: Path, prep: Prepared, tokenizer,
                fence: Fence | NoFence | None = None) -> tuple[BatchFeed, Reporter, Scorer]:
    """The pieces only rank 0 owns: the spool feed and the reporter."""
    train_rows, eval_rows = load_datasets(cfg, tokenizer, Path(prep.train_path), Path(prep.eval_path), prep.init_model)
    floor = SpaceFloor(run_dir, int(cfg.launch.min_free_gb * 1e9), "the run directory's free space")
    ledger = AdmissionLedger(run_dir / "admission", cfg.admission, len(train_rows), cfg.seed, fence=fence,
                             floor=floor)
    feed = BatchFeed(Spool(run_dir / "spool", fence=fence), ledger, cfg.admission.batch_size,
                     cfg.admission.max_staleness, cfg.trainer.batch_timeout_s, keep=informative_filter(cfg.algo),
                     read_ahead=cfg.trainer.read_ahead, mark_taken=cfg.launch.mode != "colocated")
    runner = build_scorer(cfg.reward)
    reporter = Reporter(run_dir / "logs", cfg.eval, cfg.trainer.total_steps, model_path=prep.init_model,
                        eval_rows=eval_rows, measure=held_out(cfg, tokenizer, runner),
                        instance=fence.instance if fence else "", fence=fence, metrics=cfg.metrics,
                        config=dataclasses.asdict(cfg))
    return feed, reporter, runner


def run(run_dir: Path) -> None:
    with component_exit():
        _run(run_dir)


def _run(run_dir: Path) -> None:
    preempt = PreemptionFlag()  # first: a walltime signal during start-up must not kill the process
    cfg, prep = load_saved(run_dir), load_prepared(run_dir)
    fence = Fence.from_env(run_dir, cfg.launch.orphan_grace_s)
    fence.check("start")
    ctx = init_from_env(cfg.trainer.backend)
    setup_logging(f"trainer r{ctx.rank}")
    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(prep.init_model)
    engine = build_train_engine(cfg.trainer.engine, prep.init_model, cfg.trainer, cfg.algo, ctx,
                                tokenizer.pad_token_id, cfg.model.dtype)
    feed = reporter = runner = None
    if ctx.is_main:
        feed, reporter, runner = build_rank0(cfg, run_dir, prep, tokenizer, fence)
    lora = cfg.trainer.lora
    published_adapter = (peft_config(lora.rank, lora.alpha, lora.target_modules, prep.init_model)
                         if lora.publish == "adapter" else None)
    weights = (open_transport(run_dir / "weights", cfg.weights, "host", fence, published_adapter)
               if ctx.is_main else None)  # only rank 0 publishes
    if reporter:
        reporter.published = weights.published_file
    if reporter and published_adapter is not None:  # evaluation takes the whole policy: base + adapters merged
        reporter.whole_policy = adapter_merger(prep.init_model, published_adapter)
    heartbeat = Heartbeat(run_dir, f"trainer-r{ctx.rank}@{fence.instance}", cfg.launch.heartbeat_interval_s)
    checkpointer = Checkpointer(run_dir / "ckpt", cfg.ckpt, ctx, config_hash(cfg), fence,
                                SpaceFloor(run_dir, int(cfg.launch.min_free_gb * 1e9), "checkpointing"))
    wait = batch_wait(preempt, fence, heartbeat)
    try:
        start = resume(cfg, ctx, engine, checkpointer, feed, reporter, weights, fence)
        train_loop(cfg, ctx, engine, feed, reporter, weights.publish if weights else _rank0_publishes, wait=wait,
                   heartbeat=heartbeat, checkpointer=checkpointer, start_version=start, preempt=preempt, fence=fence)
        if ctx.is_main:
            fence.check("DONE")
            feed.sync()  # the last steps' commits, if no checkpoint came after them
            atomic.write_json(run_dir / "DONE", {"version": cfg.trainer.total_steps, "time": time.time()})
            log.info("done: %d steps", cfg.trainer.total_steps)
    except Preempted as e:
        log.warning("preempted (%s): checkpoint committed, exiting for a restart", e)
        if ctx.is_main:
            request_slurm_requeue()
        raise SystemExit(EXIT_REQUEUE) from None
    finally:
        if feed:
            feed.close()
        if weights:
            weights.close()
        if reporter:
            reporter.close()
        if runner:
            runner.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    run(parser.parse_args(argv).run_dir)
