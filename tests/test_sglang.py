"""The SGLang engine at its HTTP boundary: against a stand-in of SGLang's API on CPU (tests/sglang_standin.py),
and against a real SGLang server where one can run (marked ``sglang``: CUDA only)."""

from __future__ import annotations

import importlib.util
import json
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from engine_checks import check_versions_exact, collect, hf_greedy, make_policies, prompts, run_with_update
from hpcrl.model.tiny import build_char_tokenizer
from hpcrl.rollout import sglang_engine
from hpcrl.rollout.config import RolloutConfig
from hpcrl.rollout.engine import InferenceEngine, Request, SamplingParams
from hpcrl.rollout.engines import EngineSite, build_engine
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
    done = run_with_update(engine, [Request(i, p) for i, p in enumerate(prompts(16))], weights)
    counts = check_versions_exact(done, a, b)
    assert counts["v0"] > 0 and counts["v1"] > 0 and counts["spanning"] > 0, counts
    assert counts["told_apart"] > 0.5 * (counts["v0"] + counts["v1"]), counts
    engine.sampling = SamplingParams(max_new_tokens=10, greedy=True)
    greedy = prompts(6)
    got = collect(engine, [Request(i, p) for i, p in enumerate(greedy)])
    for i, p in enumerate(greedy):
        assert got[i].output_ids == hf_greedy(b, p, 10), i
        assert got[i].versions == [1] * len(got[i].output_ids)
    if launcher[1] == str(STANDIN):  # the protocol, as the server saw it
        paths = [p for p, _ in calls(engine) if p != "/generate" and not p.startswith("/standin")]
        update = paths.index("/update_weights_from_disk")
        assert paths[update - 2:update + 3] == ["/abort_request", "/pause_generation", "/update_weights_from_disk",
                                                "/update_weight_version", "/continue_generation"], paths
        body = dict(calls(engine))["/update_weights_from_disk"]
        assert body["weight_version"] == "1" and Path(body["model_path"]) == weights.version_dir(1)


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
    with pytest.raises(EngineServerError, match="update_weights_from_disk.*no.such.weight|refused version 2"):
        engine.update_weights(WeightVersion(2, path=bad))
    # the server's weights are unknown after a failed load: the engine refuses to generate on
    assert engine.version == 1
    with pytest.raises(EngineServerError, match="loading version 2"):
        engine.poll()
    if launcher[1] == str(STANDIN):  # the server was not left paused
        assert [p for p, _ in calls(engine) if not p.startswith("/standin")][-1] == "/continue_generation"


def test_a_bad_model_path_fails_with_the_servers_own_error(launcher, tmp_path) -> None:
    with pytest.raises(EngineServerError, match="exited with code") as err:
        start(tmp_path / "no-such-model", tmp_path, server_start_timeout_s=120)
    assert "no-such-model" in err.value.tail
