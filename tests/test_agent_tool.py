"""The tool-use example (examples/agents/calculator_tool.py) and the warm start on demonstrated conversations.

The example runs unchanged, with the official ``openai`` client, against the real proxy (uvicorn, loopback) in
front of a scripted engine. A policy that says exactly what the demonstration says produces, through the proxy,
exactly the tokens the warm start trains (same ids, same trained positions): what SFT teaches is what RL then
samples and scores. Malformed tool calls get the tool runner's error back and the episode goes on. A short warm
start on a few demonstrations learns them turn for turn.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from examples.agents.calculator_tool import (  # noqa: E402
    calculate, demonstration, run_agent_return_reward, tool_result)
from hpcrl.agent.export import concat  # noqa: E402
from hpcrl.data.rows import Row  # noqa: E402
from hpcrl.model.tiny import build_char_tokenizer  # noqa: E402
from hpcrl.sft.demonstrations import tokenize_demonstration  # noqa: E402
import test_agent_proxy  # noqa: E402
from test_agent_proxy import EOS  # noqa: E402

served = test_agent_proxy.served  # the fixture: the proxy (uvicorn, loopback) over a scripted engine


def episode(proxy, url: str, data: dict, name) -> tuple[float, list]:
    key = proxy.open(("tool", name))
    reward = asyncio.run(run_agent_return_reward(data, base_url=url, api_key=key))
    return reward, proxy.close(key).calls


def test_the_calculator_tool() -> None:
    assert calculate("37*48") == "1776" and calculate("(2+3)*4") == "20" and calculate("7/2") == "3.5"
    assert calculate("-3*2=") == "-6"
    for bad in ("__import__('os')", "2**8", "1/0", "x+1", "", "1" * 80):
        assert calculate(bad).startswith("error:"), bad
    assert tool_result("calc", json.dumps({"expr": "6*7"})) == "42"
    assert tool_result("search", "{}").startswith("error: unknown tool")
    assert tool_result("calc", "{not json").startswith("error: arguments")
    assert tool_result("calc", json.dumps({"expression": "6*7"})).startswith("error: arguments")


def test_a_policy_that_follows_the_demonstration_produces_the_tokens_the_warm_start_trains(served) -> None:
    proxy, engine, url = served
    tok = proxy.tokenizer
    data = {"prompt": "37*48=", "answer": "1776", "index": 0}
    demo = demonstration(data)
    said = [m for m in demo["messages"] if m["role"] == "assistant"]
    call = said[0]["tool_calls"][0]["function"]
    engine.script += [f'<tool_call>{{"name": "{call["name"]}", "arguments": {call["arguments"]}}}</tool_call>',
                      said[1]["content"]]
    reward, calls = episode(proxy, url, data, 0)
    assert reward == 1.0 and len(calls) == 2 and calls[0].finish_reason == "tool_calls"
    ex = concat(calls)
    assert ex.turns == 2 and ex.off_branch == 0
    trained = tokenize_demonstration(tok, demo)
    ids = ex.prompt_ids + ex.episode.response_ids
    assert ids == trained.ids[:len(ids)] and len(ids) == trained.turns[-1][1]  # token for token, to the last eos
    mask = [0] * len(ex.prompt_ids) + ex.episode.loss_mask
    assert [i for i, m in enumerate(mask) if m] == [i for s, e in trained.turns for i in range(s, e)]
    assert tok.decode(trained.ids[trained.turns[0][1]:trained.turns[1][0]], skip_special_tokens=False) == \
        "\ntool: 1776<eos>\nassistant: "
    assert trained.ids[trained.turns[1][0]:trained.turns[1][1]] == [*tok.encode("1776", add_special_tokens=False), EOS]


def test_malformed_tool_calls_get_the_runners_error_and_the_episode_goes_on(served) -> None:
    proxy, engine, url = served
    engine.script += ['<tool_call>{"name": "search", "arguments": {"q": "6*7"}}</tool_call>',
                      '<tool_call>{"name": "calc", "arguments": {"expr": "6*7+"}}</tool_call>', "41"]
    reward, calls = episode(proxy, url, {"prompt": "6*7=", "answer": "42", "index": 1}, 1)
    assert reward == 0.0 and len(calls) == 3
    results = [m["content"] for m in calls[2].messages if m["role"] == "tool"]
    assert results[0].startswith("error: unknown tool") and results[1].startswith("error: invalid syntax")
    assert concat(calls).turns == 3  # one conversation: each call continues the one before
    engine.script += [f'<tool_call>{{"name": "calc", "arguments": {{"expr": "{k}"}}}}</tool_call>'
                      for k in range(3)]
    reward, calls = episode(proxy, url, {"prompt": "6*7=", "answer": "42", "index": 1}, 2)
    assert reward == 0.0 and len(calls) == 3  # MAX_CALLS tool calls, then one more that still calls: scored 0


def test_a_warm_start_on_demonstrations_learns_them_turn_for_turn(tmp_path) -> None:
    from hpcrl.model.tiny import TinyModelConfig, build_tiny_model
    from hpcrl.sft.config import SFTConfig
    from hpcrl.sft.warm_start import warm_start

    base = tmp_path / "base"
    build_tiny_model(base, TinyModelConfig(hidden_size=64, num_layers=2, seed=0))
    rows = [Row(prompt=f"{a}*{b}=", answer=str(a * b), index=i) for i, (a, b) in enumerate([(12, 34), (56, 78)])]
    cfg = SFTConfig(lr=3e-3, batch_size=2, max_steps=300, warmup_steps=5, eval_every=10, target_accuracy=1.0,
                    cache_dir=str(tmp_path / "sft"), demonstrations="examples.agents.calculator_tool:demonstration")
    never = lambda *_: pytest.fail("the prompt -> answer score is not used with demonstrations")  # noqa: E731
    res = warm_start(cfg, base, rows, rows, never, demonstrate=demonstration)
    assert res.accuracy == 1.0 and res.steps < 300 and not res.cached
    again = warm_start(cfg, base, rows, rows, never, demonstrate=demonstration)
    assert again.cached and again.path == res.path
    plain = warm_start(SFTConfig(**{**cfg.__dict__, "demonstrations": "", "max_steps": 10, "target_accuracy": 0.0}),
                       base, rows, rows, lambda p, r, row: float(r == row.answer))
    assert plain.path != res.path  # what is trained is part of the cache key


def test_demonstrations_are_checked() -> None:
    from hpcrl.sft.demonstrations import call_demonstrate

    rows = [Row(prompt="1*2=", answer="2", index=0), Row(prompt="3*4=", answer="12", index=7)]
    with pytest.raises(ValueError, match=r"row 7 \('3\*4='\): KeyError"):
        call_demonstrate(rows, lambda data: demonstration(data) if data["index"] == 0 else {}["x"])
    with pytest.raises(ValueError, match="row 0 .* expected a dict"):
        call_demonstrate(rows, lambda data: [])
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="non-empty 'messages'"):
        tokenize_demonstration(tok, {"messages": []})
    with pytest.raises(ValueError, match="no assistant message"):
        tokenize_demonstration(tok, {"messages": [{"role": "user", "content": "hi"}]})
    tok.chat_template = "{% for m in messages|reverse %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="render turn by turn"):
        tokenize_demonstration(tok, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant",
                                                  "content": "b"}, {"role": "user", "content": "c"},
                                                 {"role": "assistant", "content": "d"}]})


@pytest.mark.skipif(__import__("shutil").which("bwrap") is None, reason="bubblewrap is not installed")
def test_the_python_tool_runs_the_models_program_in_the_sandbox_and_the_episode_goes_on(served) -> None:
    """examples/agents/python_tool.py through the real proxy: a program that loops forever and one that connects
    to a port of this machine get the sandbox's errors back, and the episode goes on to its answer."""
    from examples.agents import python_tool

    proxy, engine, url = served
    net = "import socket as s;s.socket().connect(('127.0.0.1',22))"
    engine.script += [f"<tool_call>{json.dumps({'name': 'py', 'arguments': {'code': code}})}</tool_call>"
                      for code in ("while True: pass", net)] + ["42"]
    key = proxy.open(("py", 0))
    reward = asyncio.run(python_tool.run_agent_return_reward({"prompt": "6*7=", "answer": "42"}, base_url=url,
                                                              api_key=key))
    calls = proxy.close(key).calls
    results = [m["content"] for m in calls[-1].messages if m["role"] == "tool"]
    assert reward == 1.0 and len(calls) == 3, results
    assert results[0].startswith("error: killed by SIGXCPU") and results[1].startswith("error: ConnectionRefused")
    demo = python_tool.demonstration({"prompt": "37*48=", "answer": "1776"})
    assert demo["messages"][2]["content"] == "1776" == python_tool.run_python("print(37*48)")
