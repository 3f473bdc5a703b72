"""Implementations named by import path (``package.module:attr``), as the registries and the config take them.

Light (importlib only): the configuration layer uses it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["resolve"]


def resolve(target: str | Callable, key: str) -> Any:
    """``module:attr`` imported (a callable is itself); errors name the config ``key``."""
    if callable(target):
        return target
    module, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{key}: cannot import {target!r}: {e}") from None
