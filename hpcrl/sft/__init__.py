"""Supervised warm start of the policy before RL."""

from hpcrl.sft.warm_start import SFTConfig, SFTResult, warm_start

__all__ = ["SFTConfig", "SFTResult", "warm_start"]
