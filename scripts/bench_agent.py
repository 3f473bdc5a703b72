"""Does the agent example learn? Runs ``configs/agent_feedback.yaml`` and reports what changed.

    python scripts/bench_agent.py --steps 300 --out bench/agent_feedback.json

The multi-turn feedback agent (examples/agents/feedback_arithmetic.py: an
answer, "wrong, try again", a second answer; reward 1 / 0.5 / 0) trained
through the rollout's OpenAI-compatible proxy. Reported:

* held-out greedy accuracy at the start and the end (the first turn's
  answer, what the trainer's evaluation measures);
* from the trained spool groups, over the first and the last ``--window``
  steps: the first-try rate (reward 1), the any-try rate (reward > 0), the
  mean reward and the mean number of trained turns per episode;
* episode outcomes (ok / error / timeout / no_call, from the groups' meta),
  trained samples/s, wall seconds.

Extra ``key=value`` arguments go to the run (e.g. ``trainer.lr=3e-4``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from _bench import ROOT, submit

sys.path.insert(0, str(ROOT))
from hpcrl.metrics.writer import read_evals  # noqa: E402
from hpcrl.spool.format import read_group  # noqa: E402


def window_stats(samples: list) -> dict:
    n = max(len(samples), 1)
    return {"samples": len(samples),
            "first_try": sum(s.reward == 1.0 for s in samples) / n,
            "any_try": sum(s.reward > 0 for s in samples) / n,
            "reward": sum(s.reward for s in samples) / n,
            # a model turn after a loss-masked feedback turn: the second attempt
            "turns": sum(1 + int(len(s.loss_mask) > 0 and not s.loss_mask.all()) for s in samples) / n}


def report(run_dir: Path, window: int) -> dict:
    records = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [(r["step"], r["eval/accuracy"]) for r in read_evals(run_dir / "logs")]
    steps = [r for r in records if "reward/mean" in r]
    by_step: dict[int, list] = {}
    statuses: Counter = Counter()
    for d in (run_dir / "spool" / "trained").glob("step_*"):
        for f in d.glob("*.h5"):
            g = read_group(f)
            by_step.setdefault(int(d.name[5:]), []).extend(g.samples)
            statuses.update(g.meta.get("reward_status", []))
    last = max(by_step)
    early = [s for k, v in by_step.items() if k < window for s in v]
    late = [s for k, v in by_step.items() if k > last - window for s in v]
    return {"eval": evals, "first_window": window_stats(early), "last_window": window_stats(late),
            "statuses": dict(statuses), "samples_per_s": steps[-1].get("throughput/samples_per_s"),
            "wall_s": steps[-1].get("time/elapsed_s")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=30, help="steps at each end to compare")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "agent_feedback.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="hpcrl-agent-") as tmp:
        run_dir = submit(Path(tmp) / "run", [f"trainer.total_steps={args.steps}", f"eval.every_steps={args.eval_every}",
                                             *args.overrides], "agent_feedback", config="configs/agent_feedback.yaml")
        rep = report(run_dir, args.window)
    rep["meta"] = {"command": " ".join(["bench_agent.py", *(argv if argv is not None else sys.argv[1:])]),
                   "steps": args.steps, "window": args.window, "total_wall_s": time.time() - t0}
    (e0, a0), (e1, a1) = rep["eval"][0], rep["eval"][-1]
    f, la = rep["first_window"], rep["last_window"]
    print(f"held-out first-turn accuracy: {100 * a0:.1f}% (step {e0}) -> {100 * a1:.1f}% (step {e1})")
    for name, w in (("first", f), ("last", la)):
        print(f"{name} {args.window} steps: first-try {100 * w['first_try']:.1f}%  any-try {100 * w['any_try']:.1f}%  "
              f"reward {w['reward']:.3f}  turns {w['turns']:.2f}  ({w['samples']} samples)")
    print(f"episodes {rep['statuses']}  {rep['samples_per_s']:.1f} samples/s  {rep['wall_s']:.0f}s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
