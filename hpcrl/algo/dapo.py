"""DAPO's extras as pure functions: the soft overlong penalty and the dynamic-sampling test.

Dynamic sampling itself is a schedule decision: the trainer's feed
(``hpcrl.trainer.feed``) drops every prompt group for which
:func:`is_informative` is False (reason ``uniform``), records it in the
admission ledger so the rollouts admit a replacement, and keeps taking groups
until the batch is full. The overlong penalty is applied to the rewards before
advantages (``hpcrl.trainer.batch``), so it also decides which groups are
uniform.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment per response (<= 0), same shape as ``lengths``.

    ``0`` for ``L <= L_max - L_cache``; ``-factor * (L - (L_max - L_cache)) / L_cache``
    up to ``L_max``; ``-factor`` beyond it.
    """
    if buffer <= 0:
        raise ValueError(f"overlong_buffer: must be > 0, got {buffer}")
    if max_tokens <= buffer:
        raise ValueError(f"overlong_max_tokens: must be > overlong_buffer ({buffer}), got {max_tokens}")
    lengths = lengths.to(torch.float64)
    over = (lengths - (max_tokens - buffer)).clamp(min=0.0, max=float(buffer))
    return -factor * over / buffer


def is_informative(rewards: list[float]) -> bool:
    """A group is worth training on only if its rewards are not all equal."""
    return any(r != rewards[0] for r in rewards)
