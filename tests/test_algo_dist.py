"""Every algorithm family through the real FSDP2 engine: 2 gloo ranks x many micro-batches == 1 rank x 1.

Each case trains two steps with SGD (linear in the gradient, so a wrong loss
scale, normaliser, whitening moment or rank averaging shows up; Adam would
normalise it away) and compares the policy and critic weights.
"""

from __future__ import annotations

import os
import sys

import pytest
from spawn_ranks import spawn_ranks
import torch

from hpcrl.algo.config import AlgoConfig
from hpcrl.trainer import batch as B
from hpcrl.trainer.config import TrainerConfig

CASES = {
    "gspo_dual": dict(ratio_level="sequence", eps_clip=0.01, eps_clip_high=0.02, dual_clip=2.0,
                      behav_imp_weight_level="sequence", loss_agg="seq_mean_token_mean"),
    "dr_grpo_kl_loss_entropy_m2po": dict(adv_estimator="dr_grpo", loss_agg="seq_mean_token_sum", kl_mode="loss",
                                         kl_coef=0.5, entropy_coef=0.1, m2_threshold=3.0),
    "reinforce_pp_kl_reward": dict(adv_estimator="reinforce_pp", kl_mode="reward", kl_estimator="k1", kl_coef=0.2,
                                   drop_uniform_groups=False, behav_imp_weight_mode="mask",
                                   behav_imp_weight_cap=1.5, behav_imp_weight_lower=0.5),
    "ppo_gae_critic": dict(adv_estimator="gae", gamma=0.95, lam=0.9, value_clip=0.05, drop_uniform_groups=False),
    "lite_ppo_prox_approx": dict(adv_estimator="lite_ppo", prox_approx=True),
}


def _tiny_model(path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, tie_word_embeddings=True,
                      pad_token_id=0, eos_token_id=1, bos_token_id=1)
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def _rank(rank: int, world: int, port: int, model_path, out_dir, micro_tokens: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hpcrl.runtime.dist import init_from_env
    from hpcrl.trainer.fsdp import FSDPEngine
    from test_trainer import make_groups

    ctx = init_from_env("gloo")
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for name, kwargs in CASES.items():
        torch.manual_seed(0)  # the critic's fresh value head is the same in every process
        algo = AlgoConfig(**kwargs)
        cfg = TrainerConfig(world_size=world, total_steps=2, lr=1e-2, warmup_steps=0,
                            micro_batch_tokens=micro_tokens, n_minibatches=2)
        engine = FSDPEngine(model_path, cfg, algo, ctx, pad_id=0)
        engine.optimizer = torch.optim.SGD(engine.model.parameters(), lr=0.5)
        engine.scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)
        if engine.critic is not None:
            engine.critic_optimizer = torch.optim.SGD(engine.critic.parameters(), lr=0.5)
            engine.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(engine.critic_optimizer, lambda s: 1.0)
        seqs, _ = B.to_sequences(make_groups(n_groups=6, group_size=4), algo)
        stats = [engine.train_step(seqs, version=v) for v in range(2)]
        state = {f"policy.{k}": v for k, v in engine.full_state_dict().items()}
        if engine.critic is not None:
            state.update({f"critic.{k}": v for k, v in get_model_state_dict(engine.critic, options=opts).items()})
        if rank == 0:
            torch.save({"state": {k: v.clone() for k, v in state.items()}, "stats": stats}, out_dir / f"{name}.pt")
    torch.distributed.destroy_process_group()
    # every result is on disk: skip the interpreter's teardown, where a background thread of torch once aborted
    # the process ("terminate called without an active exception", exit -6) after all its work was done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(world: int, model_path, out_dir, micro_tokens: int) -> None:
    out_dir.mkdir()
    spawn_ranks(_rank, world, model_path, out_dir, micro_tokens)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("algo_dist")
    _tiny_model(tmp / "model")
    _run(1, tmp / "model", tmp / "w1", micro_tokens=100_000)
    _run(2, tmp / "model", tmp / "w2", micro_tokens=32)
    return tmp


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_many_micro_batches_equal_one_rank(runs, name) -> None:
    one, two = torch.load(runs / "w1" / f"{name}.pt"), torch.load(runs / "w2" / f"{name}.pt")
    from transformers import AutoModelForCausalLM

    w0 = AutoModelForCausalLM.from_pretrained(runs / "model").state_dict()
    w1, w2 = one["state"], two["state"]
    assert w1.keys() == w2.keys()
    moved = max((w1[f"policy.{k}"] - w0[k]).abs().max().item() for k in w0 if f"policy.{k}" in w1)
    assert moved > 1e-4
    for k in w1:
        assert torch.isfinite(w1[k]).all()
        torch.testing.assert_close(w1[k], w2[k], atol=2e-6, rtol=1e-5, msg=lambda m: f"{name} {k}: {m}")
    for step in one["stats"]:
        assert all(torch.isfinite(torch.tensor(v)) for v in step.values())
    if name == "ppo_gae_critic":
        assert any(k.startswith("critic.") for k in w1) and "value/loss" in one["stats"][0]
    if name.endswith("m2po"):  # the cutoff is over both ranks' tokens: some masked, not all
        assert all(0 < step["loss/m2_masked_fraction"] < 1 for step in one["stats"] + two["stats"])
    if name.startswith("reinforce"):
        assert abs(one["stats"][0]["adv/mean"]) < 1e-5 and one["stats"][0]["adv/std"] == pytest.approx(1, abs=1e-3)
