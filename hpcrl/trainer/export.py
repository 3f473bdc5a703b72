"""A trainer checkpoint's policy weights as a HuggingFace folder, in a plain process (no process group).

Used by ``python -m ckpt_tools to-hf`` and by a run started from another
run's checkpoint (:mod:`hpcrl.init_from`). The DCP save is read with
``no_dist=True`` and resharded onto one full copy; the architecture and
tokenizer come from ``base_model`` (the run's initial policy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
import torch.distributed.checkpoint as dcp

from hpcrl.plugins import resolve
from hpcrl.trainer.registry import HF_LAYOUT, TRAIN_ENGINES, TrainEngineSpec


def to_hf(ckpt: Path, base_model: Path, out: Path) -> Path:
    """Write ``out`` (config, tokenizer, safetensors) with the checkpoint's model weights; returns ``out``.

    A checkpoint of a LoRA run (``trainer.lora.rank > 0``) holds the base weights and the adapters apart:
    they are merged, with the adapters' scaling from the run's ``config.yaml`` next to ``ckpt/``."""
    from hpcrl.model.hf_io import load_model, load_tokenizer, save_model

    model, scalings = load_model(base_model), None
    owner, _ = checkpoint_owner(saved_keys(ckpt))
    if owner.weights is not None:  # an engine that keeps its own layout converts its weights to HF names
        model.load_state_dict(resolve(owner.weights, "trainer.engine")(ckpt, model.config), strict=False)
        return save_model(model, load_tokenizer(base_model), out)
    if has_adapters(ckpt):
        from hpcrl.trainer.lora import apply_lora

        scalings = apply_lora(model, lora_settings_of(ckpt))
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    with torch.no_grad():
        model.load_state_dict(state["model"])
        if scalings is not None:
            from hpcrl.trainer.lora import unload_merged

            unload_merged(model, scalings)
    return save_model(model, load_tokenizer(base_model), out)


def saved_keys(ckpt: Path) -> list[str]:
    """The flattened state keys a DCP checkpoint holds (``model.<param>``, ``critic.<param>``, ``optim...``)."""
    return list(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)


def has_adapters(ckpt: Path) -> bool:
    """Whether a checkpoint's policy carries LoRA adapters (it was saved by a ``trainer.lora.rank > 0`` run)."""
    return any(k.startswith("model.") and ".lora_A." in k for k in saved_keys(ckpt))


def lora_settings_of(ckpt: Path):
    """The LoRA settings the checkpoint's run trained with (its ``config.yaml``)."""
    from hpcrl.config import load_saved

    run_dir = ckpt.parent.parent
    if not (run_dir / "config.yaml").exists():
        raise ValueError(f"{ckpt} holds LoRA adapters; merging them needs its run's config.yaml "
                         f"(trainer.lora), not found in {run_dir}")
    settings = load_saved(run_dir).trainer.lora
    if not settings.rank:
        raise ValueError(f"{ckpt} holds LoRA adapters but its run's config.yaml has trainer.lora.rank = 0")
    return settings


def checkpoint_owner(keys: Iterable[str]) -> tuple[TrainEngineSpec, str]:
    """The train engine whose layout a checkpoint's keys are in, and that layout: the first registered engine
    that recognises them, else FSDP2's HuggingFace names (:data:`~hpcrl.trainer.registry.HF_LAYOUT`)."""
    keys = list(keys)
    for spec in TRAIN_ENGINES.values():
        if spec.recognise is not None:
            layout = resolve(spec.recognise, "trainer.engine")(keys)
            if layout is not None:
                return spec, layout
    return TRAIN_ENGINES[HF_LAYOUT], HF_LAYOUT
