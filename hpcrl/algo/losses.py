"""Token log-probabilities and the decoupled PPO policy loss (design.md §5), as pure functions.

Per response token: ``logp_behav`` comes from the inference engine at generation,
``logp_prox`` is recomputed by the trainer with the weights at the start of the
step (before any update, no grad; or approximated, :mod:`hpcrl.algo.prox`),
``logp`` is the current policy (with grad)::

    r_t = exp(logp - logp_prox)                 token ratio (PPO)
        | exp(mean_{t in s}(logp - logp_prox))  sequence ratio (GSPO, ratio_level=sequence)
    w_t = exp(logp_prox - logp_behav)           behaviour weight, detached; per token or the
                                                sequence's geometric mean; capped (mode=cap)
                                                or 0 where its metric is out of bounds (mode=mask);
                                                0 where (logp_behav - logp_prox)^2 > m2_cutoff
                                                (M2PO, :mod:`hpcrl.algo.m2po`)
    l_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_clip, 1 + eps_clip_high))
    l_t = min(l_t, -A_t * dual_clip)  where A_t < 0 (dual clip)
    L   = agg(l) + kl_coef * agg(k(logp, logp_ref)) [kl_mode=loss] - entropy_coef * agg(H)

``agg`` is :func:`hpcrl.algo.aggregate.aggregate` with one normaliser for all
terms. Ordering rule for micro-batches and ranks: see
:mod:`hpcrl.algo.aggregate` (sum ``loss_normaliser`` globally first).
Masked positions (``mask == 0``) contribute exactly 0 to the loss, the gradient
and the stats, whatever garbage (``-inf``, NaN) the input tensors hold there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcrl.algo.aggregate import aggregate, loss_normaliser, per_sequence_mean, to_tokens
from hpcrl.algo.config import AlgoConfig
from hpcrl.algo.kl import k3 as kl_k3
from hpcrl.algo.kl import kl_estimate

__all__ = ["LossOutput", "behaviour_weight", "decoupled_ppo_loss", "loss_normaliser", "token_logprobs"]


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
    stats: dict[str, float]  # clip_fraction, imp_weight_*, ratio_mean, approx_kl, kl_ref, entropy, n_tokens


def behaviour_weight(prox: torch.Tensor, behav: torch.Tensor, valid: torch.Tensor, cfg: AlgoConfig,
                     seq_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight used, raw weight, out-of-bounds flags) per token for sanitised ``prox``/``behav``.

    The raw weight is ``exp(prox - behav)`` per token, or per sequence the
    geometric mean ``exp(mean(prox - behav))``. Out of bounds: raw weight above
    the cap (mode=cap, where it is clamped), or the metric (ratio, or the
    token/sequence-mean k1/k2/k3 estimate of KL(behaviour || prox)) outside
    ``[lower, cap]`` (mode=mask, where the weight is 0).
    """
    log_w = prox - behav
    seq = cfg.behav_imp_weight_level == "sequence"
    if seq:
        log_w = to_tokens(per_sequence_mean(log_w, valid, seq_lengths), log_w, seq_lengths)
    raw_w = torch.exp(log_w)
    cap, lower = cfg.behav_imp_weight_cap, cfg.behav_imp_weight_lower
    if cfg.behav_imp_weight_mode == "cap":
        out = raw_w > cap if cap is not None else torch.zeros_like(valid)
        return (raw_w if cap is None else raw_w.clamp(max=cap)), raw_w, out & valid
    metric = raw_w
    if cfg.behav_imp_weight_metric != "ratio":  # KL(behav || prox) from behaviour samples: d = behav - prox
        metric = kl_estimate(behav, prox, cfg.behav_imp_weight_metric)
        if seq:
            metric = to_tokens(per_sequence_mean(metric, valid, seq_lengths), metric, seq_lengths)
    out = torch.zeros_like(valid)
    if cap is not None:
        out = out | (metric > cap)
    if lower is not None:
        out = out | (metric < lower)
    return torch.where(out, torch.zeros_like(raw_w), raw_w), raw_w, out & valid


def decoupled_ppo_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgoConfig,
    normaliser: float | None = None,
    seq_lengths: torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    m2_cutoff: float | None = None,
) -> LossOutput:
    """Decoupled PPO loss of one (micro-)batch, plus the KL loss term and entropy bonus when given.

    Shapes: ``logp``, ``logp_prox``, ``logp_behav``, ``mask`` (and ``logp_ref``,
    ``entropy``) are ``[B, T]``. ``advantages`` is ``[B, T]`` (per token) or one
    value per sequence (``[B]``, or ``[len(seq_lengths)]`` when packed).
    ``seq_lengths`` (1-D ints, summing to ``B * T``) marks packed batches;
    ``None`` means one sequence per row. ``normaliser`` defaults to
    ``loss_normaliser(mask, cfg.loss_agg, seq_lengths)``. ``logp_ref`` adds
    ``kl_coef * agg(k)`` when ``cfg.kl_mode == 'loss'`` (else it is only
    reported); ``entropy`` (with grad) subtracts ``entropy_coef * agg(H)``. ``m2_cutoff`` (M2PO, from
    :func:`hpcrl.algo.m2po.m2po_cutoff` over the whole update) gives weight 0 to the tokens whose squared log
    behaviour weight exceeds it; they stay in the normaliser, as masked tokens of mode=mask do.
    """
    _check_shapes(logp, logp_prox, logp_behav, mask, seq_lengths)
    valid = mask > 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Sanitise before any arithmetic: exp(-inf - -inf) = NaN would leak NaN
    # gradients through torch.where's backward even where it is not selected.
    logp = torch.where(valid, logp, zero)
    prox = torch.where(valid, logp_prox.detach().to(logp.dtype), zero)
    behav = torch.where(valid, logp_behav.detach().to(logp.dtype), zero)
    adv = torch.where(valid, _broadcast_advantages(advantages.detach(), logp, seq_lengths), zero)

    log_ratio = logp - prox
    if cfg.ratio_level == "sequence":  # GSPO: length-normalised sequence ratio, shared by its tokens
        log_ratio = to_tokens(per_sequence_mean(log_ratio, valid, seq_lengths), log_ratio, seq_lengths)
    ratio = torch.exp(log_ratio)
    w, raw_w, out_of_bounds = behaviour_weight(prox, behav, valid, cfg, seq_lengths)
    # per token, whatever the weight's level: what M2PO bounds the mean of, in float64 as the cutoff was found
    # (a float32 square can fall on the other side of a cutoff that lies next to a token's value)
    m2 = (behav.to(torch.float64) - prox.to(torch.float64)) ** 2
    m2_masked = (m2 > m2_cutoff) & valid if m2_cutoff is not None else torch.zeros_like(valid)
    w = torch.where(m2_masked, torch.zeros_like(w), w)
    clipped = ratio.clamp(1.0 - cfg.eps_clip, 1.0 + cfg.clip_high)
    pg_unclipped, pg_clipped = -adv * ratio, -adv * clipped
    pg = torch.maximum(pg_unclipped, pg_clipped)
    dual_active = torch.zeros_like(valid)
    if cfg.dual_clip is not None:
        bound = -adv * cfg.dual_clip
        dual_active = (adv < 0) & (pg > bound)
        pg = torch.where(dual_active, bound, pg)
    per_token = torch.where(valid, w * pg, zero)

    if normaliser is None:  # an all-masked batch gives loss 0 (still in the graph), not NaN
        normaliser = max(loss_normaliser(mask, cfg.loss_agg, seq_lengths), 1.0)
    elif not normaliser > 0:
        raise ValueError(f"normaliser: must be > 0, got {normaliser}")
    pg_loss = aggregate(per_token, valid, cfg.loss_agg, normaliser, seq_lengths)
    loss, kl_ref, ent = pg_loss, None, None
    if logp_ref is not None:
        kl_ref = kl_estimate(logp, logp_ref.detach(), cfg.kl_estimator, mask)
        if cfg.kl_mode == "loss":
            loss = loss + cfg.kl_coef * aggregate(kl_ref, valid, cfg.loss_agg, normaliser, seq_lengths)
    if entropy is not None:
        ent = torch.where(valid, entropy.to(logp.dtype), zero)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * aggregate(ent, valid, cfg.loss_agg, normaliser, seq_lengths)

    with torch.no_grad():
        stats = _stats(valid, ratio, raw_w, out_of_bounds, pg_unclipped < pg_clipped, logp - prox,
                       dual_active, kl_ref, ent, m2, m2_masked)
        stats["pg_loss"] = float(pg_loss.item())
    return LossOutput(loss=loss, stats=stats)


def _broadcast_advantages(adv: torch.Tensor, like: torch.Tensor,
                          seq_lengths: torch.Tensor | None) -> torch.Tensor:
    adv = adv.to(like.dtype)
    if adv.shape == like.shape:
        return adv
    if adv.dim() != 1:
        raise ValueError(f"advantages: must be [B, T] or per sequence, got shape {tuple(adv.shape)}")
    n_seq = like.shape[0] if seq_lengths is None else seq_lengths.numel()
    if adv.numel() != n_seq:
        raise ValueError(f"advantages: {adv.numel()} values for {n_seq} sequences")
    return to_tokens(adv, like, seq_lengths)


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


def _stats(valid: torch.Tensor, ratio: torch.Tensor, raw_w: torch.Tensor, out_of_bounds: torch.Tensor,
           clip_active: torch.Tensor, log_ratio: torch.Tensor, dual_active: torch.Tensor,
           kl_ref: torch.Tensor | None, entropy: torch.Tensor | None, m2: torch.Tensor,
           m2_masked: torch.Tensor) -> dict[str, float]:
    """Diagnostics over valid tokens, gathered with one device sync."""
    n = valid.sum()
    denom = n.clamp(min=1).to(ratio.dtype)
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x.to(ratio.dtype), zero).sum() / denom

    # k3 estimator of KL(current || prox): exp(-d) - 1 + d with d = logp - logp_prox.
    k3 = kl_k3(log_ratio)
    w_max = torch.where(valid, raw_w, zero).max() if raw_w.numel() else zero
    named = {"clip_fraction": mean(clip_active), "dual_clip_fraction": mean(dual_active),
             "imp_weight_mean": mean(raw_w), "imp_weight_max": w_max,
             "imp_weight_capped_fraction": mean(out_of_bounds), "imp_weight_m2": mean(m2),
             "m2_masked_fraction": mean(m2_masked), "ratio_mean": mean(ratio), "approx_kl": mean(k3)}
    if kl_ref is not None:
        named["kl_ref"] = mean(kl_ref)
    if entropy is not None:
        named["entropy"] = mean(entropy)
    named["n_tokens"] = n.to(ratio.dtype)
    return dict(zip(named, torch.stack(list(named.values())).tolist()))
