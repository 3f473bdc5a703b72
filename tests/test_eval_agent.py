"""Held-out evaluation that runs the agent (``eval.agent``): the agent function's episodes over greedy completions.

A one-call agent must see exactly the responses of the plain greedy evaluation (same model, same prompts,
greedy), however the calls were batched; agents that fail score 0 as in training; what ``after_batch``
raises ends the evaluation.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from hpcrl.data.rows import Row  # noqa: E402
from hpcrl.eval.accuracy import greedy_accuracy  # noqa: E402
from hpcrl.eval.agent import agent_accuracy  # noqa: E402
from hpcrl.model.hf_io import load_model, load_tokenizer  # noqa: E402
from hpcrl.model.tiny import TinyModelConfig, build_tiny_model  # noqa: E402

ROWS = [Row(prompt=f"{i}+{2 * i}=", answer=str(3 * i), index=i) for i in range(24)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("eval-agent") / "model",
                            TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                                            intermediate_size=64))
    model = load_model(path)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an untrained tiny model says one thing to every prompt: make it say different things
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model, load_tokenizer(path)


def score(response: str) -> float:
    return float(sum(map(ord, response)) % 3 == 0)  # any function of the text: the responses are what is compared


def test_a_one_call_agent_gets_the_greedy_evaluations_responses(tiny) -> None:
    model, tokenizer = tiny
    model.train()
    greedy: dict[int, str] = {}

    def record(prompt: str, response: str, row: Row) -> float:
        greedy[row.index] = response
        return score(response)

    expected = greedy_accuracy(model, tokenizer, ROWS, record, max_new_tokens=6, batch_size=5)
    seen: dict[int, str] = {}

    async def one_call(data: dict, *, base_url: str, api_key: str) -> float:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            text = (await client.completions.create(model="p", prompt=data["prompt"], max_tokens=6)).choices[0].text
        finally:
            await client.close()
        seen[data["index"]] = text
        return score(text)

    batches = []
    got = agent_accuracy(model, tokenizer, ROWS, one_call, max_new_tokens=6, timeout_s=60, concurrency=8,
                         batch_size=5, after_batch=batches.append)
    assert seen == greedy and len(set(greedy.values())) > 1  # token for token, and not one constant answer
    assert got.accuracy == expected.accuracy and got.n == len(ROWS)
    assert batches == sorted(batches) and len(batches) >= len(ROWS) // 5  # progress after every batch
    assert model.training  # its mode is restored


def test_agents_that_fail_score_zero_and_after_batch_can_stop_it(tiny) -> None:
    model, tokenizer = tiny

    async def unruly(data: dict, *, base_url: str, api_key: str):
        i = data["index"]
        if i % 4 == 1:
            raise RuntimeError("tool crashed")
        if i % 4 == 2:
            await asyncio.sleep(3600)  # past the timeout
        if i % 4 == 3:
            return 1.0  # never asked the model: no_call
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": data["prompt"]}],
                                                 max_tokens=3)
        finally:
            await client.close()
        return 1.0

    got = agent_accuracy(model, tokenizer, ROWS[:8], unruly, max_new_tokens=3, timeout_s=5, concurrency=8)
    assert got.accuracy == 0.25 and [e[3] for e in got.examples] == [1.0, 0.0, 0.0, 0.0] * 2
    assert got.metrics == {"eval/calls_per_episode": 0.25, "eval/episodes_failed": 0.75, "eval/requests_refused": 0}

    def stop(done: int) -> None:
        raise KeyboardInterrupt("stop requested")

    with pytest.raises(KeyboardInterrupt, match="stop requested"):
        agent_accuracy(model, tokenizer, ROWS[:8], unruly, max_new_tokens=3, timeout_s=5, after_batch=stop)
