"""A tool-using agent: multiply two numbers with a calculator tool, written against the official OpenAI client.

The user asks for a product (``"37*48="``); the model is offered one tool, the calculator ``calc(expr)``. An episode
goes the way tool calling goes with any OpenAI endpoint: the model answers with a tool call, the program runs the
tool and sends its result back as a ``role: tool`` message, and the model answers; up to ``MAX_CALLS`` tool calls.
The reward is 1 when the final answer is the product, else 0. A tool call that is not a well-formed
``calc`` call (unknown tool, arguments that are not JSON, an expression that is not arithmetic) gets an
error message back as its tool result, as a real tool runner would, and the episode goes on. Nothing here knows
about hpcrl: point ``base_url``/``api_key`` at any OpenAI-compatible endpoint that does tool calling and it runs
the same. hpcrl trains on it through ``agent.fn``::

    python -m hpcrl.submit --config configs/agent_tool.yaml

``demonstration`` is the warm start's example of the conversation (``sft.demonstrations``): the tiny model learns
the tool-call format from it before RL.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import operator
import weakref
from typing import Awaitable, Callable

import httpx
from openai import AsyncOpenAI

MAX_CALLS = 2  # tool calls an episode may make before it must answer

# the schema is short on purpose: the chat template lists it in every prompt, and the tiny model's sequences are
# characters (a longer description costs every training step its length again)
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object",
                                                                         "properties": {"expr": {"type": "string"}}}}}]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The tool: ``+ - * /`` and parentheses over integers, the result as text ("error: ..." otherwise)."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only integers, + - * / and parentheses")

    try:
        if len(expression) > 64:
            raise ValueError("expression too long")
        result = value(ast.parse(expression.strip().rstrip("="), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def tool_result(name: str, arguments: str) -> str:
    """What running the tool call ``name(arguments)`` gives back."""
    if name != "calc":
        return f"error: unknown tool {name!r}"
    try:
        expression = json.loads(arguments)["expr"]
    except (ValueError, KeyError, TypeError):
        return "error: arguments must be {\"expr\": ...}"
    return calculate(str(expression))


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one connection pool per event loop


def _pool() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    if loop not in _POOLS:
        _POOLS[loop] = httpx.AsyncClient(timeout=600)
    return _POOLS[loop]


async def run_agent_return_reward(data: dict, *, base_url: str, api_key: str) -> float:
    """One episode for the dataset row ``data`` (``prompt`` like "37*48=", ``answer``); returns its reward."""
    return await tool_episode(data, base_url, api_key, TOOLS, tool_result)


async def tool_episode(data: dict, base_url: str, api_key: str, tools: list[dict],
                       run_tool: Callable[[str, str], Awaitable[str] | str]) -> float:
    """The episode loop of any one-tool agent: ask, run each tool call (``run_tool(name, arguments)``, plain or
    async) and send its result back, until the model answers; 1 when the answer is ``data["answer"]``."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=_pool())
    messages: list[dict] = [{"role": "user", "content": data["prompt"]}]
    for _ in range(MAX_CALLS + 1):
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=tools)
                 ).choices[0].message
        if not reply.tool_calls:
            return 1.0 if (reply.content or "").strip() == str(data["answer"]).strip() else 0.0
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": await result if inspect.isawaitable(result) else result})
    return 0.0  # still calling tools after MAX_CALLS


def demonstration(data: dict) -> dict:
    """The conversation the warm start trains for ``data``: call the calculator, then answer with its result."""
    expression = data["prompt"].rstrip("=")
    return demonstrated(data, TOOLS, "calc", {"expr": expression}, calculate(expression))


def demonstrated(data: dict, tools: list[dict], name: str, arguments: dict, result: str) -> dict:
    """One tool call with ``arguments``, its ``result``, then the answer: a warm start's conversation."""
    return {"tools": tools, "messages": [
        {"role": "user", "content": data["prompt"]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": str(data["answer"])},
    ]}
