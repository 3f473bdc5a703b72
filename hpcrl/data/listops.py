"""A synthetic code task: write a one-line Python expression for a described list transformation.

``sort,add 3:`` -> ``[v+3 for v in sorted(x)]``. A prompt is a chain of one or two steps applied
to the list ``x`` left to right, optionally ending in a reduction:

=========  ===========================  =========  ======================
step       expression of ``e``          step       expression of ``e``
=========  ===========================  =========  ======================
``rev``    ``e[::-1]``                  ``take K``  ``e[:K]``
``sort``   ``sorted(e)``                ``drop K``  ``e[K:]``
``add K``  ``[v+K for v in e]``         ``gt K``    ``[v for v in e if v>K]``
``mul K``  ``[v*K for v in e]``         ``sum``     ``sum(e)`` (last only)
``len``    ``len(e)`` (last only)
=========  ===========================  =========  ======================

The answer is the reference expression (what the SFT warm start imitates); the row's hidden ``tests`` are five
lists (one empty) with the reference's results, judged by the code scorer (``reward.scorer: code``,
:mod:`hpcrl.reward.code`, ``form: expression``) in the sandbox. Many other expressions are right too
(``sorted(x)[::-1]`` for ``sort,rev``, ``sum(x)*2`` for ``mul 2,sum``): RL is rewarded for any. Held-out
problems are chains that never appear in the training set (compared by prompt), so the held-out score measures
composition, not recall.

``write_listops_dataset`` writes through :func:`hpcrl.data.cache.cached_split` (reused when present);
generation is deterministic in (seed, sizes).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from hpcrl.data.cache import cached_split

__all__ = ["STEPS", "listops_problem", "listops_split", "write_listops_dataset"]

FORMAT_VERSION = 1
# name -> (the values of its parameter, or () for none; how it wraps the expression e)
STEPS: dict[str, tuple[tuple[int, ...], str]] = {
    "rev": ((), "{e}[::-1]"),
    "sort": ((), "sorted({e})"),
    "add": (tuple(range(1, 10)), "[v+{k} for v in {e}]"),
    "mul": ((2, 3, 4, 5), "[v*{k} for v in {e}]"),
    "gt": (tuple(range(0, 9)), "[v for v in {e} if v>{k}]"),
    "take": ((1, 2, 3, 4), "{e}[:{k}]"),
    "drop": ((1, 2, 3, 4), "{e}[{k}:]"),
}
REDUCTIONS = {"sum": "sum({e})", "len": "len({e})"}
N_TESTS = 5


def _step(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(sorted(STEPS))
    values, template = STEPS[name]
    k = rng.choice(values) if values else None
    return (f"{name} {k}" if values else name), template.replace("{k}", str(k))


def listops_problem(rng: random.Random) -> dict:
    """One problem: its prompt, the reference expression, and hidden tests of it."""
    words, expr = [], "x"
    for _ in range(rng.choice((1, 2, 2))):
        word, template = _step(rng)
        words.append(word)
        expr = template.replace("{e}", expr)
    if rng.random() < 0.25:
        name = rng.choice(sorted(REDUCTIONS))
        words.append(name)
        expr = REDUCTIONS[name].replace("{e}", expr)
    fn = eval(f"lambda x: {expr}")  # our own reference, never a model's
    inputs = [[]] + [[rng.randint(0, 9) for _ in range(rng.randint(1, 6))] for _ in range(N_TESTS - 1)]
    return {"prompt": ",".join(words) + ":", "answer": expr, "form": "expression",
            "tests": json.dumps([[[xs], fn(xs)] for xs in inputs])}


def listops_split(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(f"listops-eval/{seed}")
    evals: dict[str, dict] = {}
    for _ in range(50 * n_eval):
        if len(evals) >= n_eval:
            break
        p = listops_problem(rng)
        evals.setdefault(p["prompt"], p)
    rng = random.Random(f"listops-train/{seed}")
    train: list[dict] = []
    while len(train) < n_train:
        p = listops_problem(rng)
        if p["prompt"] not in evals:
            train.append(p)
    return train, list(evals.values())


def write_listops_dataset(out_dir: Path, n_train: int = 20000, n_eval: int = 500, seed: int = 0) -> tuple[Path, Path]:
    """Write (or reuse) ``out_dir/train.jsonl`` and ``out_dir/eval.jsonl``; return their paths."""
    if n_train < 1 or n_eval < 1:
        raise ValueError(f"n_train: n_train and n_eval must be >= 1, got {n_train}, {n_eval}")
    meta = {"kind": "listops", "format_version": FORMAT_VERSION, "n_train": n_train, "n_eval": n_eval, "seed": seed}
    return cached_split(out_dir, meta, lambda: listops_split(n_train, n_eval, seed))
