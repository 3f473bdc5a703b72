"""Configuration of the reward function and how it is contained (kept free of heavy imports: loading a config must not pull in torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from hpcrl.reward.registry import check_scorer


@dataclass
class SandboxConfig:
    """How model-written programs run (hpcrl/reward/sandbox.py, docs/reward.md)."""

    # bwrap = bubblewrap namespaces (no network, a read-only /usr, a fresh tmpfs, its own PIDs); launcher = the
    # command in `launcher` (a site's Apptainer/enroot), with hpcrl's limits and timeout around it
    mechanism: Literal["bwrap", "launcher"] = "bwrap"
    # mechanism=launcher: the command before the program's own, e.g. [apptainer, exec, --containall, --net,
    # --network, none, --pid, python.sif]
    launcher: list[str] = field(default_factory=list)
    python: str = "/usr/bin/python3"  # the interpreter programs run with, as seen inside the sandbox
    wall_s: float = 10.0  # wall clock per program; then its whole sandbox is killed
    cpu_s: int = 5  # CPU seconds per process (RLIMIT_CPU)
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    file_mb: int = 16  # largest file a program may write (RLIMIT_FSIZE)
    disk_mb: int = 64  # size of the program's writable /tmp (bwrap)
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 64  # processes and threads inside the sandbox (RLIMIT_NPROC, in its own user namespace)
    output_bytes: int = 65536  # stdout and stderr each; a program that writes more is killed
    run_as_uid: int = 65534  # a root process drops to this user before the sandbox starts (nobody)
    scratch_dir: str = ""  # where each program's read-only /task is staged ("" = the system temporary directory)

    def __post_init__(self) -> None:
        if self.mechanism not in ("bwrap", "launcher"):
            raise ValueError(f"mechanism: must be one of 'bwrap', 'launcher', got {self.mechanism!r}")
        if self.mechanism == "launcher" and not self.launcher:
            raise ValueError("launcher: mechanism=launcher runs programs under your site's container command; set "
                             "it (e.g. [apptainer, exec, --containall, --net, --network, none, --pid, python.sif])")
        if not math.isfinite(self.wall_s) or self.wall_s <= 0:
            raise ValueError(f"wall_s: must be a finite number > 0, got {self.wall_s!r}")
        for name in ("cpu_s", "memory_mb", "file_mb", "disk_mb", "open_files", "processes", "output_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.processes < 4:
            raise ValueError(f"processes: the sandbox itself needs a few; must be >= 4, got {self.processes}")


@dataclass
class RewardConfig:
    # what scores the samples (hpcrl/reward/registry.py): function = the function `fn` below, contained as
    # `isolation` says; code = the response is a program, run in `sandbox` against the row's hidden tests
    # (hpcrl/reward/code.py); or "module:attr" of a factory (RewardConfig) -> Scorer of your own
    scorer: str = "function"
    # import path 'package.module:function'; called as fn(prompt, response, **row)
    # where row has at least 'answer'
    fn: str = "hpcrl.reward.math_verify:math_reward"
    # a call that takes longer scores 0 (status "timeout")
    timeout_s: float = 10.0
    # process: calls run in a worker subprocess that is killed and restarted on timeout
    isolation: Literal["thread", "process"] = "thread"
    # calls in flight at once in score_many (process mode: worker processes; code: sandboxes)
    max_workers: int = 4
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # scorer=code: how programs are contained
    # a group whose scoring failed for the scorer's own reasons (status infra_error: a sandbox that could not start)
    # is held by its rollout and scored again after this many seconds, then at doubling intervals ...
    infra_retry_s: float = 2.0
    # ... and ends the rollout job (the watchdog restarts it) once it has failed this long: never trained as a 0
    infra_max_wait_s: float = 600.0
    # score in a reward component of its own (python -m hpcrl.reward; a Slurm job with launch.reward's resources),
    # which the rollouts hand their items to through the run directory (hpcrl/reward/service.py)
    service: bool = False
    service_wait_s: float = 30.0  # service: a rollout waits this long for its results, then holds the group
    service_poll_s: float = 0.02  # service: how often the rollouts and the service look for new files

    def __post_init__(self) -> None:
        check_scorer(self.scorer, key="scorer")
        module, sep, attr = str(self.fn).partition(":")
        if not sep or not module.strip() or not attr.strip():
            raise ValueError(f"fn: must be an import path 'package.module:function', got {self.fn!r}")
        if not isinstance(self.timeout_s, (int, float)) or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be a finite number > 0, got {self.timeout_s!r}")
        if self.isolation not in ("thread", "process"):
            raise ValueError(f"isolation: must be one of 'thread', 'process', got {self.isolation!r}")
        for name in ("infra_retry_s", "infra_max_wait_s", "service_wait_s", "service_poll_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        if isinstance(self.max_workers, bool) or not isinstance(self.max_workers, int) or self.max_workers < 1:
            raise ValueError(f"max_workers: must be an integer >= 1, got {self.max_workers!r}")
