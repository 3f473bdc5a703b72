"""Throughput of the GPU path on a randomly initialised model of real size: one part per process.

The device check (``scripts/device_check.py``) runs each part in its own
process with its own time limit, so that one that fails or hangs costs only
its own row. A part prints one JSON object on its last line of stdout.

- ``model``: writes the model's HuggingFace folder (random weights, no
  download): ``--size 0.6B`` is Qwen3-0.6B's shape (28 layers, hidden 1024,
  16 query / 8 key-value heads of 128, MLP 3072, vocabulary 151,936, tied
  embeddings), ``--size tiny`` a ~1M-parameter one for the CPU rehearsal.
- ``fsdp``, ``fsdp_ac``, ``megatron``: the train engine (``trainer.engine``)
  on one rank of the device's backend, ``model.dtype`` bfloat16 (float32 on
  the CPU), ``--seqs`` sequences of ``--seq-len`` tokens per step (a quarter
  prompt), GRPO's decoupled PPO loss; one step of warm-up, then ``--steps``
  timed. Tokens/s counts every token of the step; model FLOPs utilisation is
  ``6 N + 6 L T d`` FLOPs per token (N: the parameters of the matrix products,
  the output layer included; L layers, T tokens per sequence, d = heads x
  head size: causal attention) over the device's dense bf16 peak.
- ``engine``: the embedded engine (TorchEngine) decoding ``--new-tokens``
  tokens after a 128-token prompt for batches of 1, 64 and 256 requests
  (eos off), and for 256 prompts of 64 to 128 tokens (a padded cache);
  generated tokens/s, and HF ``generate`` on the same prompts at batch 1 and
  64 side by side.
- ``weights``: a weight publication over disk (DiskWeights: write the
  version, then load it into an engine on the device) and the collective
  transport's packing of the state into buckets on the device. Sending the
  buckets over NCCL needs two GPUs (NCCL refuses two ranks on one device);
  its protocol runs over gloo in tests/test_collective.py.

    python scripts/device_bench.py --part model --size 0.6B --work /tmp/bench
    python scripts/device_bench.py --part fsdp --work /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

SIZES = {  # name -> Qwen3Config fields
    "0.6B": dict(vocab_size=151_936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072, max_position_embeddings=40_960,
                 rope_theta=1_000_000.0),
    "tiny": dict(vocab_size=64, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=512, max_position_embeddings=2048),
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12, "A800": 312e12,
             "L40S": 362e12}  # dense bf16 FLOP/s by device name (the SXM parts)
PAD, PROMPT = 0, 128


def on_gpu() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if on_gpu():
        torch.cuda.synchronize()


def peak_flops() -> float | None:
    if not on_gpu():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def random_model(size: str):
    """A randomly initialised Qwen3 of shape ``size`` (SIZES, seed 0), float32, on the GPU if there is one."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**SIZES[size], tie_word_embeddings=True, pad_token_id=PAD, eos_token_id=None,
                      bos_token_id=None)
    with torch.device("cuda" if on_gpu() else "cpu"):
        model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = None
    return model


def build_model(work: Path, size: str) -> dict:
    model = random_model(size)
    t0 = time.perf_counter()
    model.to(torch.bfloat16).save_pretrained(work / "model")
    n = sum(p.numel() for p in model.parameters())
    return {"size": size, "params": n, "save_s": time.perf_counter() - t0}


def matmul_params(cfg) -> int:
    """Parameters of the matrix products of one token's forward pass: the layers and the output layer."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attn = d * hd * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    mlp = 3 * d * cfg.intermediate_size
    return cfg.num_hidden_layers * (attn + mlp) + cfg.vocab_size * d


def sequences(n: int, length: int, vocab: int, seed: int = 0) -> list:
    from hpcrl.trainer.batch import TrainSequence

    rng = np.random.default_rng(seed)
    prompt, resp = length // 4, length - length // 4
    return [TrainSequence(tokens=rng.integers(1, vocab, length).astype(np.int64), prompt_len=prompt,
                          behav_logprobs=np.full(resp, -float(np.log(vocab)), np.float32),
                          versions=np.zeros(resp, np.int32), loss_mask=np.ones(resp, np.uint8),
                          advantage=float(1 if i % 2 else -1), ticket=i) for i in range(n)]


def train(work: Path, part: str, args: argparse.Namespace) -> dict:
    from transformers import AutoConfig

    from hpcrl.algo.config import AlgoConfig
    from hpcrl.runtime.dist import init_from_env
    from hpcrl.runtime.net import free_port
    from hpcrl.trainer.config import TrainerConfig
    from hpcrl.trainer.engine import build_train_engine

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    ctx = init_from_env("auto")
    dtype = "bfloat16" if on_gpu() else "float32"
    cfg = TrainerConfig(total_steps=100, lr=1e-6, warmup_steps=0, micro_batch_tokens=args.micro_tokens,
                        activation_checkpointing=part == "fsdp_ac", engine="fsdp" if part != "megatron" else part)
    engine = build_train_engine(cfg.engine, work / "model", cfg, AlgoConfig(), ctx, pad_id=PAD, dtype=dtype)
    hf = AutoConfig.from_pretrained(work / "model")
    seqs = sequences(args.seqs, args.seq_len, hf.vocab_size)
    tokens = args.seqs * args.seq_len
    if on_gpu():
        torch.cuda.reset_peak_memory_stats()
    engine.train_step(seqs, version=0)  # warm-up: allocations, kernels picked
    sync()
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        stats = engine.train_step(seqs, version=step + 1)
        sync()
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    flops = 6 * matmul_params(hf) + 6 * hf.num_hidden_layers * args.seq_len * hf.num_attention_heads * hf.head_dim
    peak = peak_flops()
    out = {"engine": part, "dtype": dtype, "seqs": args.seqs, "seq_len": args.seq_len,
           "micro_batch_tokens": args.micro_tokens, "step_s": step_s, "steps_s": times,
           "tokens_per_s": tokens / step_s, "model_tflops_per_s": flops * tokens / step_s / 1e12,
           "mfu": flops * tokens / step_s / peak if peak else None,
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu() else None,
           "loss": stats.get("loss/value")}
    torch.distributed.destroy_process_group()
    return out


def engine_model(work: Path):
    from hpcrl.model.hf_io import load_model

    device = torch.device("cuda", 0) if on_gpu() else torch.device("cpu")
    return load_model(str(work / "model"), "bfloat16" if on_gpu() else "float32").to(device).eval()


def decode(work: Path, args: argparse.Namespace) -> dict:
    from hpcrl.rollout.engine import Request, SamplingParams
    from hpcrl.rollout.torch_engine import TorchEngine

    model = engine_model(work)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    rows = []
    # (batch, ragged): equal 128-token prompts (no padding in the cache), and at the largest batch prompts of 64
    # to 128 tokens too, so that the decode steps take the padded cache's attention mask
    for batch, ragged in [*((b, False) for b in args.batches), (max(args.batches), True)]:
        engine = TorchEngine(model, eos_token_id=-1, pad_token_id=PAD, max_batch_size=batch,
                             sampling=SamplingParams(max_new_tokens=args.new_tokens))
        warm = [Request(i, rng.integers(1, vocab, PROMPT).tolist(), max_new_tokens=4) for i in range(batch)]
        engine.generate(warm)
        lengths = rng.integers(PROMPT // 2, PROMPT + 1, batch) if ragged else [PROMPT] * batch
        reqs = [Request(i, rng.integers(1, vocab, int(n)).tolist()) for i, n in enumerate(lengths)]
        sync()
        t0 = time.perf_counter()
        out = engine.generate(reqs)
        sync()
        wall = time.perf_counter() - t0
        generated = sum(len(c.output_ids) for c in out)
        assert generated == batch * args.new_tokens, (generated, batch)
        row = {"batch": batch, "ragged": ragged, "new_tokens": args.new_tokens, "wall_s": wall,
               "tokens_per_s": generated / wall}
        if batch in args.hf_batches and not ragged:  # the same work through HF generate, side by side
            row["hf_generate_tokens_per_s"] = generated / hf_generate(model, [r.prompt_ids for r in reqs],
                                                                      args.new_tokens)
        rows.append(row)
        print(f"batch {batch}: {row}", file=sys.stderr, flush=True)
    return {"dtype": str(next(model.parameters()).dtype), "prompt": PROMPT, "rows": rows}


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds HF ``generate`` takes to sample ``new_tokens`` after each prompt (one batch, same lengths)."""
    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0, pad_token_id=PAD)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        sync()
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - t0


def weights(work: Path, args: argparse.Namespace) -> dict:
    from hpcrl.rollout.torch_engine import TorchEngine
    from hpcrl.weights.collective import Layout
    from hpcrl.weights.config import WeightsConfig
    from hpcrl.weights.transport import DiskWeights, unique_tensors

    model = engine_model(work)
    state = unique_tensors(dict(model.state_dict()))
    size = sum(t.numel() * t.element_size() for t in state.values())
    disk = DiskWeights(work / "weights", WeightsConfig())
    engine = TorchEngine(model, eos_token_id=-1, pad_token_id=PAD)
    out: dict = {"bytes": size, "dtype": str(next(model.parameters()).dtype)}
    for version in (1, 2):  # the second is the one reported: the first pays for page-cache and allocator warm-up
        t0 = time.perf_counter()
        disk.publish({k: v.detach().cpu() for k, v in state.items()}, version)
        t1 = time.perf_counter()
        engine.update_weights(disk.locate(disk.latest_version()))
        sync()
        t2 = time.perf_counter()
        out.update(disk_publish_s=t1 - t0, disk_load_s=t2 - t1)
    device = next(model.parameters()).device
    layout = Layout.of(state, bucket_bytes=512 * 2**20)
    for _ in range(2):
        sync()
        t0 = time.perf_counter()
        buckets = layout.pack(state, device)
        sync()
        out["collective_pack_s"] = time.perf_counter() - t0
    out["collective_buckets"] = len(buckets)
    out["collective_send"] = ("not measured: NCCL needs one GPU per rank (two GPUs); the protocol runs over gloo "
                              "in tests/test_collective.py")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", required=True, choices=["model", "fsdp", "fsdp_ac", "megatron", "engine", "weights"])
    ap.add_argument("--work", type=Path, required=True, help="folder of the model and the published weights")
    ap.add_argument("--size", default="0.6B", choices=sorted(SIZES))
    ap.add_argument("--seqs", type=int, default=32, help="sequences per training step")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-tokens", type=int, default=8192, help="trainer.micro_batch_tokens")
    ap.add_argument("--steps", type=int, default=3, help="timed training steps (after one warm-up)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--hf-batches", type=int, nargs="*", default=[1, 64],
                    help="engine batches also timed through HF generate")
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    args.work.mkdir(parents=True, exist_ok=True)
    if args.part == "model":
        res = build_model(args.work, args.size)
    elif args.part in ("fsdp", "fsdp_ac", "megatron"):
        res = train(args.work, args.part, args)
    elif args.part == "engine":
        res = decode(args.work, args)
    else:
        res = weights(args.work, args)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
