"""Synthetic arithmetic datasets ("12+47=" -> "59", or "12*47=" -> "564") for the CPU demo, the examples and tests.

``write_arithmetic_dataset`` writes ``train.jsonl`` and ``eval.jsonl`` and then
``meta.json`` last: meta.json is the commit marker. A second call with the
same parameters finds a matching meta.json and reuses the files, so many
processes (or a resubmitted job) can call it safely; every file is published
atomically. Evaluation problems are distinct from each other and never appear
in the training set (compared by prompt). Generation is deterministic in
(seed, digits, sizes): ``random.Random`` seeded with a string is stable across
Python processes and versions.

CLI: ``python -m hpcrl.data.arithmetic --out DIR [--n-train 20000 ...]``.
"""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path

from hpcrl.data.cache import cached_split

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def _operand_range(digits: int) -> tuple[int, int]:
    if not isinstance(digits, int) or digits < 1:
        raise ValueError(f"digits: must be an integer >= 1, got {digits!r}")
    return 10 ** (digits - 1), 10**digits - 1


OPS = {"+": ("addition", lambda a, b: a + b), "*": ("multiplication", lambda a, b: a * b)}


def _kind(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"op: must be one of {sorted(OPS)}, got {op!r}")
    return OPS[op][0]


def _problem(rng: random.Random, lo: int, hi: int, op: str = "+") -> dict:
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return {"prompt": f"{a}{op}{b}=", "answer": str(OPS[op][1](a, b))}


def addition_problems(n: int, seed: int, digits: int = 2) -> list[dict]:
    """``n`` i.i.d. problems with both operands uniform over the ``digits``-digit numbers."""
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    lo, hi = _operand_range(digits)
    rng = random.Random(f"addition/{seed}/{digits}")
    return [_problem(rng, lo, hi) for _ in range(n)]


def _split(n_train: int, n_eval: int, seed: int, digits: int, op: str = "+") -> tuple[list[dict], list[dict]]:
    lo, hi, kind = *_operand_range(digits), _kind(op)
    space = (hi - lo + 1) ** 2
    if n_eval >= space:
        raise ValueError(f"n_eval: must be < {space} (all {digits}-digit problems), got {n_eval}")
    rng = random.Random(f"{kind}-eval/{seed}/{digits}")
    eval_rows: dict[str, dict] = {}
    while len(eval_rows) < n_eval:
        p = _problem(rng, lo, hi, op)
        eval_rows.setdefault(p["prompt"], p)
    rng = random.Random(f"{kind}-train/{seed}/{digits}")
    train: list[dict] = []
    while len(train) < n_train:
        p = _problem(rng, lo, hi, op)
        if p["prompt"] not in eval_rows:
            train.append(p)
    return train, list(eval_rows.values())


def write_arithmetic_dataset(
    out_dir: Path, n_train: int = 20000, n_eval: int = 500, seed: int = 0, digits: int = 2, op: str = "+"
) -> tuple[Path, Path]:
    """Write (or reuse) ``out_dir/train.jsonl`` and ``out_dir/eval.jsonl``; return their paths.
    ``op`` "*" writes multiplications instead of additions."""
    kind = _kind(op)
    if n_train < 1:
        raise ValueError(f"n_train: must be >= 1, got {n_train}")
    if n_eval < 1:
        raise ValueError(f"n_eval: must be >= 1, got {n_eval}")
    meta = {"kind": kind, "format_version": FORMAT_VERSION, "n_train": n_train,
            "n_eval": n_eval, "seed": seed, "digits": digits}
    return cached_split(out_dir, meta, lambda: _split(n_train, n_eval, seed, digits, op))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write an addition (or multiplication) dataset (train.jsonl, eval.jsonl).")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--n-train", type=int, default=20000)
    parser.add_argument("--n-eval", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--op", choices=sorted(OPS), default="+")
    args = parser.parse_args(argv)
    train, evals = write_arithmetic_dataset(Path(args.out), args.n_train, args.n_eval, args.seed, args.digits, args.op)
    print(f"train: {train}\neval: {evals}")


if __name__ == "__main__":
    main()
