"""Run the quickstart in several modes, one after another, and compare throughput and accuracy.

    python scripts/compare_modes.py --steps 300 --out bench/modes.json

Modes: asynchronous (eta = 2 by default), disaggregated synchronous
(eta = 0) and colocated synchronous (one process, eta = 0). Every run uses
the same config, seed, SFT warm start (cached) and number of trained samples.
Reports trained samples/s, the ratio to colocated, held-out accuracy before
and after, and the wall time. Extra ``key=value`` arguments go to every run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "colocated_eta0": ["launch.mode=colocated", "admission.max_staleness=0"],
    "async_eta0": ["admission.max_staleness=0"],
    "async_eta1": ["admission.max_staleness=1"],
    "async_eta2": ["admission.max_staleness=2"],
}


def run_mode(name: str, extra: list[str], steps: int, workdir: Path) -> dict:
    run_dir = workdir / name
    cmd = [sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
           f"run_dir={run_dir}", f"trainer.total_steps={steps}", f"eval.every_steps={steps}", *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["wall_s"] = time.time() - t0
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "modes.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="hpcrl-modes-") as tmp:
        for name in args.modes.split(","):
            results[name] = run_mode(name, MODES[name] + args.overrides, args.steps, Path(tmp))
            r = results[name]
            print(f"{name:16s} {r['samples_per_s']:8.1f} samples/s  acc {r['initial_accuracy']:.3f} -> "
                  f"{r['final_accuracy']:.3f}  wall {r['wall_s']:.0f}s", flush=True)
    base = results.get("colocated_eta0", {}).get("samples_per_s")
    for r in results.values():
        r["ratio_to_colocated"] = r["samples_per_s"] / base if base else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps({k: round(v["ratio_to_colocated"] or 0, 2) for k, v in results.items()}))


if __name__ == "__main__":
    main()
