"""Predict synchronous vs asynchronous throughput on GPU clusters in AReaL's published settings, and compare.

    python scripts/sim_predict.py --out bench/sim_predict.json        # ~1-2 minutes

The simulator (``hpcrl/sim/``) with GPU cost models from published numbers
(``hpcrl/sim/gpu.py``: H800 peak figures, the models' shapes, AReaL's own
training FLOP/s) plays AReaL's settings (arXiv 2505.24298: 512 prompts x 16
answers a step, generation up to 27,648 tokens, eta = 8 for math,
asynchronous runs on 3/4 of the GPUs generating and 1/4 training, synchronous
runs alternating on all of them) for the 1.5B model on 16 nodes and the 7B
model on 24, and compares the predicted speed-up with Table 1's (synchronous
AReaL hours / AReaL hours: 41.0 / 14.8 = 2.77 and 57.7 / 25.4 = 2.27). It
also sweeps the GPU count (8 to 1,024) and eta.

What no source gives is an assumption, stated in the output and swept: the
response-length distribution (log-normal, median ``--median`` tokens, capped
at the generation limit), the decode step's efficiency against its roofline,
and a step's fixed overheads. A cluster is simulated scaled down: every
rollout GPU is a replica, and the batch, the replicas and the trainer's GPUs
are divided by the same factor (each replica's load and the trainer's
per-GPU load stay AReaL's), so a 1,024-GPU run costs what a 32-GPU one does;
synchronous runs are played whole (their step waits for the slowest of all
replicas, which a smaller fleet underestimates).
Requests are spread evenly over the replicas (``Workload.spread_tickets``),
as AReaL's rollout controller dispatches them over its generation servers;
``--check-scale`` plays one setting unscaled beside its scaled run.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

from _bench import ROOT

sys.path.insert(0, str(ROOT))
from hpcrl.sim import Workload, simulate  # noqa: E402
from hpcrl.sim.gpu import H800, R1_DISTILL_QWEN_1_5B, R1_DISTILL_QWEN_7B, gpu_costs, kv_rows  # noqa: E402

PROMPTS, ANSWERS, MAX_GEN, PROMPT_TOKENS = 512, 16, 27648, 1024  # AReaL Table 3; prompts capped at 1,024 tokens
# achieved training FLOP/s per GPU of AReaL's engine (Fig. 6a, dynamic batching): 1B on 1 node, 7B on 2 nodes
TRAIN_FLOPS = {"1.5B": 427.4e12, "7B": 454.7e12}
MODELS = {"1.5B": R1_DISTILL_QWEN_1_5B, "7B": R1_DISTILL_QWEN_7B}
PUBLISHED = {"1.5B": {"nodes": 16, "sync_h": 41.0, "async_h": 14.8},  # Table 1: hours, synchronous AReaL / AReaL
             "7B": {"nodes": 24, "sync_h": 57.7, "async_h": 25.4}}


def lengths(median: float, sigma: float = 0.8, n: int = 2000, seed: int = 0) -> tuple[int, ...]:
    """Response lengths: log-normal around ``median``, capped at the generation limit (an assumption)."""
    rng = random.Random(seed)
    return tuple(min(MAX_GEN, max(16, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n))


def play(size: str, gpus: int, eta: int, median: float, steps: int, scaled: bool | None = None,
         spread: bool = True, rollout_share: float = 0.75, work: dict | None = None,
         train_flops: float | None = None, **assume) -> dict:
    """One run of ``gpus`` GPUs (a multiple of 8): eta = 0 alternates on all of them, eta > 0 gives
    ``rollout_share`` of them to generation (AReaL's 3:1 by default) and the rest to training; ``work``: more
    :class:`Workload` fields (failures, seed); ``train_flops``: the trainer's FLOP/s per GPU (default AReaL's,
    ``TRAIN_FLOPS``). Asynchronous runs are simulated scaled down by a common factor of
    replicas, trainer and batch; synchronous ones are not (a step waits for the slowest of all replicas, and the
    slowest of 128 is slower than the slowest of 4: scaled down, 1.5B on 128 GPUs came out 10 % faster) and play at
    most 10 steps (no pipeline to fill: every step is alike)."""
    scaled = eta > 0 if scaled is None else scaled
    steps = steps if eta > 0 else min(steps, 10)
    model, resp = MODELS[size], lengths(median)
    mean_seq = PROMPT_TOKENS + sum(resp) / len(resp)
    if gpus % 8 or gpus > 2048:
        raise ValueError(f"gpus: a multiple of 8 up to 2,048 (whole nodes), got {gpus}")
    rollout_gpus = round(gpus * rollout_share)
    if eta > 0 and not 0 < rollout_gpus < gpus:
        raise ValueError(f"rollout_share: leaves no GPU to {'training' if rollout_gpus else 'generation'} "
                         f"of {gpus} ({rollout_share})")
    replicas, train_gpus = (gpus, gpus) if eta == 0 else (rollout_gpus, gpus - rollout_gpus)
    scale = math.gcd(replicas, train_gpus, PROMPTS) if scaled else 1  # divides replicas, trainer GPUs and batch
    while replicas // scale < 4 and scale % 2 == 0:  # at least 4 replicas left: groups spread as over a fleet
        scale //= 2
    costs = gpu_costs(model, H800, train_gpus // scale, mean_seq, train_flops_per_gpu=TRAIN_FLOPS[size] if train_flops is None else train_flops,
                      **assume)
    rows = kv_rows(model, H800, PROMPT_TOKENS + sum(resp) / len(resp) / 2)  # a row holds half its response, on average
    work = Workload(steps=steps, batch_groups=PROMPTS // scale, group_size=ANSWERS, max_staleness=eta,
                    replicas=replicas // scale, max_batch_rows=max(rows, ANSWERS), prompt_tokens=PROMPT_TOKENS,
                    response_tokens=resp, tokens_per_event=256, queued_groups=1, spread_tickets=spread,
                    **(work or {}))
    r = simulate(work, costs)
    return {"gpus": gpus, "eta": eta, "samples_per_s": r.samples_per_s * scale, "tokens_per_s": r.tokens_per_s * scale,
            "trainer_busy": r.trainer_busy, "rollout_busy": r.rollout_busy, "rows_per_replica": work.max_batch_rows,
            "step_s": r.wall_s / steps, "rollout_gpus": replicas, "train_gpus": train_gpus, "failures": r.failures,
            "dropped_groups": r.dropped_groups}


def generation_check(size: str, median: float, **assume) -> float:
    """Tokens/s one rollout GPU decodes with a full engine at the mean context: to set beside AReaL's Fig. 6b."""
    model, resp = MODELS[size], lengths(median)
    c = gpu_costs(model, H800, 1, PROMPT_TOKENS + median, train_flops_per_gpu=TRAIN_FLOPS[size], **assume)
    ctx = PROMPT_TOKENS + sum(resp) / len(resp) / 2
    rows = kv_rows(model, H800, ctx)
    return rows / c.decode(rows, int(rows * ctx))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--median", default="4000,8000,12000", help="response-length medians to sweep (tokens)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--check-scale", action="store_true", help="1.5B on 128 GPUs, scaled and not (slow: minutes)")
    args = ap.parse_args()
    medians = [float(m) for m in args.median.split(",")]
    if args.check_scale:
        for eta in (0, 8):
            a, b = (play("1.5B", 128, eta, 8000, 6, scaled=s) for s in (True, False))
            print(f"eta {eta}: scaled {a['samples_per_s']:.2f} samples/s, unscaled {b['samples_per_s']:.2f} "
                  f"({a['samples_per_s'] / b['samples_per_s'] - 1:+.1%})", flush=True)
        return
    out: dict = {"assumptions": {"length": "log-normal, sigma 0.8, capped at 27,648", "decode_bw_efficiency": 0.6,
                                 "decode_mfu": 0.3, "decode_step_overhead_s": "from the batch-1 speed (gpu.py)",
                                 "train_step_overhead_s": 1.0, "weights_broadcast_s": 0.5},
                 "published": PUBLISHED, "table1": {}, "scaling": {}, "eta": {}}
    for size in MODELS:
        for median in medians:
            gen = generation_check(size, median)
            nodes, pub = PUBLISHED[size]["nodes"], PUBLISHED[size]["sync_h"] / PUBLISHED[size]["async_h"]
            for spread in (True, False):  # AReaL's controller spreads requests; hpcrl's workers each take their fill
                sync, asyn = (play(size, nodes * 8, eta, median, args.steps, spread=spread) for eta in (0, 8))
                ratio = asyn["samples_per_s"] / sync["samples_per_s"]
                key = f"{size}@{median:.0f}" + ("" if spread else "@greedy")
                out["table1"][key] = {"sync": sync, "async": asyn, "predicted_speedup": ratio,
                                      "published_speedup": pub, "decode_tokens_per_s_per_gpu": gen}
                print(f"{size} on {nodes} nodes, median response {median:.0f}, "
                      f"{'spread' if spread else 'greedy'}: predicted {ratio:.2f}x, published {pub:.2f}x (one "
                      f"rollout GPU decodes {gen:.0f} tokens/s; step {sync['step_s']:.0f} s synchronous, "
                      f"{asyn['step_s']:.0f} s asynchronous)", flush=True)
    median = medians[len(medians) // 2]
    for size in MODELS:
        for gpus in (8, 32, 128, 512, 1024):
            sync, asyn = (play(size, gpus, eta, median, steps=args.steps) for eta in (0, 8))
            out["scaling"][f"{size}@{gpus}"] = {"sync": sync, "async": asyn}
            print(f"{size} x {gpus:4d} GPUs: sync {sync['tokens_per_s'] / 1e3:8.1f}k tokens/s, async "
                  f"{asyn['tokens_per_s'] / 1e3:8.1f}k ({asyn['samples_per_s'] / sync['samples_per_s']:.2f}x)",
                  flush=True)
    for eta in (0, 1, 2, 4, 8, 16):
        r = play("1.5B", 128, eta, median, steps=args.steps) if eta else out["table1"][
            f"1.5B@{median:.0f}"]["sync"]
        out["eta"][str(eta)] = r
        print(f"1.5B x 128 GPUs, eta {eta:2d}: {r['tokens_per_s'] / 1e3:.1f}k tokens/s", flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
