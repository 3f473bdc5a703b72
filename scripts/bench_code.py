"""Does the code task learn? Runs ``configs/code_listops.yaml`` on several seeds and reports held-out pass@1.

    python scripts/bench_code.py --seeds 0,1,2 --steps 300 --out bench/code_listops.json

Each seed is a whole run (dataset, SFT warm start, RL) of the list-operations code task: the model writes a
Python expression, run in the reward sandbox against the row's hidden tests (``reward.scorer: code``). Reported
per seed: held-out pass@1 (the greedy program passes every hidden test; 500 held-out problems whose step chains
never appear in training) at the start of RL and at the end, the gain, what the rollouts' programs did (passed,
failed, killed by a limit, timed out: the code scorer's counts), the sandbox's infra errors, trained samples/s
and wall time; then the mean gain ± its standard error over seeds.

Extra ``key=value`` arguments go to every run (e.g. ``trainer.lr=3e-4``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _bench import ROOT, submit

sys.path.insert(0, str(ROOT))
from hpcrl.metrics.writer import read_evals, read_metrics  # noqa: E402

CONFIG = "configs/code_listops.yaml"


def report(run_dir: Path) -> dict:
    evals = [(int(r["step"]), float(r["eval/accuracy"])) for r in read_evals(run_dir / "logs")]
    steps = [r for r in read_metrics(run_dir / "logs" / "metrics.jsonl") if "reward/mean" in r]
    stats = [json.loads(p.read_text()) for p in sorted((run_dir / "logs").glob("rollout-*.stats.json"))]
    programs: dict[str, int] = {}
    for s in stats:
        for k, v in (s.get("reward") or {}).items():
            programs[k] = programs.get(k, 0) + v
    return {"eval": evals, "start": evals[0][1], "final": evals[-1][1], "gain": evals[-1][1] - evals[0][1],
            "reward_first10": statistics.mean(r["reward/mean"] for r in steps[:10]),
            "reward_last10": statistics.mean(r["reward/mean"] for r in steps[-10:]),
            "samples_per_s": steps[-1].get("throughput/samples_per_s"), "scorer_counts": programs,
            "infra_errors": sum(s.get("samples_infra_error", 0) for s in stats)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "code_listops.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    runs = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix="hpcrl-code-") as tmp:
            run_dir = submit(Path(tmp) / "run", [f"seed={seed}", f"trainer.total_steps={args.steps}",
                                                 f"eval.every_steps={args.eval_every}", *args.overrides],
                             f"code seed {seed}", config=CONFIG)
            runs[seed] = {**report(run_dir), "wall_s": time.time() - t0}
        r = runs[seed]
        print(f"seed {seed}: held-out pass@1 {100 * r['start']:.1f}% -> {100 * r['final']:.1f}% "
              f"({100 * r['gain']:+.1f} points); rollout reward {r['reward_first10']:.3f} -> {r['reward_last10']:.3f}; "
              f"{r['samples_per_s']:.1f} samples/s; programs {r['scorer_counts']}; {r['wall_s']:.0f}s", flush=True)
    gains = [100 * r["gain"] for r in runs.values()]
    summary = {"gain_mean": statistics.mean(gains),
               "gain_se": statistics.stdev(gains) / len(gains) ** 0.5 if len(gains) > 1 else None,
               "gain_min": min(gains)}
    print(f"mean gain {summary['gain_mean']:+.1f}" + (f" ± {summary['gain_se']:.1f}" if summary["gain_se"] else "")
          + f" points (min {summary['gain_min']:+.1f})")
    out = {"runs": runs, "summary": summary,
           "meta": {"command": " ".join(["bench_code.py", *(argv if argv is not None else sys.argv[1:])]),
                    "config": CONFIG, "steps": args.steps, "time": time.strftime("%Y-%m-%d %H:%M:%S")}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
