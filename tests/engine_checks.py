"""Checks shared by the server-engine tests (vLLM for real, SGLang against its stand-in).

Two tiny Qwen3 policies A (the server's initial weights) and B (published as
version 1) with sharpened logits, so greedy decoding has no near-ties.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hpcrl.model.hf_io import load_model, save_model
from hpcrl.model.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from hpcrl.rollout.engine import Completion, Request
from hpcrl.weights.transport import DiskWeights
from hpcrl.weights.config import WeightsConfig

EOS = 1


def _sharpen(model) -> None:
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)  # logits x4: peaked distributions, no greedy near-ties


def make_policies(root: Path) -> tuple[Path, torch.nn.Module, torch.nn.Module, DiskWeights]:
    """(HF folder of A, model A, model B, disk weights with B published as version 1)."""
    raw = build_tiny_model(root / "raw", TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32,
                                                          intermediate_size=128, max_position_embeddings=256))
    a = load_model(raw)
    _sharpen(a)
    path_a = save_model(a, build_char_tokenizer(), root / "policy_a")
    b = load_model(path_a)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.abs().mean())
    weights = DiskWeights(root / "weights", WeightsConfig())
    weights.publish(b.state_dict(), 1)
    return path_a, a.eval(), b.eval(), weights


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 60, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def full_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def collect(engine, requests: list[Request]) -> list[Completion]:
    for r in requests:
        engine.submit(r)
    done: list[Completion] = []
    while len(done) < len(requests):
        done += engine.poll(0.01)
    return sorted(done, key=lambda c: c.id)


def run_with_update(engine, requests: list[Request], weights: DiskWeights) -> list[Completion]:
    """Submit all, update to version 1 mid-way, collect everything.

    Mid-way: when the first request finishes or a quarter of the time a
    warm-up run of the same requests took, whichever comes first.
    """
    t0 = time.time()
    collect(engine, [Request(("warm-up", r.id), r.prompt_ids, r.max_new_tokens) for r in requests])
    after_s = (time.time() - t0) / 4
    for r in requests:
        engine.submit(r)
    done: list[Completion] = []
    t0, updated = time.time(), False
    while len(done) < len(requests):
        done += engine.poll(0.01)
        if not updated and (done or time.time() - t0 > after_s):
            engine.update_weights(weights.locate(1))
            updated = True
        assert time.time() - t0 < 120, "engine did not finish"
    assert updated and engine.version == 1
    return sorted(done, key=lambda c: c.id)


def check_versions_exact(done: list[Completion], a, b, tol: float = 2e-3) -> dict[str, int]:
    """Every token's logprob equals its tagged version's own (and not the other's): versions are exact."""
    models = {0: a, 1: b}
    counts = {"v0": 0, "v1": 0, "spanning": 0, "told_apart": 0}
    for c in done:
        assert c.versions == sorted(c.versions), c.versions  # never back to an older version
        ref = {v: full_logprobs(m, c.prompt_ids, c.output_ids) for v, m in models.items()}
        for i, (lp, v) in enumerate(zip(c.logprobs, c.versions)):
            assert abs(lp - ref[v][i]) < tol, (c.id, i, v, lp, ref[v][i], ref[1 - v][i])
            counts[f"v{v}"] += 1
            counts["told_apart"] += abs(ref[0][i] - ref[1][i]) > 10 * tol
        counts["spanning"] += len(set(c.versions)) == 2
    return counts
