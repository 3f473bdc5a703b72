"""Configuration of the RL algorithm: advantage estimator, decoupled PPO clip and loss aggregation.

One ``AlgoConfig`` is built once when the run config is loaded and then only read
by the trainer. ``__post_init__`` rejects bad values before anything is submitted;
each message starts with the field name (the loader prefixes the section name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

AdvEstimator = Literal["grpo", "dr_grpo", "rloo"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]

ADV_ESTIMATORS: tuple[str, ...] = get_args(AdvEstimator)
LOSS_AGGS: tuple[str, ...] = get_args(LossAgg)


@dataclass
class AlgoConfig:
    """Hyper-parameters of advantage estimation and the decoupled PPO loss."""

    # how per-sample advantages are computed from the rewards of a prompt group
    adv_estimator: AdvEstimator = "grpo"
    # added to the group std (grpo) so that the division never blows up
    adv_eps: float = 1e-6
    # PPO clip epsilon: the ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]
    eps_clip: float = 0.2
    # asymmetric upper clip epsilon (DAPO's clip-higher); None = eps_clip
    eps_clip_high: float | None = None
    # clamp exp(logp_prox - logp_behav) to at most this; None = no cap
    behav_imp_weight_cap: float | None = 5.0
    # how per-token losses are reduced to the scalar loss
    loss_agg: LossAgg = "token_mean"
    # groups whose rewards are all equal give no gradient and are left out of the loss
    drop_uniform_groups: bool = True
    # sampling temperature; logits are divided by it before logprobs
    temperature: float = 1.0

    def __post_init__(self) -> None:
        _check_choice("adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        _check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        if not self.adv_eps > 0:
            raise ValueError(f"adv_eps: must be > 0, got {self.adv_eps}")
        if not 0 < self.eps_clip < 1:
            raise ValueError(f"eps_clip: must be in (0, 1), got {self.eps_clip}")
        if self.eps_clip_high is not None and not self.eps_clip_high > 0:
            raise ValueError(f"eps_clip_high: must be > 0 or null, got {self.eps_clip_high}")
        cap = self.behav_imp_weight_cap
        if cap is not None and not cap > 1:
            raise ValueError(f"behav_imp_weight_cap: must be > 1 or null, got {cap}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")

    @property
    def clip_high(self) -> float:
        """The upper clip epsilon actually used."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


def _check_choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field}: must be one of {list(allowed)}, got {value!r}")
