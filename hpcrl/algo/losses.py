"""Token log-probabilities and the decoupled PPO loss (DESIGN section 5), as pure functions.

Per response token: ``logp_behav`` comes from the inference engine at generation,
``logp_prox`` is recomputed by the trainer with the weights at the start of the
step (before any update, no grad), ``logp`` is the current policy (with grad).

    r_t = exp(logp - logp_prox)
    w_t = min(exp(logp_prox - logp_behav), cap)                  (detached)
    l_t = w_t * max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_clip, 1 + eps_clip_high))

Ordering rule for callers that split a minibatch into micro-batches (and ranks):
compute the global denominator first with ``loss_normaliser`` summed over every
micro-batch of the minibatch on every rank, then pass it as ``normaliser`` to each
micro-batch call; the micro-batch losses then add up to the whole-minibatch loss,
so gradients accumulated over micro-batches (and summed over ranks) are exact.

Masked positions (``mask == 0``) contribute exactly 0 to the loss, the gradient
and the stats, whatever garbage (``-inf``, NaN) the logprob tensors hold there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcrl.algo.config import LOSS_AGGS, AlgoConfig


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits ``[B, T, V]``, targets ``[B, T]`` -> ``log softmax(logits / temperature)[targets]``, ``[B, T]``.

    Computed as ``logits[target] - logsumexp(logits)``, so no full-vocabulary
    log-softmax copy is kept. Half-precision logits are upcast to float32 (a
    bf16 logsumexp over a large vocabulary is too coarse for PPO ratios).
    """
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets: shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@dataclass
class LossOutput:
    """The aggregated loss and its diagnostics (stats are over valid tokens only)."""

    loss: torch.Tensor  # scalar, already aggregated with the normaliser given
    stats: dict[str, float]  # clip_fraction, imp_weight_*, ratio_mean, approx_kl, n_tokens


def loss_normaliser(mask: torch.Tensor, loss_agg: str, seq_lengths: torch.Tensor | None = None) -> float:
    """The local denominator: valid tokens (token_mean) or sequences with >= 1 valid token."""
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg: must be one of {list(LOSS_AGGS)}, got {loss_agg!r}")
    valid = mask > 0
    if loss_agg == "token_mean":
        return float(valid.sum().item())
    return float((_per_sequence(valid.to(torch.int64), seq_lengths) > 0).sum().item())


def decoupled_ppo_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgoConfig,
    normaliser: float | None = None,
    seq_lengths: torch.Tensor | None = None,
) -> LossOutput:
    """Decoupled PPO loss of one (micro-)batch.

    Shapes: ``logp``, ``logp_prox``, ``logp_behav``, ``mask`` are ``[B, T]``.
    ``advantages`` is ``[B, T]`` (per token) or one value per sequence (``[B]``,
    or ``[len(seq_lengths)]`` when packed). ``seq_lengths`` (1-D ints, summing
    to ``B * T``) marks packed batches: the row-major flattened tokens are
    consecutive sequences of these lengths; ``None`` means one sequence per row.
    ``normaliser`` defaults to ``loss_normaliser(mask, cfg.loss_agg, seq_lengths)``.
    """
    _check_shapes(logp, logp_prox, logp_behav, mask, seq_lengths)
    valid = mask > 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Sanitise before any arithmetic: exp(-inf - -inf) = NaN would leak NaN
    # gradients through torch.where's backward even where it is not selected.
    logp = torch.where(valid, logp, zero)
    prox = torch.where(valid, logp_prox.detach(), zero)
    behav = torch.where(valid, logp_behav.detach(), zero)
    adv = torch.where(valid, _broadcast_advantages(advantages.detach(), logp, seq_lengths), zero)

    ratio = torch.exp(logp - prox)
    raw_w = torch.exp(prox - behav)
    cap = cfg.behav_imp_weight_cap
    w = raw_w if cap is None else raw_w.clamp(max=cap)
    clipped = ratio.clamp(1.0 - cfg.eps_clip, 1.0 + cfg.clip_high)
    pg_unclipped, pg_clipped = -adv * ratio, -adv * clipped
    per_token = torch.where(valid, w * torch.maximum(pg_unclipped, pg_clipped), zero)

    if normaliser is None:  # an all-masked batch gives loss 0 (still in the graph), not NaN
        normaliser = max(loss_normaliser(mask, cfg.loss_agg, seq_lengths), 1.0)
    elif not normaliser > 0:
        raise ValueError(f"normaliser: must be > 0, got {normaliser}")
    loss = _aggregate(per_token, valid, cfg.loss_agg, seq_lengths) / normaliser

    with torch.no_grad():
        stats = _stats(valid, ratio, raw_w, cap, pg_unclipped < pg_clipped, logp - prox)
    return LossOutput(loss=loss, stats=stats)


def _aggregate(per_token: torch.Tensor, valid: torch.Tensor, loss_agg: str,
               seq_lengths: torch.Tensor | None) -> torch.Tensor:
    """Sum over the batch of the per-token loss (token_mean) or per-sequence loss."""
    if loss_agg == "token_mean":
        return per_token.sum()
    seq_sum = _per_sequence(per_token, seq_lengths)
    if loss_agg == "seq_mean_token_sum":
        return seq_sum.sum()
    n_valid = _per_sequence(valid.to(per_token.dtype), seq_lengths)
    return (seq_sum / n_valid.clamp(min=1.0)).sum()


def _per_sequence(x: torch.Tensor, seq_lengths: torch.Tensor | None) -> torch.Tensor:
    """Sum ``x [B, T]`` per sequence: per row, or per packed segment of ``seq_lengths``."""
    if seq_lengths is None:
        return x.sum(dim=-1)
    ids = _segment_ids(seq_lengths, x.device)
    out = torch.zeros(seq_lengths.numel(), dtype=x.dtype, device=x.device)
    return out.index_add(0, ids, x.reshape(-1))


def _segment_ids(seq_lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    lengths = seq_lengths.to(device=device, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)


def _broadcast_advantages(adv: torch.Tensor, like: torch.Tensor,
                          seq_lengths: torch.Tensor | None) -> torch.Tensor:
    adv = adv.to(like.dtype)
    if adv.shape == like.shape:
        return adv
    if adv.dim() != 1:
        raise ValueError(f"advantages: must be [B, T] or per sequence, got shape {tuple(adv.shape)}")
    if seq_lengths is None:
        if adv.numel() != like.shape[0]:
            raise ValueError(f"advantages: {adv.numel()} values for {like.shape[0]} sequences")
        return adv.unsqueeze(-1).expand_as(like)
    if adv.numel() != seq_lengths.numel():
        raise ValueError(f"advantages: {adv.numel()} values for {seq_lengths.numel()} packed sequences")
    return adv[_segment_ids(seq_lengths, adv.device)].reshape(like.shape)


def _check_shapes(logp: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor,
                  seq_lengths: torch.Tensor | None) -> None:
    for name, t in (("logp_prox", prox), ("logp_behav", behav), ("mask", mask)):
        if t.shape != logp.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not match logp {tuple(logp.shape)}")
    if logp.dim() != 2:
        raise ValueError(f"logp: must be [B, T], got shape {tuple(logp.shape)}")
    if seq_lengths is not None:
        if seq_lengths.dim() != 1 or bool((seq_lengths < 0).any()):
            raise ValueError("seq_lengths: must be a 1-D tensor of non-negative lengths")
        if int(seq_lengths.sum().item()) != logp.numel():
            raise ValueError(f"seq_lengths: sum {int(seq_lengths.sum().item())} != B*T = {logp.numel()}")


def _stats(valid: torch.Tensor, ratio: torch.Tensor, raw_w: torch.Tensor, cap: float | None,
           clip_active: torch.Tensor, log_ratio: torch.Tensor) -> dict[str, float]:
    """Diagnostics over valid tokens, gathered with one device sync."""
    n = valid.sum()
    denom = n.clamp(min=1).to(ratio.dtype)
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x.to(ratio.dtype), zero).sum() / denom

    capped = raw_w > cap if cap is not None else torch.zeros_like(valid)
    # k3 estimator of KL(current || prox): exp(-d) - 1 + d with d = logp - logp_prox.
    k3 = torch.exp(-log_ratio) - 1.0 + log_ratio
    w_max = torch.where(valid, raw_w, zero).max() if raw_w.numel() else zero
    values = torch.stack([
        mean(clip_active), mean(raw_w), w_max, mean(capped), mean(ratio), mean(k3), n.to(ratio.dtype),
    ]).tolist()
    names = ("clip_fraction", "imp_weight_mean", "imp_weight_max", "imp_weight_capped_fraction",
             "ratio_mean", "approx_kl", "n_tokens")
    return dict(zip(names, values))
