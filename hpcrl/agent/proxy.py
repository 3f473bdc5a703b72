"""An OpenAI-compatible HTTP proxy in front of a rollout's engine that records every call at token level.

An agent program keeps talking to an OpenAI-style endpoint (``base_url``
plus an API key) and does not know it is being trained; the proxy turns its
calls into engine requests and keeps, per session, what the trainer needs:
prompt ids, output ids, behaviour logprobs and the policy version of every
output token (:class:`Call`). :func:`hpcrl.agent.export.concat` turns a
session's calls into one training :class:`~hpcrl.rollout.episodes.Episode`.

Endpoints (FastAPI; what differs from OpenAI is listed in docs/agents.md):

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
:class:`~hpcrl.rollout.engine.Completion`); :meth:`AgentProxy.open` gives
each episode its own API key (a session), :meth:`AgentProxy.close` ends it
and returns its calls. Requests whose key is not an open session get 401,
malformed bodies 400, both in OpenAI's error shape; no response carries a
traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Hashable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from hpcrl.model.templates import PLAIN_CHAT_TEMPLATE
from hpcrl.rollout.engine import Completion

__all__ = ["AgentProxy", "Call", "Session", "PLAIN_CHAT_TEMPLATE", "listen", "parse_tool_calls", "read_admin_key"]

log = logging.getLogger(__name__)

Generate = Callable[[list[int], int], Awaitable[Completion]]

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


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
class Session:
    """The calls of one episode, in the order they finished, whichever of its keys made them."""

    key: str
    episode: Hashable
    calls: list[Call] = field(default_factory=list)
    opened: float = field(default_factory=time.time)
    keys: list[str] = field(default_factory=list)  # the episode's keys: its own, then those added by the admin
    reward: float | None = None  # set through the admin API
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set when the admin API ends the episode


MIN_ADMIN_KEY = 16


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


# -- request bodies ------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are accepted and ignored

    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)


class ParentBody(BaseModel):
    parent: str


class RewardBody(BaseModel):
    reward: float


class ChatBody(_Body):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class ProxyError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind


def _error(status: int, message: str, code: str | None, param: str | None = None,
           kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


class AgentProxy:
    """The proxy's state (sessions, the tokenizer, the engine's ``generate``) and its FastAPI ``app``."""

    def __init__(self, tokenizer, generate: Generate, *, model_name: str = "hpcrl-policy",
                 max_tokens: int = 256, admin_key: str | None = None) -> None:
        self.tokenizer, self.generate = tokenizer, generate
        self.model_name, self.max_tokens = model_name, max_tokens
        self.admin_key = admin_key  # None: no admin API (404)
        self.sessions: dict[str, Session] = {}
        self.template = getattr(tokenizer, "chat_template", None) or PLAIN_CHAT_TEMPLATE
        self.app = self._build_app()

    # -- sessions ------------------------------------------------------------------
    def open(self, episode: Hashable) -> str:
        """A new session for ``episode``; its API key."""
        key = _new_key()
        self.sessions[key] = Session(key, episode, keys=[key])
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

    def _session(self, request: Request) -> Session:
        key = _bearer(request)
        session = self.sessions.get(key)
        if session is None:
            raise ProxyError(401, "no open episode has this API key" if key else "missing API key (Bearer)",
                             "invalid_api_key")
        return session

    def _admin(self, request: Request) -> None:
        """Every admin request's first check, before its body is read: 404 when there is no admin API, 401
        without the admin key."""
        if self.admin_key is None:
            raise ProxyError(404, "not found: the admin API is off (agent.admin_key_file)", "not_found")
        if not secrets.compare_digest(_bearer(request).encode(), self.admin_key.encode()):
            raise ProxyError(401, "the admin API needs the admin key (Bearer)", "invalid_api_key")

    def _named(self, key: str) -> Session:
        session = self.sessions.get(key)
        if session is None:
            raise ProxyError(404, "no open episode has this key", "session_not_found", "key")
        return session

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
            if reply_text.startswith(said):
                trailer = reply_text[len(said):]
            elif call.finish_reason == "stop" and content and said.startswith(content) \
                    and reply_text.startswith(content):
                trailer = reply_text[len(content):]
            else:  # the reply renders otherwise than the tokens read: no exact continuation
                continue
            return [*call.prompt_ids, *call.output_ids, *self.encode(trailer + full[len(head):])]
        return self.encode(full)

    # -- generation ----------------------------------------------------------------
    async def _complete(self, prompt_ids: list[int], max_tokens: int | None, stop: list[str]) -> Call:
        if not prompt_ids:
            raise ProxyError(400, "the prompt is empty", "empty_prompt", "prompt")
        c = await self.generate(prompt_ids, min(max_tokens or self.max_tokens, self.max_tokens))
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

    def _text(self, ids: list[int], stop: list[str]) -> str:
        text = self.decode(ids, True)
        hits = [text.index(s) for s in stop if s and s in text]
        return text[:min(hits)] if hits else text

    def _token_logprobs(self, call: Call) -> list[dict]:
        toks = [self.decode([t], False) for t in call.output_ids]
        return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(toks, call.logprobs)]

    # -- the app -------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="hpcrl agent proxy", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ProxyError)
        async def proxy_error(_r: Request, e: ProxyError) -> JSONResponse:
            return _error(e.status, e.message, e.code, e.param, e.kind)

        @app.exception_handler(RequestValidationError)
        async def bad_body(_r: Request, e: RequestValidationError) -> JSONResponse:
            first = e.errors()[0] if e.errors() else {}
            where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
            return _error(400, f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}",
                          "invalid_request", where or None)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_r: Request, e: StarletteHTTPException) -> JSONResponse:
            return _error(e.status_code, str(e.detail), None)

        @app.exception_handler(Exception)
        async def internal(_r: Request, e: Exception) -> JSONResponse:
            log.exception("agent proxy: request failed")
            return _error(500, f"internal error ({type(e).__name__})", "internal_error", kind="server_error")

        admin = [Depends(self._admin)]

        @app.get("/admin/sessions", dependencies=admin)
        async def sessions() -> dict:
            now = time.time()
            return {"object": "list", "data": [
                {"id": key, "episode": str(s.episode), "keys": len(s.keys), "calls": len(s.calls),
                 "reward": s.reward, "age_s": round(now - s.opened, 3)}
                for key, s in self.sessions.items() if key == s.key]}

        @app.post("/admin/sessions", dependencies=admin)
        async def add_key(body: ParentBody) -> dict:
            self._named(body.parent)
            return {"api_key": self.add_key(body.parent)}

        @app.post("/admin/sessions/{key}/reward", dependencies=admin)
        async def set_reward(key: str, body: RewardBody) -> dict:
            session = self._named(key)
            if not math.isfinite(body.reward):
                raise ProxyError(400, f"reward: must be a finite number, got {body.reward}", "invalid_request",
                                 "reward")
            session.reward = body.reward
            return {"id": session.key, "reward": session.reward}

        @app.post("/admin/sessions/{key}/end", dependencies=admin)
        async def end(key: str) -> dict:
            session = self._named(key)
            self.close(key)
            session.ended.set()
            return {"id": session.key, "calls": len(session.calls), "reward": session.reward}

        @app.get("/v1/models")
        async def models(request: Request) -> dict:
            self._session(request)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                 "owned_by": "hpcrl"}]}

        @app.post("/v1/completions")
        async def completions(body: CompletionBody, request: Request):
            session = self._session(request)
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise ProxyError(400, "one prompt per request", "invalid_request", "prompt")
                prompt = prompt[0]
            ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
            stop = _stops(body.stop)
            calls = [await self._complete(ids, body.max_tokens, stop) for _ in range(body.n)]
            session.calls.extend(calls)
            choices = [{"index": i, "text": self._text(c.output_ids, stop), "finish_reason": c.finish_reason,
                        "logprobs": self._completion_logprobs(c) if body.logprobs is not None else None}
                       for i, c in enumerate(calls)]
            out = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                   "model": self.model_name, "choices": choices, "usage": _usage(ids, calls)}
            return _sse([{**out, "choices": [ch]} for ch in choices]) if body.stream else out

        @app.post("/v1/chat/completions")
        async def chat(body: ChatBody, request: Request):
            session = self._session(request)
            messages = [_normalise(m) for m in body.messages]
            tools = None if body.tool_choice == "none" else body.tools
            ids = self.chat_prompt(session, messages, tools)
            stop = _stops(body.stop)
            choices, calls = [], []
            for i in range(body.n):
                call = await self._complete(ids, body.max_completion_tokens or body.max_tokens, stop)
                text = self._text(call.output_ids, stop)
                content, tool_calls = parse_tool_calls(text) if tools else (text, [])
                reply = {"role": "assistant", "content": content or None}
                if tool_calls:
                    reply["tool_calls"] = tool_calls
                    call.finish_reason = "tool_calls" if call.finish_reason == "stop" else call.finish_reason
                call.messages, call.reply = messages, _normalise(reply)
                calls.append(call)
                choices.append({"index": i, "message": reply, "finish_reason": call.finish_reason,
                                "logprobs": {"content": self._token_logprobs(call)} if body.logprobs else None})
            session.calls.extend(calls)
            out = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                   "model": self.model_name, "choices": choices, "usage": _usage(ids, calls)}
            return _chat_stream(out) if body.stream else out

        return app

    def _completion_logprobs(self, call: Call) -> dict:
        toks = [self.decode([t], False) for t in call.output_ids]
        return {"tokens": toks, "token_logprobs": call.logprobs, "top_logprobs": None, "text_offset": None}


async def listen(app: FastAPI, host: str, port: int, timeout_s: float = 30.0):
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


def _bearer(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ""


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Qwen-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` spans of ``text`` as OpenAI
    ``tool_calls``, and the text outside them. A span that is not such JSON stays in the text."""
    calls, kept, pos = [], [], 0
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}})
    kept.append(text[pos:])
    return "".join(kept).strip() if calls else text, calls


def _normalise(message: dict) -> dict:
    """A message as compared for continuations: role, content (text parts joined), tool calls without ids."""
    content = message.get("content")
    if isinstance(content, list):  # content parts: the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out = {"role": message.get("role"), "content": content or None}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "function": {
            "name": t["function"]["name"], "arguments": _canonical_args(t["function"].get("arguments", "{}"))}}
            for t in message["tool_calls"]]
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _canonical_args(args: Any) -> str:
    try:
        return json.dumps(json.loads(args) if isinstance(args, str) else args)
    except ValueError:
        return str(args)


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _usage(prompt_ids: list[int], calls: list[Call]) -> dict:
    completion = sum(len(c.output_ids) for c in calls)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


def _sse(chunks: list[dict]) -> StreamingResponse:
    async def events():
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _chat_stream(out: dict) -> StreamingResponse:
    """A finished chat completion as ``chat.completion.chunk`` events: role, content, tool calls, finish."""
    base = {"id": out["id"], "object": "chat.completion.chunk", "created": out["created"], "model": out["model"]}
    chunks = []
    for ch in out["choices"]:
        i, msg = ch["index"], ch["message"]
        chunks.append({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None}]})
        if msg.get("content"):
            chunks.append({**base, "choices": [{"index": i, "delta": {"content": msg["content"]},
                                                "logprobs": ch["logprobs"], "finish_reason": None}]})
        for k, t in enumerate(msg.get("tool_calls", [])):
            chunks.append({**base, "choices": [{"index": i, "delta": {"tool_calls": [{"index": k, **t}]},
                                                "finish_reason": None}]})
        chunks.append({**base, "choices": [{"index": i, "delta": {}, "finish_reason": ch["finish_reason"]}]})
    return _sse(chunks)
