"""Reward: verifiers (math answer checking) and a runner that calls a reward
function by import path and contains it when it raises, hangs, returns
garbage or crashes its process (see ``runner`` for the rules).

Only the standard library is imported here, so a spawned reward worker stays
light.
"""

from hpcrl._lazy import lazy_namespace

# name -> defining module, imported on first use: importing a package's config (as the root
# config does) must not pull in torch
_LAZY = {
    "answers_match": "hpcrl.reward.math_verify",
    "extract_answer": "hpcrl.reward.math_verify",
    "math_reward": "hpcrl.reward.math_verify",
    "parse_number": "hpcrl.reward.math_verify",
    "RewardConfig": "hpcrl.reward.runner",
    "RewardResult": "hpcrl.reward.runner",
    "RewardRunner": "hpcrl.reward.runner",
    "load_function": "hpcrl.reward.runner",
}
lazy_namespace(__name__, _LAZY)
