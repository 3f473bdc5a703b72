"""Per-sample advantages (or per-sample scores) from the rewards of prompt groups.

Pure functions on tensors. The trainer calls :func:`group_advantages` once per
training step on the rewards of *all* the step's prompt groups at once
(``[n_groups, group_size]``), after it has gathered whole groups from the
spool and before the PPO minibatches: group statistics are computed on
complete groups and batch statistics on the whole step batch, never on a
micro-batch slice.

Every estimator is a baseline (mean) and a scale (std), each taken at the
``group`` or ``batch`` level or not at all (``none``); ``std`` is always of the
rewards at that level (``unbiased`` = Bessel's n - 1)::

    A_i = (r_i - mean_level(r)) / (std_level(r) + eps)

========================  ==============  ==============  ===========================
estimator                 default mean    default std     note
========================  ==============  ==============  ===========================
``grpo``                  group           group
``dr_grpo``               group           none            Dr. GRPO
``rloo``                  leave-one-out   none            ``r_i - (sum(r) - r_i)/(G-1)``
``lite_ppo``              group           batch           LitePPO
``reinforce_pp``          none            none            token stage: batch whitening
``reinforce_pp_baseline`` group           none            token stage: batch whitening
``gae``                   none            none            token stage: GAE, whitening
========================  ==============  ==============  ===========================

For the last three the result is the *score* at the last response token; the
per-token advantages (returns with the KL reward penalty, GAE, batch-level
whitening over tokens) are made by :mod:`hpcrl.algo.token_adv` once the
reference/critic passes have run. A group whose rewards are all equal gets
exactly zero under a group-level (or leave-one-out) baseline, never NaN;
``uniform_groups`` finds those groups so the caller can leave them out.
"""

from __future__ import annotations

import torch

from hpcrl.algo.config import ADV_ESTIMATORS, NORM_LEVELS

# estimator -> (mean level, std level) at the sequence stage
_SEQ_DEFAULTS: dict[str, tuple[str, str]] = {
    "grpo": ("group", "group"), "dr_grpo": ("group", "none"), "rloo": ("loo", "none"),
    "lite_ppo": ("group", "batch"), "reinforce_pp": ("none", "none"),
    "reinforce_pp_baseline": ("group", "none"), "gae": ("none", "none"),
}
# estimator -> (mean level, std level) at the token stage (token-level estimators only)
_TOKEN_DEFAULTS: dict[str, tuple[str, str]] = {
    "reinforce_pp": ("batch", "batch"), "reinforce_pp_baseline": ("batch", "batch"), "gae": ("batch", "batch"),
}


def resolve_levels(estimator: str, mean_level: str = "default", std_level: str = "default",
                   stage: str = "sequence") -> tuple[str, str]:
    """The (mean, std) levels used by ``estimator`` at ``stage`` ('sequence' or 'token').

    An explicit ``group`` level applies to the sequence stage, an explicit
    ``batch`` level to the token stage of token-level estimators (over all
    valid tokens of the step) and to the sequence stage of the others.
    """
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"adv_estimator: must be one of {list(ADV_ESTIMATORS)}, got {estimator!r}")
    for name, level in (("adv_mean_level", mean_level), ("adv_std_level", std_level)):
        if level not in NORM_LEVELS:
            raise ValueError(f"{name}: must be one of {list(NORM_LEVELS)}, got {level!r}")
    token_level = estimator in _TOKEN_DEFAULTS
    defaults = (_TOKEN_DEFAULTS if stage == "token" else _SEQ_DEFAULTS).get(estimator, ("none", "none"))
    out = []
    for level, default in zip((mean_level, std_level), defaults):
        if level == "default":
            out.append(default)
        elif token_level and (level == "batch") != (stage == "token"):
            out.append("none")  # this level belongs to the other stage
        else:
            out.append(level)
    return out[0], out[1]


def group_advantages(rewards: torch.Tensor, estimator: str, eps: float = 1e-6, *, mean_level: str = "default",
                     std_level: str = "default", unbiased: bool = False) -> torch.Tensor:
    """rewards ``[n_groups, group_size]`` -> per-sample advantages (or scores) of the same shape.

    Integer rewards are promoted to the default float dtype; float rewards keep
    their dtype.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards: must be [n_groups, group_size], got shape {tuple(rewards.shape)}")
    mean_lv, std_lv = resolve_levels(estimator, mean_level, std_level, "sequence")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    group_size = rewards.shape[1]
    if unbiased and group_size < 2 and std_lv == "group":  # only a group std divides by n - 1 = 0
        raise ValueError(f"group_size: an unbiased group std needs at least 2 samples, got {group_size}")
    if mean_lv == "loo":
        if group_size < 2:
            raise ValueError(f"group_size: rloo needs at least 2 samples per group, got {group_size}")
        centred = rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (group_size - 1)
    else:
        centred = rewards - _level_stat(rewards, mean_lv, "mean", unbiased)
    adv = centred if std_lv == "none" else centred / (_level_stat(rewards, std_lv, "std", unbiased) + eps)
    if mean_lv in ("group", "loo"):
        # Rounding in the mean can leave ~1 ulp residuals in an all-equal group that
        # the std division would amplify; those groups are exactly zero instead.
        adv = torch.where(uniform_groups(rewards).unsqueeze(1), torch.zeros_like(adv), adv)
    return adv


def _level_stat(x: torch.Tensor, level: str, what: str, unbiased: bool) -> torch.Tensor:
    if level == "none":
        return torch.zeros((), dtype=x.dtype, device=x.device)
    if level == "group":
        return x.mean(dim=1, keepdim=True) if what == "mean" else x.std(dim=1, keepdim=True, unbiased=unbiased)
    if what == "mean":
        return x.mean()
    return x.std(unbiased=unbiased) if x.numel() > 1 else torch.zeros((), dtype=x.dtype, device=x.device)


def uniform_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``[n_groups]`` bool: True where all rewards in the group are equal (exactly)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards: must be [n_groups, group_size], got shape {tuple(rewards.shape)}")
    return (rewards == rewards[:, :1]).all(dim=1)
