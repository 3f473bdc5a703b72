"""Per-sample advantages from the rewards of prompt groups.

Pure functions on tensors. The trainer calls them once per training step, after
it has gathered whole prompt groups (all ``group_size`` samples of a prompt) from
the spool and before the PPO minibatches: advantages are computed on complete
groups only, never on a micro-batch slice of one.

Estimators (``r`` is one group's rewards, ``G`` its size):

- ``grpo``:    ``(r_i - mean(r)) / (std(r) + eps)``, population std (``unbiased=False``)
- ``dr_grpo``: ``r_i - mean(r)`` (Dr. GRPO: no std normalisation)
- ``rloo``:    ``r_i - (sum(r) - r_i) / (G - 1)`` (leave-one-out baseline)

A group whose rewards are all equal gets all-zero advantages under every
estimator (no NaN); ``uniform_groups`` finds those groups so the caller can
leave them out of the loss (``AlgoConfig.drop_uniform_groups``).
"""

from __future__ import annotations

import torch

from hpcrl.algo.config import ADV_ESTIMATORS


def group_advantages(rewards: torch.Tensor, estimator: str, eps: float = 1e-6) -> torch.Tensor:
    """rewards ``[n_groups, group_size]`` -> per-sample advantages of the same shape.

    Integer rewards are promoted to the default float dtype; float rewards keep
    their dtype.
    """
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"adv_estimator: must be one of {list(ADV_ESTIMATORS)}, got {estimator!r}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards: must be [n_groups, group_size], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    # Rounding in the mean can leave ~1 ulp residuals in an all-equal group that
    # the std division would amplify; those groups are exactly zero instead.
    uniform = uniform_groups(rewards).unsqueeze(1)
    return torch.where(uniform, torch.zeros_like(rewards), _raw_advantages(rewards, estimator, eps))


def _raw_advantages(rewards: torch.Tensor, estimator: str, eps: float) -> torch.Tensor:
    group_size = rewards.shape[1]
    mean = rewards.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        std = rewards.std(dim=1, keepdim=True, unbiased=False)
        return (rewards - mean) / (std + eps)
    if estimator == "dr_grpo":
        return rewards - mean
    if group_size < 2:
        raise ValueError(f"group_size: rloo needs at least 2 samples per group, got {group_size}")
    others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (group_size - 1)
    return rewards - others_mean


def uniform_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``[n_groups]`` bool: True where all rewards in the group are equal (exactly)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards: must be [n_groups, group_size], got shape {tuple(rewards.shape)}")
    return (rewards == rewards[:, :1]).all(dim=1)
