"""Agent episodes: one sample = one run of the user's agent function against the rollout's proxy.

:class:`AgentEpisodes` is an :class:`~hpcrl.rollout.episodes.EpisodeRunner`.
It owns a background thread with an asyncio loop that serves the
:class:`~hpcrl.agent.proxy.AgentProxy` (uvicorn, on `agent.host`: loopback unless an admin key allows more) and runs the
episodes: ``await fn(data, base_url=..., api_key=...)`` with the dataset row
as ``data`` and a session key of the episode's own (never process-wide
environment variables, which would race between concurrent episodes).

Lifecycle:

1. Built by the rollout job (``agent.fn`` set); the proxy is listening when
   the constructor returns.
2. ``start(key, ...)`` schedules an episode on the loop. Its engine calls
   become requests queued for the rollout loop's thread, which submits them
   in ``finished()``; their completions come back through ``collect()``.
3. When the function returns (its number is the reward; ``None`` takes the
   reward set through the proxy's admin API; anything else, NaN and inf
   included, is "invalid" and 0), raises, runs past ``agent.timeout_s``
   (reward 0 then), or the admin API ends the session (the function is
   cancelled; the reward set through the API, else "invalid" and 0), the
   session is closed and its calls
   exported as ``agent.export`` says (:mod:`hpcrl.agent.export`: one
   sequence, or with ``individual`` one part per call, each with its prompt
   and its share of the reward); ``finished()`` hands the episode to the
   loop with its own prompt. An episode that made no call is an empty
   sample with reward 0. Outcomes are counted in ``stats``.
4. A restarted key (stale, or tokens of rolled-back weights) starts a new
   run of the function; a result of the earlier run is dropped.
5. ``close()`` cancels running episodes and stops the proxy and the loop.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import queue
import socket
import threading
from collections import Counter
from typing import Any, Awaitable, Callable

from hpcrl.agent.config import AgentConfig
from hpcrl.agent.export import Exported, concat, individual
from hpcrl.agent.proxy import AgentProxy, Call, ProxyError, listen, read_admin_key
from hpcrl.agent.routes import build_app
from hpcrl.data.rows import Row
from hpcrl.model.limits import ModelLimits
from hpcrl.reward.runner import RewardResult, load_function, to_reward
from hpcrl.rollout.engine import Completion, InferenceEngine, Request
from hpcrl.rollout.episodes import Episode, EpisodeKey

__all__ = ["AgentEpisodes", "AgentFn", "build_agent_episodes", "load_agent_fn"]

log = logging.getLogger(__name__)

AgentFn = Callable[..., Awaitable[float]]


def load_agent_fn(path: str) -> AgentFn:
    """``package.module:function`` -> the coroutine function; errors name the key ``agent.fn``."""
    fn = load_function(path, "agent.fn:")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent.fn: {path!r} must be an async function "
                         "(async def f(data, *, base_url, api_key) -> float)")
    return fn


def build_agent_episodes(cfg, engine: InferenceEngine, tokenizer, reward, model_path: str) -> "AgentEpisodes":
    """``rollout.episodes: agent`` (:mod:`hpcrl.rollout.registry`): each sample is an episode of ``agent.fn``
    against this job's proxy; the agent's own reward replaces ``reward``."""
    return AgentEpisodes(engine, tokenizer, cfg.agent, load_agent_fn(cfg.agent.fn),
                         max_tokens=cfg.rollout.max_new_tokens, limits=ModelLimits.of_dir(model_path))


class AgentEpisodes:
    def __init__(self, engine: InferenceEngine, tokenizer, cfg: AgentConfig, fn: AgentFn, *,
                 max_tokens: int, limits: ModelLimits, model_name: str = "hpcrl-policy") -> None:
        self.engine, self.cfg, self.fn = engine, cfg, fn
        # ok / error / timeout / no_call episodes, off-branch calls, the proxy's refusals (rejected_<code>)
        self.stats: Counter = Counter()
        self._ids = itertools.count()
        self._run_ids = itertools.count(1)
        self._runs: dict[EpisodeKey, int] = {}  # key -> its current run's id, until delivered (older runs dropped)
        self._pending: dict[int, asyncio.Future] = {}  # request id -> its caller's future (loop thread only)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()  # made on the loop, submitted on the rollout's
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        # a delivered episode's result until score(): id(episode) -> (key, result), and key -> id(episode) so
        # that an episode the loop starts again instead of scoring leaves nothing behind
        self._results: dict[int, tuple[EpisodeKey, RewardResult]] = {}
        self._delivered: dict[EpisodeKey, int] = {}
        self._tasks: set[asyncio.Task] = set()  # running episodes (loop thread only)
        self._news = threading.Event()  # set when a request is queued or an episode ended
        admin_key = read_admin_key(cfg.admin_key_file) if cfg.admin_key_file else None
        self.proxy = AgentProxy(tokenizer, self._generate, limits=limits, cfg=cfg, model_name=model_name,
                                max_tokens=max_tokens, admin_key=admin_key, counts=self.stats)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="agent-loop", daemon=True)
        self._thread.start()
        self._server, self._serving, port = asyncio.run_coroutine_threadsafe(
            listen(build_app(self.proxy), cfg.host, cfg.port), self.loop).result()
        self.base_url = f"http://{advertised_host(cfg.host)}:{port}/v1"
        self._limit = asyncio.run_coroutine_threadsafe(self._semaphore(), self.loop).result()
        log.info("agent proxy listening on %s (fn %s)", self.base_url, getattr(fn, "__qualname__", fn))

    async def _semaphore(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.cfg.max_concurrent_episodes)

    # -- EpisodeRunner -----------------------------------------------------------------
    def max_unfinished(self, slots: int) -> int:
        return self.cfg.max_concurrent_episodes

    def start(self, key: EpisodeKey, prompt_ids: list[int], row: Row) -> None:
        run = self._runs[key] = next(self._run_ids)
        stale = self._delivered.pop(key, None)  # delivered, then judged too stale and started again
        if stale is not None:
            self._results.pop(stale, None)
        asyncio.run_coroutine_threadsafe(self._episode(key, run, row.data()), self.loop)

    def collect(self, completion: Completion) -> None:
        self.loop.call_soon_threadsafe(self._resolve, completion)

    def finished(self) -> list[tuple[EpisodeKey, Episode]]:
        self._news.clear()
        while not self._requests.empty():
            request = self._requests.get()
            try:
                self.engine.submit(request)
            except ValueError as e:  # the engine refuses it: that call fails alone (the proxy checked it already)
                self.loop.call_soon_threadsafe(self._refuse, request.id[1], e)
        out = []
        while not self._done.empty():
            key, run, episode, result = self._done.get()
            if self._runs.get(key) != run:  # restarted meanwhile: the newer run counts
                continue
            del self._runs[key]
            self._results[id(episode)] = (key, result)
            self._delivered[key] = id(episode)
            out.append((key, episode))
        return out

    def score(self, row: Row, episodes: list[Episode]) -> list[RewardResult]:
        out = []
        for e in episodes:
            key, result = self._results.pop(id(e))
            self._delivered.pop(key, None)
            out.append(result)
        return out

    def wait(self, timeout_s: float) -> None:
        """Block until an episode made a request or ended, or ``timeout_s`` passed."""
        self._news.wait(timeout_s)

    def close(self) -> None:
        async def stop() -> None:
            for future in self._pending.values():  # calls in flight get an answer: the job is stopping
                if not future.done():
                    future.set_exception(ProxyError(503, "the rollout job is stopping", "unavailable",
                                                    kind="server_error"))
            for task in list(self._tasks):
                task.cancel()
            self._server.should_exit = True

        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
            asyncio.run_coroutine_threadsafe(asyncio.wait_for(self._serving, 10), self.loop).result(15)
        except Exception as e:  # noqa: BLE001 - closing: report, never mask the caller's error
            log.warning("agent proxy: stopping it: %s", e)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.proxy.shutdown()

    # -- on the loop -------------------------------------------------------------------
    async def _generate(self, prompt_ids: list[int], max_new_tokens: int) -> Completion:
        rid = next(self._ids)
        future = self.loop.create_future()
        self._pending[rid] = future
        self._requests.put(Request(id=("agent", rid), prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens))
        self._news.set()
        return await future

    def _refuse(self, rid: int, error: ValueError) -> None:
        future = self._pending.pop(rid, None)
        if future is not None and not future.done():
            future.set_exception(ProxyError(400, f"the engine refused the request: {error}",
                                            getattr(error, "code", "invalid_request")))

    def _resolve(self, completion: Completion) -> None:
        future = self._pending.pop(completion.id[1], None)
        if future is not None and not future.done():  # a cancelled episode's call: nobody waits for it
            future.set_result(completion)

    async def _episode(self, key: EpisodeKey, run: int, data: dict[str, Any]) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self._run_episode(key, run, data)
        finally:
            self._tasks.discard(task)

    async def _run_episode(self, key: EpisodeKey, run: int, data: dict[str, Any]) -> None:
        async with self._limit:
            api_key = self.proxy.open(key)
            session = self.proxy.sessions[api_key]
            status, reward = "ok", 0.0
            fn = asyncio.ensure_future(self.fn(data, base_url=self.base_url, api_key=api_key))
            ended = asyncio.ensure_future(session.ended.wait())
            try:
                done, _ = await asyncio.wait({fn, ended}, timeout=self.cfg.timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if fn in done:
                    value = fn.result()  # raises what the function raised
                    value = session.reward if value is None else value
                elif ended in done:
                    value = session.reward
                    self.stats["ended_by_admin"] += 1
                else:
                    raise asyncio.TimeoutError
                reward, status, detail = to_reward(value)  # NaN, inf, strings, None: "invalid", 0
                if status != "ok":
                    log.warning("agent episode %s %s", key, detail)
            except asyncio.TimeoutError:
                status = "timeout"
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # close() cancelled it: the job is stopping
                    raise
                status = "error"  # the user's code raised CancelledError of its own
                log.warning("agent episode %s raised CancelledError", key)
            except Exception as e:  # noqa: BLE001 - the user's code: any failure scores 0 and the run goes on
                status = "error"
                log.warning("agent episode %s raised %s: %s", key, type(e).__name__, e)
            finally:
                for task in (fn, ended):
                    task.cancel()
                    task.add_done_callback(_retrieved)  # what a cancelled function raises on its way out
                if api_key in self.proxy.sessions:  # not ended through the admin API
                    self.proxy.close(api_key)
        exported, conversation = self._export(session.calls)
        if exported is None:
            status = "no_call" if status == "ok" else status
            reward, prompt = 0.0, None
            episode = Episode(response_ids=[], logprobs=[], versions=[], loss_mask=[], text="", finish_reason="stop")
        else:
            episode, prompt = exported.episode, exported.prompt_ids
            episode.text = self.proxy.tokenizer.decode(conversation, skip_special_tokens=True)
            self.stats["off_branch_calls"] += exported.off_branch
            self.stats["turns"] += exported.turns
        episode.prompt_ids = prompt
        self.stats[status] += 1
        self._done.put((key, run, episode, RewardResult(reward=reward if status == "ok" else 0.0, status=status)))
        self._news.set()

    def _export(self, calls: list[Call]) -> tuple[Exported | None, list[int]]:
        """The session as training data (``agent.export``), and the token ids of its text for the spool's meta:
        the conversation after the first prompt as ``concat`` makes it, whichever the export."""
        branch = concat(calls)
        exported = individual(calls, self.cfg.turn_discount) if self.cfg.export == "individual" else branch
        return exported, branch.episode.response_ids if branch is not None else []


def advertised_host(host: str) -> str:
    """The host name agents reach the proxy at: the bound address, or this node's name for a wildcard bind."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("agent function after the episode ended: %r", task.exception())
