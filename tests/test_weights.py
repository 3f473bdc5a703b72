"""Disk weight publication: atomic versions, LATEST, retention, tied parameters; ckpt_tools inspect."""

from __future__ import annotations

import json

import torch

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
