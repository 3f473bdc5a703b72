"""A published policy version as a LoRA adapter (``trainer.lora.publish: adapter``).

With LoRA the trained policy is the frozen initial model plus small
adapters, so a version can be published as the adapters alone: megabytes
instead of the whole model each step, and a vLLM server swaps them in with
``POST /v1/load_lora_adapter`` instead of reloading every weight.

Lifecycle:

1. The trainer's engine gives the adapter tensors (:func:`from_engine`: the
   PEFT-injected model's ``lora_A``/``lora_B`` under the names PEFT saves);
   :class:`hpcrl.weights.transport.DiskWeights`, built with the adapter's
   :func:`peft_config`, writes ``weights/v<N>/`` as PEFT does:
   ``adapter_model.safetensors`` and ``adapter_config.json`` (whose
   ``base_model_name_or_path`` is the run's initial model), in place of
   ``model.safetensors``.
2. A server engine hands that directory to its server (vLLM loads it as the
   adapter ``policy-v<N>`` and serves the next requests with it).
3. Whatever needs the whole policy in this process (the embedded torch
   engine, held-out evaluation) takes :func:`merged`: the base weights of the
   initial model's folder (read at the first version and kept, unchanged:
   each merge makes new tensors of the adapted weights) with each adapter
   merged, ``W + alpha / r * B @ A`` in
   float32, what PEFT's ``merge_and_unload`` gives and what
   ``trainer.lora.publish: merged`` publishes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors.torch import load_file, save_file

from hpcrl.fs import atomic
from hpcrl.model.lora import ADAPTER, merged_weight

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PEFT's saved names: the wrapped model's, under this prefix
_ENGINE_ADAPTER = f".{ADAPTER}"  # the adapter name PEFT's injected layers carry


def peft_config(rank: int, alpha: float, target_modules: list[str], base_model: str | Path) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` of the trained adapters (no dropout, no bias, no saved modules)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": float(alpha),
            "target_modules": sorted(target_modules), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "modules_to_save": None, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "base_model_name_or_path": str(base_model)}


def from_engine(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a PEFT-injected model's full state dict under PEFT's saved names
    (``model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    out = {}
    for name, t in state.items():
        for part in (".lora_A", ".lora_B"):
            if part + _ENGINE_ADAPTER + "." in name:
                out[PEFT_PREFIX + name.replace(part + _ENGINE_ADAPTER + ".", part + ".")] = t.detach().contiguous()
    if not out:
        raise ValueError("no LoRA adapter in the engine's state dict (trainer.lora.rank must be > 0)")
    return out


def is_adapter(path: str | Path) -> bool:
    """Whether the published directory ``path`` holds an adapter (else ``model.safetensors``)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def write(directory: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], version: int) -> None:
    """The adapter files into ``directory`` (a temporary directory the caller renames into place)."""
    save_file(dict(tensors), str(directory / ADAPTER_FILE), metadata={"version": str(version)})
    atomic.write_json(directory / ADAPTER_CONFIG, dict(config))


def merged(path: str | Path, base: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The whole policy of the adapter directory ``path``: ``base`` (default: the weights of its config's
    ``base_model_name_or_path``, read once per process while versions name the same folder) with every adapter
    merged, under HuggingFace names. The tensors of weights without an adapter are the base's own: read,
    never write them in place."""
    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    tensors = load_file(str(Path(path) / ADAPTER_FILE))
    from hpcrl.model.hf_io import stored_weights  # (transformers: imported only where a version is merged)

    if base is None:
        folder = str(Path(config["base_model_name_or_path"]).resolve())
        if _BASE.get("folder") != folder:  # one base kept: a run's versions share their initial model
            _BASE.clear()
            _BASE.update(folder=folder, weights=stored_weights(folder))
        base = _BASE["weights"]
    return _merge(base, tensors, float(config["lora_alpha"]) / int(config["r"]), str(path))


_BASE: dict[str, Any] = {}  # the base weights :func:`merged` read last, and their folder


def _merge(base: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], scaling: float,
           where: str) -> dict[str, torch.Tensor]:
    out = dict(base)
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        module = name[len(PEFT_PREFIX):].split(".lora_A.")[0]
        target = f"{module}.weight"
        if target not in out:
            raise ValueError(f"{where}: adapter of {module!r}, which the base model has no weight of")
        # in float32, as the trainer (which loads the base in float32) computes and publishes merged weights
        out[target] = merged_weight(out[target].float(), a, tensors[name.replace(".lora_A.", ".lora_B.")], scaling)
    return out


def adapter_merger(model_path: str | Path, config: Mapping[str, Any]
                   ) -> Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """For a publisher's own use: adapters as :func:`from_engine` gives them -> the whole policy, merged into
    the base weights at ``model_path`` (read once, at the first call)."""
    base: dict[str, torch.Tensor] = {}
    scaling = float(config["lora_alpha"]) / int(config["r"])

    def merge(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not base:
            from hpcrl.model.hf_io import stored_weights

            base.update(stored_weights(model_path))
        return _merge(base, tensors, scaling, str(model_path))

    return merge
