"""Supervised warm start of the policy before RL."""

from hpcrl._lazy import lazy_namespace

# name -> defining module, imported on first use: importing a package's config (as the root
# config does) must not pull in torch
_LAZY = {
    "SFTConfig": "hpcrl.sft.warm_start",
    "SFTResult": "hpcrl.sft.warm_start",
    "warm_start": "hpcrl.sft.warm_start",
}
lazy_namespace(__name__, _LAZY)
