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

Everything here is a prediction from the stated assumptions (``sim_predict.py``'s, plus the restart time).
``--trainer-from SUMMARY`` asks the split question again with this project's own FSDP2 trainer as a device check
measured it on a GPU (``scripts/device_check.py``'s ``summary.json``: its ``fsdp`` row) instead of AReaL's training
FLOP/s, and adds the synchronous run on the same GPUs to both: the one input here that was measured on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from sim_predict import TRAIN_FLOPS, play

SHARES = (0.5, 0.625, 0.75, 0.875)  # of the GPUs given to generation (whole nodes at 64 GPUs)
WIDE = (0.25, 0.375) + SHARES  # with a slower trainer the best split can give training more
RATES = (0.0, 0.25, 1.0, 4.0)  # preemptions per rollout replica per hour


def split(size: str, gpus: int, median: float, steps: int, train_flops: float | None = None,
          sync: bool = False, shares: tuple[float, ...] = SHARES) -> dict:
    """Trained samples/s and busy fractions for each share of ``gpus`` given to generation (eta = 8), with the
    trainer's FLOP/s per GPU ``train_flops`` (default AReaL's); with ``sync``, the synchronous run (eta = 0) on
    the same GPUs too."""
    out = {}
    for share in shares:
        r = play(size, gpus, 8, median, steps, rollout_share=share, train_flops=train_flops)
        out[f"{share:g}"] = r
        print(f"{size} x {gpus} GPUs, {r['rollout_gpus']} generating / {r['train_gpus']} training: "
              f"{r['samples_per_s']:.2f} samples/s, trainer busy {r['trainer_busy']:.2f}, "
              f"rollout busy {r['rollout_busy']:.2f}", flush=True)
    if sync:
        r = out["sync"] = play(size, gpus, 0, median, steps, train_flops=train_flops)
        print(f"{size} x {gpus} GPUs, synchronous on all: {r['samples_per_s']:.2f} samples/s", flush=True)
    return out


def measured_train_flops(summary: Path) -> tuple[float, dict]:
    """This project's FSDP2 trainer as a device check measured it (``summary.json``: the ``fsdp`` row, the model
    step's size and parameters), as the FLOP/s per GPU the cost model (``hpcrl.sim.gpu``) needs to take the same time
    per trained token. The cost model counts ``8 P`` per token (a forward for the proximal log-probabilities, then a
    forward and a backward) plus ``16 L d s/2`` of causal attention (``d``: heads x head size). The measured step, one
    minibatch, needs no proximal pass (its policy before the update is the proximal one) and did ``6 P + 12 L d s/2``:
    ``achieved_flops_per_gpu``. Its time per token is the cost model's work at 4/3 of that rate, the rate returned:
    a run with more minibatches (a proximal pass) trains at the achieved rate instead."""
    steps = json.loads(Path(summary).read_text())["steps"]
    if steps.get("fsdp", {}).get("status") != "ok" or steps.get("model", {}).get("status") != "ok":
        raise SystemExit(f"{summary}: no measured fsdp row (run the device check's fsdp and model steps)")
    row, model = steps["fsdp"]["result"], steps["model"]["result"]
    from device_bench import SIZES  # the shape the check built (imports torch: only here)

    shape = SIZES[model["size"]]
    attention = shape["num_hidden_layers"] * shape["num_attention_heads"] * shape["head_dim"] * row["seq_len"] / 2
    done = 6 * model["params"] + 12 * attention  # forward + backward, what the one-minibatch step did
    counted = 8 * model["params"] + 16 * attention  # the cost model's work per token (hpcrl.sim.gpu.gpu_costs)
    flops = row["tokens_per_s"] * counted
    return flops, {"summary": str(summary), "model": model["size"], "params": model["params"],
                   "seq_len": row["seq_len"], "tokens_per_s": row["tokens_per_s"], "flops_per_token_done": done,
                   "flops_per_token_counted": counted, "achieved_flops_per_gpu": row["tokens_per_s"] * done,
                   "train_flops_per_gpu": flops, "areal_train_flops_per_gpu": TRAIN_FLOPS}


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
    ap.add_argument("--trainer-from", type=Path, help="a device check's summary.json: the split again with this "
                    "project's trainer as measured there")
    ap.add_argument("--no-preemption", action="store_true", help="the split question alone")
    args = ap.parse_args()
    wide = args.trainer_from is not None  # both trainers side by side: every share, and the synchronous run
    shares = WIDE if wide else SHARES
    out = {"assumptions": {"median_response": args.median, "restart_s": args.restart_s,
                           "rest": "as scripts/sim_predict.py (roofline efficiencies, broadcast, lengths)"},
           "split": {size: split(size, args.gpus, args.median, args.steps, sync=wide, shares=shares)
                     for size in ("1.5B", "7B")}}
    if args.trainer_from:
        flops, source = measured_train_flops(args.trainer_from)
        achieved = source["achieved_flops_per_gpu"]
        print(f"this project's trainer, measured: {achieved / 1e12:.0f} TFLOP/s achieved per GPU "
              f"({source['tokens_per_s']:.0f} tokens/s at {source['model']}, {source['seq_len']} tokens a sequence), "
              f"{flops / 1e12:.0f} in the cost model's accounting (no proximal pass)", flush=True)
        out["measured_trainer"] = source
        out["split_measured_trainer"] = {size: split(size, args.gpus, args.median, args.steps, flops, sync=True,
                                                     shares=WIDE) for size in ("1.5B", "7B")}
    if not args.no_preemption:
        out["preemption"] = preemption("1.5B", args.preempt_gpus, args.median, args.steps, args.restart_s, args.seeds)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
