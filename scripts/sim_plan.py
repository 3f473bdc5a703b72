"""Before buying time: how to split GPUs between generation and training, and what preemption costs, predicted.

    python scripts/sim_plan.py --out bench/sim_plan.json      # ~5 minutes on 2 cores

The same simulator, GPU cost models and AReaL settings as ``scripts/sim_predict.py`` (the 1.5B and 7B models on
H800s, 512 prompts x 16 answers a step, a log-normal response length around ``--median`` tokens, eta = 8 unless
said), asking what a user asks before submitting:

* **How many rollout GPUs per trainer GPU** (``--gpus`` in all, asynchronous): each share of the GPUs given to
  generation, with the trained samples/s and how busy each side is. Too few rollout GPUs and the trainer waits;
  too many and they wait on the staleness bound.
* **What preemption costs**: every rollout replica preempted as a Poisson process of ``rate`` per hour, losing its
  in-flight groups (their tickets reissued, so nothing is lost or trained twice) and back after ``--restart-s``
  (an assumption: requeue, start-up and loading the weights), at eta = 2 and 8; throughput relative to no
  preemption, averaged over ``--seeds`` seeds (failures are random).

Everything here is a prediction from the stated assumptions (``sim_predict.py``'s, plus the restart time); nothing
was measured on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from sim_predict import play

SHARES = (0.5, 0.625, 0.75, 0.875)  # of the GPUs given to generation (whole nodes at 64 GPUs)
RATES = (0.0, 0.25, 1.0, 4.0)  # preemptions per rollout replica per hour


def split(size: str, gpus: int, median: float, steps: int) -> dict:
    """Trained samples/s and busy fractions for each share of ``gpus`` given to generation (eta = 8)."""
    out = {}
    for share in SHARES:
        r = play(size, gpus, 8, median, steps, rollout_share=share)
        out[f"{share:g}"] = r
        print(f"{size} x {gpus} GPUs, {r['rollout_gpus']} generating / {r['train_gpus']} training: "
              f"{r['samples_per_s']:.2f} samples/s, trainer busy {r['trainer_busy']:.2f}, "
              f"rollout busy {r['rollout_busy']:.2f}", flush=True)
    return out


def preemption(size: str, gpus: int, median: float, steps: int, restart_s: float, seeds: int) -> dict:
    """Throughput under preempted rollouts, relative to none, at eta = 2 and 8 (mean over seeds)."""
    out: dict = {}
    for eta in (2, 8):
        base = None
        for rate in RATES:
            runs = [play(size, gpus, eta, median, steps,
                         work={"rollout_failures_per_hour": rate, "restart_s": restart_s, "seed": seed})
                    for seed in (range(seeds) if rate else [0])]  # no failures: nothing random
            sps = statistics.mean(r["samples_per_s"] for r in runs)
            base = sps if rate == 0 else base
            out[f"eta{eta}@{rate:g}"] = {"eta": eta, "rate_per_hour": rate, "samples_per_s": sps,
                                         "relative": sps / base, "failures": sum(r["failures"] for r in runs),
                                         "seeds": len(runs)}
            print(f"{size} x {gpus} GPUs, eta {eta}, {rate:g} preemptions per replica-hour: {sps:.2f} samples/s "
                  f"({sps / base:.2f}x; {out[f'eta{eta}@{rate:g}']['failures']} preemptions in {len(runs)} runs)",
                  flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--gpus", type=int, default=64, help="GPUs in all for the split (a multiple of 8)")
    ap.add_argument("--preempt-gpus", type=int, default=128, help="GPUs in all under preemption (AReaL's 1.5B run)")
    ap.add_argument("--median", type=float, default=8000.0, help="median response length (tokens; an assumption)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--restart-s", type=float, default=300.0, help="a preempted replica's time back (assumption)")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    out = {"assumptions": {"median_response": args.median, "restart_s": args.restart_s,
                           "rest": "as scripts/sim_predict.py (roofline efficiencies, broadcast, lengths)"},
           "split": {size: split(size, args.gpus, args.median, args.steps) for size in ("1.5B", "7B")},
           "preemption": preemption("1.5B", args.preempt_gpus, args.median, args.steps, args.restart_s, args.seeds)}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
