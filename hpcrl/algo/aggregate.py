"""Loss aggregation: per-token values -> one scalar, exactly as one whole-batch computation.

Three modes (``AlgoConfig.loss_agg``), with ``N`` the normaliser:

- ``token_mean``: ``sum_t x_t / N``, ``N`` = valid tokens;
- ``seq_mean_token_mean``: ``sum_s (sum_{t in s} x_t / n_s) / N``, ``N`` = sequences with >= 1 valid token;
- ``seq_mean_token_sum`` (Dr. GRPO): ``sum_s sum_{t in s} x_t / N``, ``N`` as above.

Ordering rule for callers that split a minibatch into micro-batches (and
ranks): sum :func:`loss_normaliser` over every micro-batch of the minibatch on
every rank first, then pass that sum to :func:`aggregate` for each
micro-batch; the micro-batch results then add up to the whole-minibatch value.
A batch is one sequence per row, or packed (``seq_lengths``: consecutive
sequences of these lengths in the row-major flattened tokens).
"""

from __future__ import annotations

import torch

from hpcrl.algo.config import LOSS_AGGS


def loss_normaliser(mask: torch.Tensor, loss_agg: str, seq_lengths: torch.Tensor | None = None) -> float:
    """The local denominator: valid tokens (token_mean) or sequences with >= 1 valid token."""
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg: must be one of {list(LOSS_AGGS)}, got {loss_agg!r}")
    valid = mask > 0
    if loss_agg == "token_mean":
        return float(valid.sum().item())
    return float((per_sequence(valid.to(torch.int64), seq_lengths) > 0).sum().item())


def aggregate(per_token: torch.Tensor, valid: torch.Tensor, loss_agg: str, normaliser: float,
              seq_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """``per_token`` (already 0 on invalid positions) reduced by ``loss_agg`` and divided by ``normaliser``."""
    if loss_agg == "token_mean":
        total = per_token.sum()
    else:
        seq_sum = per_sequence(per_token, seq_lengths)
        if loss_agg == "seq_mean_token_sum":
            total = seq_sum.sum()
        else:
            n_valid = per_sequence(valid.to(per_token.dtype), seq_lengths)
            total = (seq_sum / n_valid.clamp(min=1.0)).sum()
    return total / normaliser


def per_sequence(x: torch.Tensor, seq_lengths: torch.Tensor | None) -> torch.Tensor:
    """Sum ``x [B, T]`` per sequence: per row, or per packed segment of ``seq_lengths``."""
    if seq_lengths is None:
        return x.sum(dim=-1)
    ids = segment_ids(seq_lengths, x.device)
    out = torch.zeros(seq_lengths.numel(), dtype=x.dtype, device=x.device)
    return out.index_add(0, ids, x.reshape(-1))


def per_sequence_mean(x: torch.Tensor, valid: torch.Tensor, seq_lengths: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``x`` over the valid tokens of each sequence (0 for a sequence without any)."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    n = per_sequence(valid.to(x.dtype), seq_lengths).clamp(min=1.0)
    return per_sequence(torch.where(valid, x, zero), seq_lengths) / n


def to_tokens(per_seq: torch.Tensor, like: torch.Tensor, seq_lengths: torch.Tensor | None) -> torch.Tensor:
    """Broadcast one value per sequence back onto the ``[B, T]`` token grid of ``like``."""
    if seq_lengths is None:
        return per_seq.unsqueeze(-1).expand_as(like)
    return per_seq[segment_ids(seq_lengths, per_seq.device)].reshape(like.shape)


def segment_ids(seq_lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    lengths = seq_lengths.to(device=device, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
