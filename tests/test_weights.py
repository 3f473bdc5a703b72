"""Disk weight publication: atomic versions, LATEST, retention, tied parameters; ckpt_tools inspect."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ckpt_tools.__main__ import main as ckpt_main
from hpcrl.weights.config import WeightsConfig
from hpcrl.weights.transport import DiskWeights, storable_tensors, unique_tensors


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(10, 4, generator=g)
    return {"embed.weight": emb, "lm_head.weight": emb, "layer.weight": torch.randn(4, 4, generator=g)}


def test_publish_fetch_latest_and_prune(tmp_path) -> None:
    w = DiskWeights(tmp_path / "weights", WeightsConfig(keep_last=2))
    assert w.latest_version() == 0  # nothing published: the initial model
    for v in (1, 2, 3):
        w.publish(state(v), v)
    assert w.latest_version() == 3
    got = w.fetch(3)
    assert torch.equal(got["layer.weight"], state(3)["layer.weight"])
    # the tied alias is stored as its own copy: a server that loads the model untied (vLLM) needs it
    assert torch.equal(got["lm_head.weight"], got["embed.weight"])
    versions = sorted(p.name for p in (tmp_path / "weights").glob("v*"))
    assert versions == ["v000002", "v000003"]
    assert not [p for p in (tmp_path / "weights").iterdir() if ".tmp." in p.name]


def test_unique_and_storable_tensors_tell_aliases_from_equal_values() -> None:
    a = torch.zeros(3)
    out = unique_tensors({"a": a, "b": torch.zeros(3), "c": a})
    assert sorted(out) == ["a", "b"]
    stored = storable_tensors({"a": a, "b": torch.zeros(3), "c": a})
    assert sorted(stored) == ["a", "b", "c"] and stored["c"].data_ptr() != stored["a"].data_ptr()


def test_ckpt_tools_inspect(tmp_path, capsys) -> None:
    w = DiskWeights(tmp_path / "weights", WeightsConfig())
    w.publish(state(0), 7)
    assert ckpt_main(["inspect", str(w.version_dir(7)), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["metadata"]["version"] == "7"
    assert info["total_params"] == 2 * 10 * 4 + 4 * 4  # the tied lm_head is stored as its own copy
    assert ckpt_main(["inspect", str(tmp_path / "missing")]) == 2


def test_weight_version_stages_tensors_for_a_server_and_keeps_only_the_newest(tmp_path) -> None:
    from hpcrl.weights.version import WeightVersion

    on_disk = DiskWeights(tmp_path / "weights", WeightsConfig())
    on_disk.publish(state(1), 1)
    located = on_disk.locate(1)
    assert located.directory(tmp_path / "staging") == on_disk.version_dir(1)  # disk mode: the published dir itself
    assert torch.equal(located.tensors()["layer.weight"], state(1)["layer.weight"])
    staged = WeightVersion(2, state=state(2)).directory(tmp_path / "staging")  # collective mode: written once
    assert staged.name == "v000002"
    got = load_file(str(staged / "model.safetensors"))
    assert torch.equal(got["lm_head.weight"], state(2)["embed.weight"])  # the tied alias as its own tensor
    WeightVersion(3, state=state(3)).directory(tmp_path / "staging")
    assert sorted(p.name for p in (tmp_path / "staging").iterdir()) == ["v000003"]
    import shutil
    shutil.rmtree(on_disk.version_dir(1))
    with pytest.raises(FileNotFoundError):  # pruned meanwhile: the rollout looks again
        located.directory(tmp_path / "staging")
    with pytest.raises(ValueError, match="exactly one"):
        WeightVersion(4)


def test_adapter_versions_merge_into_a_base_read_once(tmp_path, monkeypatch) -> None:
    """Published adapters (trainer.lora.publish: adapter) come back merged, W + alpha / r * B @ A, each version
    its own; the base model's folder is read at the first version only, and the cached base is left as read."""
    from safetensors.torch import save_file

    import hpcrl.model.hf_io as hf_io
    from hpcrl.weights.adapter import PEFT_PREFIX, peft_config

    base_dir = tmp_path / "base"
    base_dir.mkdir()
    gen = torch.Generator().manual_seed(0)
    base = {"model.layers.0.self_attn.q_proj.weight": torch.randn(6, 4, generator=gen),
            "model.norm.weight": torch.randn(4, generator=gen)}
    save_file(base, str(base_dir / "model.safetensors"))
    reads = []
    stored = hf_io.stored_weights
    monkeypatch.setattr(hf_io, "stored_weights", lambda path: reads.append(path) or stored(path))
    weights = DiskWeights(tmp_path / "weights", WeightsConfig(keep_last=3),
                          adapter=peft_config(2, 4.0, ["q_proj"], base_dir))
    adapters = {}
    for v in (1, 2):
        a, b = torch.randn(2, 4, generator=gen), torch.randn(6, 2, generator=gen)
        adapters[v] = (a, b)
        name = f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj"
        weights.publish({f"{name}.lora_A.weight": a, f"{name}.lora_B.weight": b}, v)
    for v in (1, 2, 1):
        got = weights.fetch(v)
        a, b = adapters[v]
        torch.testing.assert_close(got["model.layers.0.self_attn.q_proj.weight"],
                                   base["model.layers.0.self_attn.q_proj.weight"] + 2.0 * b @ a)
        assert torch.equal(got["model.norm.weight"], base["model.norm.weight"])
    assert len(reads) == 1
