"""Where one policy version's weights are: the thing a rollout hands to its engine.

A :class:`WeightVersion` names a version and *where* its weights live, not
the tensors themselves, so that each engine takes them the way it can:

- the embedded torch engine calls :meth:`WeightVersion.tensors` (a state
  dict in this process: read from the directory, or the tensors a collective
  transfer already received);
- a server engine (vLLM, SGLang) calls :meth:`WeightVersion.directory` and
  tells its server to reload from that path; tensors that only exist in this
  process (collective mode, colocated mode) are first written to a staging
  directory on node-local storage.

A directory holds ``model.safetensors`` with HuggingFace parameter names,
the layout :class:`hpcrl.weights.transport.DiskWeights` publishes, or a LoRA
adapter in PEFT's layout (:mod:`hpcrl.weights.adapter`): a server loads it as
an adapter, :meth:`WeightVersion.tensors` merges it into its base model.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file, save_file

from hpcrl.fs import atomic
from hpcrl.weights import adapter
from hpcrl.weights.config import WEIGHTS_FILE  # noqa: F401 (re-exported)


def aliases(state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Names whose tensor shares storage with an earlier name (tied parameters) -> that earlier name."""
    first: dict[tuple, str] = {}
    out = {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.device)
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def unique_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop aliases of tied parameters."""
    dup = aliases(state_dict)
    return {name: t.detach().contiguous() for name, t in state_dict.items() if name not in dup}


def storable_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every name, a tied alias as its own copy (safetensors refuses shared storage).

    Published weights carry ``lm_head.weight`` even when it is tied to the
    embedding: a server that loads the model untied (vLLM, see
    :mod:`hpcrl.rollout.vllm_engine`) needs it, and a tied model loads it as
    the same values.
    """
    dup = aliases(state_dict)
    return {name: t.detach().clone() if name in dup else t.detach().contiguous() for name, t in state_dict.items()}


@dataclass
class WeightVersion:
    version: int
    path: Path | None = None  # a directory holding model.safetensors (disk mode)
    state: Mapping[str, torch.Tensor] | None = None  # tensors already in this process (collective, colocated)

    def __post_init__(self) -> None:
        if (self.path is None) == (self.state is None):
            raise ValueError("WeightVersion: give exactly one of path or state")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state dict, HuggingFace names (an adapter merged into its base model); raises FileNotFoundError
        when the directory was pruned meanwhile."""
        if self.state is not None:
            return dict(self.state)
        if adapter.is_adapter(self.path):
            return adapter.merged(self.path)
        return load_file(str(Path(self.path) / WEIGHTS_FILE))

    def directory(self, staging: Path) -> Path:
        """A directory with the weights as safetensors: ``path``, or ``staging/v<N>`` written now.

        Only the newest staged version is kept: older ``staging/v*`` are removed.
        """
        if self.path is not None:
            if not (Path(self.path) / WEIGHTS_FILE).exists() and not adapter.is_adapter(self.path):
                raise FileNotFoundError(f"{self.path}/{WEIGHTS_FILE}")
            return Path(self.path)
        target = Path(staging) / f"v{self.version:06d}"
        for old in Path(staging).glob("v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        if not target.exists():
            with atomic.directory(target) as tmp:
                save_file(storable_tensors(self.state), str(tmp / WEIGHTS_FILE),
                          metadata={"version": str(self.version)})
        return target
