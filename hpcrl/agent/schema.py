"""The agent proxy's request bodies as typed models, and its errors in OpenAI's shape.

Every body is validated against these models before any of it reaches the
tokenizer, the chat template or the engine: a malformed one is a 400 that
names the field (``messages.1.assistant.tool_calls.0.function``), never a 500
from code that assumed a shape. Fields of OpenAI's API that the proxy does
not use are accepted and ignored (``extra="allow"``), but where a field is
used its type and bounds are checked: token ids are ints, texts are strings,
``n``, ``max_tokens``, ``logprobs``, ``stop`` and the sampling values are
within OpenAI's ranges. Content parts other than text (images, audio) are
refused: the policy reads text only.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)

__all__ = ["ChatBody", "CompletionBody", "ParentBody", "ProxyError", "RewardBody", "error_response", "normalise", "parse_tool_calls", "MAX_N",
           "MAX_STOPS"]

MAX_N = 64  # completions per request
MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string


class ProxyError(Exception):
    """A request the proxy answers with an error: HTTP ``status``, OpenAI's ``code``, ``param`` and ``type``."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind
        self.headers = headers or {}

    def response(self, close: bool = False) -> JSONResponse:
        """The error as OpenAI sends it; ``close`` ends the connection (a body was left unread)."""
        headers = {**self.headers, **({"connection": "close"} if close else {})}
        return error_response(self.status, self.message, self.code, self.param, self.kind, headers)


def error_response(status: int, message: str, code: str | None, param: str | None = None,
                   kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI's fields the proxy does not use are accepted and ignored


# -- messages ----------------------------------------------------------------------
class TextPart(_Open):
    type: Literal["text"]
    text: str


Content = Union[str, list[Annotated[TextPart, Field(discriminator="type")]]]


class FunctionCall(_Open):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; an object is accepted too


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Open):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Open):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None


class ToolMessage(_Open):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None
    name: str | None = None


Message = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]


class FunctionDef(_Open):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: NamedFunction


# -- bodies ------------------------------------------------------------------------
Stop = Union[Annotated[str, Field(max_length=MAX_STOP_CHARS)],
             Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOPS)]]


class _Body(_Open):
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    stop: Stop | None = None
    stream: bool = False
    # accepted and not applied: sampling is the run's (the trainer's logprobs assume it); checked all the same
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    user: str | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionBody(_Body):
    prompt: str | list[StrictInt] | list[str]  # token ids are JSON integers: no bools, floats or strings
    logprobs: int | None = Field(None, ge=0, le=20)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _named_tool_is_offered(self) -> ChatBody:
        if isinstance(self.tool_choice, NamedToolChoice):
            offered = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in offered:
                raise ValueError(f"tool_choice: names {self.tool_choice.function.name!r}, not one of the tools "
                                 f"offered {offered}")
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages with their declared fields only (a field another role has, such as ``tool_calls`` on a
        user message, is dropped with the rest of OpenAI's fields the proxy does not use)."""
        return [_declared(m) for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        if self.tool_choice == "none" or not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def _declared(model: BaseModel) -> dict[str, Any]:
    out = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if value is None:
            continue
        if isinstance(value, BaseModel):
            value = _declared(value)
        elif isinstance(value, list):
            value = [_declared(v) if isinstance(v, BaseModel) else v for v in value]
        out[name] = value
    return out


class ParentBody(BaseModel):
    parent: str


class RewardBody(BaseModel):
    reward: float


# -- shapes of messages -------------------------------------------------------------
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


def normalise(message: dict) -> dict:
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
