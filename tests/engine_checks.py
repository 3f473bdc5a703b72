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
from hpcrl.rollout.engine import Completion, Request, SamplingParams
from hpcrl.weights.transport import DiskWeights
from hpcrl.weights.config import WeightsConfig
from hpcrl.weights.version import WeightVersion

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


def update_mid_generation(engine, requests: list[Request], a, b, weights: DiskWeights, attempts: int = 5,
                          long_tokens: int = 160, in_memory: bool = False) -> tuple[dict[str, int], int, torch.nn.Module]:
    """Submit all, update the weights mid-way, collect everything, and check every token's version is exact.

    Every fourth request is a pacer that may generate two tokens; the others
    may generate ``long_tokens``. The long ones are sent first, the pacers
    after them (a later poll), and the update comes once every pacer has
    finished: by then the long ones had reached the engine before the pacers
    and shared their steps, so they are generating (triggering on the first
    pacer instead, alone on an idle server, interrupted nothing). Where the
    update still missed the generation (on a loaded machine a server's
    answers can lag its engine), no sequence spans two versions: the
    scenario is played again with the next version (B and A alternate), up
    to ``attempts`` times. Exactness is checked on every attempt.

    ``in_memory``: each version is handed over as tensors in this process
    (as collective weights are), not as its published directory.

    Returns (counts of the attempt that interrupted generation, its new
    version, the model holding that version's weights).
    """
    collect(engine, [Request(("warm-up", r.id), r.prompt_ids, r.max_new_tokens) for r in requests])
    models = {engine.version: a}
    tries = []
    for _ in range(attempts):
        old = engine.version
        new = old + 1
        models[new] = b if models[old] is a else a
        if weights.latest_version() < new:
            weights.publish(models[new].state_dict(), new)
        paced = [Request((new, r.id), r.prompt_ids, 2 if i % 4 == 0 else long_tokens) for i, r in enumerate(requests)]
        pacers = [r for r in paced if r.max_new_tokens == 2]
        done: list[Completion] = []
        for batch in ([r for r in paced if r.max_new_tokens != 2], pacers):  # each sent at the poll after it
            for r in batch:
                engine.submit(r)
            done += engine.poll(0)
        t0, updated = time.time(), False
        while True:  # (everything done before the update: it still comes, and the attempt missed)
            if not updated and {r.id for r in pacers} <= {c.id for c in done}:
                engine.update_weights(WeightVersion(new, state=models[new].state_dict()) if in_memory
                                      else weights.locate(new))
                updated = True
            if len(done) == len(paced):
                break
            done += engine.poll(0.01)
            assert time.time() - t0 < 120, "engine did not finish"
        assert updated and engine.version == new
        counts = check_versions_exact(done, models[old], models[new], old, new)
        if counts["old"] > 0 and counts["new"] > 0 and counts["spanning"] > 0:
            return counts, new, models[new]
        tries.append(counts)
    raise AssertionError(f"no update of {attempts} interrupted a generation: {tries}")


def check_versions_exact(done: list[Completion], old_model, new_model, old: int = 0, new: int = 1,
                         tol: float = 2e-3) -> dict[str, int]:
    """Every token's logprob equals its tagged version's own (and not the other's): versions are exact."""
    models = {old: old_model, new: new_model}
    counts = {"old": 0, "new": 0, "spanning": 0, "told_apart": 0}
    for c in done:
        assert c.versions == sorted(c.versions), c.versions  # never back to an older version
        assert set(c.versions) <= {old, new}, c.versions
        ref = {v: full_logprobs(m, c.prompt_ids, c.output_ids) for v, m in models.items()}
        for i, (lp, v) in enumerate(zip(c.logprobs, c.versions)):
            other = new if v == old else old
            assert abs(lp - ref[v][i]) < tol, (c.id, i, v, lp, ref[v][i], ref[other][i])
            counts["old" if v == old else "new"] += 1
            counts["told_apart"] += abs(ref[old][i] - ref[new][i]) > 10 * tol
        counts["spanning"] += len(set(c.versions)) == 2
    return counts


def groups_share_first_requests(engine, a, b, weights: DiskWeights) -> tuple[dict[str, int], list, list[int]]:
    """Prompt groups (four samples of each of four prompts) with an update mid-way (``update_mid_generation``
    checks every token's version), then a greedy group of four. Returns the engine's request counts of the first
    part (``sequences``, ``first_requests``: requests that were not resubmissions), the greedy group's completions
    and HF generate's output for its prompt under the weights the engine holds."""
    sampling, engine.sampling = engine.sampling, SamplingParams(max_new_tokens=24)  # sampled, as a rollout does
    try:
        before = dict(engine.stats)
        group = [Request((p, k), prompt) for p, prompt in enumerate(prompts(4)) for k in range(4)]
        even, odd = a, b  # version v holds A's weights for v even, B's for v odd (update_mid_generation alternates)
        update_mid_generation(engine, group, *((even, odd) if engine.version % 2 == 0 else (odd, even)), weights)
        delta = {k: engine.stats[k] - before[k] for k in ("requests", "segments", "resubmitted")}
        counts = {"sequences": delta["segments"] - delta["resubmitted"],
                  "first_requests": delta["requests"] - delta["resubmitted"]}
        engine.sampling = SamplingParams(max_new_tokens=10, greedy=True)
        prompt = prompts(5)[4]
        got = collect(engine, [Request(k, prompt) for k in range(4)])
        return counts, got, hf_greedy(odd if engine.version % 2 else even, prompt, 10)
    finally:
        engine.sampling = sampling
