"""Quality at speed: held-out accuracy versus step and versus wall-clock for each staleness bound.

    python scripts/bench_quality.py --steps 250 --out bench/quality.json

The AReaL staleness table on our task: the quickstart (2-digit addition, the
~1M-parameter model, the cached SFT warm start, GRPO) run one after another
on the same cores with the same seed, for

* ``eta{0,1,2,4,8}``: decoupled PPO (the default objective) with
  ``admission.max_staleness`` = eta (eta = 0 is synchronous RL);
* ``plain_eta{1,2,4,8}``: plain PPO (``algo.decoupled=false``): clipping around
  the behaviour policy, no proximal recompute, no behaviour weight (at eta = 0
  the two objectives are the same);
* ``keepkv_eta4``: decoupled PPO, eta = 4, in-flight sequences keeping their KV
  cache across weight updates (``rollout.kv_on_update=keep``).

Every run evaluates greedy held-out accuracy on ``--eval-size`` problems every
``--eval-every`` steps (and at the start). Writes ``bench/quality.json`` (every
curve plus a summary per run: start, final and best accuracy, the accuracy
reached by the wall time at which the fastest run finished, trained
samples/s, max staleness) and ``bench/quality.png``. Extra ``key=value``
arguments go to every run. One seed: differences of a few points are within
the noise of a single run (about 2 points of standard error on 500 problems).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from _bench import ROOT, pyplot, submit

RUNS = {
    **{f"eta{e}": [f"admission.max_staleness={e}"] for e in (0, 1, 2, 4, 8)},
    **{f"plain_eta{e}": [f"admission.max_staleness={e}", "algo.decoupled=false"] for e in (1, 2, 4, 8)},
    "keepkv_eta4": ["admission.max_staleness=4", "rollout.kv_on_update=keep"],
}


def run(name: str, extra: list[str], args: argparse.Namespace, workdir: Path) -> dict:
    run_dir = submit(workdir / name, [f"trainer.total_steps={args.steps}", f"eval.every_steps={args.eval_every}",
                                      f"eval.size={args.eval_size}", *extra, *args.overrides], name)
    records = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [{"step": r.get("step", 0), "wall_s": r.get("time/elapsed_s", 0.0), "accuracy": r["eval/accuracy"]}
             for r in records if r.get("eval/accuracy") is not None]
    steps = [r for r in records if "reward/mean" in r]
    return {"overrides": extra, "evals": evals,
            "reward": [(r["step"], r["reward/mean"]) for r in steps],
            "samples_per_s": steps[-1].get("throughput/samples_per_s") if steps else None,
            "staleness_max": max((r.get("staleness/max", 0) for r in steps), default=None),
            "wall_s": evals[-1]["wall_s"] if evals else None}


def accuracy_at(evals: list[dict], wall_s: float) -> float:
    """The last accuracy measured by ``wall_s`` (step-function interpolation)."""
    seen = [e["accuracy"] for e in evals if e["wall_s"] <= wall_s + 1e-9]
    return seen[-1] if seen else evals[0]["accuracy"]


def summarise(results: dict) -> None:
    first_done = min(r["wall_s"] for r in results.values())
    for r in results.values():
        acc = [e["accuracy"] for e in r["evals"]]
        r["summary"] = {"start": acc[0], "final": acc[-1], "best": max(acc), "gain": acc[-1] - acc[0],
                        "at_first_finish": accuracy_at(r["evals"], first_done), "first_finish_s": first_done}


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, r in results.items():
        style = "--" if name.startswith("plain") else (":" if name.startswith("keepkv") else "-")
        axes[0].plot([e["step"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], style, marker=".",
                     label=name)
        axes[1].plot([e["wall_s"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], style, marker=".",
                     label=name)
    axes[0].set_xlabel("trainer step")
    axes[1].set_xlabel("wall-clock seconds (trainer)")
    for ax in axes:
        ax.set_ylabel("held-out greedy accuracy")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-size", type=int, default=500)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "quality.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    unknown = [n for n in args.runs.split(",") if n not in RUNS]
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)}")
    results, started = {}, time.time()
    with tempfile.TemporaryDirectory(prefix="hpcrl-quality-") as tmp:
        for name in args.runs.split(","):
            t0 = time.time()
            results[name] = r = run(name, RUNS[name], args, Path(tmp))
            acc = [e["accuracy"] for e in r["evals"]]
            print(f"{name:12s} accuracy {100 * acc[0]:5.1f}% -> {100 * acc[-1]:5.1f}% (best {100 * max(acc):5.1f}%)  "
                  f"{r['samples_per_s'] or 0:6.1f} samples/s  staleness max {r['staleness_max']}  "
                  f"{time.time() - t0:.0f}s", flush=True)
    summarise(results)
    meta = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "steps": args.steps, "eval_every": args.eval_every, "eval_size": args.eval_size,
            "total_wall_s": time.time() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
    plot(results, args.out.with_suffix(".png"))
    return results


if __name__ == "__main__":
    main()
