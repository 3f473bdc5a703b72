"""The tracker registry: the one place that maps a name of ``metrics.trackers`` to an implementation.

A :class:`TrackerSpec` names the tracker's factory ``(MetricsConfig, TrackerContext) -> Tracker`` by import path
(imported only when a component opens it, :func:`hpcrl.metrics.trackers.open_tracker`) and the package it needs,
so that the config rejects a tracker whose package is missing when the run is submitted, not when the trainer
starts. :data:`TRACKERS` holds the built-in ones (``tensorboard``, ``wandb``, ``mlflow``);
:func:`register_tracker` adds one within a process, and a config names one of its own by import path
(``metrics.trackers: [my_pkg.trackers:SPEC]``, a :class:`TrackerSpec`, or ``my_pkg.trackers:factory``, the
factory alone).

This module is light (no torch, no tracker package): the config layer imports it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

from hpcrl.plugins import Registry

__all__ = ["TRACKERS", "TrackerSpec", "check_tracker", "register_tracker", "tracker_spec"]


@dataclass(frozen=True)
class TrackerSpec:
    name: str
    # (MetricsConfig, TrackerContext) -> Tracker (hpcrl/metrics/trackers.py), or its "module:attr"
    build: str | Callable[..., Any]
    package: str = ""  # the module it imports ("" = nothing beyond hpcrl's own dependencies)
    extra: str = ""  # the pip extra that installs that module, named in the error


# a config may also name a factory alone (``module:factory``): it becomes a spec of that name
TRACKERS = Registry("metrics.trackers", TrackerSpec, wrap=lambda name, factory: TrackerSpec(name, build=factory))
register_tracker = TRACKERS.register  # make a spec a choice of metrics.trackers (within this process)
tracker_spec = TRACKERS.lookup  # the spec a name in metrics.trackers names (a registered name, or module:attr)


def check_tracker(name: str, key: str = "trackers") -> TrackerSpec:
    """The spec ``name`` names, after checking that its package is installed (errors name ``key``)."""
    spec = tracker_spec(name, key)
    if spec.package and importlib.util.find_spec(spec.package) is None:
        how = f"pip install -e '.[{spec.extra}]'" if spec.extra else f"pip install {spec.package}"
        raise ValueError(f"{key}: {name} needs the {spec.package} package: {how}")
    return spec


register_tracker(TrackerSpec("tensorboard", build="hpcrl.metrics.trackers:TensorBoardTracker"))
register_tracker(TrackerSpec("wandb", build="hpcrl.metrics.trackers:WandbTracker", package="wandb",
                             extra="trackers"))
register_tracker(TrackerSpec("mlflow", build="hpcrl.metrics.trackers:MlflowTracker", package="mlflow",
                             extra="trackers"))
