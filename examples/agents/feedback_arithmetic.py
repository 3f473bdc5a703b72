"""Multi-turn arithmetic with feedback: an ordinary agent program, written against the official OpenAI client.

The model answers an addition; if the answer is wrong the "environment" says so and the model tries again, up
to ``TURNS`` answers. The reward is ``DISCOUNT ** k`` for a right answer at attempt ``k`` (1 first time, 0.5
second time), 0 if every attempt is wrong. Nothing here knows about hpcrl: point ``base_url``/``api_key`` at
any OpenAI-compatible endpoint and it runs the same. hpcrl trains on it through ``agent.fn``::

    python -m hpcrl.submit --config configs/agent_feedback.yaml
"""

from __future__ import annotations

import asyncio
import weakref

import httpx
from openai import AsyncOpenAI

TURNS = 2
DISCOUNT = 0.5
FEEDBACK = "wrong, try again"


# One connection pool per event loop, shared by the episodes: a client of its own per episode would build a
# TLS context each time (~25 ms of CPU), which costs more than the episode's calls.
_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pool() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    if loop not in _POOLS:
        _POOLS[loop] = httpx.AsyncClient(timeout=600)
    return _POOLS[loop]


async def run_agent_return_reward(data: dict, *, base_url: str, api_key: str) -> float:
    """One episode for the dataset row ``data`` (``prompt``, ``answer``); returns its reward."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=_pool())
    messages = [{"role": "user", "content": data["prompt"]}]
    for attempt in range(TURNS):
        reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message
        if (reply.content or "").strip() == str(data["answer"]).strip():
            return DISCOUNT ** attempt
        messages += [{"role": "assistant", "content": reply.content or ""}, {"role": "user", "content": FEEDBACK}]
    return 0.0
