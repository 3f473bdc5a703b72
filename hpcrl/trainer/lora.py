"""LoRA adapters on the trained policy (``trainer.lora.rank > 0``), through PEFT.

Lifecycle, inside :class:`hpcrl.trainer.fsdp.FSDPEngine`:

1. :func:`apply_lora` injects PEFT LoRA layers into the loaded HF model in
   place (before FSDP2 sharding): every base weight is frozen, only the
   ``lora_A``/``lora_B`` matrices train, and the optimizer holds only them.
   Parameter names gain PEFT's ``base_layer`` / ``lora_A.default`` parts;
   checkpoints (DCP) hold the frozen base weights, the adapters and the
   adapters' optimizer state, so a resume continues exactly.
2. :func:`merge_lora` turns the gathered full state dict into plain HF names
   with each adapted weight merged, ``W + scaling * B @ A`` (what PEFT's
   ``merge_and_unload`` computes), so rollout engines load published
   versions exactly as they load full fine-tuning's.

The reference policy (a KL term) and the critic are not adapted: the
reference is the initial policy, the critic trains in full.
"""

from __future__ import annotations

import torch

from hpcrl.model.lora import ADAPTER, merged_weight
from hpcrl.trainer.config import LoraSettings

__all__ = ["ADAPTER", "apply_lora", "merge_lora", "merged_weight", "unload_merged"]



def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> dict[str, float]:
    """Inject adapters into ``model`` in place; returns each adapted module's scaling by its name prefix."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise ImportError("trainer.lora.rank > 0 needs PEFT: pip install 'hpcrl[lora]'") from e
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0,
                        target_modules=list(settings.target_modules), bias="none")
    names = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n})
    no_match = ValueError(f"trainer.lora.target_modules {settings.target_modules} matched no module of the model "
                          f"(its module names: {names})")
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:  # PEFT's NoMatchingPeftModuleError
        if "not found" in str(e):
            raise no_match from None
        raise
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    if not adapted:
        raise no_match
    _check_mergeable(model, adapted)
    return {name: float(m.scaling[ADAPTER]) for name, m in adapted.items()}


def _check_mergeable(model: torch.nn.Module, adapted: dict[str, torch.nn.Module]) -> None:
    """:func:`merge_lora` merges plain linear layers whose weight is their own: refuse anything else
    (embeddings, transposed Conv1D weights, a head tied to the embeddings) before training starts."""
    from peft.tuners.lora import Linear

    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for name, m in adapted.items():
        leaf = name.rsplit(".", 1)[-1]
        if type(m) is not Linear or getattr(m, "fan_in_fan_out", False):
            raise ValueError(f"trainer.lora.target_modules: {leaf!r} ({name}) is a {type(m.base_layer).__name__}; "
                             f"adapters are merged into plain linear layers only")
        shared = owners.get(id(m.base_layer.weight), [])
        if len(shared) > 1:
            raise ValueError(f"trainer.lora.target_modules: {leaf!r} ({name}) shares its weight with "
                             f"{[n for n in shared if not n.startswith(name + '.')]} (tied); a merged adapter would "
                             f"change both")


def merge_lora(state: dict[str, torch.Tensor], scalings: dict[str, float]) -> dict[str, torch.Tensor]:
    """A full state dict with adapters -> HF names, each adapted weight merged (float32 math, stored dtype)."""
    out = {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        prefix, _, leaf = name.rpartition(".base_layer.")
        if not prefix:  # not an adapted module
            out[name] = tensor
            continue
        if leaf == "weight":
            tensor = merged_weight(tensor, state[f"{prefix}.lora_A.{ADAPTER}.weight"],
                                   state[f"{prefix}.lora_B.{ADAPTER}.weight"], scalings[prefix])
        out[f"{prefix}.{leaf}"] = tensor
    return out


def unload_merged(model: torch.nn.Module, scalings: dict[str, float]) -> torch.nn.Module:
    """Merge each adapter into its base layer in place and put the base layer back (HF names again),
    one layer at a time: no second copy of the model."""
    with torch.no_grad():
        for prefix, scaling in scalings.items():
            parent_name, _, leaf = prefix.rpartition(".")
            parent = model.get_submodule(parent_name)
            layer = getattr(parent, leaf)
            base = layer.base_layer
            base.weight.copy_(merged_weight(base.weight, layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight,
                                            scaling))
            setattr(parent, leaf, base)
    return model
