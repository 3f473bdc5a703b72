"""Math verification by symbolic equivalence: HuggingFace's ``math-verify`` behind hpcrl's reward function signature.

``reward.fn: hpcrl.reward.symbolic:symbolic_math_reward`` scores 1.0 when the response's answer is
mathematically equal to the reference: LaTeX parsed to SymPy, so ``2\\sqrt{2}`` equals ``\\sqrt{8}``,
``(1,2]`` is an interval, ``\\{1,2\\}`` a set, ``x=3`` answers ``3``, units and ``\\text{}`` are dropped.
The default verifier (:mod:`hpcrl.reward.math_verify`) compares exact rationals and normalised strings: it
is much faster, and right wherever answers are numbers. docs/reward.md has both on a table of tricky pairs
(``scripts/bench_math_verify.py``).

``math-verify``'s own timeouts use ``SIGALRM``, which works only on a process's main thread; they are turned
off here and the reward runner's ``reward.timeout_s`` bounds every call instead (``reward.isolation:
process`` kills a call that runs past it). Install with ``pip install -e '.[math]'``.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["symbolic_math_reward"]


def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError("hpcrl.reward.symbolic needs math-verify: pip install -e '.[math]' "
                          "(or pip install math-verify)") from e
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warning, on every call
    return math_verify


def symbolic_math_reward(prompt: str, response: str, answer: str, **row: Any) -> float:
    """1.0 when ``response``'s final answer (a ``\\boxed{}``, a ``$...$``, or a bare expression) is equivalent to
    ``answer``; 0.0 otherwise, or when either side does not parse."""
    mv = _math_verify()
    answer = str(answer)
    gold = mv.parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=None)
    if not gold:
        gold = mv.parse(answer, parsing_timeout=None)
    pred = mv.parse(response, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if mv.verify(gold, pred, timeout_seconds=None) else 0.0
