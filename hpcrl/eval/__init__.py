"""Evaluation of a policy: greedy accuracy on held-out rows."""


from importlib import import_module
from typing import Any

# name -> defining module, imported on first use: importing a package's config (as the root
# config does) must not pull in torch
_LAZY = {
    "EvalResult": "hpcrl.eval.accuracy",
    "greedy_accuracy": "hpcrl.eval.accuracy",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpcrl.eval' has no attribute {name!r}")
