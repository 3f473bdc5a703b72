"""KL estimators against a reference policy, and the per-token entropy.

Pure functions. With ``d = logp - logp_ref`` on tokens sampled from the
policy (Schulman's estimators of ``KL(pi || pi_ref)``)::

    k1 = d            unbiased, high variance, can be negative
    k2 = d^2 / 2      biased, low variance, >= 0
    k3 = exp(-d) - 1 + d   unbiased, >= 0

The trainer uses them either as a per-token reward penalty (``kl_mode:
reward``: ``r_t -= kl_coef * k(t)``, before advantages; see
:mod:`hpcrl.algo.gae`) or as a loss term (``kl_mode: loss``: ``+ kl_coef *
agg(k)``, in :func:`hpcrl.algo.losses.decoupled_ppo_loss`). Masked positions
give exactly 0 whatever garbage the inputs hold there.
"""

from __future__ import annotations

import torch

from hpcrl.algo.config import KL_ESTIMATORS


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token ``k1``/``k2``/``k3`` estimate of ``KL(pi || pi_ref)``; 0 where ``mask == 0``."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator: must be one of {list(KL_ESTIMATORS)}, got {estimator!r}")
    if logp.shape != logp_ref.shape:
        raise ValueError(f"logp_ref: shape {tuple(logp_ref.shape)} does not match logp {tuple(logp.shape)}")
    if mask is not None:
        valid = mask > 0
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        logp, logp_ref = torch.where(valid, logp, zero), torch.where(valid, logp_ref.to(logp.dtype), zero)
    d = logp - logp_ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return k3(d)


def k3(d: torch.Tensor) -> torch.Tensor:
    """``exp(-d) - 1 + d``, accurate in float32 too.

    The closed form cancels twice for small ``|d|`` (the result is about
    ``d^2 / 2``): written as it reads it loses 2 % at ``d = 1e-3`` in float32,
    and even ``expm1(-d) + d`` keeps only ``~2 eps / |d|``. Below
    ``|d| = 1e-2`` the Taylor series to ``d^6`` is used instead (truncation
    below 1e-13 relative); above it ``expm1(-d) + d`` is accurate to
    ``~2 eps / |d|`` <= 1e-5 in float32."""
    series = d * d * (1 / 2 - d * (1 / 6 - d * (1 / 24 - d * (1 / 120 - d / 720))))
    return torch.where(d.abs() < 1e-2, series, torch.expm1(-d) + d)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits ``[B, T, V]`` -> entropy of ``softmax(logits / temperature)`` per position, ``[B, T]``."""
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1, keepdim=True)
    p = torch.exp(logits - logz)
    return (logz.squeeze(-1) - (p * logits).sum(dim=-1))
