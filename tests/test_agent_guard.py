"""The agent proxy under hostile and careless clients, over the real embedded engine.

The proxy runs as a rollout job runs it: :class:`AgentEpisodes` serves it
(uvicorn, loopback) in front of a real :class:`TorchEngine` on a tiny model,
and a pump thread drives the engine as the rollout loop does (submit the
queued requests, decode, hand completions back). Each case of the review
that found the holes is a test here: token ids outside the vocabulary
(which used to kill the engine loop), prompts longer than the context, huge
bodies, the key checked before the body, malformed message shapes (400
naming the field, the keep-alive connection still usable), a failure inside
the proxy kept to its request, a slow request not stalling other sessions,
the per-episode quotas. Then property-based fuzzing of both completion
routes: no request may get a 500, hang, or stop the engine loop.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hpcrl.agent.config import AgentConfig  # noqa: E402
from hpcrl.agent.proxy import AgentProxy  # noqa: E402
from hpcrl.agent.routes import build_app  # noqa: E402
from hpcrl.agent.runner import AgentEpisodes  # noqa: E402
from hpcrl.model.hf_io import load_model, load_tokenizer  # noqa: E402
from hpcrl.model.limits import ModelLimits, Rejected  # noqa: E402
from hpcrl.model.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model  # noqa: E402
from hpcrl.rollout.engine import Completion, Request, SamplingParams  # noqa: E402
from hpcrl.rollout.torch_engine import TorchEngine  # noqa: E402
from test_agent_proxy import serve  # noqa: E402

MB = 1024 * 1024
# examples per route, the same ones every run; HPCRL_FUZZ_EXAMPLES=5000 HPCRL_FUZZ_RANDOM=1 for a longer, new search
FUZZ_EXAMPLES = int(os.environ.get("HPCRL_FUZZ_EXAMPLES", "300"))


async def never_called(data: dict, *, base_url: str, api_key: str) -> float:
    raise AssertionError("these tests open sessions themselves")


class Pump(threading.Thread):
    """The rollout loop's part, on its own thread: submit queued requests, decode, return completions."""

    def __init__(self, runner: AgentEpisodes, engine: TorchEngine) -> None:
        super().__init__(name="pump", daemon=True)
        self.runner, self.engine = runner, engine
        self.stop, self.error = threading.Event(), None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.runner.finished()
                if self.engine.num_in_flight():
                    for completion in self.engine.poll():
                        self.runner.collect(completion)
                else:
                    self.runner.wait(0.01)
        except BaseException as e:  # noqa: BLE001 - the test reads it: the engine loop died
            self.error = e


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("guard") / "model",
                                 TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                                 head_dim=16, intermediate_size=64))
    tokenizer = load_tokenizer(model_dir)
    engine = TorchEngine(load_model(model_dir), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, max_batch_size=8,
                         sampling=SamplingParams(max_new_tokens=4), seed=0)
    cfg = AgentConfig(fn="x:y", session_rate_limit=0, session_max_in_flight=0)  # quotas: their own test
    runner = AgentEpisodes(engine, tokenizer, cfg, never_called, max_tokens=4, limits=ModelLimits.of_dir(model_dir))
    pump = Pump(runner, engine)
    pump.start()
    yield runner, pump
    pump.stop.set()
    pump.join(10)
    runner.close()


def alive(runner: AgentEpisodes, pump: Pump) -> None:
    """The engine loop is running and a well-formed request of a new session gets its completion."""
    assert pump.is_alive() and pump.error is None, f"the engine loop died: {pump.error!r}"
    key = runner.proxy.open(("check", time.monotonic()))
    try:
        r = client(runner.base_url, key).completions.create(model="p", prompt="1+1=", max_tokens=3)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    finally:
        runner.proxy.close(key)


def client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)


@contextmanager
def session(runner: AgentEpisodes):
    key = runner.proxy.open(("t", time.monotonic()))
    try:
        yield key
    finally:
        if key in runner.proxy.sessions:
            runner.proxy.close(key)


def post(url: str, path: str, key: str | None, body, **kw) -> httpx.Response:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers=headers, timeout=60, **kw)


def announce(runner: AgentEpisodes, method: str, path: str, key: str | None, length: int) -> tuple[int, dict, dict]:
    """Send only the headers of a request whose body would be ``length`` bytes; the answer (status, headers,
    error) that comes without the body."""
    port = int(runner.base_url.rsplit(":", 1)[1].split("/")[0])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest(method, path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(length))
        if key:
            conn.putheader("Authorization", f"Bearer {key}")
        conn.endheaders()
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())["error"]
    finally:
        conn.close()


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in response.text
    return error


# -- the review's cases ------------------------------------------------------------------
def test_token_ids_outside_the_vocabulary_get_400_and_the_engine_loop_goes_on(live) -> None:
    runner, pump = live
    with session(runner) as key:
        for bad in ([1000000], [-1], [5, 6, runner.engine.limits.vocab_size]):
            with pytest.raises(openai.BadRequestError) as e:
                client(runner.base_url, key).completions.create(model="p", prompt=bad, max_tokens=2)
            assert e.value.body["code"] == "invalid_token_id" and e.value.body["param"] == "prompt"
    assert runner.stats["rejected_invalid_token_id"] >= 3
    alive(runner, pump)


def test_the_engine_refuses_token_ids_outside_the_vocabulary_itself(live) -> None:
    """The last line, for any caller that did not check: submit raises, nothing enters the batch."""
    runner, _ = live
    engine = runner.engine
    with pytest.raises(Rejected, match="outside the vocabulary"):
        engine.submit(Request(id="x", prompt_ids=[3, engine.limits.vocab_size]))
    with pytest.raises(ValueError):
        engine.submit(Request(id="y", prompt_ids=[-1]))


def test_a_prompt_longer_than_the_context_gets_400_and_a_huge_body_413(live) -> None:
    runner, pump = live
    proxy = runner.proxy
    assert proxy.max_prompt_tokens == 512 - 4  # the model's context minus rollout.max_new_tokens
    with session(runner) as key:
        big = "1+1=" * (2 * MB // 4)  # 2 MB: about 2.1 M tokens for a model with 512 positions
        with pytest.raises(openai.BadRequestError) as e:
            client(runner.base_url, key).chat.completions.create(model="p", messages=[{"role": "user",
                                                                                      "content": big}])
        assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
        with pytest.raises(openai.BadRequestError) as e:
            client(runner.base_url, key).completions.create(model="p", prompt=[7] * 509, max_tokens=2)
        assert e.value.body["code"] == "context_length_exceeded"
        r = client(runner.base_url, key).completions.create(model="p", prompt=[7] * 508, max_tokens=4)
        assert r.usage.prompt_tokens == 508  # the longest prompt allowed is served
        status, headers, error = announce(runner, "POST", "/v1/chat/completions", key, 20 * MB)
        assert (status, error["code"], headers["connection"]) == (413, "request_too_large", "close")
        chunked = httpx.post(runner.base_url + "/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                             content=iter([b'{"prompt": "', b"x" * (3 * MB), b"x" * (3 * MB), b'"}']))
        assert chunked.status_code == 413  # no Content-Length: read up to the limit, then refused
    assert runner.stats["rejected_context_length_exceeded"] >= 2 and runner.stats["rejected_request_too_large"] >= 2
    alive(runner, pump)


def test_the_key_is_checked_before_the_body_on_every_route(live) -> None:
    runner, _ = live
    url, admin = runner.base_url, runner.base_url.removesuffix("/v1")
    for path in ("/chat/completions", "/completions"):
        for key in (None, "sk-nobody"):
            for body in (b"{not json", b'{"messages": 3}'):
                r = post(url, path, key, body)
                assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
                assert r.headers.get("connection") == "close"  # the body was never read
            # a 20 MB body announced and never sent: the answer comes without the proxy waiting for it
            status, headers, error = announce(runner, "POST", "/v1" + path, key, 20 * MB)
            assert (status, error["code"], headers.get("connection")) == (401, "invalid_api_key", "close")
    with session(runner) as key:  # one key in two headers: the guard and the route could read different ones
        r = httpx.post(url + "/completions", timeout=10, content=b'{"prompt": "1"}',
                       headers=[("Authorization", f"Bearer {key}"), ("Authorization", "Bearer sk-other")])
        assert r.status_code == 401 and "one Authorization header" in error_of(r)["message"]
        for path in ("/x", "//v1/completions", "/v2/completions", "/"):  # outside the API: 404, body unread
            r = httpx.post(admin + path, timeout=10, content=b"{}", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 404 and r.headers.get("connection") == "close", (path, r.status_code)
    for body in (b"{not json", b'{"parent": 1}'):
        r = post(admin, "/admin/sessions", "sk-nobody", body)
        assert r.status_code == 404  # the admin API is off: nothing about it shows, whatever the body
        assert httpx.get(admin + "/admin/sessions", timeout=10).status_code == 404
    runner.proxy.admin_key = "k" * 20
    try:
        for key in (None, "sk-nobody", "k" * 19):
            assert post(admin, "/admin/sessions", key, b"{not json").status_code == 401
            assert post(admin, "/admin/sessions/sk-x/reward", key, b"[").status_code == 401
        assert post(admin, "/admin/sessions", "k" * 20, b"{not json").status_code == 400  # the key, then the body
    finally:
        runner.proxy.admin_key = None


MALFORMED = [  # body, the field the 400 names
    ({"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "tool_calls": [{"id": "c1"}]}]},
     "messages.1.assistant.tool_calls.0.function"),
    ({"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "tool_calls": "calc"}]},
     "messages.1.assistant.tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 42}]}]}, "messages.0.user.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.user.content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 9}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["s"] * 17}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {}}]},
     "tools.0.function.name"),
]


def test_token_ids_are_json_integers_and_a_named_tool_must_be_offered(live) -> None:
    runner, _ = live
    with session(runner) as key:
        for prompt in ([True, 5], [1.0], [3, "4"], "a\ud800b"):  # bools, floats, mixed, a lone surrogate
            r = post(runner.base_url, "/completions", key, {"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 400 and error_of(r)["code"] == "invalid_request", (prompt, r.text)
        r = post(runner.base_url, "/chat/completions", key, {"messages": [{"role": "user", "content": "1"}],
                                                             "tool_choice": {"type": "function",
                                                                             "function": {"name": "calc"}}})
        assert r.status_code == 400 and "not one of the tools offered" in error_of(r)["message"]
        r = post(runner.base_url, "/completions", key, b'{"prompt": ')
        assert r.status_code == 400 and error_of(r)["param"] is None and "Invalid JSON" in error_of(r)["message"]


def test_malformed_shapes_get_400_naming_the_field_and_the_connection_stays_usable(live) -> None:
    runner, pump = live
    port = int(runner.base_url.rsplit(":", 1)[1].split("/")[0])
    with session(runner) as key:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # one keep-alive connection for all
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        try:
            for body, field in MALFORMED:
                conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
                r = conn.getresponse()
                error = json.loads(r.read())["error"]
                assert r.status == 400, (body, error)
                assert error["param"].startswith(field) and field in error["message"], (field, error)
            conn.request("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "1+"}],
                                                                     "max_tokens": 2}), headers)
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["choices"][0]["message"]["role"] == "assistant"
        finally:
            conn.close()
    alive(runner, pump)


def test_a_failure_inside_the_proxy_fails_that_request_alone(live, monkeypatch) -> None:
    """The template raising (a bug, a tokenizer's quirk) is a 500 in OpenAI's shape for that request; the next
    request on the same connection, the other sessions and the engine go on."""
    runner, pump = live
    render = runner.proxy.render

    def fragile(messages, tools, generation_prompt):
        if any(m.get("content") == "boom" for m in messages):
            raise RuntimeError("template exploded")
        return render(messages, tools, generation_prompt)

    monkeypatch.setattr(runner.proxy, "render", fragile)
    port = int(runner.base_url.rsplit(":", 1)[1].split("/")[0])
    with session(runner) as key:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        try:
            for content, status in (("boom", 500), ("1+", 200), ("boom", 500), ("2+", 200)):
                conn.request("POST", "/v1/chat/completions",
                             json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2}), headers)
                r = conn.getresponse()
                body = json.loads(r.read())
                assert r.status == status, body
                if status == 500:
                    assert body["error"]["code"] == "internal_error" and "Traceback" not in json.dumps(body)
        finally:
            conn.close()
    assert runner.stats["rejected_internal_error"] >= 2
    alive(runner, pump)


def test_a_request_stuck_in_the_tokenizer_does_not_stall_other_sessions(live, monkeypatch) -> None:
    """Rendering and tokenising run off the event loop: while one request's tokenisation is held, another
    session's requests are answered."""
    runner, pump = live
    held, entered = threading.Event(), threading.Event()
    encode = runner.proxy.encode

    def slow(text: str) -> list[int]:
        if "hold" in text:
            entered.set()
            assert held.wait(60)
        return encode(text)

    monkeypatch.setattr(runner.proxy, "encode", slow)
    with session(runner) as a, session(runner) as b:
        result = {}
        stuck = threading.Thread(target=lambda: result.update(r=post(runner.base_url, "/completions", a,
                                                                       {"prompt": "hold", "max_tokens": 2})))
        stuck.start()
        try:
            assert entered.wait(30)
            assert [m.id for m in client(runner.base_url, b).models.list().data] == ["hpcrl-policy"]
            r = client(runner.base_url, b).completions.create(model="p", prompt="3+", max_tokens=2)
            assert r.choices[0].finish_reason in ("stop", "length")
        finally:
            held.set()
            stuck.join(60)
        assert result["r"].status_code == 200
    alive(runner, pump)


# -- quotas ------------------------------------------------------------------------------
def test_an_episode_over_its_quota_gets_429_with_retry_after() -> None:
    tokenizer = build_char_tokenizer()
    gate = threading.Event()

    async def generate(prompt_ids: list[int], max_new_tokens: int) -> Completion:
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return Completion(id=None, prompt_ids=prompt_ids, output_ids=[1], logprobs=[-0.1], versions=[0],
                          finish_reason="stop")

    cfg = AgentConfig(session_max_in_flight=2, session_rate_limit=0)
    proxy = AgentProxy(tokenizer, generate, limits=ModelLimits(len(tokenizer), 512), cfg=cfg, max_tokens=4)
    with serve(build_app(proxy)) as url:
        key, other = proxy.open(("q", 0)), proxy.open(("q", 1))
        sub = proxy.add_key(key)  # a sub-agent's key shares its episode's quota
        results = []
        threads = [threading.Thread(target=lambda k=k: results.append(post(url, "/completions", k,
                                                                          {"prompt": "1+", "max_tokens": 1})))
                   for k in (key, sub)]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while proxy.sessions[key].quota.in_flight < 2:
            assert time.time() < deadline
            time.sleep(0.01)
        third = post(url, "/completions", key, {"prompt": "1+", "max_tokens": 1})
        assert third.status_code == 429 and error_of(third)["code"] == "too_many_requests_in_flight"
        assert third.headers["retry-after"] == "1"
        assert httpx.get(url + "/models", headers={"Authorization": f"Bearer {other}"}, timeout=10).status_code == 200
        gate.set()
        for t in threads:
            t.join(30)
        assert [r.status_code for r in results] == [200, 200]
        # n counts: a request of n = 3 would hold 3 completions of 2
        big = post(url, "/completions", key, {"prompt": "1+", "max_tokens": 1, "n": 3})
        assert big.status_code == 429 and error_of(big)["code"] == "too_many_requests_in_flight"
        # the rate: a new episode with 0.1 requests per second, a burst of one (max(rate, 1))
        proxy.cfg.session_rate_limit = 0.1
        slow = proxy.open(("q", 2))
        codes = [httpx.get(url + "/models", headers={"Authorization": f"Bearer {slow}"}, timeout=10)
                 for _ in range(4)]
        assert [r.status_code for r in codes] == [200, 429, 429, 429]  # unless 10 s passed between two of them
        assert error_of(codes[1])["code"] == "rate_limit_exceeded" and 1 <= int(codes[1].headers["retry-after"]) <= 10
        assert proxy.counts["rejected_rate_limit_exceeded"] == 3 and proxy.counts["rejected_too_many_requests_in_flight"] == 2
        proxy.sessions[slow].quota.stamp -= 10.0  # ten seconds later: one request's worth refilled
        assert httpx.get(url + "/models", headers={"Authorization": f"Bearer {slow}"}, timeout=10).status_code == 200
        assert httpx.get(url + "/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 200


def test_the_limits_are_checked_in_the_config() -> None:
    for bad in (dict(max_request_bytes=10), dict(max_prompt_tokens=-1), dict(session_max_in_flight=-2),
                dict(session_rate_limit=float("nan"))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AgentConfig(**bad)
    tokenizer = build_char_tokenizer()
    with pytest.raises(ValueError, match="max_prompt_tokens"):  # no room left for a reply
        AgentProxy(tokenizer, None, limits=ModelLimits(len(tokenizer), 512), max_tokens=512)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        AgentProxy(tokenizer, None, limits=ModelLimits(len(tokenizer), 512), cfg=AgentConfig(max_prompt_tokens=512))


def test_model_limits_are_read_from_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100, "max_position_embeddings": 64}))
    assert ModelLimits.of_dir(tmp_path) == ModelLimits(vocab_size=100, context=64)
    assert ModelLimits.of_config({"text_config": {"vocab_size": 9, "n_positions": 32}}) == ModelLimits(9, 32)
    assert ModelLimits.of_config({"vocab_size": 9}).context is None
    with pytest.raises(ValueError, match="vocab_size"):
        ModelLimits.of_config({"hidden_size": 8})


# -- fuzzing -----------------------------------------------------------------------------
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 40, 2 ** 40), st.floats(allow_nan=True),
                    st.text(max_size=12))
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=3), max_leaves=8)
_ids = st.lists(st.one_of(st.integers(0, 60), st.integers(-3, 2 ** 31)), max_size=600)
_text = st.one_of(st.text(max_size=40), st.text(alphabet="0123456789+=-*() ", max_size=40),
                  st.text(alphabet=st.characters(categories=["Cs", "Nd"]), max_size=4))  # lone surrogates too
_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio"])},
                              optional={"text": st.one_of(_text, _json)})
_content = st.one_of(_text, st.lists(_part, max_size=3), _json)
_function = st.fixed_dictionaries({}, optional={"name": st.one_of(st.text(max_size=8), _json),
                                                "arguments": st.one_of(st.text(max_size=20), _json)})
_tool_call = st.one_of(_json, st.fixed_dictionaries({"type": st.sampled_from(["function", "bogus"])},
                                                    optional={"id": _scalar, "function": st.one_of(_function, _json)}))
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", ""])},
    optional={"content": _content, "tool_calls": st.one_of(st.lists(_tool_call, max_size=2), _json),
              "tool_call_id": _scalar, "name": _scalar})
_common = {"n": st.one_of(st.integers(-1, 70), _json), "max_tokens": st.one_of(st.integers(-1, 10 ** 6), _json),
           "stop": st.one_of(_text, st.lists(_text, max_size=18), _json), "stream": st.one_of(st.booleans(), _json),
           "temperature": st.one_of(st.floats(-1, 3), _json), "top_p": st.floats(allow_nan=True),
           "model": _scalar, "seed": _scalar}
_chat = st.fixed_dictionaries({"messages": st.one_of(st.lists(_message, min_size=0, max_size=4), _json)},
                              optional={**_common, "logprobs": st.one_of(st.booleans(), _json),
                                        "top_logprobs": st.integers(-1, 30), "max_completion_tokens": st.integers(-1, 9),
                                        "tools": st.one_of(st.lists(st.fixed_dictionaries(
                                            {"type": st.just("function"), "function": _function}), max_size=2), _json),
                                        "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), _json)})
_completion = st.fixed_dictionaries({"prompt": st.one_of(_text, _ids, st.lists(_text, max_size=2), _json)},
                                    optional={**_common, "logprobs": st.one_of(st.integers(-1, 25), _json)})
# well-formed requests at their edges, so that the fuzzing reaches the engine too
_arith = st.text(alphabet="0123456789+=-*() ", min_size=1, max_size=600)
_good_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"]), "content": _arith}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), _arith)},
                          optional={"tool_calls": st.lists(st.fixed_dictionaries(
                              {"type": st.just("function"), "function": st.fixed_dictionaries(
                                  {"name": st.text(min_size=1, max_size=8), "arguments": st.text(max_size=30)})}),
                              max_size=2)}))
_good_common = {"n": st.integers(1, 64), "max_tokens": st.integers(1, 10 ** 6),
                "stop": st.one_of(_arith, st.lists(st.text(max_size=4), max_size=16)), "stream": st.booleans()}
_good_chat = st.fixed_dictionaries({"messages": st.lists(_good_message, min_size=1, max_size=4)},
                                   optional={**_good_common, "logprobs": st.booleans()})
_good_completion = st.fixed_dictionaries({"prompt": st.one_of(_arith, st.lists(st.integers(0, 60), min_size=1,
                                                                               max_size=600))},
                                         optional={**_good_common, "logprobs": st.integers(0, 5)})
_body = st.one_of(_json, st.binary(max_size=64))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=not os.environ.get("HPCRL_FUZZ_RANDOM"),
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


STATUSES: dict[tuple[str, int], int] = {}


def _fuzz_post(http_client: httpx.Client, path: str, body) -> httpx.Response:
    """POST ``body`` (JSON, or raw bytes) and count the status; a hang fails on the client's timeout."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http_client.post(path, content=content)
    STATUSES[path, r.status_code] = STATUSES.get((path, r.status_code), 0) + 1
    return r


def _answered(r: httpx.Response) -> bool:
    """A 200 carries its completions (as a JSON body or as server-sent events ending in [DONE]); a 400 carries
    OpenAI's error shape."""
    if r.status_code == 400:
        return set(r.json().get("error", {})) == {"message", "type", "param", "code"}
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        return r.text.rstrip().endswith("data: [DONE]")
    return r.status_code == 200 and len(r.json()["choices"]) >= 1


@pytest.fixture(scope="module")
def fuzz_client(live):
    runner, _ = live
    key = runner.proxy.open(("fuzz", 0))
    with httpx.Client(base_url=runner.base_url, timeout=60, headers={"Authorization": f"Bearer {key}",
                                                                      "Content-Type": "application/json"}) as c:
        yield c
    runner.proxy.close(key)


@FUZZ
@given(body=st.one_of(_good_chat, _chat, _body))
def test_fuzzed_chat_requests_never_get_a_500_a_hang_or_a_dead_engine_loop(live, fuzz_client, body) -> None:
    _, pump = live
    r = _fuzz_post(fuzz_client, "/chat/completions", body)
    assert r.status_code in (200, 400) and _answered(r), (r.status_code, r.text[:500], body)
    assert pump.is_alive() and pump.error is None, f"the engine loop died on {body!r}: {pump.error!r}"


@FUZZ
@given(body=st.one_of(_good_completion, _completion, _body))
def test_fuzzed_completion_requests_never_get_a_500_a_hang_or_a_dead_engine_loop(live, fuzz_client, body) -> None:
    _, pump = live
    r = _fuzz_post(fuzz_client, "/completions", body)
    assert r.status_code in (200, 400) and _answered(r), (r.status_code, r.text[:500], body)
    assert pump.is_alive() and pump.error is None, f"the engine loop died on {body!r}: {pump.error!r}"


@FUZZ
@given(path=st.one_of(st.sampled_from(["/v1/models", "/v1/completions", "/v1/chat/completions", "/admin/sessions",
                                       "/admin/sessions/x/end", "/v1", "/", "/docs", "/openapi.json"]),
                      st.text(alphabet="/v1adminsesconplt%.2F", max_size=30).map(lambda p: "/" + p)),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"]),
       keyed=st.booleans(), body=st.one_of(st.just(b""), _body.map(lambda b: b if isinstance(b, bytes) else
                                                                      json.dumps(b).encode())))
def test_fuzzed_paths_and_methods_never_get_a_500(live, fuzz_client, path, method, keyed, body) -> None:
    runner, pump = live
    headers = {} if keyed else {"Authorization": "Bearer sk-nobody"}
    r = fuzz_client.request(method, runner.base_url.removesuffix("/v1") + path, content=body or None,
                            headers=headers)
    assert r.status_code < 500, (method, path, r.status_code, r.text[:300])
    assert pump.is_alive() and pump.error is None


def test_after_the_fuzzing_the_engine_loop_serves(live) -> None:
    alive(*live)
    if STATUSES:  # the fuzzing reached the engine with well-formed requests, and refused malformed ones
        for path in ("/chat/completions", "/completions"):
            assert STATUSES.get((path, 200), 0) >= FUZZ_EXAMPLES // 10 and STATUSES.get((path, 400), 0), STATUSES
