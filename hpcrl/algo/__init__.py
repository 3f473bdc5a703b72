"""RL algorithms as pure functions on tensors: advantages, policy/value losses, KL, DAPO extras.

The trainer, once per step: shapes rewards (:func:`overlong_penalty`) and
computes sequence advantages/scores on whole prompt groups
(:func:`group_advantages`, :func:`uniform_groups`); recomputes (or
approximates, :func:`approx_prox_logprobs`) proximal logprobs
(:func:`token_logprobs`); for token-level estimators makes per-token
advantages (:func:`token_rewards`, :func:`gae`, :func:`whiten`); then for
every micro-batch calls :func:`decoupled_ppo_loss` (and
:func:`value_loss_per_token` for the critic) with the minibatch-wide
:func:`loss_normaliser`.
"""

from hpcrl.algo.advantages import group_advantages, resolve_levels, uniform_groups
from hpcrl.algo.aggregate import aggregate, loss_normaliser
from hpcrl.algo.config import AlgoConfig
from hpcrl.algo.dapo import is_informative, overlong_penalty
from hpcrl.algo.gae import gae, masked_moments, token_rewards, value_loss_per_token, whiten
from hpcrl.algo.kl import kl_estimate, token_entropy
from hpcrl.algo.losses import LossOutput, behaviour_weight, decoupled_ppo_loss, token_logprobs
from hpcrl.algo.prox import approx_prox_logprobs

__all__ = [
    "AlgoConfig", "LossOutput", "aggregate", "approx_prox_logprobs", "behaviour_weight", "decoupled_ppo_loss",
    "gae", "group_advantages", "is_informative", "kl_estimate", "loss_normaliser", "masked_moments",
    "overlong_penalty", "resolve_levels", "token_entropy", "token_logprobs", "token_rewards", "uniform_groups",
    "value_loss_per_token", "whiten",
]
