"""Where the embedded engine's decode step spends its time on a GPU, beside HF ``generate``.

A probe, not a benchmark of record: it builds a randomly initialised model in memory (``--size 0.6B`` is
Qwen3-0.6B's shape, as in scripts/device_bench.py; ``tiny`` for a rehearsal on the CPU), then times one
128-token prompt's decoding per row below at batch 1 and 64, side by side in one process:

- ``hf``: HF ``generate`` (sampling, no top-k/top-p), the reference;
- ``engine``: ``TorchEngine.generate`` as it is;
- ``engine_hf_sample``: the engine with HF's sampling (softmax, multinomial without a generator, one host copy);
- ``engine_cache_position``: the engine's model call given ``cache_position`` as older HF ``generate`` gave it.
  Qwen3's forward in transformers 5 has no such parameter (checked on 5.19: it is dropped with the other keyword
  arguments), so this row is the engine as it is, run again in the same pass: a control for the spread between
  identical runs;
- ``engine_no_position_ids``: the engine's model call without ``position_ids`` (valid here: no row is padded).

Each row is the wall time of one ``generate`` over ``--new-tokens`` tokens per sequence, divided by that count: the
prefill is included, and the engine takes one decode step per token where HF takes one fewer (its first token comes
from the prefill). The rows run in the order above in every pass.

Then it prints torch.profiler's top host-time operators for the engine and for HF at batch 1, and cProfile's
top Python functions of the engine. Output: the report on stdout (``--out`` also writes it to a file).

    python scripts/device_decode_probe.py --size 0.6B --out /tmp/probe.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from scripts.device_bench import PAD, PROMPT, SIZES, on_gpu, random_model, sync  # noqa: E402


def build(size: str) -> torch.nn.Module:
    """The probe's model: device_bench's random Qwen3 of ``size``, bf16 on a GPU, float32 on the CPU, in eval mode."""
    return random_model(size).to(torch.bfloat16 if on_gpu() else torch.float32).eval()


def hf_sample(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    tok = torch.multinomial(logp.exp(), 1).squeeze(1)
    both = torch.stack([tok.double(), logp.gather(1, tok[:, None]).squeeze(1).double()]).tolist()
    return [int(t) for t in both[0]], both[1]


def wrap_forward(model, cache_position: bool = False, position_ids: bool = True):
    """The model's forward with its decode calls changed as the row says; returns the undo."""
    orig = model.forward

    def forward(*args, **kw):
        if kw.get("input_ids") is not None and kw["input_ids"].shape[1] == 1:  # a decode step
            if cache_position:
                n = kw["past_key_values"].get_seq_length()
                kw["cache_position"] = torch.arange(n, n + 1, device=kw["input_ids"].device)
            if not position_ids:
                kw.pop("position_ids", None)
        return orig(*args, **kw)

    model.forward = forward  # an instance attribute: nn.Module.__call__ finds it before the class's
    return lambda: model.__dict__.pop("forward", None)


def prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, PROMPT), generator=g).tolist()


def time_engine(model, batch: int, new: int, variant: str) -> float:
    from hpcrl.rollout.engine import Request, SamplingParams
    from hpcrl.rollout.torch_engine import TorchEngine

    engine = TorchEngine(model, eos_token_id=-1, pad_token_id=PAD, max_batch_size=batch,
                         sampling=SamplingParams(max_new_tokens=new))
    if variant == "engine_hf_sample":
        engine._sample = hf_sample.__get__(engine)
    undo = wrap_forward(model, cache_position=variant == "engine_cache_position",
                        position_ids=variant != "engine_no_position_ids")
    try:
        vocab = model.config.vocab_size
        engine.generate([Request(i, p, max_new_tokens=4) for i, p in enumerate(prompts(batch, vocab, 1))])
        reqs = [Request(i, p) for i, p in enumerate(prompts(batch, vocab, 2))]
        sync()
        t0 = time.perf_counter()
        engine.generate(reqs)
        sync()
        return (time.perf_counter() - t0) / new
    finally:
        undo()


def time_hf(model, batch: int, new: int) -> float:
    ids = torch.tensor(prompts(batch, model.config.vocab_size, 2), device=next(model.parameters()).device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0, pad_token_id=PAD)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        sync()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        sync()
    return (time.perf_counter() - t0) / new


def profile(fn, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu() else [])
    with tprofile(activities=acts) as prof:
        fn()
        sync()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.6B" if on_gpu() else "tiny", choices=sorted(SIZES))
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    model = build(args.size)
    dev = torch.cuda.get_device_name() if on_gpu() else "cpu"
    say(f"# decode probe: {args.size}, {next(model.parameters()).dtype}, {dev}, torch {torch.__version__}, "
        f"attention {model.config._attn_implementation}, {PROMPT}-token prompts, {args.new_tokens} new tokens")
    variants = ["hf", "engine", "engine_hf_sample", "engine_cache_position", "engine_no_position_ids"]
    for batch in (1, 64):
        for rep in range(2):  # each row twice, alternating, so that drift shows
            for v in variants:
                s = time_hf(model, batch, args.new_tokens) if v == "hf" else \
                    time_engine(model, batch, args.new_tokens, v)
                say(f"batch {batch:3d}  {v:24s} {s * 1e3:8.2f} ms/token-step  (pass {rep + 1})")
    n = 8
    say(f"\n## torch.profiler, engine, batch 1, {n} tokens (top host-time operators)")
    say(profile(lambda: time_engine(model, 1, n, "engine"), 25))
    say(f"\n## torch.profiler, HF generate, batch 1, {n} tokens")
    say(profile(lambda: time_hf(model, 1, n), 25))
    say(f"\n## cProfile, engine, batch 1, {args.new_tokens} tokens (tottime)")
    prof = cProfile.Profile()
    prof.runcall(time_engine, model, 1, args.new_tokens, "engine")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    say(buf.getvalue())
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
