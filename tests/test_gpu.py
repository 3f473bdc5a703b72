"""The CUDA paths on a real GPU: the engine, the FSDP2 and megatron trainers over NCCL, weights into a CUDA engine.

Skipped where no CUDA device is visible; on a GPU node run ``pytest -m gpu``.
Not here: the collective transport between processes over NCCL, which needs
one GPU per process (NCCL refuses two ranks on one device); its protocol is
the gloo one that ``test_collective.py`` checks between real processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpcrl.rollout.engine import Request, SamplingParams
from hpcrl.rollout.torch_engine import TorchEngine
from hpcrl.weights.collective import Layout
from hpcrl.weights.config import WeightsConfig
from hpcrl.weights.transport import DiskWeights, unique_tensors
from test_engine import EOS, PAD, prompts, tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def exact_float32():
    """No TF32: results are compared with float32 references."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def test_engine_on_cuda_matches_hf_generate() -> None:
    model = tiny_model(1).to(CUDA)
    engine = TorchEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_batch_size=3,
                         sampling=SamplingParams(max_new_tokens=12, greedy=True))
    reqs = [Request(i, p, max_new_tokens=6 + (i % 4) * 2) for i, p in enumerate(prompts(7, seed=1))]
    for r, c in zip(reqs, engine.generate(reqs)):
        ids = torch.tensor([r.prompt_ids], device=CUDA)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=r.max_new_tokens, eos_token_id=EOS, pad_token_id=PAD)
        assert c.output_ids == out[0, len(r.prompt_ids):].tolist(), r.id


def test_disk_weights_load_into_a_cuda_engine_bit_identical(tmp_path: Path) -> None:
    src = tiny_model(3)
    disk = DiskWeights(tmp_path / "weights", WeightsConfig())
    disk.publish(src.state_dict(), 1)
    engine = TorchEngine(tiny_model(4).to(CUDA), eos_token_id=EOS, pad_token_id=PAD)
    engine.update_weights(disk.locate(disk.latest_version()))
    got = engine.model.state_dict()
    for k, v in src.state_dict().items():
        assert got[k].device.type == "cuda" and torch.equal(got[k].cpu(), v), k


def test_collective_layout_packs_and_unpacks_on_cuda() -> None:
    state = unique_tensors({k: v.to(CUDA) for k, v in tiny_model(5).state_dict().items()})
    layout = Layout.of(state, bucket_bytes=4096)
    buckets = layout.pack(state, CUDA)
    assert len(buckets) > 1 and all(b.device.type == "cuda" for b in buckets)
    back = Layout.from_json(layout.to_json()).unpack(buckets)  # handed over on the host
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k].cpu()) for k in state)


def test_fsdp_trainer_over_nccl_matches_gloo_on_cpu(tmp_path: Path) -> None:
    from test_trainer import _run, _tiny_model

    model_path = tmp_path / "model"
    _tiny_model(model_path)
    _run(1, model_path, tmp_path / "cpu.pt", micro_tokens=100_000, backend="gloo")
    _run(1, model_path, tmp_path / "cuda.pt", micro_tokens=100_000, backend="nccl")
    cpu, cuda = torch.load(tmp_path / "cpu.pt"), torch.load(tmp_path / "cuda.pt")
    assert cpu.keys() == cuda.keys()
    for k in cpu:
        torch.testing.assert_close(cuda[k], cpu[k], atol=1e-4, rtol=1e-3)


def test_megatron_trainer_on_cuda_matches_the_cpu(tmp_path: Path) -> None:
    """trainer.engine=megatron on one GPU over NCCL: two PPO steps with a critic give the weights that the
    same steps give on the CPU over gloo (the model, master weights and inputs moved to the rank's device)."""
    pytest.importorskip("megatron.core")
    from test_megatron import _train, qwen3

    model = qwen3(tied=True, kv_heads=2, layers=2, vocab=40)
    model.config.pad_token_id = 0
    model.save_pretrained(tmp_path / "model")
    cpu = _train(1, tmp_path / "model", tmp_path / "cpu.pt", "megatron", micro_tokens=32, gae=True)
    cuda = _train(1, tmp_path / "model", tmp_path / "cuda.pt", "megatron", micro_tokens=32, gae=True,
                  backend="nccl")
    assert cpu["weights"].keys() == cuda["weights"].keys()
    for k in cpu["weights"]:
        torch.testing.assert_close(cuda["weights"][k], cpu["weights"][k], atol=1e-4, rtol=1e-3)
    for a, b in zip(cuda["stats"], cpu["stats"]):
        assert a["value/loss"] == pytest.approx(b["value/loss"], rel=1e-3, abs=1e-5)
