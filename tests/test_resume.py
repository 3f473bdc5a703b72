"""Faithful resume: a trainer killed with SIGKILL and resumed from its checkpoint ends
with the same parameters as one that never stopped (given the same spool input).

The spool is filled by the test (no rollout), so both runs see the same
trajectories: run A trains 6 steps straight; run B gets the first 4 steps'
groups only, checkpoints at step 3, trains step 4, blocks waiting for data
and is killed; then the rest of the groups arrive and a new trainer process
resumes from step 3 (the step-4 batch goes back to ready and is trained
again). Versions past the checkpoint are republished; nothing is lost.
"""

from __future__ import annotations

import json
import logging
import shutil
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hpcrl.audit import audit
from hpcrl.ckpt import store
from hpcrl.admission.ledger import AdmissionLedger
from hpcrl.config import load_config, load_saved, save
from hpcrl.data.arithmetic import write_arithmetic_dataset
from hpcrl.runtime.dist import free_port
from hpcrl.prepared import Prepared, load_prepared
from hpcrl.fs import atomic
from hpcrl.metrics.writer import read_metrics
from hpcrl.model.tiny import TinyModelConfig, build_tiny_model
from hpcrl.spool.format import Sample, TrajectoryGroup
from hpcrl.spool.store import Spool

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
B, G, STEPS = 2, 4, 6


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("assets")
    build_tiny_model(d / "model", TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                                                  head_dim=16, intermediate_size=64))
    write_arithmetic_dataset(d / "data", n_train=200, n_eval=10)
    return d


def make_run(run_dir: Path, assets: Path, world_size: int, extra: tuple[str, ...] = ()) -> None:
    cfg = load_config(None, [
        f"run_dir={run_dir}", f"model.path={assets / 'model'}", f"data.train_path={assets / 'data/train.jsonl'}",
        f"data.eval_path={assets / 'data/eval.jsonl'}", f"admission.batch_size={B}", "admission.max_staleness=100",
        f"rollout.group_size={G}", f"rollout.max_batch_size={G}", f"trainer.total_steps={STEPS}",
        f"trainer.world_size={world_size}", "trainer.lr=1e-2", "trainer.warmup_steps=2",
        "trainer.lr_schedule=cosine", "ckpt.every_steps=3", "eval.at_start=false", "eval.every_steps=0",
        "eval.size=4", "rollout.max_new_tokens=2", *extra])
    run_dir.mkdir(parents=True)
    save(cfg, run_dir / "config.yaml")
    atomic.write_json(run_dir / "prepared.json", Prepared(
        init_model=str(assets / "model"), base_model=str(assets / "model"),
        train_path=str(assets / "data/train.jsonl"), eval_path=str(assets / "data/eval.jsonl")).__dict__)
    (run_dir / "admission" / "tickets").mkdir(parents=True)


def feed_groups(run_dir: Path, tickets: range, content_of: int = 0) -> None:
    """Admitted groups in the spool, as a rollout writer "r0" would have published them (ticket t holds what
    ticket ``t + content_of`` holds in another run)."""
    spool = Spool(run_dir / "spool")
    cfg = load_saved(run_dir)
    rows = sum(1 for _ in open(load_prepared(run_dir).train_path))
    ledger = AdmissionLedger(run_dir / "admission", cfg.admission, rows, cfg.seed)
    for t in tickets:
        rng = np.random.default_rng(t + content_of)
        samples = []
        for i in range(G):
            n = int(rng.integers(1, 5))
            samples.append(Sample(rng.integers(3, 40, n).astype(np.int32), (-rng.random(n)).astype(np.float32),
                                  np.zeros(n, np.int32), np.ones(n, np.uint8), float(i % 2), "stop"))
        (run_dir / "admission" / "tickets" / f"t{t:09d}").write_text('{"writer": "r0"}')
        position = {"epoch": ledger.ticket(t).epoch, "row": ledger.ticket(t).row}
        spool.publish(TrajectoryGroup(ticket=t, writer="r0", prompt_ids=rng.integers(3, 40, 5).astype(np.int32),
                                      samples=samples, meta=position))


def start_trainer(run_dir: Path, world_size: int) -> list[subprocess.Popen]:
    port = str(free_port())
    procs = []
    for r in range(world_size):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        log = open(run_dir / f"trainer-r{r}.out", "ab")
        procs.append(subprocess.Popen([sys.executable, "-m", "hpcrl.trainer", "--run-dir", str(run_dir)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def wait_all(procs: list[subprocess.Popen], run_dir: Path, timeout: float = 180) -> None:
    for p in procs:
        assert p.wait(timeout) == 0, (run_dir / "trainer-r0.out").read_text()[-3000:]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The last published version, as a whole policy (published LoRA adapters merged into the base model)."""
    from hpcrl.weights.version import WeightVersion

    return WeightVersion(STEPS, path=run_dir / "weights" / f"v{STEPS:06d}").tensors()


def uninterrupted(run_dir: Path, assets: Path, world_size: int, extra: tuple[str, ...] = ()) -> dict:
    make_run(run_dir, assets, world_size, extra)
    feed_groups(run_dir, range(STEPS * B))
    wait_all(start_trainer(run_dir, world_size), run_dir)
    return final_weights(run_dir)


def killed_and_resumed(run_dir: Path, assets: Path, world_size: int, resume_world_size: int,
                       extra: tuple[str, ...] = (), resume_with: tuple[str, ...] = ()) -> dict:
    """Killed after step 4, resumed from step 3 on ``resume_world_size`` ranks with the overrides
    ``resume_with`` (as ``--resume`` rewrites config.yaml)."""
    make_run(run_dir, assets, world_size, extra)
    feed_groups(run_dir, range(4 * B))
    procs = start_trainer(run_dir, world_size)
    deadline = time.time() + 120
    while not any(r.get("step") == 4 for r in read_metrics(run_dir / "logs/metrics.jsonl")):
        assert time.time() < deadline and all(p.poll() is None for p in procs), "trainer did not reach step 4"
        time.sleep(0.1)
    time.sleep(0.5)  # now blocked waiting for the step-5 batch
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert [s for s, _ in store.committed(run_dir / "ckpt")] == [3]
    assert (run_dir / "weights" / "LATEST").read_text().strip() == "4"  # version 4 is lost with the kill
    if resume_world_size != world_size or resume_with:
        cfg = load_config(run_dir / "config.yaml", list(resume_with))
        save(replace(cfg, trainer=replace(cfg.trainer, world_size=resume_world_size)), run_dir / "config.yaml")
    feed_groups(run_dir, range(4 * B, STEPS * B))
    wait_all(start_trainer(run_dir, resume_world_size), run_dir)
    return final_weights(run_dir)


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_is_bit_identical(tmp_path, assets, world_size: int) -> None:
    a = uninterrupted(tmp_path / "a", assets, world_size)
    b = killed_and_resumed(tmp_path / "b", assets, world_size, world_size)
    init = load_file(str(assets / "model" / "model.safetensors"))
    assert any(not torch.equal(a[k], init[k]) for k in a if k in init)  # training did change the weights
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rep = audit(tmp_path / "b")
    assert rep.ok and rep.trained_groups == STEPS * B, rep.violations  # each group trained exactly once


def test_resume_two_ranks_onto_one(tmp_path, assets) -> None:
    a = uninterrupted(tmp_path / "a", assets, 1)
    b = killed_and_resumed(tmp_path / "b", assets, 2, 1)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)


def test_metrics_continue_across_a_trainer_restart(tmp_path, assets) -> None:
    """Killed after step 4 (checkpoint at 3) and restarted: the second leg's records continue the first's
    counters (samples, training time, wall time since the run started) and never re-evaluate the initial
    policy as if it were the trained one."""
    run = tmp_path / "m"
    killed_and_resumed(run, assets, 1, 1, extra=("eval.at_start=true",))
    records = read_metrics(run / "logs/metrics.jsonl")
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, STEPS]  # none at the resume step
    steps = [r for r in records if "reward/mean" in r]
    assert [(r["step"], r["leg"]) for r in steps] == [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2), (5, 2), (6, 2)]
    first, last = {r["step"]: r for r in steps if r["leg"] == 1}, steps[-1]
    # leg 2 started from the step-3 checkpoint: its training time includes leg 1's up to that checkpoint
    assert last["time/train_s"] >= first[3]["time/leg_s"] + last["time/leg_s"]
    assert last["throughput/samples_per_s"] == pytest.approx(STEPS * B * G / last["time/train_s"], rel=1e-3)
    assert last["throughput/leg_samples_per_s"] == pytest.approx(3 * B * G / last["time/leg_s"], rel=1e-3)
    elapsed = [r["time/elapsed_s"] for r in records]
    assert elapsed == sorted(elapsed) and last["time/elapsed_s"] >= last["time/train_s"]  # downtime included
    # each step's own training passes are time/update_s; the cumulative time/train_s does not overwrite them
    assert all(0 < r["time/update_s"] <= r["time/step_s"] <= r["time/train_s"] for r in steps)


def test_corrupt_newest_checkpoint_falls_back(tmp_path, assets) -> None:
    run = tmp_path / "c"
    make_run(run, assets, 1)
    feed_groups(run, range(STEPS * B))
    wait_all(start_trainer(run, 1), run)
    steps = [s for s, _ in store.committed(run / "ckpt")]
    assert steps == [3, 6]
    shard = next((run / "ckpt" / "step_000006").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])  # truncated shard
    assert store.verify(run / "ckpt" / "step_000006")
    assert store.latest_valid(run / "ckpt")[0] == 3


def test_ckpt_tools_to_hf_verify_prune(tmp_path, assets, capsys) -> None:
    from transformers import AutoModelForCausalLM

    from ckpt_tools.__main__ import main as tools

    run = tmp_path / "t"
    make_run(run, assets, 2)
    feed_groups(run, range(STEPS * B))
    wait_all(start_trainer(run, 2), run)  # a checkpoint written by 2 ranks, converted by one process
    ckpt = run / "ckpt" / "step_000006"
    assert tools(["inspect", str(run), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["metadata"]["step"] == 6 and info["metadata"]["world_size"] == 2
    assert tools(["to-hf", str(ckpt), str(tmp_path / "hf")]) == 0
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    trained = AutoModelForCausalLM.from_pretrained(assets / "model", local_files_only=True)
    trained.load_state_dict(final_weights(run), strict=False)  # what the trainer published at version 6
    ids = torch.tensor([[5, 9, 12, 7, 3, 22]])
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, trained(ids).logits)
    assert tools(["verify", str(run / "ckpt")]) == 0 and tools(["verify", str(run)]) == 0  # a ckpt root or a run
    capsys.readouterr()
    assert [s for s, _ in store.committed(run / "ckpt")] == [3, 6]

    def refused(damaged: Path) -> None:
        assert tools(["verify", str(damaged)]) == 1
        assert "DAMAGED" in capsys.readouterr().out
        assert tools(["to-hf", str(damaged), str(tmp_path / "hf-damaged")]) == 1  # refused, nothing written
        assert "refusing to convert" in capsys.readouterr().err and not (tmp_path / "hf-damaged").exists()

    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-3])  # truncated
    refused(ckpt)
    assert tools(["prune", str(run), "--keep-last", "0"]) == 2  # would leave nothing to resume from
    assert tools(["prune", str(run), "--keep-last", "1"]) == 0
    assert [s for s, _ in store.committed(run / "ckpt")] == [3, 6]  # the newest, and the newest that verifies
    older = store.committed(run / "ckpt")[0][1]
    flipped = next(older.glob("*.distcp"))  # same size, 64 bytes changed: only the checksum tells
    data = bytearray(flipped.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    flipped.write_bytes(bytes(data))
    refused(older)
    assert tools(["to-hf", str(older), str(tmp_path / "forced"), "--force"]) == 0
    assert "WARNING: converting the DAMAGED" in capsys.readouterr().err and (tmp_path / "forced").exists()
    assert tools(["prune", str(tmp_path / "forced"), "--keep-last", "1"]) == 1  # no checkpoint there


def test_preemption_signal_checkpoints_and_resumes_identically(tmp_path, assets) -> None:
    a = uninterrupted(tmp_path / "a", assets, 2)
    run = tmp_path / "p"
    make_run(run, assets, 2)
    feed_groups(run, range(4 * B))
    procs = start_trainer(run, 2)
    deadline = time.time() + 120
    while not any(r.get("step") == 4 for r in read_metrics(run / "logs/metrics.jsonl")):
        assert time.time() < deadline, "trainer did not reach step 4"
        time.sleep(0.1)
    time.sleep(0.5)  # waiting for the step-5 batch
    for p in procs:
        p.send_signal(signal.SIGUSR2)  # what Slurm sends before the time limit
    assert [p.wait(60) for p in procs] == [75, 75]
    assert [s for s, _ in store.committed(run / "ckpt")] == [3, 4]  # checkpointed at the signal
    feed_groups(run, range(4 * B, STEPS * B))
    wait_all(start_trainer(run, 2), run)
    b = final_weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_a_critic_is_bit_identical(tmp_path, assets) -> None:
    ppo = ("algo.adv_estimator=gae", "algo.drop_uniform_groups=false", "algo.critic_lr=1e-2")
    a = uninterrupted(tmp_path / "a", assets, 1, ppo)
    b = killed_and_resumed(tmp_path / "b", assets, 1, 1, ppo)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rewind_to_an_older_checkpoint_retrains_what_came_after(tmp_path, assets) -> None:
    """A finished run rewound to step 3: the step-6 checkpoint is set aside, not deleted, the groups trained
    in steps 4-6 go back to the queue and are trained again, and the final weights are bit-identical to a
    run that never rewound; every group is trained exactly once in the final model's history."""
    a = uninterrupted(tmp_path / "a", assets, 1)
    run = tmp_path / "r"
    make_run(run, assets, 1)
    feed_groups(run, range(STEPS * B))
    wait_all(start_trainer(run, 1), run)
    assert [s for s, _ in store.committed(run / "ckpt")] == [3, 6]
    assert store.request_rewind(run / "ckpt", 3, "test") == [6]
    wait_all(start_trainer(run, 1), run)
    log = (run / "trainer-r0.out").read_text()
    assert "rewound to step 3: 1 newer checkpoint(s) set aside" in log and "'released': 6" in log, log[-3000:]
    assert not (run / "ckpt" / store.REWIND).exists()
    assert [p.name for p in (run / "ckpt" / store.REWOUND).glob("*/step_*")] == ["step_000006"]
    assert [s for s, _ in store.committed(run / "ckpt")] == [3, 6]  # step 6 written again by the second leg
    b = final_weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rep = audit(run)
    assert rep.ok and rep.trained_groups == STEPS * B, rep.violations
    store.request_rewind(run / "ckpt", 3, "test")
    shutil.rmtree(run / "ckpt" / "step_000003")
    with pytest.raises(store.CheckpointError, match="cannot rewind to .*step_000003"):
        store.apply_rewind(run / "ckpt")
    assert [s for s, _ in store.committed(run / "ckpt")] == [6]  # a failed rewind moves nothing


def started_from(run_dir: Path, assets: Path, source: Path, restore: str, *extra: str) -> Prepared:
    """A new run prepared from ``source`` the way ``python -m hpcrl.submit --from`` does."""
    from hpcrl.prepare import prepare

    cfg = load_config(None, [
        f"run_dir={run_dir}", f"model.path={assets / 'model'}", f"data.train_path={assets / 'data/train.jsonl'}",
        f"data.eval_path={assets / 'data/eval.jsonl'}", f"admission.batch_size={B}", "admission.max_staleness=100",
        f"rollout.group_size={G}", f"rollout.max_batch_size={G}", "trainer.total_steps=3", "trainer.lr=1e-2",
        "trainer.warmup_steps=2", "ckpt.every_steps=3", "eval.at_start=false", "eval.every_steps=0", "eval.size=4",
        "rollout.max_new_tokens=2", f"init.checkpoint={source}", f"init.restore=[{restore}]", *extra])
    run_dir.mkdir(parents=True)
    save(cfg, run_dir / "config.yaml")
    return prepare(cfg, run_dir)


def test_a_new_run_from_another_runs_checkpoint(tmp_path, assets) -> None:
    """Run A trains 6 steps (constant lr after a 2-step warm-up). Run B starts from A's step-3 checkpoint with
    its optimizer, schedule position and data position, and trains A's last 3 batches as its first 3: its
    weights are bit-identical to A's. Run C takes the weights alone (fresh optimizer, warm-up from 0): they
    differ. The step-0 checkpoint shares A's shard files (hard links); a model of another architecture, or
    the data position of another dataset, is refused before anything is written."""
    a = uninterrupted(tmp_path / "a", assets, 1, ("trainer.lr_schedule=constant",))
    source = tmp_path / "a" / "ckpt" / "step_000003"
    b_dir = tmp_path / "b"
    prep = started_from(b_dir, assets, source, "optimizer,scheduler,data")
    assert prep.init_from["data_offset"] == 3 * B and Path(prep.init_model) == b_dir / "init" / "model"
    ours, theirs = AdmissionLedger(b_dir / "admission", load_saved(b_dir).admission, 1), \
        AdmissionLedger(tmp_path / "a" / "admission", load_saved(b_dir).admission, 1)
    assert (ours.ticket(0).epoch, ours.ticket(0).row) == (theirs.ticket(3 * B).epoch, theirs.ticket(3 * B).row)
    shard = next(source.glob("*.distcp"))
    assert (b_dir / "ckpt" / "step_000000" / shard.name).stat().st_ino == shard.stat().st_ino
    assert not store.verify(b_dir / "ckpt" / "step_000000")
    feed_groups(b_dir, range(3 * B), content_of=3 * B)  # A's batches of steps 4-6
    wait_all(start_trainer(b_dir, 1), b_dir)
    assert "starting from" in (b_dir / "trainer-r0.out").read_text()
    b = load_file(str(b_dir / "weights" / "v000003" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert audit(b_dir).ok

    c_dir = tmp_path / "c"
    started_from(c_dir, assets, tmp_path / "a", "")  # a run directory: its newest checkpoint (step 6)
    assert json.loads((c_dir / "ckpt" / "step_000000" / "trainer.json").read_text())["load"] == ["model"]
    feed_groups(c_dir, range(3 * B), content_of=3 * B)
    wait_all(start_trainer(c_dir, 1), c_dir)
    c = load_file(str(c_dir / "weights" / "v000003" / "model.safetensors"))
    assert any(not torch.equal(a[k], c[k]) for k in a)

    build_tiny_model(tmp_path / "wide", TinyModelConfig(hidden_size=48, num_layers=2, num_heads=2, num_kv_heads=2,
                                                        head_dim=16, intermediate_size=64))
    with pytest.raises(ValueError, match=r"another architecture.*'hidden_size': \(48, 32\)"):
        started_from(tmp_path / "d", assets, source, "", f"model.path={tmp_path / 'wide'}")
    with pytest.raises(ValueError, match="init.restore: data: the source trained on 200 rows with seed 0"):
        started_from(tmp_path / "e", assets, source, "data", "seed=1")
    assert not (tmp_path / "e" / "ckpt").exists() and not (tmp_path / "d" / "init").exists()


def test_a_lora_trainer_resumes_bit_identically_and_exports_merged_weights(tmp_path, assets, capsys) -> None:
    """trainer.lora.rank on 2 FSDP2 ranks: killed -9 after step 4 and resumed from the step-3 checkpoint (base
    weights, adapters and their Adam state), the published weights equal an uninterrupted run's bit for bit;
    they differ from the initial policy by a low-rank matrix in each adapted projection only; ckpt_tools to-hf
    merges the adapters of the final checkpoint into exactly the weights published with it; a full-fine-tuning
    run cannot start from the LoRA checkpoint's trainer state (refused, naming both). The resumed run publishes
    the adapters alone (trainer.lora.publish: adapter): merged into the base model they are the same weights."""
    from ckpt_tools.__main__ import main as tools

    lora = ("trainer.lora.rank=2", "trainer.lora.alpha=4")
    a = uninterrupted(tmp_path / "a", assets, 2, lora)
    b = killed_and_resumed(tmp_path / "b", assets, 2, 2, lora + ("trainer.lora.publish=adapter",
                                                                 f"eval.every_steps={STEPS}"))
    assert "eval/accuracy" in read_metrics(tmp_path / "b" / "logs/metrics.jsonl")[-1]  # evaluated the merged policy
    published = tmp_path / "b" / "weights" / f"v{STEPS:06d}"
    assert sorted(p.name for p in published.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert a.keys() - {"lm_head.weight"} == b.keys() - {"lm_head.weight"}  # (a tied head: the embedding)
    assert all(torch.equal(a[k], b[k]) for k in b)
    init = load_file(str(assets / "model" / "model.safetensors"))
    assert set(init) <= set(a) <= set(init) | {"lm_head.weight"}  # HF names, merged (the tied head as in full FT)
    for k in init:
        delta = a[k] - init[k]
        if k.endswith("proj.weight"):
            assert delta.abs().max() > 0 and torch.linalg.matrix_rank(delta, atol=1e-6) <= 2, k
        else:
            assert not delta.any(), k
    assert audit(tmp_path / "b").ok
    assert tools(["to-hf", str(tmp_path / "a" / "ckpt" / f"step_{STEPS:06d}"), str(tmp_path / "hf")]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for k in exported:  # the tied head is not written twice
        torch.testing.assert_close(exported[k], a[k], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="LoRA rank 2.*full fine-tuning"):
        started_from(tmp_path / "c", assets, tmp_path / "a", "")


@pytest.mark.parametrize("parallel", ["tensor_parallel", "pipeline_parallel"])
def test_a_megatron_trainer_resumes_bit_identically(tmp_path, assets, parallel, caplog) -> None:
    """trainer.engine=megatron with tensor_parallel=2 or pipeline_parallel=2 (gloo): killed -9 after step 4 and
    resumed from the step-3 checkpoint (each rank's slices of the weights and of AdamW's state), the published
    weights equal an uninterrupted run's bit for bit, and every group is trained once. Resumed onto other
    sizes (TP = 2 onto PP = 2) the checkpoint is resharded and training goes on to the same weights. The TP = 2
    runs train PPO with a critic (GAE): its weights and AdamW state are checkpointed and resharded too; an FSDP2
    run started from that checkpoint takes the policy's weights and starts its critic afresh."""
    pytest.importorskip("megatron.core")
    megatron = ("trainer.engine=megatron", f"trainer.megatron.{parallel}=2")
    if parallel == "tensor_parallel":
        megatron += ("algo.adv_estimator=gae", "algo.drop_uniform_groups=false", "algo.critic_lr=1e-2")
    a = uninterrupted(tmp_path / "a", assets, 2, megatron)
    b = killed_and_resumed(tmp_path / "b", assets, 2, 2, megatron)
    init = load_file(str(assets / "model" / "model.safetensors"))
    assert any(not torch.equal(a[k], init[k]) for k in a if k in init)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rep = audit(tmp_path / "b")
    assert rep.ok and rep.trained_groups == STEPS * B, rep.violations
    from ckpt_tools.__main__ import main as tools  # the final checkpoint as an HF folder: the slices merged

    assert tools(["to-hf", str(tmp_path / "a" / "ckpt" / f"step_{STEPS:06d}"), str(tmp_path / "hf")]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(exported[k], a[k]) for k in exported)
    from hpcrl.trainer.checkpoint import layout_mismatch  # another engine's checkpoint is refused, naming why

    assert re.search(r"does not hold 1 of this trainer's 1 weights.*another trainer engine", layout_mismatch(
        tmp_path / "a" / "ckpt" / f"step_{STEPS:06d}", {"model": {"model.norm.weight": 0}}))
    if parallel == "tensor_parallel":  # resumed onto PP = 2: the TP = 2 checkpoint resharded as it loads
        c = killed_and_resumed(tmp_path / "c", assets, 2, 2, megatron, ("trainer.megatron.tensor_parallel=1",
                                                                         "trainer.megatron.pipeline_parallel=2"))
        log = (tmp_path / "c" / "trainer-r1.out").read_text()
        assert "(model) of TP=2 PP=1 resharded onto TP rank 0 of 1, stage 1 of 2" in log
        assert "(critic) of TP=2 PP=1 resharded onto TP rank 0 of 1, stage 1 of 2" in log
        for k in a:  # the same steps, summed in another order
            torch.testing.assert_close(c[k], a[k], atol=1e-5, rtol=1e-4)
        assert audit(tmp_path / "c").ok
        # an FSDP2 run started from it takes the policy's weights; the critic starts afresh, with a warning
        with caplog.at_level(logging.WARNING, logger="hpcrl.init_from"):
            prep = started_from(tmp_path / "d", assets, tmp_path / "a", "", "algo.adv_estimator=gae")
        assert json.loads((tmp_path / "d" / "ckpt" / "step_000000" / "trainer.json").read_text())["load"] == []
        assert any("holds the critic of a megatron TP=2 PP=1 trainer, this run's is fsdp" in r.getMessage()
                   for r in caplog.records), caplog.text
        init = load_file(str(Path(prep.init_model) / "model.safetensors"))
        assert all(torch.equal(init[k], a[k]) for k in init)
        return
    # one micro-batch an update on two stages: the log says how idle that leaves them and what to change
    assert re.search(r"pipeline: an update of 1 micro-batch\(es\) on 2 stages leaves the stages idle 50% .*"
                     r"trainer.micro_batch_tokens", (tmp_path / "a" / "trainer-r0.out").read_text())
    # another layout starts from its weights (the exported HF folder); its optimizer state does not fit there
    with pytest.raises(ValueError, match=r"optimizer state of a megatron TP=1 PP=2 trainer, this run's is fsdp"):
        started_from(tmp_path / "c", assets, tmp_path / "a", "optimizer")
    # the megatron engine with other sizes loads the weights and the optimizer state, resharded as on a resume
    started_from(tmp_path / "e", assets, tmp_path / "a", "optimizer", "trainer.engine=megatron")
    assert json.loads((tmp_path / "e" / "ckpt" / "step_000000" / "trainer.json").read_text())["load"] == ["model",
                                                                                                          "optim"]
    prep = started_from(tmp_path / "d", assets, tmp_path / "a", "")  # the FSDP2 engine: the default
    assert json.loads((tmp_path / "d" / "ckpt" / "step_000000" / "trainer.json").read_text())["load"] == []
    init = load_file(str(Path(prep.init_model) / "model.safetensors"))
    assert all(torch.equal(init[k], a[k]) for k in init)
    feed_groups(tmp_path / "d", range(3 * B))
    wait_all(start_trainer(tmp_path / "d", 1), tmp_path / "d")
    assert audit(tmp_path / "d").ok
