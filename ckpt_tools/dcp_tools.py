"""Trainer checkpoints (DCP directories) for ``python -m ckpt_tools``: inspect, verify, to-hf, prune.

All of it runs in a plain process, without a process group: DCP checkpoints
are read with ``no_dist=True`` and resharded onto one full copy.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hpcrl.fs import atomic
from hpcrl.ckpt import store
from hpcrl.trainer.export import to_hf  # noqa: F401  (python -m ckpt_tools to-hf)


def is_dcp(path: Path) -> bool:
    return (path / ".metadata").exists()


def inspect_dcp(path: Path) -> dict:
    meta = FileSystemReader(str(path)).read_metadata()
    tensors = []
    for key, m in sorted(meta.state_dict_metadata.items()):
        if isinstance(m, TensorStorageMetadata):
            shape = list(m.size)
            numel = 1
            for d in shape:
                numel *= d
            tensors.append({"name": key, "dtype": str(m.properties.dtype).replace("torch.", ""),
                            "shape": shape, "numel": numel})
    trainer = atomic.read_json(path / "trainer.json") if (path / "trainer.json").exists() else {}
    return {"path": str(path), "metadata": {k: trainer.get(k) for k in ("step", "world_size", "config_hash")},
            "tensors": tensors,
            "total_params": sum(t["numel"] for t in tensors if t["name"].startswith("model.")),
            "files_bytes": sum(p.stat().st_size for p in path.iterdir() if p.is_file())}


def resolve(path: Path) -> Path:
    """A checkpoint directory, or the newest valid one under a ``ckpt/`` root or a run directory."""
    for root in (path, path / "ckpt"):
        if is_dcp(root):
            return root
        found = store.latest_valid(root)
        if found:
            return found[1]
    raise SystemExit(f"error: no valid checkpoint at {path}")


def base_model_of(ckpt: Path) -> Path:
    """The run's initial policy (architecture and tokenizer), from ``<run_dir>/prepared.json``."""
    prepared = ckpt.parent.parent / "prepared.json"
    if not prepared.exists():
        raise SystemExit(f"error: {prepared} not found; pass --base-model")
    return Path(atomic.read_json(prepared)["init_model"])
