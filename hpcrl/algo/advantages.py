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
whitening over tokens) are made by :mod:`hpcrl.algo.gae` once the
reference/critic passes have run. A group whose rewards are all equal gets
exactly zero under a group-level (or leave-one-out) baseline, never NaN;
``uniform_groups`` finds those groups so the caller can leave them out.

Ragged groups: with ``group_sizes`` the rewards are one flat ``[n_samples]``
tensor, the groups' samples one after the other, and groups may differ in
size (an agent run with ``agent.export=individual`` makes one sample per
model call, so a ticket's group holds as many samples as its episodes made
calls). Every statistic is the same as above with each group's own size:
the group mean and std are over all the group's samples, each sample
weighing one (AReaL's individual mode; an episode with more calls weighs
more), leave-one-out divides by that group's ``G - 1``, and the batch level
is over every sample of the step. Equal-sized groups given as a 2-D tensor
take the 2-D path, unchanged.
"""

from __future__ import annotations

from typing import Sequence

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
                     std_level: str = "default", unbiased: bool = False,
                     group_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Per-sample advantages (or scores) of the same shape as ``rewards``.

    ``rewards``: ``[n_groups, group_size]``, or with ``group_sizes`` (ragged
    groups) the flat ``[sum(group_sizes)]`` rewards of the groups one after
    the other. Integer rewards are promoted to the default float dtype; float
    rewards keep their dtype.
    """
    mean_lv, std_lv = resolve_levels(estimator, mean_level, std_level, "sequence")
    if group_sizes is not None:
        return _ragged_advantages(rewards, group_sizes, mean_lv, std_lv, eps, unbiased)
    if rewards.dim() != 2:
        raise ValueError(f"rewards: must be [n_groups, group_size], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    group_size = rewards.shape[1]
    _check_group_size(group_size, mean_lv, std_lv, unbiased)
    if mean_lv == "loo":
        centred = rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (group_size - 1)
    else:
        centred = rewards - _level_stat(rewards, mean_lv, "mean", unbiased)
    adv = centred if std_lv == "none" else centred / (_level_stat(rewards, std_lv, "std", unbiased) + eps)
    if mean_lv in ("group", "loo"):
        # Rounding in the mean can leave ~1 ulp residuals in an all-equal group that
        # the std division would amplify; those groups are exactly zero instead.
        adv = torch.where(uniform_groups(rewards).unsqueeze(1), torch.zeros_like(adv), adv)
    return adv


def _check_group_size(smallest: int, mean_lv: str, std_lv: str, unbiased: bool) -> None:
    if unbiased and smallest < 2 and std_lv == "group":  # only a group std divides by n - 1 = 0
        raise ValueError(f"group_size: an unbiased group std needs at least 2 samples, got {smallest}")
    if mean_lv == "loo" and smallest < 2:
        raise ValueError(f"group_size: rloo needs at least 2 samples per group, got {smallest}")


def _ragged_advantages(rewards: torch.Tensor, group_sizes: Sequence[int], mean_lv: str, std_lv: str, eps: float,
                       unbiased: bool) -> torch.Tensor:
    """:func:`group_advantages` of flat rewards over consecutive groups of the given sizes (segment sums)."""
    x = rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())
    seg, sizes = _segments(x, group_sizes)
    _check_group_size(int(sizes.min()), mean_lv, std_lv, unbiased)
    n = sizes.to(x.dtype)
    sums = torch.zeros(len(n), dtype=x.dtype, device=x.device).index_add_(0, seg, x)
    group_mean = sums / n
    if mean_lv == "loo":
        centred = x - (sums[seg] - x) / (n[seg] - 1)
    elif mean_lv == "group":
        centred = x - group_mean[seg]
    else:
        centred = x - _level_stat(x, mean_lv, "mean", unbiased)
    if std_lv == "group":  # two passes: the moments around the group's mean
        dev = x - group_mean[seg]
        var = torch.zeros_like(n).index_add_(0, seg, dev * dev) / (n - 1 if unbiased else n)
        adv = centred / (var.sqrt()[seg] + eps)
    else:
        adv = centred if std_lv == "none" else centred / (_level_stat(x, std_lv, "std", unbiased) + eps)
    if mean_lv in ("group", "loo"):  # all-equal groups exactly zero, as on the 2-D path
        adv = torch.where(_ragged_uniform(x, seg, sizes)[seg], torch.zeros_like(adv), adv)
    return adv


def _segments(x: torch.Tensor, group_sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(group index of every sample, sizes) of flat ``x`` split into ``group_sizes``; checked."""
    if x.dim() != 1:
        raise ValueError(f"rewards: with group_sizes, must be flat [n_samples], got shape {tuple(x.shape)}")
    sizes = torch.as_tensor(list(group_sizes), dtype=torch.long, device=x.device)
    if sizes.numel() == 0 or (sizes < 1).any():
        raise ValueError(f"group_sizes: every group needs at least one sample, got {sizes.tolist()}")
    if int(sizes.sum()) != x.numel():
        raise ValueError(f"group_sizes: sum to {int(sizes.sum())} but rewards has {x.numel()} samples")
    return torch.repeat_interleave(torch.arange(len(sizes), device=x.device), sizes), sizes


def _ragged_uniform(x: torch.Tensor, seg: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    first = x[torch.cumsum(sizes, 0) - sizes][seg]
    differs = torch.zeros(len(sizes), dtype=torch.long, device=x.device).index_add_(0, seg, (x != first).long())
    return differs == 0


def _level_stat(x: torch.Tensor, level: str, what: str, unbiased: bool) -> torch.Tensor:
    if level == "none":
        return torch.zeros((), dtype=x.dtype, device=x.device)
    if level == "group":
        return x.mean(dim=1, keepdim=True) if what == "mean" else x.std(dim=1, keepdim=True, unbiased=unbiased)
    if what == "mean":
        return x.mean()
    return x.std(unbiased=unbiased) if x.numel() > 1 else torch.zeros((), dtype=x.dtype, device=x.device)


def uniform_groups(rewards: torch.Tensor, group_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """``[n_groups]`` bool: True where all rewards in the group are equal (exactly).

    ``rewards`` as in :func:`group_advantages`: 2-D, or flat with ``group_sizes``."""
    if group_sizes is not None:
        seg, sizes = _segments(rewards, group_sizes)
        return _ragged_uniform(rewards, seg, sizes)
    if rewards.dim() != 2:
        raise ValueError(f"rewards: must be [n_groups, group_size], got shape {tuple(rewards.shape)}")
    return (rewards == rewards[:, :1]).all(dim=1)
