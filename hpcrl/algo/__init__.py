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

from hpcrl._lazy import lazy_namespace

# name -> defining module, imported on first use: importing a package's config (as the root
# config does) must not pull in torch
_LAZY = {
    "group_advantages": "hpcrl.algo.advantages",
    "resolve_levels": "hpcrl.algo.advantages",
    "uniform_groups": "hpcrl.algo.advantages",
    "aggregate": "hpcrl.algo.aggregate",
    "loss_normaliser": "hpcrl.algo.aggregate",
    "AlgoConfig": "hpcrl.algo.config",
    "is_informative": "hpcrl.algo.dapo",
    "overlong_penalty": "hpcrl.algo.dapo",
    "batch_moments": "hpcrl.algo.gae",
    "gae": "hpcrl.algo.gae",
    "masked_moments": "hpcrl.algo.gae",
    "token_rewards": "hpcrl.algo.gae",
    "value_loss_per_token": "hpcrl.algo.gae",
    "whiten": "hpcrl.algo.gae",
    "kl_estimate": "hpcrl.algo.kl",
    "token_entropy": "hpcrl.algo.kl",
    "LossOutput": "hpcrl.algo.losses",
    "behaviour_weight": "hpcrl.algo.losses",
    "decoupled_ppo_loss": "hpcrl.algo.losses",
    "token_logprobs": "hpcrl.algo.losses",
    "approx_prox_logprobs": "hpcrl.algo.prox",
}
lazy_namespace(__name__, _LAZY)
