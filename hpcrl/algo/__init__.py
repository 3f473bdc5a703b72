"""RL algorithm as pure functions on tensors: group advantages and the decoupled PPO loss.

The trainer computes advantages once per step on whole prompt groups
(``group_advantages``, ``uniform_groups``), recomputes proximal logprobs
(``token_logprobs``) before the update, then for every micro-batch calls
``decoupled_ppo_loss`` with the minibatch-wide ``loss_normaliser``.
"""

from hpcrl.algo.advantages import group_advantages, uniform_groups
from hpcrl.algo.config import AlgoConfig
from hpcrl.algo.losses import LossOutput, decoupled_ppo_loss, loss_normaliser, token_logprobs

__all__ = [
    "AlgoConfig",
    "LossOutput",
    "decoupled_ppo_loss",
    "group_advantages",
    "loss_normaliser",
    "token_logprobs",
    "uniform_groups",
]
