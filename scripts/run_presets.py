"""Run every algorithm preset (configs/algos/*.yaml) on the quickstart task and tabulate the result.

    python scripts/run_presets.py --steps 60 --out bench/presets.json [--presets grpo ppo] [key=value ...]

Each preset runs ``python -m hpcrl.submit`` for a fixed number of steps from
the cached SFT warm start (the same for every preset), one after another.
Reported per preset: held-out greedy accuracy at the start and the end, the
number of metric values that are not finite (must be 0), mean train time per
step, dropped groups, and the wall time. Also measures the proximal logprob
approximation: the GRPO preset again with ``algo.prox_approx=true`` (rows
``grpo+prox_approx``), comparing the ``time/prepare_s`` per step.
Extra ``key=value`` arguments go to every run.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (ROOT / "configs" / "algos").glob("*.yaml"))


def run_preset(name: str, preset: str, extra: list[str], steps: int, workdir: Path) -> dict:
    run_dir = workdir / name
    cmd = [sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/algos" / f"{preset}.yaml"),
           f"run_dir={run_dir}", f"trainer.total_steps={steps}", "eval.every_steps=0",
           # the schedule the table in docs/algorithms.md was measured with: a short run decaying like the
           # quickstart's 2000 steps would learn about half as much per step
           "trainer.lr_schedule=constant", *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps_recs = [r for r in records if "time/update_s" in r]
    values = [v for r in records for v in r.values() if isinstance(v, (int, float))]
    last = steps_recs[-1] if steps_recs else {}
    return {
        "preset": name, "steps": summary["steps"], "acc_start": summary["initial_accuracy"],
        "acc_end": summary["final_accuracy"], "non_finite": sum(not math.isfinite(v) for v in values),
        "train_s_per_step": sum(r["time/update_s"] for r in steps_recs) / max(len(steps_recs), 1),
        "prepare_s_per_step": sum(r.get("time/prepare_s", 0.0) for r in steps_recs) / max(len(steps_recs), 1),
        "dropped": {k[len("groups/dropped_"):]: v for k, v in last.items() if k.startswith("groups/dropped_")},
        "wall_s": time.time() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--presets", nargs="*", default=PRESETS)
    parser.add_argument("--no-prox-approx", action="store_true", help="skip the prox_approx comparison run")
    parser.add_argument("--out", type=Path)
    args, extra = parser.parse_known_args()
    runs = [(p, p, []) for p in args.presets]
    if not args.no_prox_approx and "grpo" in args.presets:
        runs.append(("grpo+prox_approx", "grpo", ["algo.prox_approx=true"]))
    results = []
    with tempfile.TemporaryDirectory(prefix="presets-") as tmp:
        for name, preset, overrides in runs:
            results.append(run_preset(name, preset, overrides + extra, args.steps, Path(tmp)))
            r = results[-1]
            gain = 100 * (r["acc_end"] - r["acc_start"])
            print(f"{name:24s} acc {r['acc_start']:.3f} -> {r['acc_end']:.3f} ({gain:+.1f})"
                  f"  non-finite {r['non_finite']}  train {r['train_s_per_step'] * 1000:.0f} ms/step"
                  f"  prepare {r['prepare_s_per_step'] * 1000:.0f} ms/step  dropped {r['dropped']}"
                  f"  wall {r['wall_s']:.0f}s", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
