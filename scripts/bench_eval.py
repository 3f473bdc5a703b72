"""Does held-out evaluation stall the trainer? The quickstart with evaluation in the trainer and as a component.

    python scripts/bench_eval.py --steps 200 --eval-every 10 --out bench/eval_modes.json

Runs the quickstart (cached SFT warm start, the default objective and eta)
one row after another on the same cores with the same seed:

* ``trainer``: ``eval.mode=trainer`` (rank 0 evaluates between steps while
  the step waits);
* ``component``: ``eval.mode=component`` (``python -m hpcrl.eval`` evaluates
  the snapshots the trainer hands over, in its own process);
* ``rare``: ``eval.mode=trainer`` evaluating only at the start and the end
  (``eval.every_steps=0``): the trainer's pace with (almost) no evaluation.

Per row, from ``logs/metrics.jsonl``: the trainer's wall time per step (the
growth of ``time/train_s`` from one record to the next: everything the loop
did, so an evaluation after step s shows in the interval from s to s + 1),
its mean over the intervals that followed a due step and over the others, trained samples/s, and the accuracies; for the
component, how far its records trail the hand-over (``eval/lag_s``). Extra
``key=value`` arguments go to every run. Timings on a shared machine are
noisy: compare rows of one invocation only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import ROOT, submit  # noqa: E402

sys.path.insert(0, str(ROOT))
from hpcrl.metrics.writer import read_evals, read_metrics  # noqa: E402

ROWS = {
    "trainer": ["eval.mode=trainer"],
    "component": ["eval.mode=component"],
    "rare": ["eval.mode=trainer", "eval.every_steps=0"],
}


def summarize(run_dir: Path, every: int, total: int) -> dict:
    steps = [r for r in read_metrics(run_dir / "logs" / "metrics.jsonl") if "reward/mean" in r]
    # interval p -> r: step r's work, plus whatever followed step p's record (its evaluation, if one was due)
    walls = {p["step"]: r["time/train_s"] - p["time/train_s"] for p, r in zip(steps, steps[1:])}
    due = [w for s, w in walls.items() if s % every == 0 or s == total]
    other = [w for s, w in walls.items() if not (s % every == 0 or s == total)]
    evals = read_evals(run_dir / "logs")
    lags = [r["eval/lag_s"] for r in evals if "eval/lag_s" in r]
    return {
        "run_dir": str(run_dir), "steps": len(steps),
        "step_wall_due_s": sum(due) / max(len(due), 1), "step_wall_other_s": sum(other) / max(len(other), 1),
        "step_wall_max_s": max(walls.values(), default=0.0), "train_s": steps[-1]["time/train_s"],
        "samples_per_s": steps[-1]["throughput/samples_per_s"],
        "evaluations": len(evals), "eval_s_mean": sum(r["time/eval_s"] for r in evals) / max(len(evals), 1),
        "eval_lag_s_mean": sum(lags) / len(lags) if lags else None, "eval_lag_s_max": max(lags, default=None),
        "initial_accuracy": evals[0]["eval/accuracy"] if evals else None,
        "final_accuracy": evals[-1]["eval/accuracy"] if evals else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-size", type=int, default=500)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "eval_modes.json")
    parser.add_argument("--summarize", type=Path, default=None,
                        help="run nothing: summarize the rows already in this directory (<dir>/<row>)")
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args()
    results, base = {}, str(args.summarize or tempfile.mkdtemp(prefix="hpcrl-bench-eval-"))
    common = [f"trainer.total_steps={args.steps}", f"eval.every_steps={args.eval_every}",
              f"eval.size={args.eval_size}", *args.overrides]
    for name in args.rows.split(","):
        t = time.time()
        if not args.summarize:
            print(f"[{name}] running {args.steps} steps ...", flush=True)
        run_dir = Path(base) / name if args.summarize else submit(Path(base) / name, [*common, *ROWS[name]], name)
        results[name] = {**summarize(run_dir, args.eval_every, args.steps), "overrides": ROWS[name],
                         "wall_s": None if args.summarize else time.time() - t}
        r = results[name]
        print(f"[{name}] step wall {r['step_wall_other_s']:.3f}s, {r['step_wall_due_s']:.3f}s when eval was due "
              f"(max {r['step_wall_max_s']:.2f}s); {r['samples_per_s']:.1f} samples/s; {r['evaluations']} evals of "
              f"{r['eval_s_mean']:.2f}s; accuracy {r['initial_accuracy']:.3f} -> {r['final_accuracy']:.3f}",
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {"steps": args.steps, "eval_every": args.eval_every,
                                             "eval_size": args.eval_size, "overrides": args.overrides},
                                    "rows": results}, indent=2))
    print(f"{'row':<10} {'step s':>8} {'due s':>8} {'max s':>7} {'samples/s':>10} {'evals':>6} {'lag s':>7} "
          f"{'final acc':>9}")
    for name, r in results.items():
        lag = "-" if r["eval_lag_s_mean"] is None else f"{r['eval_lag_s_mean']:.1f}"
        print(f"{name:<10} {r['step_wall_other_s']:>8.3f} {r['step_wall_due_s']:>8.3f} {r['step_wall_max_s']:>7.2f} "
              f"{r['samples_per_s']:>10.1f} {r['evaluations']:>6} {lag:>7} {r['final_accuracy']:>9.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
