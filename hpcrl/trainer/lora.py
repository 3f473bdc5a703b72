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

from hpcrl.trainer.config import LoraSettings

__all__ = ["apply_lora", "merge_lora"]

ADAPTER = "default"  # PEFT's adapter name


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> dict[str, float]:
    """Inject adapters into ``model`` in place; returns each adapted module's scaling by its name prefix."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise ImportError("trainer.lora.rank > 0 needs PEFT: pip install 'hpcrl[lora]'") from e
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0,
                        target_modules=list(settings.target_modules), bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    scalings = {name: float(m.scaling[ADAPTER]) for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    if not scalings:
        names = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules()})
        raise ValueError(f"trainer.lora.target_modules {settings.target_modules} matched no module of the model "
                         f"(its module names: {names})")
    return scalings


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
            a = state[f"{prefix}.lora_A.{ADAPTER}.weight"].float()
            b = state[f"{prefix}.lora_B.{ADAPTER}.weight"].float()
            tensor = (tensor.float() + scalings[prefix] * (b @ a)).to(tensor.dtype)
        out[f"{prefix}.{leaf}"] = tensor
    return out
