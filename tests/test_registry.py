"""The rollout-engine registry: choices, errors and each engine's checks come from the registered specs, and
an engine registered from outside hpcrl (``tests/toy_engines.py``) runs a real run with no change to hpcrl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.config import ConfigError, load_config
from hpcrl.rollout.registry import ENGINES, EngineSpec, engine_spec, register_engine

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs/quickstart.yaml")


def test_the_choices_and_the_error_come_from_the_registry() -> None:
    assert {"torch", "vllm", "sglang"} <= set(ENGINES)
    with pytest.raises(ConfigError, match=r"rollout\.engine: must be one of \['sglang', 'torch', 'vllm'") as e:
        load_config(QUICK, ["rollout.engine=tensorrt"])
    assert "module:attr" in str(e.value)
    with pytest.raises(ConfigError, match="cannot import 'no_such_module:SPEC'"):
        load_config(QUICK, ["rollout.engine=no_such_module:SPEC"])
    with pytest.raises(ConfigError, match="not an EngineSpec"):
        load_config(QUICK, ["rollout.engine=json:dumps"])
    with pytest.raises(ValueError, match="registered already"):
        register_engine(EngineSpec("torch", build="x:y"))


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


def test_a_plugin_engine_is_named_by_import_path(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    cfg = load_config(QUICK, ["rollout.engine=toy_engines:TOY"])
    spec = engine_spec(cfg.rollout.engine)
    assert spec.name == "toy_engines:TOY" and ENGINES["toy_engines:TOY"] is spec and not spec.server
    with pytest.raises(ConfigError, match="needs an embedded engine|weight-update group"):
        load_config(QUICK, ["rollout.engine=toy_engines:TOY", "rollout.server_update=group"])


@pytest.mark.slow
def test_a_run_with_an_engine_registered_outside_hpcrl(tmp_path: Path) -> None:
    """``python -m hpcrl.submit ... rollout.engine=toy_engines:TOY``: the rollout process builds the toy engine
    through the registry and drives it through the real loop; the run completes and its audit is clean."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    out = subprocess.run([sys.executable, "-m", "hpcrl.submit", "--config", QUICK, f"run_dir={run}",
                          f"model.cache_dir={cache}/models", f"data.synthetic_dir={cache}/data",
                          "model.tiny_hidden_size=32", "model.tiny_layers=2", "data.n_train=2000", "data.n_eval=40",
                          "sft.enabled=false", "admission.batch_size=4", "rollout.group_size=4",
                          "rollout.max_batch_size=8", "rollout.max_new_tokens=4", "trainer.total_steps=6",
                          "eval.every_steps=0", "eval.size=40", "rollout.engine=toy_engines:TOY"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    counts = [json.loads(p.read_text()) for p in (run / "logs").glob("*.toy.json")]
    assert counts and counts[0]["completed"] >= 6 * 4 * 4 and counts[0]["updates"] >= 1, counts
    from hpcrl.audit import audit

    rep = audit(run)
    assert rep.ok and rep.steps == 6, rep.violations
