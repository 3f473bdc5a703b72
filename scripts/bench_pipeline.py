"""Do pipeline stages train faster than one rank? The megatron engine's training step alone, no rollout.

    python scripts/bench_pipeline.py --out bench/pipeline_1f1b.json

Builds a Qwen3-architecture model with random weights (``--hidden``,
``--layers``, a 64-token vocabulary) and a synthetic batch (``--groups``
groups of 8 responses, 48-96 tokens each, rewards 0/1), then, one layout
after another, runs the megatron engine's ``train_step`` on that batch
``--steps`` times plus one warm-up step that is not counted (``--critic``: PPO
with GAE, which adds a pass without gradients for the values and the
critic's own update): on 1 rank, then
on ``--pp`` ranks as pipeline stages (``trainer.megatron.pipeline_parallel``),
each rank on one thread, the micro-batches cut at ``--micro-tokens`` tokens.
Per layout: the median step time, trained samples/s, the peak RSS of every
rank, and the speed-up over 1 rank. With 1F1B the stages compute at the same
time, so on ``p`` idle cores ``p`` stages can approach ``p`` times one rank's
speed (less the pipeline's fill and drain, ``(p - 1) / (m + p - 1)`` of the
time with ``m`` micro-batches, and the transfers); a schedule that runs one
stage at a time cannot pass 1x. Timings on a shared machine are noisy:
compare the rows of one invocation only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_model(path: Path, hidden: int, layers: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=hidden // 4, intermediate_size=3 * hidden,
                         max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)


def batch(n_groups: int, seed: int = 0):
    """``n_groups`` groups of 8 synthetic responses (the same on every rank)."""
    import numpy as np

    from hpcrl.spool.format import Sample, TrajectoryGroup

    rng = np.random.default_rng(seed)
    groups = []
    for t in range(n_groups):
        prompt = rng.integers(3, 64, size=int(rng.integers(12, 24))).astype(np.int32)
        samples = []
        for i in range(8):
            n = int(rng.integers(48, 97))
            samples.append(Sample(response_ids=rng.integers(3, 64, size=n).astype(np.int32),
                                  behav_logprobs=(-rng.random(n) * 3).astype(np.float32),
                                  versions=np.zeros(n, np.int32), loss_mask=np.ones(n, np.uint8),
                                  reward=float(i % 2), finish_reason="stop"))
        groups.append(TrajectoryGroup(ticket=t, writer="bench", prompt_ids=prompt, samples=samples))
    return groups


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, model: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import resource

    import torch

    torch.set_num_threads(1)
    from hpcrl.algo.config import AlgoConfig
    from hpcrl.runtime.dist import init_from_env
    from hpcrl.trainer import batch as B
    from hpcrl.trainer.config import MegatronSettings, TrainerConfig
    from hpcrl.trainer.engine import build_train_engine

    ctx = init_from_env("gloo")
    cfg = TrainerConfig(engine="megatron", world_size=world, total_steps=args.steps + 1, lr=1e-5, warmup_steps=0,
                        micro_batch_tokens=args.micro_tokens, megatron=MegatronSettings(pipeline_parallel=world))
    algo = AlgoConfig(adv_estimator="gae") if args.critic else AlgoConfig()
    engine = build_train_engine("megatron", model, cfg, algo, ctx, pad_id=0)
    seqs, _ = B.to_sequences(batch(args.groups), algo)
    walls = []
    for step in range(args.steps + 1):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        engine.train_step(seqs)
        torch.distributed.barrier()
        if step:  # the first step warms up (allocations, the first sends)
            walls.append(time.perf_counter() - t0)
        print(f"[bench_pipeline] {world} rank(s), rank {rank}: step {step} took {time.perf_counter() - t0:.2f} s",
              flush=True)
    n_micro = len(engine._micro_batches(seqs))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out, f"rank{rank}.json").write_text(json.dumps({"walls": walls, "peak_rss_mib": rss,
                                                        "samples": len(seqs), "micro_batches": n_micro}))
    torch.distributed.destroy_process_group()


def run_layout(world: int, args: argparse.Namespace, model: Path, work: Path) -> dict:
    import multiprocessing as mp

    from hpcrl.runtime.dist import free_port

    out = work / f"world{world}"
    out.mkdir()
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, str(model), str(out))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a rank of the {world}-rank run exited with {p.exitcode}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    wall = statistics.median(ranks[0]["walls"])
    return {"ranks": world, "pipeline_parallel": world, "micro_batches": ranks[0]["micro_batches"],
            "step_s_median": wall, "step_s": ranks[0]["walls"], "samples_per_s": ranks[0]["samples"] / wall,
            "peak_rss_mib": [r["peak_rss_mib"] for r in ranks]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages of the second layout")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8, help="groups of 8 responses in the batch")
    parser.add_argument("--micro-tokens", type=int, default=1024, help="trainer.micro_batch_tokens")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per layout (after one warm-up)")
    parser.add_argument("--critic", action="store_true",
                        help="PPO with a critic (GAE): a no-grad pass for the values, then the critic's updates")
    parser.add_argument("--out", type=Path, help="write the summary here (JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model(work / "model", args.hidden, args.layers)
        rows = [run_layout(w, args, work / "model", work) for w in (1, args.pp)]
    base = rows[0]["step_s_median"]
    for row in rows:
        row["speedup_over_1_rank"] = base / row["step_s_median"]
        print(f"{row['ranks']} rank(s), PP={row['pipeline_parallel']}, {row['micro_batches']} micro-batches: "
              f"{row['step_s_median']:.2f} s/step, {row['samples_per_s']:.1f} samples/s, "
              f"{row['speedup_over_1_rank']:.2f}x one rank, peak RSS {row['peak_rss_mib']} MiB")
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "cpus": os.cpu_count(), "rows": rows,
               "date": time.strftime("%Y-%m-%d")}
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"summary -> {args.out}")


if __name__ == "__main__":
    main()
