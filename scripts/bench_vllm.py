"""vLLM through hpcrl's engine seam against vLLM offline, the embedded engine and HF generate.

All rows generate the same long-tailed workload (``bench_engine.workload``:
prompts of 8-32 tokens, request i wants L_i tokens from a clipped
log-normal, eos ignored) with the same tiny Qwen3 model (the quickstart's
1M-parameter architecture, saved in HuggingFace format):

- ``vllm offline``: ``vllm.LLM.generate`` on all requests at once, in its own
  process (the engine's own speed, no HTTP);
- ``vllm seam``: :class:`hpcrl.rollout.remote_engine.RemoteEngine` driving a
  vLLM server that ``build_engine`` starts, all requests submitted at once
  and polled (HTTP, the client thread, the segment bookkeeping);
- ``vllm seam + updates``: the same with a weight update (abort, pause,
  reload, reset cache, version, resume, resubmit) every ``--update-every-s``
  seconds: what a rollout pays for interruptible generation;
- ``torch engine`` and ``HF generate``: as in ``scripts/bench_engine.py``.

Useful tokens/s = sum(L_i) / wall time. Targets: seam >= 90% of offline;
weight updates <= 5% of the rollout's wall time. Writes ``--out`` (JSON).

    python scripts/bench_vllm.py --requests 256 --batch 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def offline(model: str, prompts: list[list[int]], lengths: list[int], batch: int) -> float:
    """Seconds vLLM's offline engine takes for the workload (after a warm-up)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=batch,
              logprobs_mode="processed_logprobs", seed=0)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, logprobs=0) for n in lengths]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(inputs[:8], params[:8], use_tqdm=False)
    t0 = time.perf_counter()
    out = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in out] == lengths
    return seconds


def seam(model: str, prompts, lengths, batch: int, update_every_s: float, staging: Path, log_dir: Path,
         published: Path) -> dict:
    """Wall time through the seam (with a weight update every ``update_every_s`` s unless 0), engine stats."""
    from hpcrl.model.tiny import build_char_tokenizer
    from hpcrl.rollout.config import RolloutConfig
    from hpcrl.rollout.engine import SamplingParams
    from hpcrl.rollout.engines import EngineSite, build_engine
    from hpcrl.weights.version import WeightVersion

    cfg = RolloutConfig(engine="vllm", max_new_tokens=max(lengths), max_batch_size=batch, group_size=1,
                        server_args=["--max-model-len", "512", "--max-num-seqs", str(batch), "--seed", "0"],
                        staging_dir=str(staging))
    site = EngineSite(model_path=model, dtype="float32", log_dir=log_dir, name=f"bench-{int(update_every_s * 1000)}")
    engine = build_engine(cfg, site, seed=0, tokenizer=build_char_tokenizer())
    try:
        engine.sampling = SamplingParams(max_new_tokens=max(lengths), ignore_eos=True)
        run(engine, prompts[:8], [4] * 8, 0.0, None)  # warm-up
        for key in engine.stats:
            engine.stats[key] = 0
        seconds, updates = run(engine, prompts, lengths, update_every_s, WeightVersion(0, path=published))
        return {"seconds": seconds, "updates": updates, **engine.stats}
    finally:
        engine.close()


def run(engine, prompts, lengths, update_every_s: float, weights) -> tuple[float, int]:
    from hpcrl.rollout.engine import Request
    from hpcrl.weights.version import WeightVersion

    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.submit(Request(i, p, max_new_tokens=n))
    done, updates, last = [], 0, t0
    while len(done) < len(prompts):
        done += engine.poll(0.005)
        if update_every_s and time.perf_counter() - last >= update_every_s:
            updates += 1
            engine.update_weights(WeightVersion(updates, path=weights.path))
            last = time.perf_counter()
    seconds = time.perf_counter() - t0
    by_id = {c.id: c for c in done}
    assert [len(by_id[i].output_ids) for i in range(len(prompts))] == lengths
    return seconds, updates


def publish(model: str, root: Path) -> Path:
    from hpcrl.model.hf_io import load_model
    from hpcrl.weights.config import WeightsConfig
    from hpcrl.weights.transport import DiskWeights

    weights = DiskWeights(root, WeightsConfig())
    weights.publish(load_model(model).state_dict(), 1)
    return weights.version_dir(1)


def embedded(model_dir: str, prompts, lengths, batch: int) -> tuple[float, float]:
    """(torch engine seconds, HF generate seconds) on the same model."""
    import torch

    from bench_engine import bench_engine, bench_hf
    from hpcrl.model.hf_io import load_model

    torch.set_num_threads(1)
    model = load_model(model_dir).eval()
    model.generation_config.eos_token_id = None
    bench_engine(model, prompts[:4], [4] * 4, batch, "cpu")
    t_engine, _ = bench_engine(model, prompts, lengths, batch, "cpu")
    t_hf = bench_hf(model, prompts, lengths, batch, "cpu")
    return t_engine, t_hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--update-every-s", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "vllm.json")
    ap.add_argument("--offline-only", type=Path, help=argparse.SUPPRESS)  # internal: the offline row, in a child
    args = ap.parse_args()

    from bench_engine import workload
    from hpcrl.model.tiny import build_tiny_model

    prompts, lengths = workload(args.requests, args.max_len, seed=0)
    prompts = [[t % 97 + 2 for t in p] for p in prompts]  # ids inside the char vocabulary, clear of pad/eos
    if args.offline_only:
        print("RESULT " + json.dumps({"seconds": offline(str(args.offline_only), prompts, lengths, args.batch)}))
        return
    useful = sum(lengths)
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = str(build_tiny_model(tmp / "model"))
    print(f"{args.requests} requests, lengths mean {useful / len(lengths):.1f} max {max(lengths)}, "
          f"batch {args.batch}, eos ignored", flush=True)
    child = subprocess.run([sys.executable, __file__, "--requests", str(args.requests), "--batch", str(args.batch),
                            "--max-len", str(args.max_len), "--offline-only", model],
                           capture_output=True, text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    if child.returncode:
        sys.exit(f"vLLM offline run failed:\n{child.stderr[-3000:]}")
    result_line = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    rows = {"vllm offline": json.loads(result_line.removeprefix("RESULT "))["seconds"]}
    published = publish(model, tmp / "weights")  # the same weights, as the trainer publishes a version
    plain = seam(model, prompts, lengths, args.batch, 0.0, tmp / "staging", tmp / "logs", published)
    rows["vllm seam"] = plain["seconds"]
    upd = seam(model, prompts, lengths, args.batch, args.update_every_s, tmp / "staging", tmp / "logs", published)
    rows["vllm seam + updates"] = upd["seconds"]
    rows["torch engine"], rows["HF generate"] = embedded(model, prompts, lengths, min(args.batch, 64))
    result = {"requests": args.requests, "batch": args.batch, "useful_tokens": useful,
              "tokens_per_s": {k: useful / v for k, v in rows.items()},
              "seam_over_offline": rows["vllm offline"] / rows["vllm seam"],
              "seam_with_updates_over_offline": rows["vllm offline"] / rows["vllm seam + updates"],
              "updates": upd["updates"], "update_share": upd["update_s"] / upd["seconds"],
              "update_s_mean": upd["update_s"] / max(upd["updates"], 1), "resubmitted": upd["resubmitted"],
              "update_drain_s_mean": upd["update_drain_s"] / max(upd["updates"], 1),
              "update_load_s_mean": upd["update_load_s"] / max(upd["updates"], 1)}
    for name, seconds in rows.items():
        print(f"{name:22s} {useful / seconds:8.0f} tok/s  ({seconds:.2f} s)")
    print(f"seam / offline: {result['seam_over_offline']:.2f} (target >= 0.90); with updates "
          f"{result['seam_with_updates_over_offline']:.2f}; {upd['updates']} updates, "
          f"{result['update_s_mean'] * 1000:.0f} ms each (abort and drain {result['update_drain_s_mean'] * 1000:.0f} "
          f"ms, pause + reload + resume {result['update_load_s_mean'] * 1000:.0f} ms), "
          f"{100 * result['update_share']:.1f}% of wall time (target <= 5%), {upd['resubmitted']} segments resubmitted")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
