"""What a LoRA adapter is, shared by the trainer that trains one and the weights that publish or merge one:
PEFT's adapter name and the merge of an adapter into its base weight."""

from __future__ import annotations

import torch

__all__ = ["ADAPTER", "merged_weight"]

ADAPTER = "default"  # PEFT's adapter name


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``base + scaling * b @ a`` computed in float32, in ``base``'s dtype."""
    return (base.float() + scaling * (b.float() @ a.float())).to(base.dtype)
