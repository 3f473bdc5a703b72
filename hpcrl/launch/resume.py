"""What ``python -m hpcrl.submit --resume <run_dir | ckpt_dir> [key=value ...]`` continues, and with which config.

Lifecycle: :func:`open_resumed` is called by ``hpcrl.submit`` before the
supervisor starts:

1. The target is a run directory (``config.yaml`` in it) or one of its
   checkpoint directories (``<run_dir>/ckpt/step_N``). A checkpoint must
   verify and be the newest valid one: the trainer always resumes from the
   newest valid checkpoint, and going back to an older one would need the
   groups trained after it returned to the queue (not supported: the
   refusal names the newest one).
2. A finished run (``DONE``) is refused. A cancel request is removed.
3. Overrides may change only what does not change what has been trained:
   ``trainer.total_steps`` (more than the newest checkpoint's step),
   ``rollout.replicas``, ``launch.*`` except ``launch.mode``, ``watchdog.*``
   and ``eval.*``. Anything else is refused by name. The frozen
   ``config.yaml`` is rewritten with the change; the schedule of the
   learning rate follows the new ``trainer.total_steps`` from the resumed
   step on.
4. Every resume is appended to ``jobs/events.jsonl`` (``action: resume``,
   with the checkpoint and the overrides).
"""

from __future__ import annotations

import getpass
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

from hpcrl.ckpt.store import committed, latest_valid, verify
from hpcrl.config import ConfigError, RunConfig, load_config, load_saved, save
from hpcrl.launch.control import CANCEL, cancel_requested

log = logging.getLogger(__name__)
SAFE_KEYS = ("trainer.total_steps", "rollout.replicas", "launch.*", "watchdog.*", "eval.*")
UNSAFE_KEYS = ("launch.mode",)  # the components (colocated or not) and their checkpoints differ


def safe_to_change(key: str) -> bool:
    key = key.strip()
    if key in UNSAFE_KEYS:
        return False
    return any(key == s or (s.endswith(".*") and key.startswith(s[:-1])) for s in SAFE_KEYS)


def locate(target: Path) -> tuple[Path, Path | None]:
    """(run directory, checkpoint directory or None) of a ``--resume`` target."""
    target = target.expanduser().resolve()
    if (target / "config.yaml").exists():
        return target, None
    run_dir = target.parent.parent
    if target.parent.name == "ckpt" and (run_dir / "config.yaml").exists():
        return run_dir, target
    raise ConfigError(f"--resume: {target} is neither a run directory (no config.yaml) nor a checkpoint "
                      "directory <run_dir>/ckpt/step_N")


def check_checkpoint(run_dir: Path, ckpt: Path) -> None:
    problems = verify(ckpt)
    if problems:
        raise ConfigError(f"--resume: checkpoint {ckpt} does not verify: {'; '.join(problems[:3])}")
    newest = latest_valid(run_dir / "ckpt")
    if newest is not None and newest[1].resolve() != ckpt:
        raise ConfigError(f"--resume: {ckpt.name} is not the newest valid checkpoint ({newest[1].name}); the run "
                          f"continues from the newest (--resume {run_dir}); going back to an older one is not "
                          "supported")


def apply_overrides(cfg: RunConfig, run_dir: Path, overrides: list[str]) -> RunConfig:
    keys = [o.split("=", 1)[0] for o in overrides]
    refused = [k for k in keys if not safe_to_change(k)]
    if refused:
        raise ConfigError(f"--resume cannot change {', '.join(refused)}: it would change what has been trained "
                          f"(a resume may change {', '.join(SAFE_KEYS)}; not {', '.join(UNSAFE_KEYS)})")
    new = replace(load_config(run_dir / "config.yaml", overrides), run_dir=str(run_dir))
    done = committed(run_dir / "ckpt")
    if done and new.trainer.total_steps <= done[-1][0]:
        raise ConfigError(f"trainer.total_steps: {new.trainer.total_steps} is not above the step of the newest "
                          f"checkpoint ({done[-1][0]})")
    save(new, run_dir / "config.yaml")
    log.info("config.yaml updated for this resume: %s", " ".join(overrides))
    return new


def open_resumed(target: Path, overrides: list[str]) -> RunConfig:
    """The config to continue ``target`` with (see the module docstring); raises ConfigError."""
    run_dir, ckpt = locate(target)
    cfg = load_saved(run_dir)
    if (run_dir / "DONE").exists():
        raise ConfigError(f"run_dir: {run_dir} has finished (DONE is there); nothing to resume")
    if ckpt is not None:
        check_checkpoint(run_dir, ckpt)
    if overrides:
        cfg = apply_overrides(cfg, run_dir, overrides)
    request = cancel_requested(run_dir)
    if request is not None:
        log.info("the run was cancelled by %s at %s; resuming it", request.get("user", "?"),
                 time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(request.get("time", 0))))
        (run_dir / CANCEL).unlink(missing_ok=True)
    (run_dir / "jobs").mkdir(exist_ok=True)
    newest = committed(run_dir / "ckpt")
    with open(run_dir / "jobs" / "events.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), "component": "run", "job_id": "", "action": "resume",
                            "reason": f"--resume by {getpass.getuser()}", "overrides": overrides,
                            "checkpoint": str(newest[-1][1]) if newest else None}) + "\n")
    return replace(cfg, run_dir=str(run_dir))
