"""A code-tool agent: the model answers a multiplication by running Python in hpcrl's sandbox.

The calculator example's episode (examples/agents/calculator_tool.py: ask, tool call, tool result, answer) with
one difference: the tool is ``py(code)``, which runs the model's Python program in the reward sandbox
(:mod:`hpcrl.reward.sandbox`: no network, nothing of the run directory, CPU, memory, process and output limits,
everything it started killed at the timeout) and returns what it printed. A program that loops, forks, floods its
output or tries to leave is contained and answered with an error, and the episode goes on. The reward is 1 when
the final answer is the product::

    python -m hpcrl.submit --config configs/agent_code_tool.yaml

``demonstration`` is the warm start's conversation: ``print(37*48)``, its output, the answer.
"""

from __future__ import annotations

import asyncio
import json
import threading

from examples.agents.calculator_tool import demonstrated, tool_episode
from hpcrl.reward.config import SandboxConfig
from hpcrl.reward.sandbox import Sandbox

TOOLS = [{"type": "function", "function": {"name": "py", "parameters": {"type": "object",
                                                                       "properties": {"code": {"type": "string"}}}}}]
LIMITS = SandboxConfig(wall_s=5.0, cpu_s=2, memory_mb=256, processes=16, output_bytes=4096)
_SANDBOX: Sandbox | None = None
_LOCK = threading.Lock()


def sandbox() -> Sandbox:
    """One sandbox per process (built, and probed, on the first tool call)."""
    global _SANDBOX
    with _LOCK:
        if _SANDBOX is None:
            _SANDBOX = Sandbox(LIMITS)
        return _SANDBOX


def run_python(code: str) -> str:
    """The tool: run ``code`` in the sandbox; what it printed (the last 64 characters), or "error: ..."."""
    if len(code) > 512:
        return "error: program too long"
    r = sandbox().run({"main.py": code}, ["python", "-I", "/task/main.py"])
    if r.status == "ok":
        return r.stdout.decode(errors="replace").strip()[-64:]
    last = (r.stderr.decode(errors="replace").strip().splitlines() or [r.detail])[-1]
    return f"error: {last[-80:] if r.status == 'exit' else r.detail}"


async def tool_result(name: str, arguments: str) -> str:
    """What running the tool call ``name(arguments)`` gives back (the program runs off the event loop)."""
    if name != "py":
        return f"error: unknown tool {name!r}"
    try:
        code = json.loads(arguments)["code"]
    except (ValueError, KeyError, TypeError):
        return "error: arguments must be {\"code\": ...}"
    return await asyncio.to_thread(run_python, str(code))


async def run_agent_return_reward(data: dict, *, base_url: str, api_key: str) -> float:
    """One episode for the dataset row ``data`` (``prompt`` like "37*48=", ``answer``); returns its reward."""
    return await tool_episode(data, base_url, api_key, TOOLS, tool_result)


def demonstration(data: dict) -> dict:
    """The conversation the warm start trains for ``data``: print the product in Python, then answer it."""
    code = f"print({data['prompt'].rstrip('=')})"
    return demonstrated(data, TOOLS, "py", {"code": code}, str(data["answer"]))
