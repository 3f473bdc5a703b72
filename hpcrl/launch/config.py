"""Configuration of how the components are started and supervised."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from hpcrl.launch.registry import scheduler_spec

_MEM = re.compile(r"^\d+[KMGT]?$")


@dataclass
class ResourcesConfig:
    """What one component's Slurm job asks for (``launch.trainer.*``, ``launch.rollout.*``, ``launch.eval.*``,
    ``launch.reward.*``)."""

    nodes: int = 1  # nodes per job
    tasks_per_node: int = 0  # tasks (processes) per node; 0 = trainer.world_size / nodes for the trainer, 1 for a rollout
    gpus_per_node: int = 0  # accelerators per node (--gpus-per-node); 0 = none requested
    cpus_per_task: int = 1  # --cpus-per-task
    mem: str = ""  # memory per node, e.g. "16G" (--mem); "" = the cluster's default
    time_min: int = 60  # wall-clock limit in minutes (--time)
    signal_s: int = 60  # Slurm sends SIGUSR2 this many seconds before time_min (--signal=USR2@N): checkpoint, restart
    partition: str = ""  # --partition; "" = the cluster's default partition
    account: str = ""  # --account; "" = the user's default account
    qos: str = ""  # --qos; "" = default
    constraint: str = ""  # --constraint, e.g. "a100"; "" = none
    gres: str = ""  # --gres, e.g. "gpu:4"; "" = none
    exclusive: bool = False  # --exclusive: whole nodes
    extra_sbatch: list[str] = field(default_factory=list)  # more sbatch options, e.g. ["--reservation=foo"]
    setup: list[str] = field(default_factory=list)  # shell lines run in the job before the component (module load, source venv)
    container_image: str = ""  # srun --container-image (pyxis/enroot); "" = no container
    container_mounts: str = ""  # srun --container-mounts, e.g. "/scratch:/scratch"

    def __post_init__(self) -> None:
        for name in ("nodes", "cpus_per_task", "time_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 < self.signal_s < 60 * self.time_min:
            raise ValueError(f"signal_s: must be between 1 and time_min*60-1 = {60 * self.time_min - 1} seconds "
                             f"(Slurm may send it up to 30 s early), got {self.signal_s}")
        for name in ("tasks_per_node", "gpus_per_node"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.mem and not _MEM.match(self.mem):
            raise ValueError(f"mem: expected a size like 4000M or 16G, got {self.mem!r}")
        for line in self.extra_sbatch:
            if not line.removeprefix("#SBATCH").strip().startswith("--"):
                raise ValueError(f"extra_sbatch: expected options like '--reservation=foo', got {line!r}")
        if self.container_mounts and not self.container_image:
            raise ValueError("container_mounts: set container_image too")


@dataclass
class AutoscaleConfig:
    """``launch.autoscale``: the rollout fleet follows the trainer's demand (:mod:`hpcrl.launch.autoscale`)."""

    enabled: bool = False  # false: the count is rollout.replicas, or what `python -m hpcrl scale` sets
    min_replicas: int = 1  # never fewer rollout replicas
    max_replicas: int = 4  # never more
    add_wait_share: float = 0.2  # add one when the trainer waited for data more than this share of the window
    drain_wait_share: float = 0.05  # drain one when it waited less than this share ...
    drain_ready_share: float = 0.75  # ... and the ready groups fill this share of what the staleness bound allows
    window_s: float = 60.0  # seconds of training (after the previous decision) the signals cover
    min_steps: int = 5  # trainer steps a window needs before it decides anything
    cooldown_s: float = 60.0  # seconds between two decisions
    interval_s: float = 5.0  # seconds between two assessments
    room_within_s: float = 120.0  # Slurm: add only when `sbatch --test-only` says the job starts within this

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas: need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, "
                             f"{self.max_replicas}")
        if not 0 <= self.drain_wait_share < self.add_wait_share <= 1:
            raise ValueError("drain_wait_share: need 0 <= drain_wait_share < add_wait_share <= 1 (the gap is the "
                             f"hysteresis), got {self.drain_wait_share}, {self.add_wait_share}")
        if not 0 < self.drain_ready_share <= 1:
            raise ValueError(f"drain_ready_share: must be in (0, 1], got {self.drain_ready_share}")
        for name in ("window_s", "cooldown_s", "interval_s", "room_within_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.min_steps < 1:
            raise ValueError(f"min_steps: must be >= 1, got {self.min_steps}")


@dataclass
class LaunchConfig:
    # hpcrl/launch/registry.py: local = every component is a local process; slurm = each component is its own
    # Slurm job (submitit); srun = inside an sbatch allocation (sbatch/run_async_ppo.sh), each component is an srun
    # step in its het group; or "module:attr" of a SchedulerSpec of your own
    scheduler: str = "local"
    mode: Literal["async", "colocated"] = "async"  # async: separate trainer and rollout processes; colocated: one process alternates
    progress_interval_s: float = 5.0  # seconds between progress lines on the terminal
    # a component whose job has waited this long in the scheduler's queue is said on the terminal (again every 10
    # minutes while it waits, and when it starts): the progress line alone stands still then
    queue_note_s: float = 60.0
    shutdown_timeout_s: float = 30.0  # grace period for components to exit after the run ends
    preempt_grace_s: float = 120.0  # after SIGUSR2/SIGTERM to the supervisor: time for components to checkpoint and exit
    heartbeat_interval_s: float = 5.0  # how often each component process writes its heartbeat
    trainer: ResourcesConfig = field(default_factory=ResourcesConfig)  # the trainer job's resources (slurm/srun)
    rollout: ResourcesConfig = field(default_factory=ResourcesConfig)  # each rollout job's resources (slurm/srun)
    eval: ResourcesConfig = field(default_factory=ResourcesConfig)  # the evaluation job's resources (eval.mode=component)
    reward: ResourcesConfig = field(default_factory=ResourcesConfig)  # the reward service's job (reward.service=true)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)  # rollout replicas follow the trainer's demand
    slurm_state_interval_s: float = 2.0  # seconds between sacct/squeue reads of the jobs' states
    # a component whose supervisor has not been seen for this long stops cleanly (checkpoint, exit 75), so a
    # dead login-node supervisor does not leave jobs burning an allocation; 0 = never
    orphan_grace_s: float = 600.0
    # --resume / a new owner: how long the previous owner's components get to stop by themselves (they see
    # the new owner epoch at their next check) before they are killed
    takeover_timeout_s: float = 60.0
    # the run directory's floor of free space: below it rollouts start no new prompt group, a periodic checkpoint
    # without room for it is held off, and a component stopped by a storage fault (exit 74) waits to be restarted
    min_free_gb: float = 1.0

    def __post_init__(self) -> None:
        if self.min_free_gb < 0:
            raise ValueError(f"min_free_gb: must be >= 0, got {self.min_free_gb}")
        scheduler_spec(self.scheduler, key="scheduler")
        if self.progress_interval_s <= 0:
            raise ValueError(f"progress_interval_s: must be > 0, got {self.progress_interval_s}")
        if self.queue_note_s <= 0:
            raise ValueError(f"queue_note_s: must be > 0, got {self.queue_note_s}")
        if self.shutdown_timeout_s <= 0:
            raise ValueError(f"shutdown_timeout_s: must be > 0, got {self.shutdown_timeout_s}")
        if self.preempt_grace_s <= 0:
            raise ValueError(f"preempt_grace_s: must be > 0, got {self.preempt_grace_s}")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s: must be > 0, got {self.heartbeat_interval_s}")
        if self.orphan_grace_s < 0:
            raise ValueError(f"orphan_grace_s: must be >= 0 (0 = never), got {self.orphan_grace_s}")
        if self.takeover_timeout_s <= 0:
            raise ValueError(f"takeover_timeout_s: must be > 0, got {self.takeover_timeout_s}")
        if self.slurm_state_interval_s <= 0:
            raise ValueError(f"slurm_state_interval_s: must be > 0, got {self.slurm_state_interval_s}")
