"""Configuration of the RL algorithm: advantage estimator, policy loss, KL/entropy terms, DAPO extras.

One ``AlgoConfig`` is built once when the run config is loaded and then only read
by the trainer. ``__post_init__`` rejects bad values and inconsistent
combinations before anything is submitted; each message starts with the field
name (the loader prefixes the section name). The per-algorithm presets in
``configs/algos/`` set a handful of these fields each (docs/algorithms.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

AdvEstimator = Literal["grpo", "dr_grpo", "rloo", "lite_ppo", "reinforce_pp", "reinforce_pp_baseline", "gae"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
NormLevel = Literal["default", "group", "batch", "none"]
Level = Literal["token", "sequence"]
WeightMode = Literal["cap", "mask"]
WeightMetric = Literal["ratio", "k1", "k2", "k3"]
KLEstimator = Literal["k1", "k2", "k3"]
KLMode = Literal["none", "reward", "loss"]

ADV_ESTIMATORS: tuple[str, ...] = get_args(AdvEstimator)
LOSS_AGGS: tuple[str, ...] = get_args(LossAgg)
NORM_LEVELS: tuple[str, ...] = get_args(NormLevel)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
# estimators whose advantages are per token and need model passes (reference, critic) first
TOKEN_LEVEL_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")


@dataclass
class AlgoConfig:
    """Hyper-parameters of advantage estimation and the decoupled PPO loss."""

    # how per-sample advantages are computed from the rewards (and values) of prompt groups
    adv_estimator: AdvEstimator = "grpo"
    # where the baseline mean is taken: default = the estimator's own choice (docs/algorithms.md)
    adv_mean_level: NormLevel = "default"
    # where the std that advantages are divided by is taken: default = the estimator's own choice
    adv_std_level: NormLevel = "default"
    # Bessel-corrected (n - 1) std instead of the population std
    adv_std_unbiased: bool = False
    # added to the std so that the division never blows up
    adv_eps: float = 1e-6
    # PPO clip epsilon: the ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]
    eps_clip: float = 0.2
    # asymmetric upper clip epsilon (DAPO's clip-higher); None = eps_clip
    eps_clip_high: float | None = None
    # dual clip c > 1: for negative advantages the loss is bounded by -A * c; None = off
    dual_clip: float | None = None
    # token: PPO ratio per token; sequence: GSPO's length-normalised geometric-mean ratio per sequence
    ratio_level: Level = "token"
    # behaviour weight exp(logp_prox - logp_behav): cap = clamp at the upper bound; mask = zero tokens outside bounds
    behav_imp_weight_mode: WeightMode = "cap"
    # upper bound on the behaviour weight (or on the metric in mask mode); None = no bound
    behav_imp_weight_cap: float | None = 5.0
    # lower bound of the behaviour weight in mask mode (metric ratio only); None = no lower bound
    behav_imp_weight_lower: float | None = None
    # the behaviour weight (and its mask metric) per token or per sequence (geometric mean)
    behav_imp_weight_level: Level = "token"
    # what the mask bounds compare: the weight itself or a k1/k2/k3 estimate of KL(behaviour || prox)
    behav_imp_weight_metric: WeightMetric = "ratio"
    # M2PO: when the mean squared log behaviour weight of an update's tokens reaches this, the largest are
    # masked until the rest's mean is below it (hpcrl.algo.m2po); None = off
    m2_threshold: float | None = None
    # how per-token losses are reduced to the scalar loss
    loss_agg: LossAgg = "token_mean"
    # groups whose rewards are all equal give no gradient and are left out of the loss
    drop_uniform_groups: bool = True
    # DAPO dynamic sampling: the trainer drops uniform groups from the spool and takes more until B are in hand
    dynamic_sampling: bool = False
    # sampling temperature; logits are divided by it before logprobs. Follows rollout.temperature (a run
    # config with the two different is refused): the rollouts sample with it, the trainer must score with it
    temperature: float = 1.0
    # KL against the frozen initial policy: none, a per-token reward penalty, or a loss term
    kl_mode: KLMode = "none"
    # the KL estimator (k1 = log ratio, k2 = half squared log ratio, k3 = exp(-d) - 1 + d)
    kl_estimator: KLEstimator = "k3"
    # coefficient of the KL penalty (reward) or KL loss term
    kl_coef: float = 0.0
    # coefficient of the entropy bonus (subtracted from the loss); 0 = off
    entropy_coef: float = 0.0
    # GAE discount gamma (adv_estimator=gae; also discounts REINFORCE++ returns)
    gamma: float = 1.0
    # GAE lambda (adv_estimator=gae)
    lam: float = 1.0
    # value clipping range around the values before the update (adv_estimator=gae); None = off
    value_clip: float | None = 0.2
    # critic learning rate (adv_estimator=gae)
    critic_lr: float = 1e-4
    # critic coefficient: scales the value loss 0.5 * (V - R)^2
    value_loss_coef: float = 1.0
    # DAPO soft overlong penalty: the buffer length L_cache (tokens); 0 = off
    overlong_buffer: int = 0
    # DAPO soft overlong penalty: the maximum response length L_max (set it to rollout.max_new_tokens)
    overlong_max_tokens: int = 0
    # DAPO soft overlong penalty: the penalty at L_max (reward -= factor * overshoot / L_cache)
    overlong_penalty_factor: float = 1.0
    # skip the proximal recompute pass: log-linear interpolation of behaviour and current logprobs by version
    prox_approx: bool = False
    # false = plain PPO: clip around the behaviour policy (proximal = behaviour, no recompute, no behaviour
    # weight); the baseline decoupled PPO is measured against under staleness
    decoupled: bool = True

    def __post_init__(self) -> None:
        for name, allowed in (("adv_estimator", ADV_ESTIMATORS), ("loss_agg", LOSS_AGGS),
                              ("adv_mean_level", NORM_LEVELS), ("adv_std_level", NORM_LEVELS),
                              ("ratio_level", get_args(Level)), ("behav_imp_weight_level", get_args(Level)),
                              ("behav_imp_weight_mode", get_args(WeightMode)),
                              ("behav_imp_weight_metric", get_args(WeightMetric)),
                              ("kl_mode", get_args(KLMode)), ("kl_estimator", KL_ESTIMATORS)):
            _check_choice(name, getattr(self, name), allowed)
        _check_positive(self, ("adv_eps", "temperature", "critic_lr", "value_loss_coef"))
        _check_nonneg(self, ("kl_coef", "entropy_coef", "overlong_buffer", "overlong_penalty_factor"))
        if not 0 < self.eps_clip < 1:
            raise ValueError(f"eps_clip: must be in (0, 1), got {self.eps_clip}")
        if self.eps_clip_high is not None and not self.eps_clip_high > 0:
            raise ValueError(f"eps_clip_high: must be > 0 or null, got {self.eps_clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip: must be > 1 or null, got {self.dual_clip}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"value_clip: must be > 0 or null, got {self.value_clip}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}: must be in [0, 1], got {getattr(self, name)}")
        self._check_behaviour_weight()
        if self.m2_threshold is not None and not self.m2_threshold > 0:
            raise ValueError(f"m2_threshold: must be > 0 or null, got {self.m2_threshold}")
        if self.m2_threshold is not None and (not self.decoupled or self.prox_approx):
            raise ValueError("m2_threshold: M2PO bounds the weights between the behaviour and the recomputed "
                             "proximal policy; it needs decoupled=true and prox_approx=false")
        if self.prox_approx and not self.decoupled:
            raise ValueError("prox_approx: approximates the proximal policy of decoupled PPO; "
                             "with decoupled=false there is none (set prox_approx=false)")
        self._check_combinations()

    def _check_behaviour_weight(self) -> None:
        cap, lower = self.behav_imp_weight_cap, self.behav_imp_weight_lower
        ratio = self.behav_imp_weight_metric == "ratio"
        if cap is not None and not cap > (1 if ratio else 0):
            raise ValueError(f"behav_imp_weight_cap: must be > {1 if ratio else 0} or null, got {cap}")
        if self.behav_imp_weight_mode == "cap" and not ratio:
            raise ValueError("behav_imp_weight_metric: cap mode clamps the ratio; use mode=mask for k1/k2/k3")
        if lower is not None and (self.behav_imp_weight_mode != "mask" or not ratio or not 0 <= lower < 1):
            raise ValueError(f"behav_imp_weight_lower: needs mode=mask, metric=ratio and a value in [0, 1), "
                             f"got {lower}")

    def _check_combinations(self) -> None:
        if self.kl_mode != "none" and self.kl_coef == 0:
            raise ValueError(f"kl_coef: must be > 0 when kl_mode={self.kl_mode!r}")
        if self.kl_mode == "reward" and self.adv_estimator not in TOKEN_LEVEL_ESTIMATORS:
            raise ValueError(f"kl_mode: 'reward' needs a token-level estimator {list(TOKEN_LEVEL_ESTIMATORS)}, "
                             f"got adv_estimator={self.adv_estimator!r}")
        if self.overlong_buffer > 0 and not self.overlong_max_tokens > self.overlong_buffer:
            raise ValueError(f"overlong_max_tokens: must be > overlong_buffer ({self.overlong_buffer}) "
                             f"when the overlong penalty is on, got {self.overlong_max_tokens}")
        if self.adv_estimator == "rloo" and self.adv_mean_level not in ("default",):
            raise ValueError("adv_mean_level: rloo uses its leave-one-out baseline; leave it 'default'")

    @property
    def clip_high(self) -> float:
        """The upper clip epsilon actually used."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def token_level_advantages(self) -> bool:
        """Advantages need per-token model passes (reference KL reward, critic values)."""
        return self.adv_estimator in TOKEN_LEVEL_ESTIMATORS

    @property
    def needs_reference(self) -> bool:
        """A frozen reference model is needed (KL as reward penalty or loss term)."""
        return self.kl_mode != "none"


def _check_choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field}: must be one of {list(allowed)}, got {value!r}")


def _check_positive(cfg: AlgoConfig, names: tuple[str, ...]) -> None:
    for name in names:
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name}: must be > 0, got {getattr(cfg, name)}")


def _check_nonneg(cfg: AlgoConfig, names: tuple[str, ...]) -> None:
    for name in names:
        if not getattr(cfg, name) >= 0:
            raise ValueError(f"{name}: must be >= 0, got {getattr(cfg, name)}")
