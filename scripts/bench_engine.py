"""Throughput of TorchEngine vs HF generate on long-tailed response lengths.

Both generate the same prompts with eos disabled; request i wants L_i tokens,
L_i drawn from a clipped log-normal (long tail). HF generate runs batches of
``--batch`` left-padded prompts with do_sample and max_new_tokens = the
longest L_i of the batch (it cannot stop rows early), so it decodes wasted
tokens; the engine uses per-request ``max_new_tokens`` and continuous
batching. Useful tokens/s = sum(L_i) / wall time, for both.

    python scripts/bench_engine.py --sizes 1M 10M --requests 64 --batch 16
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from hpcrl.rollout.engine import Request, SamplingParams  # noqa: E402
from hpcrl.rollout.torch_engine import TorchEngine  # noqa: E402

SIZES = {  # name -> (hidden, layers, heads, head_dim, intermediate)
    "1M": (128, 4, 4, 32, 512),
    "10M": (320, 6, 8, 40, 1280),
    "100M": (768, 12, 12, 64, 3072),
}
VOCAB, PAD = 64, 0


def build(size: str, device: str, dtype: torch.dtype) -> Qwen3ForCausalLM:
    h, n, heads, hd, inter = SIZES[size]
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                      num_key_value_heads=heads, head_dim=hd, intermediate_size=inter,
                      tie_word_embeddings=True, pad_token_id=PAD, eos_token_id=None, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def workload(n: int, max_len: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(8, 32))] for _ in range(n)]
    lengths = [max(4, min(max_len, int(rng.lognormvariate(3.0, 0.9)))) for _ in range(n)]
    return prompts, lengths


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_hf(model, prompts, lengths, batch: int, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=max(lengths[i:i + batch]), pad_token_id=PAD)
    sync(device)
    return time.perf_counter() - t0


def bench_engine(model, prompts, lengths, batch: int, device: str) -> tuple[float, dict]:
    engine = TorchEngine(model, eos_token_id=-1, pad_token_id=PAD, max_batch_size=batch,
                         sampling=SamplingParams(max_new_tokens=max(lengths)))
    reqs = [Request(i, p, max_new_tokens=n) for i, (p, n) in enumerate(zip(prompts, lengths))]
    sync(device)
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    sync(device)
    assert [len(c.output_ids) for c in out] == lengths
    return time.perf_counter() - t0, engine.stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["1M", "10M"], choices=sorted(SIZES))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts, lengths = workload(args.requests, args.max_len, seed=0)
    useful = sum(lengths)
    print(f"{args.requests} requests, lengths mean {useful / len(lengths):.1f} max {max(lengths)}, "
          f"batch {args.batch}, device {args.device}, {args.threads} thread(s)")
    rows = []
    for size in args.sizes:
        model = build(size, args.device, getattr(torch, args.dtype))
        params = sum(p.numel() for p in model.parameters()) / 1e6
        bench_engine(model, prompts[:4], [4] * 4, args.batch, args.device)  # warm-up
        t_hf = bench_hf(model, prompts, lengths, args.batch, args.device)
        t_en, stats = bench_engine(model, prompts, lengths, args.batch, args.device)
        print(f"{size} ({params:.2f}M params): HF generate {useful / t_hf:8.0f} useful tok/s ({t_hf:.2f} s), "
              f"TorchEngine {useful / t_en:8.0f} tok/s ({t_en:.2f} s, mean batch "
              f"{stats['mean_running_batch_size']:.1f}), ratio engine/HF {t_hf / t_en:.2f}")
        rows.append({"size": size, "params_m": params, "hf_tokens_per_s": useful / t_hf,
                     "engine_tokens_per_s": useful / t_en, "ratio": t_hf / t_en,
                     "mean_batch": stats["mean_running_batch_size"]})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "useful_tokens": useful, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
