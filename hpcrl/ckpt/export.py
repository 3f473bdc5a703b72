"""A trainer checkpoint's policy weights as a HuggingFace folder, in a plain process (no process group).

Used by ``python -m ckpt_tools to-hf`` and by a run started from another
run's checkpoint (:mod:`hpcrl.init_from`). The DCP save is read with
``no_dist=True`` and resharded onto one full copy; the architecture and
tokenizer come from ``base_model`` (the run's initial policy).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp


def to_hf(ckpt: Path, base_model: Path, out: Path) -> Path:
    """Write ``out`` (config, tokenizer, safetensors) with the checkpoint's model weights; returns ``out``."""
    from hpcrl.model.hf_io import load_model, load_tokenizer, save_model

    model = load_model(base_model)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    with torch.no_grad():
        model.load_state_dict(state["model"])
    return save_model(model, load_tokenizer(base_model), out)
