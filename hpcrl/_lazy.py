"""Lazy package namespaces: ``from hpcrl.algo import gae`` works, but importing ``hpcrl.algo.config``
(as the root config does) does not import torch.

:func:`lazy_namespace` turns a package into one whose public names are imported from their defining
modules on first use. A submodule whose name is also a public name (``hpcrl.algo.gae``: the module and
the function) never shadows the name once imported, exactly as with eager imports in ``__init__``.
"""

from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import Any


def lazy_namespace(package: str, names: dict[str, str]) -> None:
    """Make ``package``'s attributes in ``names`` (name -> defining module) load on first access."""

    class _Namespace(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name not in names:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = getattr(import_module(names[name]), name)
            object.__setattr__(self, name, value)
            return value

        def __setattr__(self, name: str, value: Any) -> None:
            if name in names and isinstance(value, types.ModuleType):
                return  # the import system binding a submodule: the public name wins
            object.__setattr__(self, name, value)

        def __dir__(self) -> list[str]:
            return sorted(set(super().__dir__()) | set(names))

    module = sys.modules[package]
    module.__class__ = _Namespace
    module.__all__ = sorted(names)
