"""Implementations named by import path (``package.module:attr``), as the registries and the config take them.

Light (importlib only): the configuration layer uses it.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any, Callable

__all__ = ["Registry", "defer_plugins", "plugins_deferred", "resolve"]

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


class Registry(dict):
    """One seam's choices: name -> spec, where a spec is a frozen dataclass of ``kind`` with ``name`` and
    ``build`` fields. A config value is a registered name, or ``module:attr`` of a spec outside hpcrl (imported
    and registered under that value on first use; with plugins deferred, a placeholder that imports nothing);
    with ``wrap``, ``module:attr`` may also name a bare callable, which ``wrap`` makes a spec of."""

    def __init__(self, key: str, kind: type, wrap: Callable[[str, Callable], Any] | None = None) -> None:
        super().__init__()
        # wrap: how a bare callable named ``module:attr`` becomes a spec (None: the name must be of a spec)
        self.key, self.kind, self.wrap = key, kind, wrap

    def register(self, spec: Any) -> Any:
        """Make ``spec`` a choice of the config key; a name is registered once."""
        if spec.name in self and self[spec.name] is not spec:
            raise ValueError(f"{self.key}: {spec.name!r} is registered already")
        self[spec.name] = spec
        return spec

    def lookup(self, name: str, key: str | None = None) -> Any:
        """The spec ``name`` names; errors name ``key`` (default: the full config key; a config passes its own
        field name, the loader adds the section)."""
        key = key or self.key
        if name in self:
            return self[name]
        if ":" in name and _deferred:  # a run's own config, read by a light command: no import
            return self.kind(name=name, build=name)
        if ":" in name:
            spec = resolve(name, key)
            if not isinstance(spec, self.kind) and self.wrap is not None and callable(spec):
                spec = self.wrap(name, spec)
            if not isinstance(spec, self.kind):
                raise ValueError(f"{key}: {name!r} is a {type(spec).__name__}, not the {self.kind.__name__} it must name")
            return self.register(spec if spec.name == name else replace(spec, name=name))
        raise ValueError(f"{key}: must be one of {sorted(self)} or 'module:attr' (its {self.kind.__name__}), got "
                         f"{name!r}")
