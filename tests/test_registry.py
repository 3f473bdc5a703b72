"""The registries (rollout engines, train engines, reward scorers, schedulers): choices, errors and each engine's checks come
from the registered specs, and implementations registered from outside hpcrl (``tests/toy_engines.py``) run a
real run with no change to hpcrl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.audit import audit
from hpcrl.config import ConfigError, load_config
from hpcrl.metrics.writer import read_metrics
from hpcrl.rollout.registry import ENGINES, EngineSpec, engine_spec, register_engine

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs/quickstart.yaml")
AGENT = str(ROOT / "configs/agent_feedback.yaml")


def test_the_choices_and_the_error_come_from_the_registry() -> None:
    assert {"torch", "vllm", "sglang"} <= set(ENGINES)
    with pytest.raises(ConfigError, match=r"^rollout\.engine: must be one of \[") as e:
        load_config(QUICK, ["rollout.engine=tensorrt"])
    assert all(f"'{name}'" in str(e.value) for name in ("torch", "vllm", "sglang")) and "module:attr" in str(e.value)
    with pytest.raises(ConfigError, match="cannot import 'no_such_module:SPEC'"):
        load_config(QUICK, ["rollout.engine=no_such_module:SPEC"])
    with pytest.raises(ConfigError, match="is a function, not the EngineSpec it must name"):
        load_config(QUICK, ["rollout.engine=json:dumps"])
    with pytest.raises(ValueError, match="registered already"):
        register_engine(EngineSpec("torch", build="x:y"))


def test_the_schedulers_choices_and_how_their_jobs_are_reached_come_from_the_registry() -> None:
    from hpcrl.launch.registry import PROCESS_JOBS, SCHEDULERS, SLURM_JOBS, SchedulerSpec, jobs_of

    assert {"local", "slurm", "srun"} <= set(SCHEDULERS)
    with pytest.raises(ConfigError, match=r"^launch\.scheduler: must be one of \['local', 'slurm', 'srun'"):
        load_config(QUICK, ["launch.scheduler=pbs"])
    assert load_config(QUICK, ["launch.scheduler=toy_engines:TOY_SCHED"]).launch.scheduler == "toy_engines:TOY_SCHED"
    with pytest.raises(ValueError, match="jobs must be 'process' or 'slurm'"):
        SchedulerSpec("pbs", build="x:y", jobs="pbs")
    # a record names its kind of job; one written before records did is read through its scheduler
    assert jobs_of({"scheduler": "slurm"}) == SLURM_JOBS and jobs_of({"scheduler": "srun"}) == PROCESS_JOBS
    assert jobs_of({"scheduler": "a_plugin:NOT_IMPORTED", "jobs": SLURM_JOBS}) == SLURM_JOBS
    assert jobs_of({}) == PROCESS_JOBS


def test_each_engine_checks_what_it_cannot_do() -> None:
    with pytest.raises(ConfigError, match="kv_on_update: 'keep' needs an embedded engine"):
        load_config(QUICK, ["rollout.engine=vllm", "rollout.kv_on_update=keep"])
    assert load_config(QUICK, ["rollout.kv_on_update=keep"]).rollout.kv_on_update == "keep"
    with pytest.raises(ConfigError, match=r"server_update: 'group' needs a rollout\.engine with a weight-update "
                                          r"group \(sglang;"):
        load_config(QUICK, ["rollout.engine=vllm", "rollout.server_update=group"])
    lora = ["trainer.lora.rank=8", "trainer.lora.publish=adapter"]
    assert engine_spec("torch").adapters(4096) is None and engine_spec("vllm").adapters(512) is None
    with pytest.raises(ConfigError, match=r"vLLM serves adapters up to rank 512"):
        load_config(QUICK, [*lora, "rollout.engine=vllm", "trainer.lora.rank=600"])


def test_light_commands_read_a_plugin_engine_without_importing_it(tmp_path) -> None:
    """``python -m hpcrl status`` on a run whose config names a plugin that this process cannot import: the
    saved config loads without it (it was checked at submit)."""
    from hpcrl.config import save

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(QUICK, [f"run_dir={run}"])
    save(cfg, run / "config.yaml")
    text = (run / "config.yaml").read_text().replace("engine: torch", "engine: not_installed_anywhere:SPEC")
    (run / "config.yaml").write_text(text)
    out = subprocess.run([sys.executable, "-m", "hpcrl", "status", str(run), "--json"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and json.loads(out.stdout)["state"], out.stderr[-2000:]
    with pytest.raises(ConfigError, match="cannot import 'not_installed_anywhere:SPEC'"):  # a submit would refuse it
        load_config(QUICK, ["rollout.engine=not_installed_anywhere:SPEC"])


def test_a_plugin_engine_is_named_by_import_path(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    cfg = load_config(QUICK, ["rollout.engine=toy_engines:TOY"])
    spec = engine_spec(cfg.rollout.engine)
    assert spec.name == "toy_engines:TOY" and ENGINES["toy_engines:TOY"] is spec and not spec.server
    with pytest.raises(ConfigError, match="needs an embedded engine|weight-update group"):
        load_config(QUICK, ["rollout.engine=toy_engines:TOY", "rollout.server_update=group"])


def test_the_episode_runners_choices_and_checks_come_from_the_registry(monkeypatch) -> None:
    from hpcrl.rollout.registry import RUNNERS, episodes_of

    assert {"single_turn", "agent"} <= set(RUNNERS)
    assert episodes_of(load_config(QUICK, [])).name == "single_turn"  # auto, without agent.fn
    assert episodes_of(load_config(AGENT, [])).name == "agent"  # auto, with agent.fn
    with pytest.raises(ConfigError, match="rollout.episodes: must be one of \\['agent', 'single_turn'"):
        load_config(QUICK, ["rollout.episodes=multi"])
    with pytest.raises(ConfigError, match="rollout.episodes: 'agent' runs the agent function; set agent.fn"):
        load_config(QUICK, ["rollout.episodes=agent"])
    with pytest.raises(ConfigError, match="agent.fn: set, but rollout.episodes=single_turn does not run agents"):
        load_config(AGENT, ["rollout.episodes=single_turn"])
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    assert episodes_of(load_config(QUICK, ["rollout.episodes=toy_engines:TOY_EPISODES"])).name == \
        "toy_engines:TOY_EPISODES"


def test_the_train_engines_choices_checks_and_layouts_come_from_the_registry(monkeypatch) -> None:
    from hpcrl.init_from import trainer_layout, weight_layout
    from hpcrl.launch.resume import safe_to_change
    from hpcrl.trainer.registry import TRAIN_ENGINES, train_engine_spec

    assert {"fsdp", "megatron"} <= set(TRAIN_ENGINES)
    with pytest.raises(ConfigError, match=r"^trainer\.engine: must be one of \[.*'fsdp', 'megatron'"):
        load_config(QUICK, ["trainer.engine=deepspeed"])
    with pytest.raises(ConfigError, match=r"^trainer\.world_size: 3 is not a multiple of megatron"):
        load_config(QUICK, ["trainer.engine=megatron", "trainer.world_size=3", "trainer.megatron.tensor_parallel=2"])
    cfg = load_config(QUICK, ["trainer.engine=megatron", "trainer.world_size=2", "trainer.megatron.pipeline_parallel=2"])
    assert trainer_layout(cfg) == "megatron TP=1 PP=2" and trainer_layout(load_config(QUICK, [])) == "fsdp"
    assert weight_layout(["model.tp2.1.pp2.0/decoder.layers.0.x", "optim.y"]) == "megatron TP=2 PP=2"
    assert weight_layout(["model.model.embed_tokens.weight"]) == "fsdp"
    assert safe_to_change("trainer.megatron.tensor_parallel") and not safe_to_change("trainer.lr")
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    with pytest.raises(ConfigError, match=r"^trainer\.lora\.rank: LoRA is not built for trainer\.engine=toy_engines"):
        load_config(QUICK, ["trainer.engine=toy_engines:TOY_TRAIN", "trainer.lora.rank=4"])
    # its checkpoints hold HuggingFace names (no recogniser): FSDP2's layout, so --from moves between the two
    assert train_engine_spec("toy_engines:TOY_TRAIN").layout_of(load_config(QUICK, []).trainer) == "fsdp"


def test_the_scorer_comes_from_the_reward_registry(monkeypatch) -> None:
    from hpcrl.reward.config import RewardConfig
    from hpcrl.reward.registry import build_scorer
    from hpcrl.reward.runner import RewardRunner
    from hpcrl.reward.scorer import Scorer

    with pytest.raises(ConfigError, match=r"^reward\.scorer: must be one of \['code', 'function'\]"):
        load_config(QUICK, ["reward.scorer=docker"])
    with build_scorer(RewardConfig()) as scorer:
        assert isinstance(scorer, RewardRunner) and isinstance(scorer, Scorer)
        assert [r.status for r in scorer.score_many([("1+1=", "2", {"answer": "2"})])] == ["ok"]
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    plugin = build_scorer(RewardConfig(scorer="toy_engines:CountingScorer"))
    assert isinstance(plugin, Scorer) and plugin.score("1+1=", "3", {"answer": "2"}).reward == 0.0
    assert plugin.items == 1
    plugin.close()
    with pytest.raises(ValueError, match="cannot import 'toy_engines:Nothing'"):
        build_scorer(RewardConfig(scorer="toy_engines:Nothing"))


@pytest.mark.slow
def test_a_run_with_engines_registered_outside_hpcrl(tmp_path: Path) -> None:
    """``python -m hpcrl.submit ... rollout.engine=toy_engines:TOY trainer.engine=toy_engines:TOY_TRAIN
    reward.scorer=toy_engines:CountingScorer launch.scheduler=toy_engines:TOY_SCHED
    weights.mode=toy_engines:TOY_WEIGHTS rollout.episodes=toy_engines:TOY_EPISODES``: the supervisor starts the
    components through the toy scheduler, the trainer publishes through the toy transport, the rollout and trainer
    processes build the toy engines, the episode runner and the scorer
    through the registries and drive them through the real loops; the run completes, its audit is clean, and
    ``status`` reads its jobs without importing the plugin."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    scored = tmp_path / "scored"
    scored.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}",
           "HPCRL_TOY_SCORER_OUT": str(scored)}
    out = subprocess.run([sys.executable, "-m", "hpcrl.submit", "--config", QUICK, f"run_dir={run}",
                          f"model.cache_dir={cache}/models", f"data.synthetic_dir={cache}/data",
                          "model.tiny_hidden_size=32", "model.tiny_layers=2", "data.n_train=2000", "data.n_eval=40",
                          "sft.enabled=false", "admission.batch_size=4", "rollout.group_size=4",
                          "rollout.max_batch_size=8", "rollout.max_new_tokens=4", "trainer.total_steps=6",
                          "eval.every_steps=0", "eval.size=40", "rollout.engine=toy_engines:TOY",
                          "trainer.engine=toy_engines:TOY_TRAIN", "reward.scorer=toy_engines:CountingScorer",
                          "launch.scheduler=toy_engines:TOY_SCHED", "weights.mode=toy_engines:TOY_WEIGHTS",
                          "rollout.episodes=toy_engines:TOY_EPISODES"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    counts = [json.loads(p.read_text()) for p in (run / "logs").glob("*.toy.json")]
    assert counts and counts[0]["completed"] >= 6 * 4 * 4 and counts[0]["updates"] >= 1, counts
    steps = [r["toy/steps"] for r in read_metrics(run / "logs" / "metrics.jsonl") if "toy/steps" in r]
    assert steps == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], steps
    items = sum(json.loads(p.read_text())["items"] for p in scored.glob("*.json"))
    assert items >= 6 * 4 * 4  # the rollout scored every sample it published through the plugin
    episodes = sum(int(p.read_text()) for p in scored.glob("*.episodes"))
    assert episodes >= 6 * 4 * 4  # ... and made every one through the plugin runner
    rep = audit(run)
    assert rep.ok and rep.steps == 6, rep.violations
    # the scheduler started every component, and the run's job records say how status and a take-over reach them
    assert sorted(json.loads((run / "logs" / "toy_scheduler.json").read_text())) == ["rollout-0", "trainer-r0"]
    records = json.loads((run / "jobs" / "registry.json").read_text())
    assert {(r["scheduler"], r["jobs"]) for r in records.values()} == {("toy_engines:TOY_SCHED", "process")}
    assert "started trainer-r0 (toy pid" in out.stderr
    published = {int(v) for v in (run / "weights" / "toy_published.txt").read_text().split()}
    assert set(range(1, 7)) <= published, published  # the trainer published every version through the plugin
    status = subprocess.run([sys.executable, "-m", "hpcrl", "status", str(run)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)  # no plugin import
    assert status.returncode == 0 and "trainer-r0" in status.stdout, status.stdout + status.stderr


def test_the_server_backends_declare_what_their_engine_specs_promise(tmp_path) -> None:
    """``ServerBackend`` holds a backend's whole contract: an engine whose spec offers an update group has a
    backend with ``push`` (:class:`PushesWeights`), the others have none, and a RemoteEngine refuses a group for
    a backend that cannot take it."""
    from hpcrl.plugins import resolve
    from hpcrl.rollout.engine import SamplingParams
    from hpcrl.rollout.remote_engine import PushesWeights, RemoteEngine

    servers = [s for s in ENGINES.values() if s.server and s.backend]
    assert {s.name for s in servers} >= {"vllm", "sglang"}
    for spec in servers:
        backend = resolve(spec.backend, "rollout.engine")()
        assert isinstance(backend, PushesWeights) == spec.update_group, spec.name
        assert callable(backend.server_command) and callable(backend.prepare) and backend.health_path
    vllm = resolve(engine_spec("vllm").backend, "rollout.engine")()
    with pytest.raises(TypeError, match="VLLMBackend has no push"):
        RemoteEngine(vllm, "http://127.0.0.1:9", sampling=SamplingParams(), staging_dir=tmp_path, update_group=object())
