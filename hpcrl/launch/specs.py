"""The components of a run, as the scheduler submits them: which processes or jobs, with which command,
log file, environment and resources (``launch.*``). Read by the supervisor and the dry run; a spec is a
description only, stamped with its owner epoch and instance when it is submitted (:func:`hpcrl.launch.jobs.stamp`).
"""

from __future__ import annotations

from pathlib import Path

from hpcrl.config import RunConfig
from hpcrl.launch.fleet import wanted_replicas
from hpcrl.launch.registry import scheduler_spec
from hpcrl.launch.scheduler import ComponentSpec, python_module
from hpcrl.runtime.net import free_port


def component_specs(cfg: RunConfig, run_dir: Path) -> list[ComponentSpec]:
    """Every component of the run. The watchdog restarts them, so none asks Slurm to requeue itself
    (a self-requeued job beside the watchdog's resubmission would be a second trainer)."""
    return [no_self_requeue(spec) for spec in _specs(cfg, run_dir)]


def no_self_requeue(spec: ComponentSpec) -> ComponentSpec:
    spec.env["HPCRL_SLURM_REQUEUE"] = "0"
    return spec


def rollout_spec(cfg: RunConfig, run_dir: Path, k: int) -> ComponentSpec:
    """Rollout replica ``k``: its own process or job, with the resources of ``launch.rollout``."""
    return ComponentSpec(f"rollout-{k}", python_module("hpcrl.rollout", "--run-dir", str(run_dir), "--replica", str(k)),
                         run_dir / "logs" / f"rollout-{k}.log", resources=cfg.launch.rollout)


def _specs(cfg: RunConfig, run_dir: Path) -> list[ComponentSpec]:
    return _trainer_rollout_specs(cfg, run_dir) + _eval_specs(cfg, run_dir) + _reward_specs(cfg, run_dir)


def _reward_specs(cfg: RunConfig, run_dir: Path) -> list[ComponentSpec]:
    """The reward service (``reward.service``), with the resources of ``launch.reward``."""
    if not cfg.reward.service:
        return []
    return [ComponentSpec("reward", python_module("hpcrl.reward", "--run-dir", str(run_dir)),
                          run_dir / "logs" / "reward.log", resources=cfg.launch.reward)]


def _eval_specs(cfg: RunConfig, run_dir: Path) -> list[ComponentSpec]:
    """The evaluation component (``eval.mode: component``), with the resources of ``launch.eval``."""
    if cfg.eval.mode != "component":
        return []
    return [ComponentSpec("eval", python_module("hpcrl.eval", "--run-dir", str(run_dir)),
                          run_dir / "logs" / "eval.log", resources=cfg.launch.eval)]


def _trainer_rollout_specs(cfg: RunConfig, run_dir: Path) -> list[ComponentSpec]:
    logs = run_dir / "logs"
    rd = ["--run-dir", str(run_dir)]
    if cfg.launch.mode == "colocated":
        return [ComponentSpec("colocated", python_module("hpcrl.colocated", *rd), logs / "colocated.log")]
    if scheduler_spec(cfg.launch.scheduler).places_ranks:
        return _job_specs(cfg, run_dir)
    world, port = cfg.trainer.world_size, str(free_port())
    specs = [ComponentSpec(f"trainer-r{r}", python_module("hpcrl.trainer", *rd), logs / f"trainer-r{r}.log",
                           {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(world)]
    return specs + [rollout_spec(cfg, run_dir, k) for k in range(wanted_replicas(cfg, run_dir))]


def _job_specs(cfg: RunConfig, run_dir: Path) -> list[ComponentSpec]:
    """For a scheduler that places ranks: one trainer job/step with world_size tasks (ranks from
    SLURM_PROCID), one per rollout replica."""
    logs, rd = run_dir / "logs", ["--run-dir", str(run_dir)]
    if cfg.launch.mode == "colocated":
        return [ComponentSpec("colocated", python_module("hpcrl.colocated", *rd), logs / "colocated.log",
                              resources=cfg.launch.trainer)]
    specs = [ComponentSpec("trainer", python_module("hpcrl.trainer", *rd), logs / "trainer-r{rank}.log",
                           resources=cfg.launch.trainer, tasks=cfg.trainer.world_size)]
    return specs + [rollout_spec(cfg, run_dir, k) for k in range(wanted_replicas(cfg, run_dir))]
