"""A synthetic task with long-tailed response lengths: reverse a digit string.

``rev:48213=`` -> ``31284``. The string length L is drawn from a truncated
power law, P(L) proportional to (L - MIN_LEN + 1)^-alpha on MIN_LEN..max_len
(MIN_LEN = 3: shorter strings are too few to keep held-out problems out of
the training set), so most responses are
a few tokens and a few are many times longer: the shape of reasoning-model
outputs that makes synchronous RL wait on its slowest sample. The last digit
of the prompt is never 0, so answers have no leading zero (the math verifier
compares numbers).

``write_reverse_dataset`` writes ``train.jsonl`` and ``eval.jsonl`` and then
``meta.json`` last (the commit marker); a second call with the same
parameters reuses the files. Every file is published atomically and
generation is deterministic in (seed, max_len, alpha, sizes). Held-out
problems never appear in the training set (compared by prompt).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

from hpcrl.data.cache import cached_split

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MIN_LEN = 3


def length_weights(max_len: int, alpha: float) -> list[float]:
    """Unnormalised P(L) for L = MIN_LEN..max_len."""
    if max_len < MIN_LEN:
        raise ValueError(f"max_len: must be >= {MIN_LEN}, got {max_len}")
    if alpha <= 0:
        raise ValueError(f"alpha: must be > 0, got {alpha}")
    return [(length - MIN_LEN + 1) ** -alpha for length in range(MIN_LEN, max_len + 1)]


def reverse_problem(rng: random.Random, lengths: list[int], weights: list[float]) -> dict:
    n = rng.choices(lengths, weights)[0]
    digits = [rng.choice("0123456789") for _ in range(n - 1)] + [rng.choice("123456789")]
    s = "".join(digits)
    return {"prompt": f"rev:{s}=", "answer": s[::-1]}


def reverse_split(n_train: int, n_eval: int, seed: int, max_len: int, alpha: float) -> tuple[list[dict], list[dict]]:
    weights = length_weights(max_len, alpha)
    lengths = list(range(MIN_LEN, max_len + 1))
    rng = random.Random(f"reverse-eval/{seed}/{max_len}/{alpha}")
    evals: dict[str, dict] = {}
    for _ in range(50 * n_eval):  # short strings repeat; the cap keeps a tiny max_len from looping forever
        if len(evals) >= n_eval:
            break
        p = reverse_problem(rng, lengths, weights)
        evals.setdefault(p["prompt"], p)
    rng = random.Random(f"reverse-train/{seed}/{max_len}/{alpha}")
    train: list[dict] = []
    while len(train) < n_train:
        p = reverse_problem(rng, lengths, weights)
        if p["prompt"] not in evals:
            train.append(p)
    return train, list(evals.values())


def write_reverse_dataset(out_dir: Path, n_train: int = 20000, n_eval: int = 500, seed: int = 0,
                          max_len: int = 24, alpha: float = 1.5) -> tuple[Path, Path]:
    """Write (or reuse) ``out_dir/train.jsonl`` and ``out_dir/eval.jsonl``; return their paths."""
    if n_train < 1 or n_eval < 1:
        raise ValueError(f"n_train: n_train and n_eval must be >= 1, got {n_train}, {n_eval}")
    meta = {"kind": "reverse", "format_version": FORMAT_VERSION, "n_train": n_train, "n_eval": n_eval,
            "seed": seed, "max_len": max_len, "alpha": alpha}
    return cached_split(out_dir, meta, lambda: reverse_split(n_train, n_eval, seed, max_len, alpha))
