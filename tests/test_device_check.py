"""The device check (scripts/device_check.sh): its CPU rehearsal end to end, and the wheel bundle that travels
to a bare GPU machine installed offline into a fresh Python 3.12 virtual environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_cpu_rehearsal_runs_every_step_and_reports_what_it_measured(tmp_path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "scripts/device_check.sh", "--cpu", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, "HPCRL_WHEELS": str(tmp_path / "none")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # what comes back from a lease: a few plain files, no folders
    assert sorted(p.name for p in out.iterdir()) == ["check.log", "pytest.xml", "report.txt", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["mode"] == "cpu rehearsal" and summary["environment"]["device"] == "cpu"
    assert list(steps) == ["pytest", "quickstart_cpu", "model", "fsdp", "fsdp_ac", "engine", "weights", "megatron"]
    assert all(s["status"] == "ok" for s in steps.values()), steps
    gpu = steps["pytest"]["result"]  # collected and skipped here: the module imports without a GPU
    assert gpu["tests"] >= 5 and gpu["skipped"] == gpu["tests"]
    q = steps["quickstart_cpu"]["result"]
    assert q["steps"] == 20 and q["samples_per_s"] > 0 and q["rollout_device"] == "cpu" and len(q["eval_accuracy"]) == 2
    for engine in ("fsdp", "fsdp_ac", "megatron"):
        r = steps[engine]["result"]
        assert r["tokens_per_s"] > 0 and r["mfu"] is None and len(r["steps_s"]) == 2, r  # no peak known for a CPU
    # the same batch from the same weights: activation checkpointing and the megatron engine give FSDP2's loss
    assert steps["fsdp_ac"]["result"]["loss"] == pytest.approx(steps["fsdp"]["result"]["loss"], rel=1e-4)
    assert steps["megatron"]["result"]["loss"] == pytest.approx(steps["fsdp"]["result"]["loss"], rel=1e-4)
    rows = steps["engine"]["result"]["rows"]
    assert [(r["batch"], r["ragged"]) for r in rows] == [(1, False), (8, False), (8, True)]
    assert all(r["hf_generate_tokens_per_s"] > 0 for r in rows[:2]) and "hf_generate_tokens_per_s" not in rows[2]
    w = steps["weights"]["result"]
    assert w["bytes"] > 3_000_000 and w["disk_publish_s"] > 0 and w["collective_buckets"] >= 1
    report = (out / "report.txt").read_text()
    assert "quickstart on the cpu: 20 steps" in report and "batch    8, ragged:" in report and "megatron" in report


def _python312() -> str | None:
    """A working Python 3.12 (pyenv's versions first: its shim on PATH may not select one)."""
    pyenv = Path(os.path.expanduser("~/.pyenv/versions"))
    found = sorted(pyenv.glob("3.12*/bin/python3.12")) if pyenv.exists() else []
    for cand in [*map(str, reversed(found)), shutil.which("python3.12")]:
        if cand and subprocess.run([cand, "-c", "pass"], capture_output=True).returncode == 0:
            return cand
    return None


def test_the_wheel_bundle_fits_and_installs_offline_into_a_fresh_python312(tmp_path) -> None:
    py312 = _python312()
    if py312 is None:
        pytest.skip("no Python 3.12 on this machine")
    dest = tmp_path / "whl"
    made = subprocess.run(["bash", "scripts/device_wheels.sh", "--dest", str(dest)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PIP": f"{sys.executable} -m pip"})
    if made.returncode != 0 and "No matching distribution" not in made.stderr and "Could not" in made.stderr:
        pytest.skip(f"no package index reachable: {made.stderr[-300:]}")
    assert made.returncode == 0, made.stderr[-2000:]
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    assert [w.split("-")[0] for w in wheels] == ["megatron_core", "omegaconf", "submitit"]
    assert sum(p.stat().st_size for p in dest.iterdir()) < 60 * 2**20
    env_dir = tmp_path / "py312"
    subprocess.run([py312, "-m", "venv", str(env_dir)], check=True, timeout=300)
    python = str(env_dir / "bin" / "python")
    # what the GPU image has and the bundle's wheels require (docs/gpu.md): PyYAML, cloudpickle, typing_extensions
    subprocess.run([python, "-m", "pip", "install", "-q", "pyyaml", "cloudpickle", "typing_extensions"], check=True,
                   timeout=300, capture_output=True)
    site = tmp_path / "site"
    inst = subprocess.run(["bash", "scripts/device_check.sh", "--install-only"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHON": python, "HPCRL_WHEELS": str(dest),
                                                       "HPCRL_WHEEL_SITE": str(site), "PIP_NO_INDEX": "1"})
    assert inst.returncode == 0, inst.stderr[-2000:]
    assert inst.stdout.strip() == str(site) and "3 wheels installed" in inst.stderr
    # the config layer loads the quickstart with only the bundle and the standard library (no torch here)
    probe = ("import sys, omegaconf, submitit, importlib.metadata as m; from hpcrl.config import load_config; "
             "cfg = load_config('configs/quickstart.yaml', ['rollout.device=cpu']); "
             "print(sys.version_info[:2], m.version('megatron-core'), cfg.rollout.device, 'torch' in sys.modules)")
    got = subprocess.run([python, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{site}:{ROOT}"})
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split() == ["(3,", "12)", "0.16.1", "cpu", "False"]


def test_the_decode_probe_times_every_variant_side_by_side_and_profiles_the_engine(tmp_path) -> None:
    out = tmp_path / "probe.txt"
    proc = subprocess.run([sys.executable, "scripts/device_decode_probe.py", "--size", "tiny", "--new-tokens", "4",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = out.read_text()
    rows = [line.split() for line in report.splitlines() if line.startswith("batch")]
    variants = ["hf", "engine", "engine_hf_sample", "engine_cache_position", "engine_no_position_ids"]
    assert [(r[1], r[2]) for r in rows] == [(b, v) for b in ("1", "64") for _ in range(2) for v in variants]
    assert all(float(r[3]) > 0 for r in rows)
    assert "## torch.profiler, engine" in report and "aten::mm" in report and "## cProfile, engine" in report


def test_the_decode_probe_changes_only_the_decode_calls() -> None:
    sys.path.insert(0, str(ROOT))
    from scripts.device_decode_probe import wrap_forward

    import torch
    from transformers import DynamicCache

    class Model(torch.nn.Module):
        def forward(self, **kw):
            return kw

    model = Model()  # called as the engine calls it: model(...), through nn.Module.__call__
    cache = DynamicCache()
    undo = wrap_forward(model, cache_position=True, position_ids=False)
    step = model(input_ids=torch.zeros(2, 1, dtype=torch.long), position_ids=torch.ones(2, 1),
                 past_key_values=cache)
    assert "position_ids" not in step and step["cache_position"].tolist() == [0]
    prefill = model(input_ids=torch.zeros(2, 5, dtype=torch.long), position_ids=torch.ones(2, 5),
                    past_key_values=cache)
    assert "position_ids" in prefill and "cache_position" not in prefill  # a prefill goes through unchanged
    undo()
    assert "forward" not in model.__dict__  # the class's forward again
    assert "position_ids" in model(input_ids=torch.zeros(2, 1, dtype=torch.long), position_ids=1,
                                   past_key_values=cache)


def test_the_logprob_probe_computes_in_chunks_what_the_engine_computes_whole(tmp_path) -> None:
    out = tmp_path / "logprob.json"
    proc = subprocess.run([sys.executable, "scripts/device_logprob_probe.py", "--tokens", "96", "--vocab", "500",
                           "--hidden", "32", "--chunk", "40", "--repeats", "1", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["ways"]) == {"lm_head", "current", "chunked"}
    assert all(w["median_s"] > 0 for w in result["ways"].values())
    same = result["chunked_vs_current"]  # a last chunk shorter than the others (96 = 40 + 40 + 16) included
    assert same["grad_max_abs"] > 0 and same["grad_max_abs_diff"] <= 1e-6 * same["grad_max_abs"] + 1e-9
    assert same["logprobs_max_abs_diff"] <= 1e-5 and same["entropy_max_abs_diff"] <= 1e-5
    assert same["weight_grad_max_abs"] > 0  # the output layer's gradient, summed over the chunks
    assert same["weight_grad_max_abs_diff"] <= 1e-5 * same["weight_grad_max_abs"] + 1e-9
