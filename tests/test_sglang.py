"""The SGLang engine at its HTTP boundary: against a stand-in of SGLang's API on CPU (tests/sglang_standin.py),
and against a real SGLang server where one can run (marked ``sglang``: CUDA only)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from test_e2e import cache, check_ok, submit  # noqa: F401 (cache is a fixture)
from engine_checks import (collect, groups_share_first_requests, hf_greedy, make_policies, prompts,
                           update_mid_generation)
from hpcrl.audit import audit
from hpcrl.metrics.writer import read_metrics
from hpcrl.model.tiny import build_char_tokenizer
from hpcrl.rollout import remote_engine, sglang_engine
from hpcrl.rollout.config import RolloutConfig
from hpcrl.rollout.engine import InferenceEngine, Request, SamplingParams
from hpcrl.rollout.engines import EngineSite, build_engine
from hpcrl.rollout.remote_engine import RemoteEngine
from hpcrl.rollout.server import EngineServerError
from hpcrl.weights.version import WeightVersion

STANDIN = Path(__file__).resolve().parent / "sglang_standin.py"
REAL = importlib.util.find_spec("sglang") is not None and torch.cuda.is_available()
torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["standin", pytest.param("real", marks=[
    pytest.mark.sglang, pytest.mark.gpu, pytest.mark.skipif(not REAL, reason="needs sglang and a CUDA device")])])
def launcher(request):
    if request.param == "real":
        yield sglang_engine.LAUNCHER
        return
    original = sglang_engine.LAUNCHER
    sglang_engine.LAUNCHER = [sys.executable, str(STANDIN), "--token-delay-s", "0.002"]
    yield sglang_engine.LAUNCHER
    sglang_engine.LAUNCHER = original


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    return make_policies(tmp_path_factory.mktemp("sglang"))


def start(model_path, log_dir: Path, **cfg) -> InferenceEngine:
    rollout = RolloutConfig(**{"engine": "sglang", "max_new_tokens": 16, "server_start_timeout_s": 300, **cfg})
    site = EngineSite(model_path=str(model_path), dtype="float32", log_dir=log_dir, name="sg")
    return build_engine(rollout, site, seed=0, tokenizer=build_char_tokenizer())


@pytest.fixture(scope="module")
def engine(launcher, policies, tmp_path_factory):
    eng = start(policies[0], tmp_path_factory.mktemp("sglang-logs"))
    yield eng
    eng.close()
    assert eng.server.proc.poll() is not None


def calls(engine) -> list[tuple[str, dict]]:
    with urllib.request.urlopen(f"{engine.url}/standin/calls") as r:
        return [(c["path"], c.get("body")) for c in json.loads(r.read())]


def test_update_mid_generation_is_version_exact_and_loads_the_published_weights(engine, policies, launcher) -> None:
    _, a, b, weights = policies
    counts, version, model = update_mid_generation(engine, [Request(i, p) for i, p in enumerate(prompts(16))],
                                                   a, b, weights)
    assert counts["told_apart"] > 0.5 * (counts["old"] + counts["new"]), counts
    engine.sampling = SamplingParams(max_new_tokens=10, greedy=True)
    greedy = prompts(6)
    got = collect(engine, [Request(i, p) for i, p in enumerate(greedy)])
    for i, p in enumerate(greedy):
        assert got[i].output_ids == hf_greedy(model, p, 10), i
        assert got[i].versions == [version] * len(got[i].output_ids)
    if launcher[1] == str(STANDIN):  # the protocol, as the server saw it
        paths = [p for p, _ in calls(engine) if p != "/generate" and not p.startswith("/standin")]
        update = paths.index("/update_weights_from_disk")
        assert paths[update - 2:update + 3] == ["/abort_request", "/pause_generation", "/update_weights_from_disk",
                                                "/update_weight_version", "/continue_generation"], paths
        body = dict(calls(engine))["/update_weights_from_disk"]
        assert body["weight_version"] == str(version) and Path(body["model_path"]) == weights.version_dir(version)


def test_a_prompt_groups_samples_share_their_first_request_and_stay_version_exact(engine, policies) -> None:
    _, a, b, weights = policies
    counts, greedy, expected = groups_share_first_requests(engine, a, b, weights)
    # together: 1 first request per group of 4 (warm-up), 2 per paced group (its 2-token sample apart); alone: 1 each
    assert counts["first_requests"] <= 0.75 * counts["sequences"], counts
    assert [c.output_ids for c in greedy] == [expected] * 4


def test_versions_held_in_memory_go_to_the_server_over_its_update_group(launcher, policies, tmp_path) -> None:
    """rollout.server_update=group: tensors in the rollout's memory are broadcast into the server (rank 0 to its
    workers) instead of staged to disk; generation stays version-exact across the update."""
    _, a, b, weights = policies
    eng = start(policies[0], tmp_path, server_update="group")
    try:
        counts, version, model = update_mid_generation(eng, [Request(i, p) for i, p in enumerate(prompts(16))],
                                                       a, b, weights, in_memory=True)
        assert counts["told_apart"] > 0.5 * (counts["old"] + counts["new"]), counts
        eng.sampling = SamplingParams(max_new_tokens=10, greedy=True)
        greedy = prompts(4)
        got = collect(eng, [Request(i, p) for i, p in enumerate(greedy)])
        assert [c.output_ids for c in got] == [hf_greedy(model, p, 10) for p in greedy]
        assert not list(eng.staging_dir.glob("v*"))  # nothing was staged
        if launcher[1] == str(STANDIN):
            paths = [p for p, _ in calls(eng) if p != "/generate" and not p.startswith("/standin")]
            assert paths.count("/init_weights_update_group") == 1 and "/update_weights_from_disk" not in paths
            assert paths.count("/update_weights_from_distributed") == eng.stats["weight_updates"] >= 1
            body = [b for p, b in calls(eng) if p == "/update_weights_from_distributed"][-1]
            assert body["weight_version"] == str(version) and "lm_head.weight" in body["names"]
    finally:
        eng.close()


@pytest.mark.slow
def test_a_run_broadcasting_collective_weights_into_the_server_passes_the_audit(tmp_path, cache) -> None:
    """A whole run with an SGLang rollout (the stand-in, through rollout.server_launcher): the trainer's broadcast
    reaches the rollout, which broadcasts it on into its server over the server's update group, every step."""
    run = tmp_path / "sglang"
    check_ok(submit(run, cache, "rollout.engine=sglang", "weights.mode=collective", "rollout.server_update=group",
                    f"rollout.server_launcher=[{sys.executable},{STANDIN},--token-delay-s,0]",
                    "admission.max_staleness=0", "algo.drop_uniform_groups=false", timeout=600))
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.steps == 8 and rep.max_token_staleness == 0
    steps = [r for r in read_metrics(run / "logs" / "metrics.jsonl") if "mismatch/tokens" in r]
    # eta = 0: every token comes from the weights the trainer holds; the server's logprobs are the trainer's
    assert len(steps) == 8 and max(r["mismatch/abs_max"] for r in steps) < 1e-3
    stats = json.loads((run / "logs" / "rollout-0.stats.json").read_text())
    assert stats["engine"]["weight_updates"] >= 4
    assert "weight-update group" in (run / "logs" / "rollout-0.log").read_text()


def test_abort_all_returns_every_request_and_the_engine_goes_on(engine) -> None:
    engine.sampling = SamplingParams(max_new_tokens=16)
    for i, p in enumerate(prompts(5)):
        engine.submit(Request(("x", i), p))
    assert sorted(r.id for r in engine.abort_all()) == [("x", i) for i in range(5)]
    assert engine.num_in_flight() == 0
    assert [c.id for c in collect(engine, [Request("after", [5, 6, 7])])] == ["after"]


def test_a_refused_update_fails_with_the_servers_message(engine, launcher, tmp_path) -> None:
    bad = tmp_path / "v000002"
    bad.mkdir()
    from safetensors.torch import save_file
    save_file({"no.such.weight": torch.zeros(2)}, str(bad / "model.safetensors"))
    version = engine.version
    with pytest.raises(EngineServerError, match=f"update_weights_from_disk.*no.such.weight|refused version {version + 1}"):
        engine.update_weights(WeightVersion(version + 1, path=bad))
    # the server's weights are unknown after a failed load: the engine refuses to generate on
    assert engine.version == version
    with pytest.raises(EngineServerError, match=f"loading version {version + 1}"):
        engine.poll()
    if launcher[1] == str(STANDIN):  # the server was not left paused
        assert [p for p, _ in calls(engine) if not p.startswith("/standin")][-1] == "/continue_generation"


def test_a_bad_model_path_fails_with_the_servers_own_error(launcher, tmp_path) -> None:
    with pytest.raises(EngineServerError, match="exited with code") as err:
        start(tmp_path / "no-such-model", tmp_path, server_start_timeout_s=120)
    assert "no-such-model" in err.value.tail


# -- the client's connection pool against a server's keep-alive ---------------------------------------------------

class OneRequestPerConnection:
    """A raw HTTP server that answers the first request on a connection and closes the connection when a second
    one arrives: what a server does whose keep-alive expires just as a pooled connection is reused."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(asyncio.start_server(self.serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        for answered in (False, True):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0)
            await reader.readexactly(length)
            if answered:
                break
            body = json.dumps({"text": "", "output_ids": [5, 6],
                               "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "0",
                                             "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]]}}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()
        writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)


def test_a_connection_idle_longer_than_the_client_keepalive_is_not_reused(tmp_path) -> None:
    # uvicorn (vLLM's and SGLang's server) closes an idle connection after 5 s; a client that reuses one as it
    # closes gets "Server disconnected", and the rollout job failed (seen on a loaded CI machine)
    server = OneRequestPerConnection()
    engine = RemoteEngine(sglang_engine.SGLangBackend(), server.url, sampling=SamplingParams(max_new_tokens=2),
                          staging_dir=tmp_path / "staging")
    try:
        first = collect(engine, [Request("first", [3, 4])])
        assert first[0].output_ids == [5, 6] and first[0].logprobs == [-0.5, -0.25]
        time.sleep(remote_engine.CLIENT_KEEPALIVE_S + 0.5)  # idle: the pool must have let the connection go
        second = collect(engine, [Request("second", [3, 4])])
        assert second[0].output_ids == [5, 6] and server.connections == 2
    finally:
        engine.close()
        server.close()
