"""The agent proxy's HTTP routes: chat, completions and admin routers over one :class:`AgentProxy`.

:func:`build_app` assembles the FastAPI app of one proxy behind its
:class:`~hpcrl.agent.guard.Guard` (what uvicorn serves); by the time a route runs, the guard has
checked the key and the body's size. A route validates the body against the
typed models of :mod:`hpcrl.agent.schema` (400 naming the field), renders,
tokenises and later decodes on the proxy's worker threads (a large request
never stalls the event loop that serves every other session), checks the prompt against the
model's limits (:meth:`AgentProxy.admit`) and only then asks the engine.
Every error leaves in OpenAI's shape and is counted by its code.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hpcrl.agent.guard import Guard
from hpcrl.agent.schema import (ChatBody, CompletionBody, ParentBody, ProxyError, RewardBody, error_response,
                                normalise, parse_tool_calls)

if TYPE_CHECKING:
    from hpcrl.agent.proxy import AgentProxy, Call, Session

__all__ = ["build_app"]

log = logging.getLogger(__name__)


def build_app(proxy: AgentProxy) -> Guard:
    """The proxy's ASGI app: the routers below behind the :class:`~hpcrl.agent.guard.Guard`."""
    return Guard(_routes(proxy), proxy, proxy.cfg.max_request_bytes)


def _routes(proxy: AgentProxy) -> FastAPI:
    app = FastAPI(title="hpcrl agent proxy", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ProxyError)
    async def proxy_error(_r: Request, e: ProxyError) -> JSONResponse:
        proxy.count(e.code)
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(_r: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        proxy.count("invalid_request")
        return error_response(400, f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}",
                              "invalid_request", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_r: Request, e: StarletteHTTPException) -> JSONResponse:
        proxy.count(f"http_{e.status_code}")
        return error_response(e.status_code, str(e.detail), None)

    @app.exception_handler(Exception)
    async def internal(_r: Request, e: Exception) -> JSONResponse:
        log.exception("agent proxy: request failed")
        proxy.count("internal_error")
        return error_response(500, f"internal error ({type(e).__name__})", "internal_error", kind="server_error")

    for router in (admin_router(proxy), completions_router(proxy), chat_router(proxy)):
        app.include_router(router)
    return app


def admin_router(proxy: AgentProxy) -> APIRouter:
    """``/admin/sessions``: list, add a sub-agent's key, set a reward, end an episode (the guard checked the key)."""
    router = APIRouter(prefix="/admin/sessions")

    @router.get("")
    async def sessions() -> dict:
        now = time.time()
        return {"object": "list", "data": [
            {"id": key, "episode": str(s.episode), "keys": len(s.keys), "calls": len(s.calls),
             "reward": s.reward, "age_s": round(now - s.opened, 3)}
            for key, s in proxy.sessions.items() if key == s.key]}

    @router.post("")
    async def add_key(body: ParentBody) -> dict:
        proxy.named(body.parent)
        return {"api_key": proxy.add_key(body.parent)}

    @router.post("/{key}/reward")
    async def set_reward(key: str, body: RewardBody) -> dict:
        session = proxy.named(key)
        if not math.isfinite(body.reward):
            raise ProxyError(400, f"reward: must be a finite number, got {body.reward}", "invalid_request", "reward")
        session.reward = body.reward
        return {"id": session.key, "reward": session.reward}

    @router.post("/{key}/end")
    async def end(key: str) -> dict:
        session = proxy.named(key)
        proxy.close(key)
        session.ended.set()
        return {"id": session.key, "calls": len(session.calls), "reward": session.reward}

    return router


def completions_router(proxy: AgentProxy) -> APIRouter:
    """``GET /v1/models`` and ``POST /v1/completions`` (text or token-id prompts)."""
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models(request: Request) -> dict:
        _session(proxy, request)
        return {"object": "list", "data": [{"id": proxy.model_name, "object": "model", "created": 0,
                                             "owned_by": "hpcrl"}]}

    @router.post("/completions")
    async def completions(request: Request):
        session = _session(proxy, request)
        body = await _parse(proxy, request, CompletionBody)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ProxyError(400, "one prompt per request", "invalid_request", "prompt")
            prompt = prompt[0]
        ids = await proxy.offload(proxy.encode, prompt) if isinstance(prompt, str) else list(prompt)
        stop = body.stops()
        calls = await proxy.complete(session, ids, body.max_tokens, stop, body.n, "prompt")
        out = await proxy.offload(_completion_reply, proxy, body, ids, calls, stop)
        session.calls.extend(calls)
        return _sse([{**out, "choices": [ch]} for ch in out["choices"]]) if body.stream else out

    return router


def chat_router(proxy: AgentProxy) -> APIRouter:
    """``POST /v1/chat/completions``: messages rendered with the chat template, tool calls parsed."""
    router = APIRouter(prefix="/v1")

    @router.post("/chat/completions")
    async def chat(request: Request):
        session = _session(proxy, request)
        body = await _parse(proxy, request, ChatBody)

        def prompt() -> tuple[list[dict], list[dict] | None, list[int]]:
            messages, tools = [normalise(m) for m in body.message_dicts()], body.tool_dicts()
            return messages, tools, proxy.chat_prompt(session, messages, tools)

        messages, tools, ids = await proxy.offload(prompt)
        stop = body.stops()
        calls = await proxy.complete(session, ids, body.max_completion_tokens or body.max_tokens, stop, body.n,
                                     "messages")
        out = await proxy.offload(_chat_reply, proxy, body, messages, tools, ids, calls, stop)
        session.calls.extend(calls)
        return _chat_stream(out) if body.stream else out

    return router


def _session(proxy: AgentProxy, request: Request) -> Session:
    """The episode the guard authenticated this request for (an episode ended meanwhile: 401)."""
    session = getattr(request.state, "session", None)
    if session is None or session.key not in proxy.sessions:
        raise ProxyError(401, "no open episode has this API key", "invalid_api_key")
    return session


async def _parse(proxy: AgentProxy, request: Request, model: type[BaseModel]):
    """The body validated against ``model`` on a worker thread; a 400 naming the field otherwise."""
    raw = await request.body()
    try:
        return await proxy.offload(model.model_validate_json, raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_input=False)) from None


def _completion_reply(proxy: AgentProxy, body: CompletionBody, ids: list[int], calls: list[Call],
                      stop: list[str]) -> dict:
    choices = [{"index": i, "text": proxy.text(c.output_ids, stop), "finish_reason": c.finish_reason,
                "logprobs": proxy.completion_logprobs(c) if body.logprobs is not None else None}
               for i, c in enumerate(calls)]
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": proxy.model_name, "choices": choices, "usage": _usage(ids, calls)}


def _chat_reply(proxy: AgentProxy, body: ChatBody, messages: list[dict], tools: list[dict] | None,
                ids: list[int], calls: list[Call], stop: list[str]) -> dict:
    """The chat completion; each call learns the messages it answered and the reply it gave."""
    choices = []
    for i, call in enumerate(calls):
        text = proxy.text(call.output_ids, stop)
        content, tool_calls = parse_tool_calls(text) if tools else (text, [])
        reply = {"role": "assistant", "content": content or None}
        if tool_calls:
            reply["tool_calls"] = tool_calls
            call.finish_reason = "tool_calls" if call.finish_reason == "stop" else call.finish_reason
        call.messages, call.reply = messages, normalise(reply)
        choices.append({"index": i, "message": reply, "finish_reason": call.finish_reason,
                        "logprobs": {"content": proxy.token_logprobs(call)} if body.logprobs else None})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": proxy.model_name, "choices": choices, "usage": _usage(ids, calls)}


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
