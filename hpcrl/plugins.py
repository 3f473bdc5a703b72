"""Implementations named by import path (``package.module:attr``), as the registries and the config take them.

Light (importlib only): the configuration layer uses it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["defer_plugins", "plugins_deferred", "resolve"]

_deferred = False


def defer_plugins() -> None:
    """From now on, in this process, a config names plugins (``module:attr``) without importing them: for the
    commands that only read a run (``status``, ``cancel``, the audit), whose config was checked, plugins
    included, when the run was submitted."""
    global _deferred
    _deferred = True


def plugins_deferred() -> bool:
    return _deferred


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
    except Exception as e:  # the plugin's own module failed: say which, under the key, without a second prefix
        raise ValueError(f"{key}: importing {target!r} failed: {type(e).__name__}: {e}") from None
