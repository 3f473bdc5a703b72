"""The benchmark's task as the simulator's calibration and check see it (scripts/bench_async.py's task): its
batch and engine sizes and the lengths it draws. Shared by scripts/sim_calibrate.py (measuring) and
scripts/_sim_check.py (playing a results file)."""

from __future__ import annotations

import random
import sys

import numpy as np

from _bench import ROOT

sys.path.insert(0, str(ROOT))
from hpcrl.data.longtail import MIN_LEN, length_weights  # noqa: E402

B, G, ROWS, MAX_NEW = 16, 8, 64, 26
MAX_LEN, ALPHA = 24, 1.5  # the reverse task's defaults (hpcrl/data/longtail.py)


def task_lengths(n: int = 4096, seed: int = 0) -> tuple[list[int], float]:
    """Response tokens (the reversed digits + eos) drawn from the task, and the mean prompt tokens ("rev:<n>=")."""
    rng = random.Random(seed)
    lengths = rng.choices(range(MIN_LEN, MAX_LEN + 1), length_weights(MAX_LEN, ALPHA), k=n)
    return [min(n + 1, MAX_NEW) for n in lengths], float(np.mean([n + 5 for n in lengths]))


def group_shapes(run: dict) -> tuple[tuple, ...]:
    """The trained groups' prompt and response lengths a bench_async run recorded (``group_shapes``), with the
    prefixes each two neighbours share where it recorded them (Workload.group_shapes)."""
    shapes = []
    for prompt, lengths, *shared in (shape.split(":") for shape in run.get("group_shapes", ())):
        shape = (int(prompt), tuple(max(1, int(n)) for n in lengths.split(",")))  # an empty response: one token
        shapes.append((*shape, tuple(int(n) for n in shared[0].split(",") if n)) if shared else shape)
    return tuple(shapes)
