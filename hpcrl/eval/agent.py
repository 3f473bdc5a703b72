"""Held-out evaluation of an agent: each row runs the agent function once against greedy decoding.

``agent_accuracy`` is what ``eval.agent: true`` measures in place of one
greedy completion per prompt: the agent function (``agent.fn``) runs one
episode per held-out row against an :class:`~hpcrl.agent.proxy.AgentProxy`
whose completions are greedy, and the accuracy is the mean of the rewards
it returns (an episode that raises, runs past ``agent.timeout_s`` or returns
no number scores 0, as in training). The result's metrics add
``eval/calls_per_episode`` and ``eval/episodes_failed`` (the fraction that
raised, timed out, returned no number or made no call) and ``eval/requests_refused`` (the calls the proxy
refused: malformed, too long, over the quota). An agent that takes several turns or
calls tools is measured doing that, which one completion of its first
prompt cannot show.

The proxy checks every call as in training (:mod:`hpcrl.agent.guard`,
:meth:`~hpcrl.agent.proxy.AgentProxy.admit`, the limits of ``agent``); a
batch whose generation fails fails its calls (500) and the evaluation goes
on. Completions are batched: every episode's call waits in a queue, and one HF
``generate`` (greedy, left-padded, in a worker thread so that the proxy keeps
serving) answers all calls queued when the previous batch ended, up to
``batch_size``.

Lifecycle: one call builds an asyncio loop in the caller's thread, serves the
proxy on a free loopback port (uvicorn), runs the episodes (at most
``concurrency`` at once), then stops the server and the loop. The model is
put in eval mode and its training mode restored afterwards; ``after_batch``
(a heartbeat, a stop check) is called after every batch with the number of
episodes finished so far, and whatever it raises ends the evaluation.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from hpcrl.agent.config import AgentConfig
from hpcrl.agent.proxy import AgentProxy, ProxyError, listen
from hpcrl.agent.routes import build_app
from hpcrl.data.rows import Row
from hpcrl.eval.accuracy import N_EXAMPLES, EvalResult, left_pad
from hpcrl.model.limits import ModelLimits
from hpcrl.reward.runner import to_reward
from hpcrl.rollout.engine import Completion

__all__ = ["agent_accuracy"]

log = logging.getLogger(__name__)


class _GreedyBatches:
    """``generate`` for the proxy: queued calls answered in batches by one greedy HF ``generate``."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int,
                 after_batch: Callable[[], None]) -> None:
        self.model, self.tokenizer, self.batch_size, self.after_batch = model, tokenizer, batch_size, after_batch
        self.context = ModelLimits.of_config(model.config).context
        self.queue: list[tuple[list[int], int, asyncio.Future]] = []
        self.wake = asyncio.Event()
        self.calls = self.batches = 0

    async def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Completion:
        future = asyncio.get_running_loop().create_future()
        self.queue.append((list(prompt_ids), max_new_tokens, future))
        self.wake.set()
        return await future

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            await asyncio.sleep(0.005)  # calls sent together arrive over a few loop turns
            while self.queue:
                batch, self.queue = self._next_batch()
                try:
                    outs = await asyncio.to_thread(self._generate, [(p, n) for p, n, _ in batch])
                except Exception as e:  # noqa: BLE001 - the batch's calls fail (500), the evaluation goes on
                    log.exception("agent evaluation: a batch of %d calls failed", len(batch))
                    outs = [ProxyError(500, f"generation failed ({type(e).__name__})", "internal_error",
                                       kind="server_error") for _ in batch]
                for (_, _, future), out in zip(batch, outs):
                    if future.done():  # its episode may have timed out meanwhile
                        continue
                    if isinstance(out, Exception):
                        future.set_exception(out)
                    else:
                        future.set_result(out)
                self.calls += len(batch)
                self.batches += 1
                self.after_batch()

    def _next_batch(self) -> tuple[list, list]:
        """The next batch, in queue order, of calls that fit the context together (the longest prompt plus the
        most tokens any of them asks for: left padding costs no position, a batch generates that many); the
        calls that do not fit wait for a later batch."""
        batch, rest, longest, most = [], [], 0, 0
        for item in self.queue:
            prompt, n, _ = item
            fits = self.context is None or max(longest, len(prompt)) + max(most, n) <= self.context
            if len(batch) < self.batch_size and (fits or not batch):
                batch.append(item)
                longest, most = max(longest, len(prompt)), max(most, n)
            else:
                rest.append(item)
        return batch, rest

    def _generate(self, batch: list[tuple[list[int], int]]) -> list[Completion]:
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        width = max(n for _, n in batch)
        ids, mask = left_pad([p for p, _ in batch], pad)
        device = next(self.model.parameters()).device
        gen = GenerationConfig(do_sample=False, max_new_tokens=width, pad_token_id=pad, eos_token_id=eos)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      generation_config=gen)[:, ids.shape[1]:].tolist()
        completions = []
        for (prompt, n), tokens in zip(batch, out):
            tokens = tokens[:n]
            stop = tokens.index(eos) + 1 if eos in tokens else None  # after eos there is only padding
            tokens = tokens[:stop] if stop else tokens
            completions.append(Completion(id=None, prompt_ids=prompt, output_ids=tokens, logprobs=[0.0] * len(tokens),
                                          versions=[0] * len(tokens), finish_reason="stop" if stop else "length"))
        return completions


def agent_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[Row],
    fn: Callable,
    *,
    max_new_tokens: int,
    timeout_s: float,
    concurrency: int = 64,
    batch_size: int = 256,
    after_batch: Callable[[int], None] | None = None,
    cfg: AgentConfig | None = None,
) -> EvalResult:
    """Mean reward of ``fn``'s episodes on ``rows`` with greedy completions (see the module's docstring)."""
    if not rows:
        raise ValueError("rows: need at least one row to evaluate")
    was_training = model.training
    model.eval()
    try:
        return asyncio.run(_evaluate(model, tokenizer, rows, fn, max_new_tokens, timeout_s, concurrency, batch_size,
                                     after_batch, cfg))
    finally:
        model.train(was_training)


async def _evaluate(model, tokenizer, rows: list[Row], fn: Callable, max_new_tokens: int, timeout_s: float,
                    concurrency: int, batch_size: int, after_batch: Callable[[int], None] | None,
                    cfg: AgentConfig | None) -> EvalResult:
    finished = 0
    batches = _GreedyBatches(model, tokenizer, batch_size, lambda: after_batch and after_batch(finished))
    proxy = AgentProxy(tokenizer, batches.generate, limits=ModelLimits.of_config(model.config), cfg=cfg,
                       max_tokens=max_new_tokens)
    server, serving, port = await listen(build_app(proxy), "127.0.0.1", 0)
    base_url = f"http://127.0.0.1:{port}/v1"
    limit = asyncio.Semaphore(concurrency)
    scores: list[float] = [0.0] * len(rows)
    replies: list[str] = [""] * len(rows)
    calls_made: list[int] = [0] * len(rows)
    statuses: dict[str, int] = {}

    async def episode(i: int, row: Row) -> None:
        nonlocal finished
        async with limit:
            key = proxy.open(("eval", i))
            try:
                value = await asyncio.wait_for(fn(row.data(), base_url=base_url, api_key=key), timeout_s)
                scores[i], status, _ = to_reward(value)
            except asyncio.TimeoutError:
                status = "timeout"
            except Exception as e:  # noqa: BLE001 - the user's code: scores 0, as in training
                status = "error"
                log.debug("eval episode %d raised %s: %s", i, type(e).__name__, e)
            finally:
                calls = proxy.close(key).calls
            if status != "ok":
                scores[i] = 0.0
            elif not calls:
                scores[i], status = 0.0, "no_call"
            replies[i] = proxy.decode(calls[-1].output_ids, True) if calls else ""
            calls_made[i] = len(calls)
            statuses[status] = statuses.get(status, 0) + 1
            finished += 1

    generating = asyncio.ensure_future(batches.run())
    episodes = asyncio.gather(*(episode(i, row) for i, row in enumerate(rows)))
    try:
        done, _ = await asyncio.wait([generating, episodes], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # what after_batch or generate raised
    finally:
        episodes.cancel()  # and with it every episode still running
        episodes.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning of it
        generating.cancel()
        server.should_exit = True
        await serving
        proxy.shutdown()
    if statuses.get("ok", 0) < len(rows):
        log.warning("agent evaluation: episodes by status %s", statuses)
    log.debug("agent evaluation: %d calls in %d batches", batches.calls, batches.batches)
    examples = [(r.prompt, replies[i], r.answer, scores[i]) for i, r in enumerate(rows[:N_EXAMPLES])]
    failed = len(rows) - statuses.get("ok", 0)
    return EvalResult(accuracy=sum(scores) / len(rows), n=len(rows), examples=examples,
                      metrics={"eval/calls_per_episode": sum(calls_made) / len(rows),
                               "eval/episodes_failed": failed / len(rows),
                               "eval/requests_refused": sum(proxy.counts.values())})
