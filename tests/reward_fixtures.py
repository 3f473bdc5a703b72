"""Reward functions that misbehave, for tests/test_reward.py (imported by
path in worker processes too, so keep this module light)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import time

NOT_CALLABLE = 5


def exact(prompt: str, response: str, answer: str, **row: object) -> float:
    return 1.0 if response.strip() == str(answer) else 0.0


def raises(prompt: str, response: str, **row: object) -> float:
    raise ValueError(f"bad row {row.get('answer')}")


def hangs(prompt: str, response: str, **row: object) -> float:
    time.sleep(60)
    return 1.0


def hangs_if_asked(prompt: str, response: str, **row: object) -> float:
    """Hangs for response 'hang'; else the pid of the process that ran it."""
    if response == "hang":
        time.sleep(60)
    return float(os.getpid())


def hangs_with_child(prompt: str, response: str, pid_file: str, **row: object) -> float:
    """Starts a grandchild (as a code sandbox would), records its pid, hangs."""
    child = subprocess.Popen(["sleep", "60"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    time.sleep(60)
    return 1.0


def returns_nan(prompt: str, response: str, **row: object) -> float:
    return float("nan")


def returns_inf(prompt: str, response: str, **row: object) -> float:
    return float("inf")


def returns_none(prompt: str, response: str, **row: object) -> None:
    return None


def returns_str(prompt: str, response: str, **row: object) -> str:
    return "1.0"


def returns_bool(prompt: str, response: str, **row: object) -> bool:
    return response == "yes"


def returns_int(prompt: str, response: str, **row: object) -> int:
    return 2


def exits(prompt: str, response: str, **row: object) -> float:
    if response == "die":
        os._exit(3)
    return 0.5


def segfaults(prompt: str, response: str, **row: object) -> float:
    if response == "die":
        ctypes.string_at(0)
    return 0.5


def worker_pid(prompt: str, response: str, **row: object) -> float:
    return float(os.getpid())
