"""The two math verifiers side by side: agreement with the right verdict on tricky answer pairs, and time per call.

    python scripts/bench_math_verify.py --repeat 20 --out bench/math_verify.json

``exact`` is hpcrl's default (:func:`hpcrl.reward.math_verify.math_reward`: exact rationals, normalised strings);
``symbolic`` is HuggingFace's ``math-verify`` (:func:`hpcrl.reward.symbolic.symbolic_math_reward`). Each pair is a
reference answer, a model response whose final answer is boxed, and the verdict a grader should give. The table
says which verifier gets each pair right; the time is the median per call over ``--repeat`` rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcrl.reward.math_verify import math_reward  # noqa: E402
from hpcrl.reward.symbolic import symbolic_math_reward  # noqa: E402

# (reference, the response's final answer, right verdict, what the pair tests)
PAIRS = [
    ("0.5", r"\frac{1}{2}", True, "fraction vs decimal"),
    (r"\frac{3}{4}", "0.75", True, "decimal vs fraction"),
    (r"\frac12", r"\dfrac{1}{2}", True, "\\frac12 shorthand"),
    ("3", "x=3", True, "an equation's right side"),
    ("1234", "1,234", True, "thousands separator"),
    ("2", "2.0", True, "trailing zero"),
    ("5", r"5\text{ cm}", True, "units"),
    ("-3", "3", False, "sign"),
    ("1/3", "0.333", False, "a rounded value is not equal"),
    (r"\sqrt{8}", r"2\sqrt{2}", True, "surds"),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True, "rationalised denominator"),
    ("(x+1)^2", "x^2+2x+1", True, "expanded polynomial"),
    ("(1,2]", "(1,2]", True, "interval"),
    ("(1,2]", "(1,2)", False, "interval, other bracket"),
    ("[1,2]", "[1,2)", False, "interval, half-open"),
    (r"\{1,2\}", r"\{2,1\}", True, "set order"),
    (r"\pi", "3.14", False, "pi rounded"),
    (r"2\pi", r"\pi \cdot 2", True, "product order"),
    ("12", "13", False, "a wrong integer"),
    ("10", r"10^{\circ}", True, "degrees"),
]


def timed(fn, *args) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    verifiers = {"exact": math_reward, "symbolic": symbolic_math_reward}
    rows, times = [], {k: [] for k in verifiers}
    for reference, final, right, what in PAIRS:
        response = f"Let me work it out. The final answer is $\\boxed{{{final}}}$."
        row = {"reference": reference, "response_answer": final, "right": right, "what": what}
        for name, fn in verifiers.items():
            results = []
            for _ in range(args.repeat):
                score, seconds = timed(fn, "prompt", response, reference)
                results.append(score)
                times[name].append(seconds)
            row[name] = (results[0] == 1.0) == right
        rows.append(row)
    report = {"pairs": rows,
              "agreement": {k: sum(r[k] for r in rows) / len(rows) for k in verifiers},
              "median_us_per_call": {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()},
              "repeat": args.repeat, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    width = max(len(r["what"]) for r in rows)
    print(f"{'pair':<{width}}  {'reference':<22} {'answer':<22} right  exact  symbolic")
    for r in rows:
        print(f"{r['what']:<{width}}  {r['reference']:<22} {r['response_answer']:<22} {str(r['right']):<6} "
              f"{'ok' if r['exact'] else 'WRONG':<6} {'ok' if r['symbolic'] else 'WRONG'}")
    print("agreement:", {k: f"{100 * v:.0f}%" for k, v in report["agreement"].items()},
          "median per call:", {k: f"{v:.0f} us" for k, v in report["median_us_per_call"].items()})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
