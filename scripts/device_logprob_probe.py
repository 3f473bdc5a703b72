"""What the trainer's log-probabilities over the vocabulary cost on a GPU, and what computing them in chunks saves.

A probe, not a benchmark of record. The FSDP2 engine (``hpcrl/trainer/fsdp.py``) takes the model's logits of a
micro-batch, copies them to float32 and computes ``token_logprobs`` and ``token_entropy`` over the whole
vocabulary. This times, for one micro-batch of ``--tokens`` tokens (default 8,192, the device check's) over a
vocabulary of ``--vocab`` (151,936, Qwen3's) from hidden states of ``--hidden`` (1,024), forward and backward:

- ``lm_head``: the output layer's matrix product alone (bf16), for scale;
- ``current``: the output layer, then the engine's path (float32 copy, log-probabilities, detached entropy);
- ``chunked``: the same results computed ``--chunk`` tokens at a time, each chunk's logits recomputed in the
  backward (``torch.utils.checkpoint``), so no float32 copy of the whole logits is kept.

It checks that ``chunked`` gives ``current``'s log-probabilities, entropies and gradients (of the hidden states and,
summed over the chunks, of the output layer), and prints the time and the peak memory of each above the inputs
(median of ``--repeats`` after a warm-up).

    python scripts/device_logprob_probe.py --out /tmp/logprob.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from hpcrl.algo import token_entropy  # noqa: E402
from hpcrl.algo.losses import token_logprobs  # noqa: E402


def current(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's path (``FSDPEngine._forward``): the whole micro-batch's logits, copied to float32."""
    logits = (hidden @ weight.t()).float()
    return token_logprobs(logits, targets), token_entropy(logits.detach())


def chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
            chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [checkpoint(current, hidden[:, s:s + chunk], weight, targets[:, s:s + chunk], use_reentrant=False)
             for s in range(0, hidden.shape[1], chunk)]
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


def lm_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, None]:
    return (hidden @ weight.t()).sum(-1), None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(fn, hidden, weight, targets, device) -> tuple[torch.Tensor, torch.Tensor | None, tuple, float]:
    """One forward and backward of ``fn``: (log-probabilities, entropies, (gradient of the hidden states, of the
    output layer), seconds)."""
    h = hidden.detach().requires_grad_(True)
    weight.grad = None  # the output layer's gradient is computed too, as in the step
    sync(device)
    t0 = time.perf_counter()
    logp, ent = fn(h, weight, targets)
    logp.float().sum().backward()
    sync(device)
    return logp.detach(), ent, (h.grad, weight.grad), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = torch.cuda.is_available()
    ap.add_argument("--tokens", type=int, default=8192 if gpu else 512)
    ap.add_argument("--vocab", type=int, default=151_936 if gpu else 4096)
    ap.add_argument("--hidden", type=int, default=1024 if gpu else 128)
    ap.add_argument("--chunk", type=int, default=1024 if gpu else 128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype, generator=g)
    weight = (torch.randn(args.vocab, args.hidden, device=device, dtype=dtype, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (1, args.tokens), device=device, generator=g)
    ways = {"lm_head": lm_head, "current": current,
            "chunked": lambda h, w, t: chunked(h, w, t, args.chunk)}
    result: dict = {"device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
                    "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "chunk": args.chunk,
                    "dtype": str(dtype), "ways": {}}
    outputs = {}
    for name, fn in ways.items():
        run(fn, hidden, weight, targets, device)  # warm-up
        times = []
        weight.grad = None  # the warm-up's: not counted as this way's memory
        if gpu:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        for _ in range(args.repeats):
            logp, ent, grad, s = run(fn, hidden, weight, targets, device)
            times.append(s)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if gpu else None
        outputs[name] = (logp, ent, grad)
        result["ways"][name] = {"median_s": statistics.median(times), "times_s": times, "peak_extra_gib": peak}
        print(f"{name:8s} {1e3 * statistics.median(times):8.2f} ms  forward + backward"
              + (f"  peak {peak:.2f} GiB above the inputs" if peak is not None else ""), flush=True)
    (a, ea, ga), (b, eb, gb) = outputs["current"], outputs["chunked"]
    same = {"logprobs_max_abs_diff": float((a - b).abs().max()), "entropy_max_abs_diff": float((ea - eb).abs().max()),
            "grad_max_abs_diff": float((ga[0].float() - gb[0].float()).abs().max()),
            "grad_max_abs": float(ga[0].float().abs().max()),
            "weight_grad_max_abs_diff": float((ga[1].float() - gb[1].float()).abs().max()),
            "weight_grad_max_abs": float(ga[1].float().abs().max())}
    result["chunked_vs_current"] = same
    print("chunked vs current: " + ", ".join(f"{k} {v:.3g}" for k, v in same.items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
