"""Token-level advantages: rewards per token, discounted returns, GAE, whitening, the value loss.

Pure functions on ``[B, T]`` tensors (one sequence per row, ``mask`` 1 on
trained response tokens). Masked positions are *skipped*, not treated as
steps: the next state of a valid token is the next valid token of its row,
and the episode ends after the last valid token (so a tool-output span inside
a response neither earns reward nor breaks the return chain). Masked
positions of every output are exactly 0.

Order used by the trainer for token-level estimators (``reinforce_pp``,
``reinforce_pp_baseline``, ``gae``), once per step, after the reference and
critic passes over the whole step batch:

1. :func:`token_rewards`: the sequence score at the last valid token, minus
   ``kl_coef * k`` on every valid token when ``kl_mode: reward``;
2. :func:`gae` (``lam = 1`` and zero values = discounted returns, REINFORCE++);
3. :func:`whiten` with batch moments summed over every micro-batch and rank
   in two passes (:func:`batch_moments`: the mean, then the moments around
   it), so the result does not depend on the split and the variance has no
   cancellation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """``[B]`` scores -> ``[B, T]`` rewards: score at each row's last valid token, ``- kl_coef * kl`` on valid ones."""
    valid = mask > 0
    if scores.dim() != 1 or scores.numel() != mask.shape[0]:
        raise ValueError(f"scores: must be [B] with B = {mask.shape[0]}, got shape {tuple(scores.shape)}")
    t_idx = torch.arange(mask.shape[1], device=mask.device).expand_as(valid)
    last = torch.where(valid, t_idx, torch.full_like(t_idx, -1)).max(dim=1).values
    is_last = (t_idx == last.unsqueeze(1)) & valid
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    rewards = torch.where(is_last, scores.unsqueeze(1).expand_as(is_last), zero)
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * torch.where(valid, kl.to(scores.dtype), zero)
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor | None, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over valid positions -> (advantages, returns), both ``[B, T]``.

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``
    where ``next`` is the next valid position of the row (``V = A = 0`` past the
    last one). ``values=None`` means zeros: then ``lam = 1`` gives the
    discounted return-to-go. Returns are ``A + V``.
    """
    if rewards.shape != mask.shape or (values is not None and values.shape != mask.shape):
        raise ValueError(f"rewards/values: shapes must match mask {tuple(mask.shape)}")
    valid = mask > 0
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    r = torch.where(valid, rewards, zero)
    v = torch.zeros_like(r) if values is None else torch.where(valid, values.detach().to(r.dtype), zero)
    adv = torch.zeros_like(r)
    next_v = torch.zeros_like(r[:, 0])
    next_a = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        m = valid[:, t]
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        adv[:, t] = torch.where(m, a, zero)
        next_a = torch.where(m, a, next_a)
        next_v = torch.where(m, v[:, t], next_v)
    return adv, torch.where(valid, adv + v, zero)


def masked_moments(x: torch.Tensor, mask: torch.Tensor, center: float = 0.0) -> torch.Tensor:
    """``[sum, sum of squares, count]`` of ``x - center`` over valid positions, float64 (add them across
    splits)."""
    valid = mask > 0
    xv = torch.where(valid, x.double() - center, torch.zeros((), dtype=torch.float64, device=x.device))
    return torch.stack([xv.sum(), (xv * xv).sum(), valid.sum().double()])


def batch_moments(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
                  all_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> tuple[torch.Tensor, float]:
    """(moments, center) of every ``(x, mask)`` pair together, for :func:`whiten`.

    Two passes, each a sum over the pairs and ``all_sum`` over ranks: the mean, then the moments around it.
    The result does not depend on the split, and the variance keeps its digits: the one-pass
    ``E[x^2] - E[x]^2`` loses all of them when ``|mean| >> std`` (at mean 1e8 and std 1e-2, float64 rounding
    alone is ~1e3 times the variance)."""
    pairs = list(pairs)
    zero = torch.zeros(3, dtype=torch.float64)
    first = all_sum(sum((masked_moments(x, m).cpu() for x, m in pairs), zero))
    center = float(first[0] / first[2]) if float(first[2]) > 0 else 0.0
    return all_sum(sum((masked_moments(x, m, center).cpu() for x, m in pairs), zero)), center


def whiten(x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor, shift_mean: bool = True,
           scale: bool = True, unbiased: bool = False, eps: float = 1e-6, center: float = 0.0) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` with mean/std from ``moments`` taken around ``center`` (see
    :func:`batch_moments`); 0 off the mask."""
    s, ss, n = (float(v) for v in moments.tolist())
    offset = s / n if n > 0 else 0.0
    mean = center + offset
    var = max(ss / n - offset * offset, 0.0) if n > 0 else 0.0
    if unbiased and n > 1:
        var *= n / (n - 1)
    out = x - mean if shift_mean else x
    if scale:
        out = out / (math.sqrt(var) + eps)
    return torch.where(mask > 0, out, torch.zeros((), dtype=x.dtype, device=x.device))


def value_loss_per_token(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                         mask: torch.Tensor, clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO value loss ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`` per token, and clip flags.

    Both are 0 off the mask; ``clip=None`` is the plain squared error.
    """
    valid = mask > 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(valid, values, zero)
    old = torch.where(valid, old_values.detach().to(v.dtype), zero)
    ret = torch.where(valid, returns.detach().to(v.dtype), zero)
    err = (v - ret) ** 2
    if clip is None:
        return torch.where(valid, 0.5 * err, zero), torch.zeros_like(valid)
    v_clipped = old + (v - old).clamp(-clip, clip)
    err_clipped = (v_clipped - ret) ** 2
    return torch.where(valid, 0.5 * torch.maximum(err, err_clipped), zero), valid & (err_clipped > err)
