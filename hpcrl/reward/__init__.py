"""Reward: verifiers (math answer checking) and a runner that calls a reward
function by import path and contains it when it raises, hangs, returns
garbage or crashes its process (see ``runner`` for the rules).

Only the standard library is imported here, so a spawned reward worker stays
light.
"""

from hpcrl.reward.math_verify import answers_match, extract_answer, math_reward, parse_number
from hpcrl.reward.runner import RewardConfig, RewardResult, RewardRunner, load_function

__all__ = [
    "RewardConfig",
    "RewardResult",
    "RewardRunner",
    "answers_match",
    "extract_answer",
    "load_function",
    "math_reward",
    "parse_number",
]
