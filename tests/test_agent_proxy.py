"""The agent proxy through the official ``openai`` client, and the concat and individual exports of a session.

The proxy runs for real (FastAPI under uvicorn on a loopback port) in front
of a scripted engine: each call outputs the next scripted text, token by
token with the tiny model's character tokenizer, logprob -0.5 and the
engine's current version per token. That makes every token id of a
multi-turn episode known in advance, so the export is checked exactly.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import numpy as np  # noqa: E402

from hpcrl.agent.export import concat, individual  # noqa: E402
from hpcrl.agent.proxy import AgentProxy, parse_tool_calls  # noqa: E402
from hpcrl.agent.routes import build_app  # noqa: E402
from hpcrl.model.limits import ModelLimits  # noqa: E402
from hpcrl.model.tiny import build_char_tokenizer  # noqa: E402
from hpcrl.rollout.engine import Completion  # noqa: E402
from hpcrl.rollout.worker import spool_samples  # noqa: E402
from hpcrl.runtime.dist import free_port  # noqa: E402
from hpcrl.spool.format import TrajectoryGroup  # noqa: E402

EOS = 1


class ScriptedEngine:
    """``generate`` for the proxy: the next scripted text (+ eos), at the version set by the test."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.script, self.version, self.asked = tokenizer, [], 0, []

    async def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Completion:
        self.asked.append(list(prompt_ids))
        await asyncio.sleep(0.01)  # let concurrent sessions interleave
        ids = [*self.tokenizer.encode(self.script.pop(0), add_special_tokens=False), EOS][:max_new_tokens]
        return Completion(id=None, prompt_ids=list(prompt_ids), output_ids=ids, logprobs=[-0.5] * len(ids),
                          versions=[self.version] * len(ids), finish_reason="stop" if ids[-1] == EOS else "length")


@contextmanager
def serve(app):
    """``app`` under uvicorn on a free loopback port, on a thread; its base URL (``.../v1``)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "proxy did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def served():
    tokenizer = build_char_tokenizer()
    engine = ScriptedEngine(tokenizer)
    proxy = AgentProxy(tokenizer, engine.generate, limits=ModelLimits(vocab_size=len(tokenizer), context=1024),
                       max_tokens=128)
    with serve(build_app(proxy)) as url:
        yield proxy, engine, url


def client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)


def test_chat_completions_models_and_streaming(served) -> None:
    proxy, engine, url = served
    key = proxy.open(("t", 0))
    c = client(url, key)
    assert [m.id for m in c.models.list().data] == ["hpcrl-policy"]
    engine.script += ["4", "5"]
    r = c.chat.completions.create(model="hpcrl-policy", messages=[{"role": "user", "content": "2+2="}],
                                  logprobs=True, temperature=0.7)
    assert r.choices[0].message.content == "4" and r.choices[0].finish_reason == "stop"
    assert [t.logprob for t in r.choices[0].logprobs.content] == [-0.5, -0.5]  # "4" and eos
    assert r.usage.completion_tokens == 2
    prompt = proxy.tokenizer.decode(engine.asked[-1], skip_special_tokens=False)
    assert prompt == "user: 2+2=<eos>\nassistant: "  # the plain template of a tokenizer without one
    chunks = list(c.chat.completions.create(model="x", messages=[{"role": "user", "content": "2+3="}], stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "5"
    assert chunks[-1].choices[0].finish_reason == "stop"
    engine.script += ["42"]
    t = c.completions.create(model="x", prompt="6*7=", max_tokens=8, logprobs=1)
    assert t.choices[0].text == "42" and t.choices[0].logprobs.token_logprobs == [-0.5] * 3
    engine.script += ["12 is it. 13"]
    t = c.completions.create(model="x", prompt="3*4=", max_tokens=32, stop=["xyz", " is"])
    assert t.choices[0].text == "12" and t.choices[0].finish_reason == "stop"
    calls = proxy.close(key).calls
    assert proxy.tokenizer.decode(calls[3].output_ids) == "12 is"  # trained up to the token that completed the stop
    assert len(calls) == 4 and calls[2].prompt_ids == proxy.tokenizer.encode("6*7=", add_special_tokens=False)


def test_unknown_keys_and_malformed_bodies_get_openai_errors(served) -> None:
    proxy, engine, url = served
    asked = len(engine.asked)
    with pytest.raises(openai.AuthenticationError) as e:
        client(url, "sk-nobody").chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    key = proxy.open(("t", 1))
    with pytest.raises(openai.BadRequestError) as e:
        client(url, key).chat.completions.create(model="x", messages=[])
    assert e.value.status_code == 400 and "messages" in e.value.body["message"]
    raw = httpx.post(f"{url}/chat/completions", content=b"{not json", timeout=10,
                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in raw.text
    proxy.close(key)
    with pytest.raises(openai.AuthenticationError):  # a closed session's key is dead
        client(url, key).models.list()
    assert len(engine.asked) == asked  # none of these reached the engine


TOOL_CALL = '<tool_call>{"name": "calc", "arguments": {"e": "2*21"}}</tool_call>'


def three_turn_tool_episode(proxy, engine, url: str, name) -> list:
    """Turn 1 calls a tool (at version 3), turn 2 answers wrongly and hears so, turn 3 answers (both at
    version 4); the session's calls."""
    key = proxy.open(("t", name))
    c = client(url, key)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    engine.script += [TOOL_CALL, "41", "42"]
    messages = [{"role": "user", "content": "2*21?"}]
    engine.version = 3
    r1 = c.chat.completions.create(model="x", messages=messages, tools=tools)
    tc = r1.choices[0].message.tool_calls
    assert r1.choices[0].finish_reason == "tool_calls" and tc[0].function.name == "calc"
    assert json.loads(tc[0].function.arguments) == {"e": "2*21"}
    messages += [r1.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tc[0].id, "content": "42"}]
    engine.version = 4  # the policy moved on between turns
    r2 = c.chat.completions.create(model="x", messages=messages, tools=tools)
    messages += [{"role": "assistant", "content": r2.choices[0].message.content},
                 {"role": "user", "content": "wrong"}]
    r3 = c.chat.completions.create(model="x", messages=messages, tools=tools)
    assert r3.choices[0].message.content == "42"
    return proxy.close(key).calls


def test_a_three_turn_tool_episode_exports_exact_tokens_and_masks(served) -> None:
    """The concat export is the first prompt, then each turn's output (trained) with the tool result and
    feedback between (masked)."""
    proxy, engine, url = served
    tok = proxy.tokenizer
    calls = three_turn_tool_episode(proxy, engine, url, 2)
    p1, p2, p3 = engine.asked[-3:]
    out1 = [*tok.encode(TOOL_CALL, add_special_tokens=False), EOS]
    assert p2[:len(p1) + len(out1)] == p1 + out1  # the model's own tokens, not a re-rendering of its tool call
    out2 = [*tok.encode("41", add_special_tokens=False), EOS]
    assert p3[:len(p2) + len(out2)] == p2 + out2
    ex = concat(calls)
    assert ex.turns == 3 and ex.off_branch == 0 and ex.prompt_ids == p1
    gap1, gap2 = p2[len(p1) + len(out1):], p3[len(p2) + len(out2):]
    assert tok.decode(gap1, skip_special_tokens=False) == "\ntool: 42<eos>\nassistant: "
    assert tok.decode(gap2, skip_special_tokens=False) == "\nuser: wrong<eos>\nassistant: "
    out3 = [*tok.encode("42", add_special_tokens=False), EOS]
    e = ex.episode
    assert e.response_ids == out1 + gap1 + out2 + gap2 + out3
    assert e.loss_mask == [1] * len(out1) + [0] * len(gap1) + [1] * len(out2) + [0] * len(gap2) + [1] * len(out3)
    assert e.logprobs == [-0.5] * len(out1) + [0.0] * len(gap1) + [-0.5] * len(out2) + [0.0] * len(gap2) + \
        [-0.5] * len(out3)
    assert e.versions[:len(out1)] == [3] * len(out1) and set(e.versions[len(out1):]) == {4}
    assert e.finish_reason == "stop"


def test_a_three_turn_tool_episode_exported_individual_is_one_sample_per_call(served) -> None:
    """``individual``: each call its own sample, exactly its prompt ids and output ids with their logprobs and
    versions, the reward discounted by 0.5 per call before the last; published as one spool group whose
    prompt is the calls' common prefix and whose samples start with the rest of their prompt, masked."""
    proxy, engine, url = served
    tok = proxy.tokenizer
    calls = three_turn_tool_episode(proxy, engine, url, "individual")
    prompts = engine.asked[-3:]
    outs = [[*tok.encode(t, add_special_tokens=False), EOS] for t in (TOOL_CALL, "41", "42")]
    ex = individual(calls, turn_discount=0.5)
    assert ex.turns == 3 and ex.off_branch == 0 and ex.prompt_ids == prompts[0]
    parts = ex.episode.parts
    assert ex.episode.response_ids == [] and ex.episode.samples() is parts and len(parts) == 3
    assert [p.prompt_ids for p in parts] == prompts and [p.response_ids for p in parts] == outs
    assert [p.loss_mask for p in parts] == [[1] * len(o) for o in outs]
    assert [p.logprobs for p in parts] == [[-0.5] * len(o) for o in outs]
    assert [p.versions for p in parts] == [[3] * len(outs[0]), [4] * len(outs[1]), [4] * len(outs[2])]
    assert [p.reward_scale for p in parts] == [0.25, 0.5, 1.0]
    assert [p.finish_reason for p in parts] == ["stop"] * 3  # a tool call ends its turn as a stop
    assert (ex.episode.head_version, ex.episode.newest_version) == (3, 4)  # staleness sees every call's tokens
    assert [p.reward_scale for p in individual(calls).episode.parts] == [1.0, 1.0, 1.0]  # the default: 1

    prompt, samples, owners = spool_samples(7, [99], [ex.episode], [0.8], version=5)
    assert prompt == prompts[0] and owners == [0, 0, 0]
    assert [s.reward for s in samples] == [0.8 * 0.25, 0.8 * 0.5, 0.8]
    for s, part, p, out in zip(samples, parts, prompts, outs):
        head = len(p) - len(prompt)
        assert prompt + s.response_ids.tolist() == p + out  # the trained sequence is exactly the call's
        assert s.loss_mask.tolist() == [0] * head + [1] * len(out)
        assert s.behav_logprobs.tolist() == [0.0] * head + [-0.5] * len(out)
        assert s.versions.tolist() == [part.versions[0]] * head + part.versions  # context: its call's version
    group = TrajectoryGroup(ticket=7, writer="w", prompt_ids=np.asarray(prompt, np.int32), samples=samples)
    assert group.version_range() == (3, 4)


def test_individual_trains_every_call_that_concat_leaves_off_its_branch(served) -> None:
    """A retried first question: concat trains the branch of the last call (one off-branch call),
    individual every call, in the order they finished."""
    proxy, engine, url = served
    key = proxy.open(("t", "retry"))
    c = client(url, key)
    engine.script += ["7", "8", "9"]
    first = [{"role": "user", "content": "3+5="}]
    c.chat.completions.create(model="x", messages=first)  # "7": the agent throws it away and asks again
    c.chat.completions.create(model="x", messages=first)  # "8"
    c.chat.completions.create(model="x", messages=[*first, {"role": "assistant", "content": "8"},
                                                   {"role": "user", "content": "sure?"}])  # "9"
    calls = proxy.close(key).calls
    assert (concat(calls).turns, concat(calls).off_branch) == (2, 1)
    ex = individual(calls, turn_discount=0.9)
    assert (ex.turns, ex.off_branch) == (3, 0)
    assert [proxy.tokenizer.decode(p.response_ids, skip_special_tokens=True) for p in ex.episode.parts] == \
        ["7", "8", "9"]
    assert [p.reward_scale for p in ex.episode.parts] == [0.9 ** 2, 0.9, 1.0]
    assert individual([]) is None


def test_concurrent_sessions_are_kept_apart(served) -> None:
    proxy, engine, url = served
    keys = [proxy.open(("t", 10 + i)) for i in range(4)]
    engine.script += [str(i) for i in range(8)]

    async def episode(key: str, i: int) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        for turn in range(2):
            await c.chat.completions.create(model="x", messages=[{"role": "user", "content": f"s{i}t{turn}"}])
        await c.close()

    async def all_episodes() -> None:
        await asyncio.gather(*(episode(k, i) for i, k in enumerate(keys)))

    asyncio.run(all_episodes())
    for i, key in enumerate(keys):
        calls = proxy.close(key).calls
        prompts = [proxy.tokenizer.decode(c.prompt_ids, skip_special_tokens=False) for c in calls]
        assert prompts == [f"user: s{i}t0<eos>\nassistant: ", f"user: s{i}t1<eos>\nassistant: "]


def test_tool_call_parsing_keeps_what_is_not_a_call() -> None:
    text, calls = parse_tool_calls('ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> '
                                   '<tool_call>not json</tool_call>')
    assert [c["function"]["name"] for c in calls] == ["f"] and json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert text == "ok  <tool_call>not json</tool_call>"
    assert parse_tool_calls("plain") == ("plain", [])


def test_a_chat_reply_cut_at_a_stop_string_is_continued_with_its_turn_closed(served) -> None:
    """The reply the agent gets ends before the stop string, the trained tokens include it; the next call
    continues those tokens and then closes the assistant turn as the template does."""
    proxy, engine, url = served
    key = proxy.open(("t", "stop"))
    c = client(url, key)
    engine.script += ["hi;there", "ok"]
    messages = [{"role": "user", "content": "say hi"}]
    r = c.chat.completions.create(model="x", messages=messages, stop=[";"])
    assert r.choices[0].message.content == "hi" and r.choices[0].finish_reason == "stop"
    c.chat.completions.create(model="x", messages=[*messages, {"role": "assistant", "content": "hi"},
                                                   {"role": "user", "content": "again"}])
    asked = proxy.tokenizer.decode(engine.asked[-1], skip_special_tokens=False)
    assert asked == "user: say hi<eos>\nassistant: hi;<eos>\nuser: again<eos>\nassistant: "
    calls = proxy.close(key).calls
    assert calls[1].prompt_ids[:len(calls[0].prompt_ids) + len(calls[0].output_ids)] == \
        calls[0].prompt_ids + calls[0].output_ids  # the exact continuation: one trained branch
    assert concat(calls).turns == 2


def test_the_admin_api_adds_keys_sets_rewards_and_ends_sessions_under_its_key(served) -> None:
    proxy, engine, url = served
    admin_url = url.removesuffix("/v1") + "/admin/sessions"
    key = proxy.open(("t", 9))

    def admin(method: str, path: str = "", token: str = "k" * 20, **body) -> httpx.Response:
        return httpx.request(method, admin_url + path, json=body or None, timeout=10,
                             headers={"Authorization": f"Bearer {token}"})

    off = admin("GET")
    assert off.status_code == 404 and "agent.admin_key_file" in off.json()["error"]["message"]  # no admin key: off
    assert admin("POST", wrong="body").status_code == 404  # checked before the body: nothing about the API shows
    proxy.admin_key = "k" * 20
    try:
        assert admin("GET", token="sk-wrong").status_code == 401
        assert admin("POST", token="sk-wrong", wrong="body").status_code == 401
        assert admin("GET", token=key).status_code == 401  # an episode's key is not the admin's
        listed = admin("GET").json()["data"]
        assert [(s["id"], s["episode"], s["calls"], s["reward"]) for s in listed] == [(key, "('t', 9)", 0, None)]
        sub = admin("POST", parent=key).json()["api_key"]  # a sub-agent's key for the same episode
        engine.script += ["4", "6"]
        client(url, key).completions.create(model="x", prompt="2+2=", max_tokens=4)
        client(url, sub).completions.create(model="x", prompt="3+3=", max_tokens=4)
        assert admin("GET").json()["data"][0]["calls"] == 2 and admin("GET").json()["data"][0]["keys"] == 2
        assert admin("POST", f"/{sub}/reward", reward=0.5).json() == {"id": key, "reward": 0.5}  # any key names it
        bad = httpx.post(f"{admin_url}/{key}/reward", content=b'{"reward": NaN}', timeout=10,
                         headers={"Authorization": "Bearer " + "k" * 20, "Content-Type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward"
        assert admin("POST", f"/{key}/reward", reward="high").status_code == 400
        assert admin("POST", "/sk-nobody/end").status_code == 404
        session = proxy.sessions[key]
        assert admin("POST", f"/{key}/end").json() == {"id": key, "calls": 2, "reward": 0.5}
        assert session.ended.is_set() and session.reward == 0.5
        assert [proxy.tokenizer.decode(c.prompt_ids) for c in session.calls] == ["2+2=", "3+3="]
        for dead in (key, sub):  # ending the episode ends every key of it
            with pytest.raises(openai.AuthenticationError):
                client(url, dead).models.list()
        assert admin("GET").json()["data"] == []
    finally:
        proxy.admin_key = None


@pytest.fixture(scope="module")
def served_reserved():
    """The proxy with a tokenizer that also has a special token outside its special-tokens map (as Llama 3's
    reserved tokens are): decoding skips it, ``all_special_ids`` does not list it."""
    from tokenizers import AddedToken
    tokenizer = build_char_tokenizer()
    tokenizer.add_tokens([AddedToken("<|reserved|>", special=True)])
    assert tokenizer.convert_tokens_to_ids("<|reserved|>") not in tokenizer.all_special_ids
    engine = ScriptedEngine(tokenizer)
    proxy = AgentProxy(tokenizer, engine.generate, limits=ModelLimits(vocab_size=len(tokenizer), context=1024),
                       max_tokens=128)
    with serve(build_app(proxy)) as url:
        yield proxy, engine, url


@pytest.mark.parametrize("script, shown, written", [
    (["4<unk>2<pad>", "<unk>", "ok"], ["42", None, "ok"], ["4<unk>2<pad><eos>", "<unk><eos>"]),
    (["4<|reserved|>2", "<|reserved|>", "ok"], ["42", None, "ok"], ["4<|reserved|>2<eos>", "<|reserved|><eos>"]),
])
def test_a_reply_with_special_tokens_inside_is_continued_with_the_tokens_the_model_wrote(
        served_reserved, script, shown, written) -> None:
    """The agent reads the reply without the special tokens the model sampled (a pad, an unk, a reserved token);
    the next call still continues the model's own tokens, eos once, so the episode is one trained branch."""
    proxy, engine, url = served_reserved
    key = proxy.open(("t", "special"))
    c = client(url, key)
    engine.script += script
    messages = [{"role": "user", "content": "2+2"}]
    for _ in range(3):
        r = c.chat.completions.create(model="x", messages=messages)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "again"}]
    assert [m["content"] for m in messages[1::2]] == shown
    asked = proxy.tokenizer.decode(engine.asked[-1], skip_special_tokens=False)
    assert asked == (f"user: 2+2<eos>\nassistant: {written[0]}\nuser: again<eos>\nassistant: {written[1]}\n"
                     "user: again<eos>\nassistant: ")
    calls = proxy.close(key).calls
    assert concat(calls).turns == 3 and concat(calls).off_branch == 0
