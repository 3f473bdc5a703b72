"""The rollout component: ``python -m hpcrl.rollout --run-dir DIR --replica K``.

Lifecycle: read ``config.yaml`` and ``prepared.json`` -> build the engine
``rollout.engine`` names on the initial policy (the embedded one, or a
vLLM/SGLang server started as this process's child) and take the newest
published weights ->
run the :class:`RolloutWorker` loop (admit, generate, score, publish) until
the trainer writes ``DONE`` -> stop the engine (and its server) -> exit 0. A
server that dies or stops answering fails this process; the watchdog
resubmits it like any other crash. Any number of replicas may run at the
same time or join later: admission is global in the run directory.

Identity and ownership: the writer id and heartbeat belong to this job
instance (``r<K>-<instance>``, ``heartbeats/rollout-<K>@<instance>.json``),
never to the replica slot, so a replacement never inherits the tickets or
the heartbeat of the process it replaces. A job that Slurm itself requeued
(preemption with ``PreemptMode=REQUEUE``: the same job, instance and
heartbeat run again) writes as ``r<K>-<instance>q<N>`` (``SLURM_RESTART_COUNT``)
and first hands back what its earlier runs held. The process is fenced to its owner
epoch (:mod:`hpcrl.runtime.owner`): every ledger record and spool publish
checks it, and once a newer owner exists the process exits with code 3
without publishing what it holds. When its supervisor is gone it stops as on
a preemption signal (publish what is finished, hand the rest back, exit 75).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from hpcrl.fs import atomic
from hpcrl.admission.ledger import AdmissionLedger, incarnation
from hpcrl.config import RunConfig, load_saved
from hpcrl.launch.fleet import fleet_size
from hpcrl.runtime.device import visible_device_count
from hpcrl.runtime.heartbeat import Heartbeat
from hpcrl.runtime.cputime import since, thread_cpu_s
from hpcrl.fs.space import SpaceFloor
from hpcrl.runtime.exits import component_exit
from hpcrl.runtime.owner import Fence, NoFence
from hpcrl.runtime.preempt import EXIT_REQUEUE, PreemptionFlag
from hpcrl.runtime.logs import setup_logging
from hpcrl.prepared import Prepared, load_datasets, load_prepared
from hpcrl.model.hf_io import load_tokenizer
from hpcrl.plugins import resolve
from hpcrl.reward.registry import build_scorer
from hpcrl.reward.service import ServiceClient
from hpcrl.rollout.engines import EngineSite, build_engine
from hpcrl.rollout.registry import episodes_of
from hpcrl.rollout.server import EngineServerError
from hpcrl.rollout.worker import RolloutWorker, ScoringUnavailable
from hpcrl.spool.store import Spool
from hpcrl.spool.taken import TakenMark
from hpcrl.weights.transport import WeightTransport, open_transport

log = logging.getLogger(__name__)


def build_worker(cfg: RunConfig, run_dir: Path, prep: Prepared, replica: int, *, model=None, writer: str = "",
                 weights: WeightTransport | None = None, on_wait: Callable[[], None] | None = None,
                 fence: Fence | NoFence | None = None) -> RolloutWorker:
    """A rollout worker on the initial policy (or on ``model``, for colocated mode)."""
    tokenizer = load_tokenizer(prep.init_model)
    train_rows, _ = load_datasets(cfg, tokenizer, Path(prep.train_path), Path(prep.eval_path),
                                   prep.init_model)
    floor = SpaceFloor(run_dir, int(cfg.launch.min_free_gb * 1e9), "admission (new prompt groups)")
    ledger = AdmissionLedger(run_dir / "admission", cfg.admission, len(train_rows), cfg.seed, fence=fence,
                             floor=floor)
    spool = Spool(run_dir / "spool", fence=fence)
    colocated = cfg.launch.mode == "colocated"
    # the service's client, or the scorer itself (reward.service: the reward component scores for every rollout)
    reward = ServiceClient(cfg.reward, run_dir, writer or f"r{replica}") if cfg.reward.service else \
        build_scorer(cfg.reward)
    site = EngineSite(model_path=prep.init_model, dtype=cfg.model.dtype, log_dir=run_dir / "logs",
                      name=f"rollout-{writer or replica}", gpus=visible_device_count(cfg.launch.rollout.gpus_per_node),
                      on_wait=on_wait, lora_rank=cfg.trainer.lora.rank if cfg.trainer.lora.publish == "adapter" else 0)
    try:  # last: a server started here must not outlive a failure to build the rest
        engine = build_engine(cfg.rollout, site, seed=cfg.seed * 1000 + replica, tokenizer=tokenizer, model=model)
    except BaseException:
        reward.close()
        raise
    try:
        episodes = resolve(episodes_of(cfg).build, "rollout.episodes")(cfg, engine, tokenizer, reward,
                                                                        prep.init_model)
    except BaseException:
        engine.close()
        reward.close()
        raise
    return RolloutWorker(cfg.rollout, cfg.admission, engine=engine, tokenizer=tokenizer, rows=train_rows,
                         ledger=ledger, spool=spool, reward=reward, writer=writer or f"r{replica}", weights=weights,
                         chat_template=cfg.data.chat_template, episodes=episodes,
                         infra_retry_s=cfg.reward.infra_retry_s, infra_max_wait_s=cfg.reward.infra_max_wait_s,
                         fleet_size=(lambda: 1) if colocated else fleet_size(cfg, run_dir),
                         # colocated: it generates only while its trainer waits, which writes no mark, and new
                         # weights reach it in memory, not through a weight source that would release parked groups
                         taken=None if colocated else TakenMark(spool.root).read)


def run(run_dir: Path, replica: int) -> None:
    with component_exit():
        _run(run_dir, replica)


def _run(run_dir: Path, replica: int) -> None:
    preempt = PreemptionFlag()  # first: a walltime signal during start-up must not kill the process
    cfg, prep = load_saved(run_dir), load_prepared(run_dir)
    setup_logging(f"rollout {replica}")
    fence = Fence.from_env(run_dir, cfg.launch.orphan_grace_s)
    fence.check("start")
    torch.set_num_threads(cfg.rollout.threads)
    weights = open_transport(run_dir / "weights", cfg.weights, "member")
    # one id per job instance, and per run of it that Slurm requeued (preemption): a restart never inherits tickets
    instance_writer = f"r{replica}-{fence.instance}"
    requeues = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    writer = incarnation(instance_writer, requeues)
    heartbeat = Heartbeat(run_dir, f"rollout-{replica}@{fence.instance}", cfg.launch.heartbeat_interval_s)
    worker = build_worker(cfg, run_dir, prep, replica, weights=weights, writer=writer, fence=fence,
                          on_wait=lambda: heartbeat.beat(writer=writer, starting=True))
    if hasattr(worker.engine, "on_wait"):  # a server engine: a long weight update keeps the heartbeat fresh
        worker.engine.on_wait = lambda: heartbeat.beat(writer=writer, updating=True)
    done = run_dir / "DONE"

    def should_stop() -> bool:
        s = worker.stats
        heartbeat.beat(writer=writer, version=worker.engine.version, groups=s.groups_published,
                       samples=s.samples_generated, tokens=s.tokens_generated, restarted=s.samples_restarted,
                       infra_errors=s.samples_infra_error)
        fence.check("generation")
        return done.exists() or preempt.requested or fence.orphaned()

    if requeues:  # the run before this one ended with the job (Slurm requeues a job only once its processes ended)
        lost = worker.ledger.reclaim(instance_writer, worker.spool.live_tickets(), incarnations=True)
        log.warning("Slurm requeued this job (run %d of it, e.g. after a preemption): %d tickets the runs before "
                    "held are handed back", requeues + 1, len(lost))
    log.info("rollout %d started (writer %s, %d train rows)", replica, writer, len(worker.rows))
    try:
        try:
            worker.run(should_stop)
        except EngineServerError:
            if not preempt.requested:
                raise
            log.warning("inference server stopped during preemption (Slurm signals the whole job)")
        except ScoringUnavailable:  # hand the work back, then fail: the watchdog restarts this job
            worker.flush()
            log.error("scoring is unavailable: %d unfinished groups handed back", worker.release_unfinished())
            raise
        worker.flush()  # every finished group reaches the spool before the process goes
        if preempt.requested or fence.orphaned():
            why = "signal" if preempt.requested else "the supervisor is gone"
            log.warning("stopping (%s): %d unfinished groups handed back", why, worker.release_unfinished())
            raise SystemExit(EXIT_REQUEUE)
    finally:
        threads = thread_cpu_s()  # before closing ends the publisher's and the reward's threads
        try:
            worker.close()
        finally:
            worker.engine.close()
            worker.reward.close()
            weights.close()
    s = worker.stats
    write_stats(run_dir / "logs" / f"rollout-{replica}.stats.json", worker, getattr(weights, "stats", None), threads)
    log.info("rollout %d done: %d groups, %d samples, %d tokens, %d restarted, %d weight updates", replica,
             s.groups_published, s.samples_generated, s.tokens_generated, s.samples_restarted, s.weight_updates)


def write_stats(path: Path, worker: RolloutWorker, transfer=None, threads: dict[str, float] | None = None) -> None:
    """The worker's counters and time split, the engine's (prefill, rebuild, decode) and the transfer's; ``cpu_s``:
    the CPU seconds (user + system) of every thread of this process since the worker started (colocated: the
    training's too), so ``cpu_s / wall_s`` is the cores it kept busy on average; ``cpu_threads_s``: the same by
    thread name, since the worker started (:mod:`hpcrl.runtime.cputime`; ``threads``: the reading at the end, taken
    earlier, while the worker's threads were still alive)."""
    engine = getattr(worker.engine, "stats", None)
    atomic.write_json(path, {**asdict(worker.stats), "wall_s": time.time() - worker.stats.started,
                             "cpu_s": time.process_time() - worker.stats.cpu_started,
                             "cpu_threads_s": since(thread_cpu_s() if threads is None else threads,
                                                    worker.stats.cpu_threads_started),
                             "engine": dict(engine) if engine is not None else None,
                             "episodes": dict(getattr(worker.episodes, "stats", None) or {}),
                             "reward": dict(worker.reward.counts),
                             "transfer": asdict(transfer) if transfer is not None else None})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--replica", type=int, default=0)
    args = parser.parse_args(argv)
    run(args.run_dir, args.replica)
