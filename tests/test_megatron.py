"""The megatron-core engine's model side (``hpcrl/trainer/mcore``), on the CPU over gloo.

HuggingFace Qwen3 weights <-> megatron-core GPTModel: splitting into
tensor-parallel slices and pipeline stages and merging them back is exact
(tied and untied output layers, grouped-query attention, a vocabulary that
TP does not divide); a GPTModel built from an HF folder on 1 rank, TP = 2,
PP = 2 and TP x PP = 2 x 2 gives the HF model's logits within float32
rounding, and gathering its weights back gives the HF weights bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from hpcrl.runtime.dist import free_port  # noqa: E402
from hpcrl.trainer.mcore import convert  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def qwen3(tied: bool, kv_heads: int = 2, layers: int = 4, vocab: int = 99):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=kv_heads, head_dim=16, intermediate_size=64,
                         max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # HF leaves norms at 1: make every tensor distinct so a swapped name shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_splitting_into_parallel_ranks_and_merging_back_is_exact(tied, tp, pp) -> None:
    model = qwen3(tied)
    hf = model.state_dict()
    shards = [[convert.hf_to_mcore(hf, model.config, tp, r, pp, s, pad_vocab_to=8) for r in range(tp)]
              for s in range(pp)]
    assert shards[0][0]["embedding.word_embeddings.weight"].shape[0] * tp % (8 * tp) == 0  # padded, then split
    back = convert.mcore_to_hf(shards, model.config)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    layers = [sorted({k.split(".")[2] for k in sh[0] if k.startswith("decoder.layers.")}) for sh in shards]
    assert layers == [[str(i) for i in range(4 // pp)]] * pp  # each stage holds its own layers, locally numbered


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("saved,wanted", [((2, 1), (1, 2)), ((1, 2), (2, 2)), ((2, 2), (1, 1)), ((2, 2), (2, 1))])
def test_a_checkpoint_reshards_exactly_onto_other_parallel_sizes(tmp_path, tied, saved, wanted) -> None:
    """A checkpoint as the engine writes it (each rank's slices of the weights and of AdamW's moments, of the
    policy and of a critic) on ``saved`` = (TP, PP), read by every rank of ``wanted``: each gets exactly the
    slices of the same weights and moments that a trainer of that layout would have saved."""
    import torch.distributed.checkpoint as dcp

    from hpcrl.trainer.mcore.model import Layout
    from hpcrl.trainer.mcore.reshard import prefix, reshard

    model = qwen3(tied)
    weights = model.state_dict()
    torch.manual_seed(1)
    kinds = {"model": weights, "exp_avg": {k: torch.randn_like(v) for k, v in weights.items()}}
    kinds["exp_avg_sq"] = {k: torch.rand_like(v) for k, v in weights.items()}
    if tied:  # one weight under two HF names, one moment too
        for k in ("exp_avg", "exp_avg_sq"):
            kinds[k]["lm_head.weight"] = kinds[k]["model.embed_tokens.weight"]

    head = {k: {"output_layer.weight": torch.randn(1, 32), "output_layer.bias": torch.randn(1)} for k in kinds}

    def written(tp: int, pp: int, r: int, s: int) -> dict:
        at = prefix(tp, r, pp, s)
        state: dict = {"model": {}, "optim": {}, "critic": {}, "critic_optim": {}}
        policy = {k: convert.hf_to_mcore(v, model.config, tp, r, pp, s) for k, v in kinds.items()}
        # the critic: the decoder's weights negated, a value head (on every TP rank) in place of the output layer
        critic = {k: {n: -t for n, t in v.items() if not n.startswith("output_layer")} for k, v in policy.items()}
        for k in critic:
            critic[k].update(head[k] if s == pp - 1 else {})
        for (part, optim), parts in ((("model", "optim"), policy), (("critic", "critic_optim"), critic)):
            for name, t in parts["model"].items():
                state[part][f"{at}/{name}"] = t
                state[optim].update({f"{at}/{name}/{k}": parts[k][name] for k in ("exp_avg", "exp_avg_sq")})
                state[optim][f"{at}/{name}/step"] = torch.tensor(7.0)
        return state

    tp, pp = saved
    everything: dict = {"model": {}, "optim": {}, "critic": {}, "critic_optim": {}}
    for s in range(pp):
        for r in range(tp):
            for part, tensors in written(tp, pp, r, s).items():
                everything[part].update(tensors)
    dcp.save(everything, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    tp, pp = wanted
    for s in range(pp):
        for r in range(tp):
            got = reshard(tmp_path / "ckpt", model.config, Layout(tp, pp, 1, r, s, 0), set(everything))
            expected = written(tp, pp, r, s)
            for part in everything:
                assert got[part].keys() == expected[part].keys()
                assert all(torch.equal(got[part][k], expected[part][k]) for k in expected[part]), (part, r, s)
            weights_only = reshard(tmp_path / "ckpt", model.config, Layout(tp, pp, 1, r, s, 0), {"model"})
            assert set(weights_only) == {"model"} and weights_only["model"].keys() == expected["model"].keys()


def test_unsupported_models_and_layouts_are_refused_by_name() -> None:
    model = qwen3(tied=True, kv_heads=2)
    with pytest.raises(ValueError, match="tensor_parallel=4: must divide the 2 key/value heads"):
        convert.transformer_config(model.config, tp=4)
    with pytest.raises(ValueError, match="pipeline_parallel=3: must divide the 4 layers"):
        convert.transformer_config(model.config, pp=3)
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="only SwiGLU"):
        convert.transformer_config(model.config)


def run_ranks(hf_dir: Path, tp: int, pp: int, out: Path) -> list[dict]:
    out.mkdir(parents=True)
    world, port = tp * pp, str(free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
           "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "mcore_probe.py"), str(hf_dir), str(tp), str(pp),
                               str(out)], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("tied,tp,pp", [(True, 1, 1), (False, 2, 1), (True, 1, 2), (True, 2, 2)])
def test_a_parallel_gpt_model_computes_the_hf_logits_and_gathers_the_hf_weights(tmp_path, tied, tp, pp) -> None:
    hf_dir = tmp_path / "hf"
    qwen3(tied).save_pretrained(hf_dir)
    results = run_ranks(hf_dir, tp, pp, tmp_path / "out")
    last = [r for r in results if r["stage"] == pp - 1]
    assert len(last) == tp and all(r["max_abs_diff"] < 1e-5 for r in last), results
    assert all("max_abs_diff" not in r for r in results if r["stage"] != pp - 1)  # logits on the last stage only
    assert results[0]["names_differ"] == [] and results[0]["unequal"] == [], results[0]


def _train_rank(rank, world, port, model_path, out, engine_name, tp, micro_tokens, pp=1, gae=False,
                backend="gloo") -> None:
    """Two steps of the default objective (``gae``: PPO with a critic and GAE) with SGD (linear in the gradient,
    so a wrong loss or gradient scale shows), then the HF weights and the step statistics on rank 0."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from test_trainer import make_groups

    from hpcrl.algo.config import AlgoConfig
    from hpcrl.runtime.dist import init_from_env
    from hpcrl.trainer import batch as B
    from hpcrl.trainer.config import MegatronSettings, TrainerConfig
    from hpcrl.trainer.engine import build_train_engine

    ctx = init_from_env(backend)
    cfg = TrainerConfig(engine=engine_name, world_size=world, total_steps=2, lr=1e-2, warmup_steps=0,
                        micro_batch_tokens=micro_tokens, n_minibatches=2, grad_clip=0.5,
                        megatron=MegatronSettings(tensor_parallel=tp, pipeline_parallel=pp))
    algo = AlgoConfig(adv_estimator="gae", gamma=0.95, lam=0.9, value_clip=0.05) if gae else AlgoConfig()
    engine = build_train_engine(engine_name, model_path, cfg, algo, ctx, pad_id=0)
    engine.optimizer = torch.optim.SGD(engine.model.parameters(), lr=0.5)
    engine.scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)
    if gae:
        engine.critic_optimizer = torch.optim.SGD(engine.critic.parameters(), lr=0.5)
        engine.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(engine.critic_optimizer, lambda s: 1.0)
    seqs, _ = B.to_sequences(make_groups(n_groups=6, group_size=4), algo)
    stats = [engine.train_step(seqs) for _ in range(2)]
    state = engine.full_state_dict()
    if rank == 0:
        torch.save({"weights": {k: v.detach().cpu().clone() for k, v in state.items()}, "stats": stats}, out)
    torch.distributed.destroy_process_group()


def _train(world, model_path, out, engine_name, tp=1, micro_tokens=100_000, pp=1, gae=False, backend="gloo") -> dict:
    from spawn_ranks import spawn_ranks

    spawn_ranks(_train_rank, world, model_path, out, engine_name, tp, micro_tokens, pp, gae, backend)
    return torch.load(out)


@pytest.fixture(scope="module")
def fsdp_steps(tmp_path_factory):
    """The model, its initial weights, and the FSDP2 engine's two steps on 1 rank: what every layout must give."""
    root = tmp_path_factory.mktemp("fsdp-steps")
    model = qwen3(tied=True, kv_heads=2, layers=2, vocab=40)
    model.config.pad_token_id = 0
    model.save_pretrained(root / "model")
    return root / "model", model.state_dict(), _train(1, root / "model", root / "fsdp.pt", "fsdp")


@pytest.mark.parametrize("world,tp,pp,micro_tokens", [(1, 1, 1, 100_000), (2, 2, 1, 32), (2, 1, 1, 32),
                                                     (2, 1, 2, 32), (4, 2, 2, 100_000)],
                         ids=["1 rank", "TP=2", "DP=2 many micro-batches", "PP=2 many micro-batches", "TPxPP=2x2"])
def test_megatron_steps_equal_the_fsdp_engine(tmp_path, fsdp_steps, world, tp, pp, micro_tokens) -> None:
    """Two steps (2 minibatches each, gradient clipping active) on the same batch give the weights and the loss
    of the FSDP2 engine on 1 rank, within float32 rounding."""
    model_path, w0, ref = fsdp_steps
    got = _train(world, model_path, tmp_path / "megatron.pt", "megatron", tp, micro_tokens, pp)
    assert max((ref["weights"][k] - w0[k]).abs().max().item() for k in w0) > 1e-3  # the steps moved the weights
    assert got["weights"].keys() == ref["weights"].keys()
    for k in ref["weights"]:
        torch.testing.assert_close(got["weights"][k], ref["weights"][k], atol=2e-5, rtol=1e-4)
    # loss and gradient norm are global; token means such as the clip fraction are of rank 0's own tokens
    keys = ("loss/value", "grad/norm") + (("loss/clip_fraction",) if world == tp * pp else ())
    for a, b in zip(got["stats"], ref["stats"]):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("world,tp,pp", [(2, 2, 1), (2, 1, 2)], ids=["TP=2", "PP=2"])
def test_a_megatron_critic_trains_as_the_fsdp_critic(tmp_path, fsdp_steps, world, tp, pp) -> None:
    """PPO with GAE: the critic (the decoder with a value head, its own optimizer) gives the FSDP2 critic's values
    and value loss, before and after a step, and the policy step that its advantages make."""
    model_path = fsdp_steps[0]
    ref = _train(1, model_path, tmp_path / "fsdp.pt", "fsdp", gae=True)
    got = _train(world, model_path, tmp_path / "megatron.pt", "megatron", tp, 32, pp, gae=True)
    assert ref["stats"][0]["value/loss"] > 0 and ref["stats"][1]["value/mean"] != ref["stats"][0]["value/mean"]
    for k in ref["weights"]:
        torch.testing.assert_close(got["weights"][k], ref["weights"][k], atol=2e-5, rtol=1e-4)
    for a, b in zip(got["stats"], ref["stats"]):
        for key in ("loss/value", "grad/norm", "value/loss", "value/mean", "value/return_mean", "adv/return_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


PIPELINE_SHAPES = [(2, 7), (1, 11), (3, 5), (2, 9), (1, 4), (2, 6)]  # micro-batches of different shapes


def _pipeline_inputs(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, vocab, shape, generator=gen) for shape in PIPELINE_SHAPES]


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    logp = torch.log_softmax(logits[:, :-1, :vocab].float(), dim=-1)
    return -logp.gather(-1, ids[:, 1:, None]).sum()


def _pipeline_rank(rank, world, port, model_path, out) -> None:
    """The 1F1B passes of PIPELINE_SHAPES' micro-batches on ``world`` stages; each stage's order of passes and
    the gradients gathered under HF names on rank 0."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from hpcrl.trainer.mcore import model as M
    from hpcrl.trainer.mcore.pipeline import one_forward_one_backward

    dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = M.init_parallel(1, world)
    model = M.build(model_path, layout)
    vocab = model.hf_config.vocab_size
    inputs = _pipeline_inputs(vocab)
    def loss_of(i, out):
        return _next_token_loss(out, inputs[i], vocab)

    orders = {len(inputs): one_forward_one_backward(model, layout, inputs, loss_of)}
    grads = M.gather_hf(model, layout, {n: p.grad.clone() for n, p in model.named_parameters()})
    for m in (0, 1, 2):  # fewer micro-batches than stages
        orders[m] = one_forward_one_backward(model, layout, inputs[:m], loss_of)
    torch.save({"stage": layout.stage, "orders": orders, "grads": grads}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_the_1f1b_schedule_runs_the_stages_together_and_gives_the_model_gradients(tmp_path) -> None:
    """Four pipeline stages, six micro-batches of different shapes: each stage runs the textbook 1F1B order
    (warm-up forwards, one forward one backward, cool-down backwards; so stage s holds at most 4 - s
    micro-batches' activations), and the gradients summed over the micro-batches are the HF model's. With
    fewer micro-batches than stages (2, 1, none) the order is the textbook one too (no transfer left
    waiting)."""
    from spawn_ranks import spawn_ranks

    pp, m = 4, len(PIPELINE_SHAPES)
    hf = qwen3(tied=False, layers=4)
    hf.save_pretrained(tmp_path / "hf")
    spawn_ranks(_pipeline_rank, pp, str(tmp_path / "hf"), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(pp)]
    for r in ranks:
        s = r["stage"]
        for n, order in r["orders"].items():
            warmup = min(pp - s - 1, n)
            want = [("F", i) for i in range(warmup)]
            for i in range(warmup, n):
                want += [("F", i), ("B", i - warmup)]
            want += [("B", i) for i in range(n - warmup, n)]
            assert order == want, (s, n, order)
        order = r["orders"][m]
        held = [sum(1 for p, _ in order[: k + 1] if p == "F") - sum(1 for p, _ in order[:k] if p == "B")
                for k in range(len(order))]
        assert max(held) == pp - s, (s, held)
    vocab = hf.config.vocab_size
    sum(_next_token_loss(hf(ids).logits, ids, vocab) for ids in _pipeline_inputs(vocab)).backward()
    got = ranks[0]["grads"]
    assert got.keys() == dict(hf.named_parameters()).keys()
    for name, p in hf.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_activation_checkpointing_keeps_less_for_backward_and_takes_the_same_step(tmp_path) -> None:
    """trainer.activation_checkpointing with the megatron engine: autograd keeps far fewer bytes for backward,
    every transformer layer runs its forward again in the backward pass, and the step is the step without it."""
    from test_trainer import _checkpointing_rank, _single_rank_variants

    model_path = tmp_path / "model"
    model = qwen3(tied=True, kv_heads=2, layers=2, vocab=40)
    model.config.pad_token_id = 0
    model.save_pretrained(model_path)
    runs = _single_rank_variants(_checkpointing_rank, model_path, tmp_path, (False, True), "megatron")
    off, on = runs[False], runs[True]
    print(f"kept for backward: {off['saved_bytes']:,} -> {on['saved_bytes']:,} bytes")
    assert on["saved_bytes"] < 0.6 * off["saved_bytes"], (on["saved_bytes"], off["saved_bytes"])
    assert on["layer_calls"] > off["layer_calls"] > 0  # the recompute in backward
    for k, v in off["state"].items():
        torch.testing.assert_close(on["state"][k], v, rtol=0, atol=1e-6)


def _dtype_rank(rank, world, port, model_path, out, dtype: str, pp: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from test_trainer import make_groups

    from hpcrl.algo.config import AlgoConfig
    from hpcrl.runtime.dist import init_from_env
    from hpcrl.trainer import batch as B
    from hpcrl.trainer.config import MegatronSettings, TrainerConfig
    from hpcrl.trainer.engine import build_train_engine

    ctx = init_from_env("gloo")
    cfg = TrainerConfig(engine="megatron", world_size=world, total_steps=2, lr=1e-2, warmup_steps=0,
                        megatron=MegatronSettings(pipeline_parallel=pp))
    algo = AlgoConfig(adv_estimator="gae", critic_lr=1e-2)
    engine = build_train_engine("megatron", model_path, cfg, algo, ctx, pad_id=0, dtype=dtype)
    seqs, _ = B.to_sequences(make_groups(n_groups=4, group_size=4), algo)
    mb = B.collate(seqs, pad_id=0)
    with torch.no_grad():
        logp = engine._forward(mb, entropy=None)[0]
    engine.train_step(seqs)
    optim = [v for opt in (engine.optimizer, engine.critic_optimizer) for state in opt.state.values()
             for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    state = engine.full_state_dict()
    if rank == 0:
        torch.save({"logp": logp, "mask": mb.mask, "state": {k: v.clone() for k, v in state.items()},
                    "param_dtypes": sorted({str(p.dtype) for m in (engine.model, engine.critic)
                                            for p in m.parameters()}),
                    "master_dtypes": sorted({str(m.dtype) for m in engine.masters.values()}),
                    "optim_dtypes": sorted({str(v.dtype) for v in optim})}, out)
    torch.distributed.destroy_process_group()


def test_bfloat16_computes_in_bf16_and_keeps_float32_master_weights(tmp_path, pp: int = 2) -> None:
    """model.dtype=bfloat16 with the megatron engine on two pipeline stages (a tied embedding: its copy on the
    last stage has a master too), PPO with a critic: parameters and compute in bf16 (the critic's too), float32
    master weights (gradients summed into them in float32), optimizer state, published weights and logprobs in
    float32; the step goes where the float32 step goes."""
    from spawn_ranks import spawn_ranks

    model_path = tmp_path / "model"
    model = qwen3(tied=True, kv_heads=2, layers=2, vocab=40)
    model.config.pad_token_id = 0
    model.save_pretrained(model_path)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        spawn_ranks(_dtype_rank, pp, model_path, tmp_path / f"{dtype}.pt", dtype, pp)
        runs[dtype] = torch.load(tmp_path / f"{dtype}.pt")
    f32, b16 = runs["float32"], runs["bfloat16"]
    assert f32["param_dtypes"] == f32["master_dtypes"] == f32["optim_dtypes"] == ["torch.float32"]
    assert b16["param_dtypes"] == ["torch.bfloat16"]
    assert b16["master_dtypes"] == b16["optim_dtypes"] == ["torch.float32"]
    for run in (f32, b16):
        assert run["logp"].dtype == torch.float32 and all(v.dtype == torch.float32 for v in run["state"].values())
    valid = f32["mask"] > 0
    gap = (f32["logp"] - b16["logp"])[valid].abs().max().item()
    assert 1e-4 < gap < 0.1, gap  # bf16 compute: visibly coarser than float32, still the same model
    w0 = model.state_dict()
    step32 = torch.cat([(f32["state"][k] - w0[k]).flatten() for k in f32["state"]])
    step16 = torch.cat([(b16["state"][k] - w0[k]).flatten() for k in f32["state"]])
    assert torch.nn.functional.cosine_similarity(step32, step16, dim=0) > 0.9
    # the published weights are the float32 masters, not their bf16 rounding
    assert any(not torch.equal(v, v.bfloat16().float()) for v in b16["state"].values())


def test_a_cpu_rank_on_a_gpu_node_keeps_megatron_core_on_the_cpu(tmp_path) -> None:
    """trainer.backend=gloo on a node with CUDA: megatron-core's CUDA calls are redirected by the rank's device,
    not by whether the node has CUDA (found by the device check on an H100: the rotary tables went to the GPU
    beside a model on the CPU). CUDA's presence is a stand-in here."""
    probe = f"""
import os, torch, torch.distributed as dist
torch.cuda.is_available = lambda: True
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
dist.init_process_group("gloo", rank=0, world_size=1)
from hpcrl.trainer.mcore import model as M
M.init_parallel(1, 1, device=torch.device("cpu"))
print(torch.cuda.current_device())
"""
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert got.returncode == 0 and got.stdout.split()[-1] == "cpu", got.stderr[-2000:]
