"""Datasets: prompt/answer rows from files, and the synthetic addition task."""


from importlib import import_module
from typing import Any

# name -> defining module, imported on first use: importing a package's config (as the root
# config does) must not pull in torch
_LAZY = {
    "BadRowError": "hpcrl.data.rows",
    "Row": "hpcrl.data.rows",
    "load_rows": "hpcrl.data.rows",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpcrl.data' has no attribute {name!r}")
