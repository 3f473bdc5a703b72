"""The reward sandbox's cost per program, measured side by side on this machine.

For the same trivial program (and for one code-task judgement), alternating:
``plain``: the interpreter started directly (``subprocess.run``), and ``sandboxed``: the same program through
:class:`hpcrl.reward.sandbox.Sandbox` (bubblewrap namespaces, limits, the status pipe, staging its files). The
overhead is the difference of the medians. Also ``scorer``: one :class:`hpcrl.reward.code.CodeScorer` judgement
(harness + candidate + 3 hidden tests), and the throughput of ``score_many`` over 64 programs.

    python scripts/bench_sandbox.py --n 100 --out bench/sandbox.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcrl.reward.code import CodeScorer  # noqa: E402
from hpcrl.reward.config import RewardConfig, SandboxConfig  # noqa: E402
from hpcrl.reward.sandbox import Sandbox  # noqa: E402

PROGRAM = "print(sum(range(1000)))\n"
ROW = {"answer": "", "tests": json.dumps([[[[1, 2, 3]], [3, 2, 1]], [[[]], []], [[["a"]], ["a"]]])}
GOOD = "```python\ndef f(xs):\n    return xs[::-1]\n```"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="runs of each kind")
    parser.add_argument("--out", type=Path, help="write the results here (JSON)")
    args = parser.parse_args(argv)
    cfg = SandboxConfig()
    sandbox = Sandbox(cfg)
    scorer = CodeScorer(RewardConfig(scorer="code", sandbox=cfg))
    times: dict[str, list[float]] = {"plain": [], "sandboxed": [], "scorer": []}
    for i in range(args.n):
        t0 = time.perf_counter()
        out = subprocess.run([cfg.python, "-I", "-c", PROGRAM], capture_output=True, env={})
        t1 = time.perf_counter()
        run = sandbox.run({"main.py": PROGRAM}, ["python", "-I", "/task/main.py"])
        t2 = time.perf_counter()
        result = scorer.score("p", GOOD, ROW)
        t3 = time.perf_counter()
        assert out.stdout == run.stdout == b"499500\n" and result.reward == 1.0, (out, run, result)
        times["plain"].append(t1 - t0)
        times["sandboxed"].append(t2 - t1)
        times["scorer"].append(t3 - t2)
        if (i + 1) % 25 == 0:
            print(f"{i + 1}/{args.n}", file=sys.stderr)
    t0 = time.perf_counter()
    results = scorer.score_many([("p", GOOD, ROW)] * 64)
    many_s = time.perf_counter() - t0
    scorer.close()
    assert all(r.reward == 1.0 for r in results)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    report = {"machine": platform.node(), "cpus": __import__("os").cpu_count(), "n": args.n,
              "median_ms": {k: round(v, 2) for k, v in med.items()},
              "p90_ms": {k: round(sorted(v)[int(0.9 * len(v))] * 1000, 2) for k, v in times.items()},
              "overhead_ms": round(med["sandboxed"] - med["plain"], 2),
              "score_many_64_s": round(many_s, 3), "score_many_per_s": round(64 / many_s, 1),
              "max_workers": scorer.cfg.max_workers, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
