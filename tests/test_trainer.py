"""Trainer: micro-batch layout, LR schedule, and FSDP2 over real gloo process groups.

The decisive check: one training step over the same batch gives the same
parameters with 1 rank and 1 micro-batch as with 2 ranks and many
micro-batches (the loss normaliser and the FSDP gradient averaging are right).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcrl.algo.config import AlgoConfig
from hpcrl.runtime.dist import free_port
from hpcrl.spool.format import Sample, TrajectoryGroup
from hpcrl.trainer import batch as B
from hpcrl.trainer.config import TrainerConfig
from hpcrl.trainer.fsdp import lr_factor


def make_groups(n_groups=4, group_size=4, vocab=40, seed=0) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed)
    groups = []
    for t in range(n_groups):
        prompt = rng.integers(3, vocab, size=int(rng.integers(3, 7))).astype(np.int32)
        samples = []
        for i in range(group_size):
            n = int(rng.integers(1, 9))
            samples.append(Sample(response_ids=rng.integers(3, vocab, size=n).astype(np.int32),
                                  behav_logprobs=(-rng.random(n) * 3).astype(np.float32),
                                  versions=np.zeros(n, np.int32), loss_mask=np.ones(n, np.uint8),
                                  reward=float(i % 2 if t != 0 else 1.0), finish_reason="stop"))
        groups.append(TrajectoryGroup(ticket=t, writer="w", prompt_ids=prompt, samples=samples))
    return groups


def test_collate_aligns_targets_and_response_fields() -> None:
    groups = make_groups(n_groups=2)
    seqs, n_uniform = B.to_sequences(groups, AlgoConfig())
    assert n_uniform == 1  # group 0 has all rewards equal
    assert len(seqs) == 4
    mb = B.collate(seqs, pad_id=0)
    for i, s in enumerate(seqs):
        L, p = len(s.tokens) - s.prompt_len, s.prompt_len
        assert torch.equal(mb.targets[i, p - 1:p - 1 + L], torch.from_numpy(s.tokens[p:]))
        assert mb.mask[i].sum() == L and mb.mask[i, p - 1:p - 1 + L].all()
        np.testing.assert_array_equal(mb.behav_logprobs[i, p - 1:p - 1 + L].numpy(), s.behav_logprobs)
        assert torch.all(mb.advantages[i, p - 1:p - 1 + L] == s.advantage)
    # GRPO advantages of a group sum to zero
    assert abs(sum(s.advantage for s in seqs)) < 1e-5


def test_pack_respects_budget_and_keeps_every_sequence() -> None:
    seqs, _ = B.to_sequences(make_groups(n_groups=6, group_size=8), AlgoConfig(drop_uniform_groups=False))
    packed = B.pack(seqs, token_budget=40)
    assert sorted(id(s) for g in packed for s in g) == sorted(id(s) for s in seqs)
    assert all(max(len(s) for s in g) * len(g) <= 40 or len(g) == 1 for g in packed)
    shards = [B.shard(seqs, r, 3) for r in range(3)]
    assert sum(len(s) for s in shards) == len(seqs)


def test_lr_schedule() -> None:
    cfg = TrainerConfig(total_steps=10, warmup_steps=2, lr_schedule="linear", min_lr_ratio=0.1)
    f = [lr_factor(s, cfg) for s in range(10)]
    assert f[0] == pytest.approx(1 / 3) and f[1] == pytest.approx(2 / 3)
    assert f[2] == pytest.approx(1.0) and f[9] == pytest.approx(1 - 0.9 * 7 / 8)
    assert all(a >= b for a, b in zip(f[2:], f[3:]))
    cos = TrainerConfig(total_steps=10, warmup_steps=0, lr_schedule="cosine", min_lr_ratio=0.0)
    assert lr_factor(0, cos) == pytest.approx(1.0) and lr_factor(10, cos) == pytest.approx(0.0)


def _tiny_model(path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, tie_word_embeddings=True,
                      pad_token_id=0, eos_token_id=1, bos_token_id=1)
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def _train_rank(rank, world, port, model_path, out, micro_tokens, backend="gloo") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from hpcrl.runtime.dist import init_from_env
    from hpcrl.trainer.fsdp import FSDPEngine

    ctx = init_from_env(backend)
    cfg = TrainerConfig(world_size=world, total_steps=2, lr=1e-2, warmup_steps=0, micro_batch_tokens=micro_tokens,
                        n_minibatches=2)
    engine = FSDPEngine(model_path, cfg, AlgoConfig(), ctx, pad_id=0)
    # SGD is linear in the gradient, so a wrong loss scale (normaliser, rank averaging) shows up;
    # Adam would normalise it away.
    engine.optimizer = torch.optim.SGD(engine.model.parameters(), lr=0.5)
    engine.scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)
    seqs, _ = B.to_sequences(make_groups(n_groups=6, group_size=4), AlgoConfig())
    for _ in range(2):
        engine.train_step(seqs)
    state = engine.full_state_dict()
    if rank == 0:
        torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, out)
    torch.distributed.destroy_process_group()


def _run(world, model_path, out, micro_tokens, backend="gloo") -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_train_rank, args=(r, world, port, model_path, out, micro_tokens, backend))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0


def test_fsdp_two_ranks_many_micro_batches_equal_one_rank(tmp_path) -> None:
    model_path = tmp_path / "model"
    _tiny_model(model_path)
    _run(1, model_path, tmp_path / "w1.pt", micro_tokens=100_000)
    _run(2, model_path, tmp_path / "w2.pt", micro_tokens=32)
    w1, w2 = torch.load(tmp_path / "w1.pt"), torch.load(tmp_path / "w2.pt")
    from transformers import AutoModelForCausalLM
    w0 = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    assert w1.keys() == w2.keys()
    moved = max((w1[k] - w0[k]).abs().max().item() for k in w1)
    assert moved > 1e-4  # the step did change the weights
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-6, rtol=1e-5)


def _single_rank_variants(target, model_path, out_dir, variants, *extra) -> dict:
    """``target(model_path, out, variant, *extra)`` in a spawned process per variant -> {variant: what it saved}."""
    ctx = mp.get_context("spawn")
    for v in variants:
        p = ctx.Process(target=target, args=(model_path, out_dir / f"{v}.pt", v, *extra))
        p.start()
        p.join(120)
        assert p.exitcode == 0, f"{target.__name__}({v!r}) exited {p.exitcode}"
    return {v: torch.load(out_dir / f"{v}.pt") for v in variants}


def _anchor_rank(model_path, out, decoupled: bool) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    from hpcrl.runtime.dist import init_from_env
    from hpcrl.trainer.fsdp import FSDPEngine

    ctx = init_from_env("gloo")
    cfg = TrainerConfig(world_size=1, total_steps=1, lr=1e-2, warmup_steps=0, n_minibatches=1)
    algo = AlgoConfig(decoupled=decoupled)
    engine = FSDPEngine(model_path, cfg, algo, ctx, pad_id=0)
    seqs, _ = B.to_sequences(make_groups(n_groups=4, group_size=4), algo)  # behaviour logprobs: off-policy
    stats = engine.train_step(seqs)
    torch.save({"stats": stats, "state": {k: v.clone() for k, v in engine.full_state_dict().items()}}, out)
    torch.distributed.destroy_process_group()


def test_plain_ppo_anchors_on_the_behaviour_policy(tmp_path) -> None:
    """algo.decoupled=false: proximal = behaviour, so every behaviour weight is exactly 1; decoupled PPO
    on the same off-policy batch reweights tokens and takes a different step."""
    model_path = tmp_path / "model"
    _tiny_model(model_path)
    runs = _single_rank_variants(_anchor_rank, model_path, tmp_path, (True, False))
    plain, dec = runs[False], runs[True]
    weight = {k: v for k, v in plain["stats"].items() if k in ("loss/imp_weight_mean", "loss/imp_weight_max")}
    assert len(weight) == 2 and all(v == 1.0 for v in weight.values()), plain["stats"]
    assert plain["stats"]["loss/imp_weight_m2"] == 0.0  # log weight 0 on every token
    assert any(dec["stats"][k] != 1.0 for k in weight) and dec["stats"]["loss/imp_weight_m2"] > 0, dec["stats"]
    assert max((plain["state"][k] - dec["state"][k]).abs().max().item() for k in plain["state"]) > 1e-6


def _prox_rank(model_path, out, reuse: bool, n_minibatches: int) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    from hpcrl.runtime.dist import init_from_env
    from hpcrl.trainer.fsdp import FSDPEngine

    ctx = init_from_env("gloo")
    cfg = TrainerConfig(world_size=1, total_steps=2, lr=1e-2, warmup_steps=0, n_minibatches=n_minibatches)
    engine = FSDPEngine(model_path, cfg, AlgoConfig(), ctx, pad_id=0)
    if not reuse:  # the reference: a no-grad proximal pass before every update
        engine._prox_in_forward = lambda k: False
    prox, trained = [], []  # micro-batches of the policy's no-grad passes, and of its updates
    no_grad_passes, passes = engine._no_grad_passes, engine._passes
    engine._no_grad_passes = lambda model, mbs: (prox.append(len(mbs)) if model is engine.model else None) \
        or no_grad_passes(model, mbs)
    engine._passes = lambda model, mbs, *a: trained.append(len(mbs)) or passes(model, mbs, *a)
    seqs, _ = B.to_sequences(make_groups(n_groups=4, group_size=4), AlgoConfig())  # off-policy behaviour
    stats = [engine.train_step(seqs) for _ in range(2)]
    torch.save({"stats": stats, "prox_passes": sum(prox), "micro_batches": sum(trained),
                "state": {k: v.clone() for k, v in engine.full_state_dict().items()}}, out)
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("n_minibatches", [1, 2])
def test_first_update_takes_proximal_logprobs_from_its_own_forward(tmp_path, n_minibatches) -> None:
    """Skipping the no-grad proximal pass of the first update changes nothing but the work done."""
    model_path = tmp_path / "model"
    _tiny_model(model_path)
    runs = _single_rank_variants(_prox_rank, model_path, tmp_path, (True, False), n_minibatches)
    fast, ref = runs[True], runs[False]
    assert ref["prox_passes"] == ref["micro_batches"]
    skipped = ref["prox_passes"] - fast["prox_passes"]  # the first update's micro-batches, each step
    if n_minibatches == 1:
        assert skipped == fast["micro_batches"]
    else:
        assert 0 < skipped < fast["micro_batches"]
    for a, b in zip(fast["stats"], ref["stats"]):
        for key in b:
            if key.startswith("time/"):
                continue
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    for k in ref["state"]:
        torch.testing.assert_close(fast["state"][k], ref["state"][k], atol=1e-6, rtol=1e-5)


def _dtype_rank(model_path, out, dtype: str) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    from hpcrl.runtime.dist import init_from_env
    from hpcrl.trainer.engine import TrainEngine, build_train_engine

    ctx = init_from_env("gloo")
    cfg = TrainerConfig(world_size=1, total_steps=2, lr=1e-2, warmup_steps=0)
    engine = build_train_engine("fsdp", model_path, cfg, AlgoConfig(), ctx, pad_id=0, dtype=dtype)
    assert isinstance(engine, TrainEngine)
    seqs, _ = B.to_sequences(make_groups(n_groups=4, group_size=4), AlgoConfig())
    mb = B.collate(seqs, pad_id=0)
    with torch.no_grad():
        logp = engine._forward(mb, entropy=None)[0]
    engine.train_step(seqs)
    engine.load_schedule_state(engine.schedule_state())
    try:  # a resume whose checkpoint lacks the schedule must not restart the warm-up silently
        engine.load_schedule_state({"engine_version": 1})
        raise AssertionError("a checkpoint without scheduler state was accepted")
    except ValueError as e:
        assert "no scheduler state" in str(e)
    optim = [v for state in engine.optimizer.state.values() for v in state.values() if torch.is_tensor(v)
             and v.dim() > 0]
    torch.save({"logp": logp, "mask": mb.mask, "state": {k: v.clone() for k, v in engine.full_state_dict().items()},
                "param_dtypes": sorted({str(p.dtype) for p in engine.model.parameters()}),
                "optim_dtypes": sorted({str(v.dtype) for v in optim})}, out)
    torch.distributed.destroy_process_group()


def test_model_dtype_bfloat16_computes_in_bf16_and_keeps_float32_master_weights(tmp_path) -> None:
    """model.dtype=bfloat16 in the trainer: forward and backward in bf16 (FSDP2 mixed precision), parameters,
    optimizer state, published weights and logprobs in float32; the step goes where the float32 step goes."""
    model_path = tmp_path / "model"
    _tiny_model(model_path)
    runs = _single_rank_variants(_dtype_rank, model_path, tmp_path, ("float32", "bfloat16"))
    f32, b16 = runs["float32"], runs["bfloat16"]
    for run in (f32, b16):
        assert run["param_dtypes"] == run["optim_dtypes"] == ["torch.float32"]
        assert run["logp"].dtype == torch.float32 and all(v.dtype == torch.float32 for v in run["state"].values())
    valid = f32["mask"] > 0
    gap = (f32["logp"] - b16["logp"])[valid].abs().max().item()
    assert 1e-4 < gap < 0.1, gap  # bf16 compute: visibly coarser than float32, still the same model
    from transformers import AutoModelForCausalLM

    w0 = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    step32 = torch.cat([(f32["state"][k] - w0[k]).flatten() for k in f32["state"]])
    step16 = torch.cat([(b16["state"][k] - w0[k]).flatten() for k in f32["state"]])
    assert torch.nn.functional.cosine_similarity(step32, step16, dim=0) > 0.9


def _checkpointing_rank(model_path, out, checkpointing: bool, engine_name: str = "fsdp") -> None:
    """One step with or without activation checkpointing -> out: the bytes autograd keeps for the backward of one
    forward pass, how often a module of the first layer runs in the step, the step's weights."""
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    from hpcrl.runtime.dist import init_from_env
    from hpcrl.trainer.engine import build_train_engine

    ctx = init_from_env("gloo")
    cfg = TrainerConfig(engine=engine_name, world_size=1, total_steps=2, lr=1e-2, warmup_steps=0,
                        activation_checkpointing=checkpointing)
    engine = build_train_engine(engine_name, model_path, cfg, AlgoConfig(), ctx, pad_id=0)
    seqs, _ = B.to_sequences(make_groups(n_groups=4, group_size=4), AlgoConfig())
    mb = B.collate(seqs, pad_id=0)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    engine.model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # what autograd keeps for backward
        logp = engine._forward(mb, entropy=None)[0]
    (logp * mb.mask).sum().backward()
    engine.optimizer.zero_grad(set_to_none=True)
    calls = [0]
    layer = engine.model.decoder.layers[0].mlp if engine_name == "megatron" else engine.model.model.layers[0]
    layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    stats = engine.train_step(seqs)
    torch.save({"saved_bytes": saved[0], "layer_calls": calls[0], "loss": stats,
                "state": {k: v.clone() for k, v in engine.full_state_dict().items()}}, out)
    torch.distributed.destroy_process_group()


def test_activation_checkpointing_keeps_less_for_backward_and_takes_the_same_step(tmp_path) -> None:
    """trainer.activation_checkpointing: autograd keeps far fewer bytes for backward, every decoder layer runs
    its forward again in the backward pass, and the step is the step without it (recomputation is exact)."""
    model_path = tmp_path / "model"
    _tiny_model(model_path)
    runs = _single_rank_variants(_checkpointing_rank, model_path, tmp_path, (False, True))
    off, on = runs[False], runs[True]
    assert on["saved_bytes"] < 0.6 * off["saved_bytes"], (on["saved_bytes"], off["saved_bytes"])
    assert on["layer_calls"] > off["layer_calls"] > 0  # the recompute in backward
    for k, v in off["state"].items():
        torch.testing.assert_close(on["state"][k], v, rtol=0, atol=1e-6)


def _lora_rank(model_path, out, rank: int) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hpcrl.runtime.dist import init_from_env
    from hpcrl.trainer.config import LoraSettings
    from hpcrl.trainer.engine import build_train_engine

    ctx = init_from_env("gloo")
    cfg = TrainerConfig(world_size=1, total_steps=4, lr=1e-2, warmup_steps=0, lora=LoraSettings(rank=rank, alpha=8))
    seqs, _ = B.to_sequences(make_groups(n_groups=4, group_size=4), AlgoConfig())
    engine = build_train_engine("fsdp", model_path, cfg, AlgoConfig(), ctx, pad_id=0)
    for _ in range(2):
        engine.train_step(seqs)
    trained = sorted(n for n, p in engine.model.named_parameters() if p.requires_grad)
    in_optimizer = sum(len(g["params"]) for g in engine.optimizer.param_groups)
    dcp.save(engine.checkpoint_state(), checkpoint_id=str(out.parent / f"ckpt{rank}"))
    engine.train_step(seqs)
    raw = {k: v.clone() for k, v in get_model_state_dict(  # PEFT's names, adapters apart
        engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)).items()}
    resumed = build_train_engine("fsdp", model_path, cfg, AlgoConfig(), ctx, pad_id=0)
    state = resumed.checkpoint_state()
    dcp.load(state, checkpoint_id=str(out.parent / f"ckpt{rank}"))
    resumed.load_checkpoint_state(state)
    resumed.train_step(seqs)
    merged = {k: v.clone() for k, v in engine.full_state_dict().items()}
    resumed_state = {k: v.clone() for k, v in resumed.full_state_dict().items()}
    cfg.lora.publish = "adapter"  # the same step published as the adapters alone, in PEFT's layout
    from hpcrl.weights.adapter import peft_config
    from hpcrl.weights.config import WeightsConfig
    from hpcrl.weights.transport import DiskWeights

    weights = DiskWeights(out.parent / "weights", WeightsConfig(),
                          adapter=peft_config(rank, 8, cfg.lora.target_modules, model_path))
    weights.publish(engine.full_state_dict(), 3)
    torch.save({"trained": trained, "in_optimizer": in_optimizer, "raw": raw, "state": merged,
                "resumed": resumed_state, "adapter_dir": str(weights.version_dir(3)), "merged_back": weights.fetch(3)}, out)
    torch.distributed.destroy_process_group()


def test_lora_trains_only_adapters_publishes_merged_weights_and_resumes(tmp_path) -> None:
    """trainer.lora.rank: only PEFT's adapter matrices train (and sit in the optimizer); the published weights
    carry HF names with each adapter merged as PEFT's merge_and_unload merges it, every other weight is the
    initial one, each adapted weight moved by a matrix of rank <= r; a DCP resume continues exactly. Published
    as the adapters alone (trainer.lora.publish: adapter), the version directory is one PEFT loads as it saves
    its own, and merged back it is the merged publication bit for bit."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    model_path = tmp_path / "model"
    _tiny_model(model_path)
    lora = _single_rank_variants(_lora_rank, model_path, tmp_path, (4,))[4]
    assert lora["trained"] and all(".lora_A." in n or ".lora_B." in n for n in lora["trained"])
    assert lora["in_optimizer"] == len(lora["trained"]) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    w0 = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    state = lora["state"]
    assert set(state) <= set(w0) and not [k for k in state if "lora" in k or "base_layer" in k]
    adapted = [k for k in state if k.endswith("proj.weight")]
    assert len(adapted) == 14
    for k, v in state.items():
        if k in adapted:
            delta = v - w0[k]
            assert delta.abs().max() > 0 and torch.linalg.matrix_rank(delta, atol=1e-6) <= 4, k
        else:
            assert torch.equal(v, w0[k]), k
    # PEFT's own merge of the same adapters
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                              "gate_proj", "up_proj", "down_proj"]))
    adapters = {f"base_model.model.{k}": v for k, v in lora["raw"].items() if ".lora_" in k}
    assert len(adapters) == 28 and not set(adapters) - set(peft_model.state_dict())
    peft_model.load_state_dict(adapters, strict=False)
    merged = peft_model.merge_and_unload().state_dict()
    for k, v in state.items():
        torch.testing.assert_close(v, merged[k], rtol=0, atol=1e-6)
    for k, v in lora["resumed"].items():  # checkpoint after 2 steps, one more step = the third step
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)
    adapter_dir = Path(lora["adapter_dir"])
    assert sorted(p.name for p in adapter_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert lora["merged_back"].keys() >= state.keys() - {"lm_head.weight"}  # (the tied head: the embedding)
    for k, v in lora["merged_back"].items():
        assert torch.equal(v, state[k]), k
    by_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), str(adapter_dir))
    for k, v in by_peft.merge_and_unload().state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=1e-6)


def _adapter_publish_rank(rank, world, port, model_path, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hpcrl.runtime.dist import init_from_env
    from hpcrl.trainer.config import LoraSettings
    from hpcrl.trainer.engine import build_train_engine
    from hpcrl.weights.adapter import from_engine

    ctx = init_from_env("gloo")
    cfg = TrainerConfig(world_size=world, total_steps=1, lr=1e-2, warmup_steps=0,
                        lora=LoraSettings(rank=4, alpha=8, publish="adapter"))
    engine = build_train_engine("fsdp", model_path, cfg, AlgoConfig(), ctx, pad_id=0)
    engine.train_step(B.to_sequences(make_groups(n_groups=4, group_size=4), AlgoConfig())[0])
    published = engine.full_state_dict()
    full = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"published": published, "from_full": from_engine(full)}, out)
    else:
        assert published == {}
    torch.distributed.destroy_process_group()


def test_lora_adapters_are_published_from_their_own_shards(tmp_path) -> None:
    """trainer.lora.publish: adapter on 2 FSDP2 ranks: rank 0 gets the adapters gathered alone (not the frozen
    base), equal to those of the full state dict, after a step that moved them."""
    from spawn_ranks import spawn_ranks

    _tiny_model(tmp_path / "model")
    spawn_ranks(_adapter_publish_rank, 2, tmp_path / "model", tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt")
    assert got["published"].keys() == got["from_full"].keys() and len(got["published"]) == 28
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in got["published"].items())
    for k, v in got["from_full"].items():
        assert torch.equal(got["published"][k], v), k


@pytest.mark.parametrize("target, refused", [("lm_head", "tied"), ("embed_tokens", "plain linear")])
def test_lora_refuses_adapters_it_could_not_merge(target: str, refused: str) -> None:
    """A head tied to the embeddings (a merged adapter would change both) and an embedding (PEFT's
    lora_embedding_* adapters) are refused when the adapters are injected, before any training."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hpcrl.trainer.config import LoraSettings
    from hpcrl.trainer.lora import apply_lora

    cfg = Qwen3Config(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, tie_word_embeddings=True)
    with pytest.raises(ValueError, match=f"target_modules: '{target}'.*{refused}"):
        apply_lora(Qwen3ForCausalLM(cfg), LoraSettings(rank=2, target_modules=[target]))
    with pytest.raises(ValueError, match="matched no module"):
        apply_lora(Qwen3ForCausalLM(cfg), LoraSettings(rank=2, target_modules=["c_attn"]))


def test_the_trainer_beats_while_it_waits_for_its_batch_and_keeps_its_progress_in_the_beat(tmp_path) -> None:
    """The trainer used to beat only after a step: waiting for rollouts (its only one preempted) looked like a hang
    to a supervisor that had just restarted its heartbeat clock (a lagging sacct said the trainer's job pended)."""
    import signal

    from hpcrl.runtime.heartbeat import Heartbeat, read_heartbeats
    from hpcrl.runtime.owner import NoFence
    from hpcrl.runtime.preempt import Preempted, PreemptionFlag
    from hpcrl.trainer.main import batch_wait

    heartbeat = Heartbeat(tmp_path, "trainer-r0@x", interval_s=0.05)
    heartbeat.beat(version=7)
    first = read_heartbeats(tmp_path)["trainer-r0@x"]
    flag = PreemptionFlag((signal.SIGUSR1,))
    try:
        wait = batch_wait(flag, NoFence(), heartbeat)
        time.sleep(0.06)
        wait()
        beat = read_heartbeats(tmp_path)["trainer-r0@x"]
        assert beat["time"] > first["time"] and beat["version"] == 7
        signal.raise_signal(signal.SIGUSR1)
        with pytest.raises(Preempted):
            wait()
    finally:
        flag.close()
    heartbeat.beat(version=8)
    heartbeat.beat(force=True)
    assert read_heartbeats(tmp_path)["trainer-r0@x"]["version"] == 8


def test_a_rank_blocked_in_the_batch_broadcast_beats_from_a_thread_until_it_returns(tmp_path) -> None:
    """Ranks > 0 wait inside the broadcast of rank 0's batch as long as rank 0 waits for rollouts: they used to
    write nothing meanwhile, and a supervisor watching every rank's heartbeat (local scheduler) called them hung."""
    from hpcrl.runtime.heartbeat import Heartbeat, beating, read_heartbeats

    heartbeat = Heartbeat(tmp_path, "trainer-r1@x", interval_s=0.05)
    heartbeat.beat(version=3)
    before = read_heartbeats(tmp_path)["trainer-r1@x"]["time"]
    with beating(heartbeat):
        time.sleep(0.4)  # blocked, as in dist.broadcast_object_list
    during = read_heartbeats(tmp_path)["trainer-r1@x"]
    assert during["time"] > before + 0.2 and during["version"] == 3
    time.sleep(0.2)
    assert read_heartbeats(tmp_path)["trainer-r1@x"]["time"] == during["time"]  # the thread stopped
    with beating(None):
        pass
