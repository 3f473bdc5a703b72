"""An OpenAI-compatible HTTP proxy in front of a rollout's engine that records every call at token level.

An agent program keeps talking to an OpenAI-style endpoint (``base_url``
plus an API key) and does not know it is being trained; the proxy turns its
calls into engine requests and keeps, per session, what the trainer needs:
prompt ids, output ids, behaviour logprobs and the policy version of every
output token (:class:`Call`). :func:`hpcrl.agent.export.concat` turns a
session's calls into one training :class:`~hpcrl.rollout.episodes.Episode`.

Endpoints (FastAPI routers in :mod:`hpcrl.agent.routes`; what differs from
OpenAI is listed in docs/agents.md):

- ``GET /v1/models``;
- ``POST /v1/completions``: ``prompt`` as text or token ids, ``max_tokens``,
  ``n``, ``stop``, ``logprobs``, ``stream``;
- ``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's
  chat template (a plain ``role: content`` template when it has none),
  ``tools`` / ``tool_choice`` with Qwen-style ``<tool_call>{json}</tool_call>``
  output parsed into ``tool_calls``, tool results as ``role: tool``
  messages, ``max_tokens`` / ``max_completion_tokens``, ``n``, ``stop``,
  ``logprobs``, ``stream`` (the reply is sent as server-sent events once it
  is complete).

Sampling is the run's: a request's ``temperature`` / ``top_p`` are accepted
and not applied, since the trainer's logprobs assume the rollout's sampling.

A continuation is exact at token level: when a chat request's messages
start with an earlier call's messages and the assistant reply the proxy gave
for it, the new prompt is that call's prompt and output token ids followed
by the rendering of what was added, never a re-tokenisation of the reply.

Admin endpoints, for agents and graders outside the rollout job; off
(404) unless the proxy has an admin key, and answered only with it (Bearer;
401 otherwise):

- ``GET /admin/sessions``: the open sessions (key, episode, calls, reward,
  age);
- ``POST /admin/sessions`` ``{"parent": key}``: another key for the same
  episode (a sub-agent's); its calls join the episode's, and it closes with it;
- ``POST /admin/sessions/{key}/reward`` ``{"reward": r}``: the episode's
  reward when the agent function returns ``None`` or the session is ended;
- ``POST /admin/sessions/{key}/end``: the episode is over: its keys die, and
  the rollout job stops waiting for the function (it is cancelled).

Lifecycle: build one :class:`AgentProxy` per rollout job with a ``generate``
coroutine (prompt ids, max new tokens -> a finished
:class:`~hpcrl.rollout.engine.Completion`) and the model's
:class:`~hpcrl.model.limits.ModelLimits`, and serve
:func:`hpcrl.agent.routes.build_app` of it (:func:`listen`);
:meth:`AgentProxy.open` gives each episode its own API key (a session),
:meth:`AgentProxy.close` ends it and returns its calls.

Order of checks, each answered in OpenAI's error shape and counted by its
code (``counts``): the key, before the body is read (401; 404 for the admin
API when it is off), the body's size (413, ``agent.max_request_bytes``), the
episode's quota (429, :mod:`hpcrl.agent.guard`), the body's shape (400
naming the field, :mod:`hpcrl.agent.schema`), then the prompt against the
model (400 ``invalid_token_id`` or ``context_length_exceeded``,
:meth:`AgentProxy.admit`) before anything reaches the engine. A failure past
that point fails its own request with a 500 and nothing else: no response
carries a traceback, the connection stays usable, and the engine's loop and
every other session go on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Hashable

from hpcrl.agent.config import AgentConfig
from hpcrl.agent.schema import ProxyError, parse_tool_calls
from hpcrl.model.limits import ModelLimits, Rejected
from hpcrl.model.templates import PLAIN_CHAT_TEMPLATE
from hpcrl.rollout.engine import Completion

__all__ = ["AgentProxy", "Call", "ProxyError", "Quota", "Session", "PLAIN_CHAT_TEMPLATE", "listen", "parse_tool_calls",
           "prompt_budget", "read_admin_key"]

log = logging.getLogger(__name__)

Generate = Callable[[list[int], int], Awaitable[Completion]]



@dataclass
class Call:
    """One completion the proxy served: what the trainer needs of it, and what the agent was sent."""

    prompt_ids: list[int]
    output_ids: list[int]  # as generated (the eos token included when it stopped on eos), cut after a stop string
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    messages: list[dict] | None = None  # chat calls: the request's messages, normalised
    reply: dict | None = None  # chat calls: the assistant message returned, normalised


@dataclass
class Quota:
    """One episode's budget: ``max_in_flight`` completions at once (a request of ``n`` counts ``n``), ``rate``
    requests per second (a bucket holding one second's worth); 0: no cap."""

    rate: float = 0.0
    max_in_flight: int = 0
    in_flight: int = 0
    tokens: float = field(default=0.0)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = max(self.rate, 1.0)

    def admit(self) -> None:
        """Take one request (one completion, one second's token), or raise the 429 that refuses it."""
        self.take(1)
        if self.rate:
            now = time.monotonic()
            self.tokens = min(max(self.rate, 1.0), self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens < 1.0:
                self.release(1)
                wait = math.ceil((1.0 - self.tokens) / self.rate)
                raise ProxyError(429, f"this episode's requests exceed agent.session_rate_limit={self.rate:g}/s",
                                 "rate_limit_exceeded", kind="rate_limit_error", headers={"retry-after": str(wait)})
            self.tokens -= 1.0

    def take(self, k: int) -> None:
        """``k`` more completions in flight, or the 429 that refuses them."""
        if self.max_in_flight and self.in_flight + k > self.max_in_flight:
            raise ProxyError(429, f"this episode would have {self.in_flight + k} completions in flight "
                             f"(agent.session_max_in_flight={self.max_in_flight}; a request of n counts n)",
                             "too_many_requests_in_flight", kind="rate_limit_error", headers={"retry-after": "1"})
        self.in_flight += k

    def release(self, k: int = 1) -> None:
        self.in_flight -= k


@dataclass
class Session:
    """The calls of one episode, in the order they finished, whichever of its keys made them."""

    key: str
    episode: Hashable
    calls: list[Call] = field(default_factory=list)
    opened: float = field(default_factory=time.time)
    keys: list[str] = field(default_factory=list)  # the episode's keys: its own, then those added by the admin
    reward: float | None = None  # set through the admin API
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set when the admin API ends the episode
    quota: Quota = field(default_factory=Quota)  # its requests in flight and per second, all its keys together


MIN_ADMIN_KEY = 16
WORKERS = 4  # threads for the proxy's per-request work (parse, render, tokenise, decode)


def prompt_budget(limits: ModelLimits, max_prompt_tokens: int, max_tokens: int) -> int | None:
    """The longest prompt the proxy takes: ``agent.max_prompt_tokens``, by default (0) the model's context minus
    ``max_tokens`` (``rollout.max_new_tokens``); None when the model states no context and none is set."""
    if limits.context is None:
        return max_prompt_tokens or None
    budget = max_prompt_tokens or limits.context - max_tokens
    if not 1 <= budget < limits.context:
        why = "" if max_prompt_tokens else f" (the context minus rollout.max_new_tokens={max_tokens})"
        raise ValueError(f"agent.max_prompt_tokens: must leave room in the model's context of {limits.context} "
                         f"tokens for a reply: got {budget}{why}")
    return budget


def read_admin_key(path: str) -> str:
    """The admin key kept in ``path`` (``agent.admin_key_file``): one line, at least 16 characters, in a file
    that only its owner can read (it opens every episode's conversation and sets rewards)."""
    try:
        mode = os.stat(path).st_mode
        key = open(path).read().strip()
    except OSError as e:
        raise ValueError(f"agent.admin_key_file: cannot read {path!r}: {e.strerror}") from None
    if mode & 0o077:
        raise ValueError(f"agent.admin_key_file: {path!r} is readable by others (mode {mode & 0o777:o}); "
                         f"chmod 600 it")
    if len(key) < MIN_ADMIN_KEY or any(c.isspace() for c in key):
        raise ValueError(f"agent.admin_key_file: {path!r} must hold one key of at least {MIN_ADMIN_KEY} "
                         "characters without spaces "
                         "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return key


class AgentProxy:
    """The proxy's state: sessions, the tokenizer, the engine's ``generate``, the limits. Its HTTP app is
    :func:`hpcrl.agent.routes.build_app` of it."""

    def __init__(self, tokenizer, generate: Generate, *, limits: ModelLimits, cfg: AgentConfig | None = None,
                 model_name: str = "hpcrl-policy", max_tokens: int = 256, admin_key: str | None = None,
                 counts: Counter | None = None) -> None:
        self.tokenizer, self.generate = tokenizer, generate
        self.model_name, self.max_tokens = model_name, max_tokens
        self.cfg = cfg if cfg is not None else AgentConfig()
        self.limits, self.max_prompt_tokens = limits, prompt_budget(limits, self.cfg.max_prompt_tokens, max_tokens)
        self.admin_key = admin_key  # None: no admin API (404)
        self.sessions: dict[str, Session] = {}
        self.counts = counts if counts is not None else Counter()  # refusals by code: rejected_<code>
        self.template = getattr(tokenizer, "chat_template", None) or PLAIN_CHAT_TEMPLATE
        self.pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="agent-proxy")

    # -- sessions ------------------------------------------------------------------
    def open(self, episode: Hashable) -> str:
        """A new session for ``episode``; its API key."""
        key = _new_key()
        quota = Quota(rate=self.cfg.session_rate_limit, max_in_flight=self.cfg.session_max_in_flight)
        self.sessions[key] = Session(key, episode, keys=[key], quota=quota)
        return key

    def add_key(self, key: str) -> str:
        """Another API key for the episode of the open session ``key`` (a sub-agent's)."""
        session = self.sessions[key]
        other = _new_key()
        session.keys.append(other)
        self.sessions[other] = session
        return other

    def close(self, key: str) -> Session:
        """End a session (later calls with any of its keys get 401); its calls."""
        session = self.sessions[key]
        for k in session.keys:
            self.sessions.pop(k, None)
        return session

    def session_of(self, key: str) -> Session:
        """The open session of API key ``key``; raises the 401 that refuses it."""
        session = self.sessions.get(key) if key else None
        if session is None:
            raise ProxyError(401, "no open episode has this API key" if key else "missing API key (Bearer)",
                             "invalid_api_key")
        return session

    def check_admin(self, key: str) -> None:
        """404 when there is no admin API, 401 unless ``key`` is the admin key."""
        if self.admin_key is None:
            raise ProxyError(404, "not found: the admin API is off (agent.admin_key_file)", "not_found")
        if not secrets.compare_digest(key.encode(), self.admin_key.encode()):
            raise ProxyError(401, "the admin API needs the admin key (Bearer)", "invalid_api_key")

    def named(self, key: str) -> Session:
        session = self.sessions.get(key)
        if session is None:
            raise ProxyError(404, "no open episode has this key", "session_not_found", "key")
        return session

    def count(self, code: str | None) -> None:
        """One refused request: counted by its code; the first of each code is logged as a warning."""
        name = f"rejected_{code or 'error'}"
        self.counts[name] += 1
        (log.warning if self.counts[name] == 1 else log.debug)(
            "agent proxy refused a request (%s; counted as %s in the rollout's stats)", code, name)

    # -- rendering -----------------------------------------------------------------
    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=self.template,
                                                  add_generation_prompt=generation_prompt, tokenize=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special: bool) -> str:
        """Text of ``ids`` exactly: no clean-up of spaces before punctuation (some tokenizers default to it),
        so that a longer prefix of tokens always decodes to a longer prefix of text."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)

    def read_as(self, output_ids: list[int]) -> str:
        """``output_ids`` as the agent's reply holds them: decoded without the special tokens a sampled output may
        carry (a pad, an unk, a reserved token), as the reply's text is, but with the eos that ends it, which the
        template writes back as the turn's end."""
        eos = self.tokenizer.eos_token_id
        ends = bool(output_ids) and output_ids[-1] == eos
        body = self.decode(output_ids[:-1] if ends else output_ids, True)
        return body + self.decode([eos], False) if ends else body

    def chat_prompt(self, session: Session, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """Token ids of a chat request's prompt, continuing the longest earlier call it extends exactly."""
        full = self.render(messages, tools, True)
        for call in sorted(session.calls, key=lambda c: -len(c.messages or [])):
            if call.messages is None or messages[:len(call.messages) + 1] != [*call.messages, call.reply]:
                continue
            head = self.render([*call.messages, call.reply], tools, False)
            asked = self.render(call.messages, tools, True)
            said = self.decode(call.output_ids, False)
            if not (full.startswith(head) and head.startswith(asked)):
                continue  # a template that does not render turn by turn: render from scratch
            reply_text = head[len(asked):]
            # what the template writes after the model's own tokens: the newline after eos; after a reply cut at
            # a stop string (the tokens keep it, the agent got the text before it), the whole turn closer
            content = (call.reply or {}).get("content") or ""
            read = self.read_as(call.output_ids)  # the special tokens the agent did not see left out
            if reply_text.startswith(said):
                trailer = reply_text[len(said):]
            elif reply_text.startswith(read):
                trailer = reply_text[len(read):]
            elif (call.finish_reason == "stop" and content and call.output_ids[-1:] != [self.tokenizer.eos_token_id]
                  and self.decode(call.output_ids, True).startswith(content) and reply_text.startswith(content)):
                # cut at a stop string: no eos among the tokens, the template's closer follows them
                trailer = reply_text[len(content):]
            else:  # the reply renders otherwise than the tokens read: no exact continuation
                continue
            return [*call.prompt_ids, *call.output_ids, *self.encode(trailer + full[len(head):])]
        return self.encode(full)

    # -- generation ----------------------------------------------------------------
    async def complete(self, session: Session, prompt_ids: list[int], max_tokens: int | None, stop: list[str],
                       n: int, param: str) -> list[Call]:
        """``n`` completions of ``prompt_ids`` (generated together, within the episode's quota), once the prompt
        passed :meth:`admit`; each cut after its first stop string."""
        max_new = self.admit(prompt_ids, max_tokens, param)
        session.quota.take(n - 1)  # the request itself holds one
        try:
            done = await asyncio.gather(*(self.generate(prompt_ids, max_new) for _ in range(n)))
        finally:
            session.quota.release(n - 1)
        return await self.offload(lambda: [self._call(prompt_ids, c, stop) for c in done])

    async def offload(self, fn: Callable, *args):
        """``fn(*args)`` on the proxy's worker threads: parsing, rendering, tokenising and decoding never hold
        the event loop that serves every session (nor the default executor the engine's callers use)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def shutdown(self) -> None:
        """Stop the worker threads (the proxy's server is stopped already)."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    def admit(self, prompt_ids: list[int], max_tokens: int | None, param: str) -> int:
        """The tokens to generate for ``prompt_ids``, or the 400 that refuses it: an empty prompt, a token id
        outside the vocabulary, a prompt over ``max_prompt_tokens``. ``max_tokens`` is capped at the run's
        ``rollout.max_new_tokens`` and at what the context leaves after the prompt."""
        if not prompt_ids:
            raise ProxyError(400, "the prompt is empty", "empty_prompt", param)
        max_new = min(max_tokens or self.max_tokens, self.max_tokens)
        if self.limits.context is not None:
            max_new = min(max_new, self.limits.context - len(prompt_ids))
        try:
            self.limits.check_ids(prompt_ids, param)
            self.limits.check_length(len(prompt_ids), max(max_new, 1), self.max_prompt_tokens, param)
        except Rejected as e:
            raise ProxyError(400, e.message, e.code, e.param) from None
        return max_new

    def _call(self, prompt_ids: list[int], c: Completion, stop: list[str]) -> Call:
        out, logprobs, versions, reason = list(c.output_ids), list(c.logprobs), list(c.versions), c.finish_reason
        if stop:
            cut = self._stop_at(out, stop)
            if cut is not None:
                out, logprobs, versions, reason = out[:cut], logprobs[:cut], versions[:cut], "stop"
        return Call(list(prompt_ids), out, logprobs, versions, reason)

    def _stop_at(self, ids: list[int], stop: list[str]) -> int | None:
        """Tokens to keep: up to the one that completes the first stop string (None: no stop string).

        A prefix that holds a stop string stays holding it as tokens are added, so the first such prefix
        is found by bisection: O(log n) decodes, one when the output holds no stop string at all."""
        def hit(k: int) -> bool:
            text = self.decode(ids[:k], True)
            return any(s and s in text for s in stop)

        if not hit(len(ids)):
            return None
        lo, hi = 1, len(ids)  # hit(hi) holds; find the smallest such k
        while lo < hi:
            mid = (lo + hi) // 2
            if hit(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def text(self, ids: list[int], stop: list[str]) -> str:
        text = self.decode(ids, True)
        hits = [text.index(s) for s in stop if s and s in text]
        return text[:min(hits)] if hits else text

    def token_logprobs(self, call: Call) -> list[dict]:
        toks = [self.decode([t], False) for t in call.output_ids]
        return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(toks, call.logprobs)]

    def completion_logprobs(self, call: Call) -> dict:
        toks = [self.decode([t], False) for t in call.output_ids]
        return {"tokens": toks, "token_logprobs": call.logprobs, "top_logprobs": None, "text_offset": None}


async def listen(app, host: str, port: int, timeout_s: float = 30.0):
    """Serve ``app`` with uvicorn on the running loop; (server, its serving task, the bound port) once it listens.
    Stop it with ``server.should_exit = True`` and await the task."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=5))
    serving = asyncio.ensure_future(server.serve())
    deadline = time.time() + timeout_s
    while not server.started:
        if serving.done():
            serving.result()  # raises what stopped it (port in use...)
            raise RuntimeError("agent proxy: the server stopped before it started")
        if time.time() > deadline:
            raise RuntimeError(f"agent proxy: not listening after {timeout_s:.0f} s")
        await asyncio.sleep(0.02)
    return server, serving, server.servers[0].sockets[0].getsockname()[1]


def _new_key() -> str:
    return "sk-hpcrl-" + secrets.token_urlsafe(24)
