"""Supervised warm start of the policy before RL."""


from importlib import import_module
from typing import Any

# name -> defining module, imported on first use: importing a package's config (as the root
# config does) must not pull in torch
_LAZY = {
    "SFTConfig": "hpcrl.sft.warm_start",
    "SFTResult": "hpcrl.sft.warm_start",
    "warm_start": "hpcrl.sft.warm_start",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpcrl.sft' has no attribute {name!r}")
