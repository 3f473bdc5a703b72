"""The weight-transport registry: the one place that maps ``weights.mode`` to an implementation.

A :class:`TransportSpec` says how to open the transport (a
:class:`~hpcrl.weights.transport.WeightTransport`) for the trainer's rank 0
(the ``host``, which publishes) or a rollout (a ``member``, which receives),
and whether it can publish LoRA adapters alone (``trainer.lora.publish:
adapter``). :data:`TRANSPORTS` holds the built-in ones: ``disk`` (each version
a safetensors file under ``<run_dir>/weights/``) and ``collective`` (a
broadcast from the trainer to every rollout, :mod:`hpcrl.weights.collective`);
:func:`register_transport` adds one within a process, and a config names one
of its own by import path (``weights.mode: my_pkg.weights:SPEC``).

This module is light (no torch): the config layer imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hpcrl.plugins import Registry

__all__ = ["TRANSPORTS", "TransportSpec", "register_transport", "transport_spec"]


@dataclass(frozen=True)
class TransportSpec:
    name: str
    # (root, cfg: WeightsConfig, role: "host" | "member", fence, adapter) -> WeightTransport, or its
    # "module:function" (imported when a component opens it)
    build: str | Callable[..., Any]
    adapters: bool = False  # publishes LoRA adapters alone, for servers to load (trainer.lora.publish: adapter)


TRANSPORTS = Registry("weights.mode", TransportSpec)
register_transport = TRANSPORTS.register  # make a spec a choice of weights.mode (within this process)
transport_spec = TRANSPORTS.lookup  # the spec a value of weights.mode names (a registered name, or module:attr)

register_transport(TransportSpec("disk", build="hpcrl.weights.transport:open_disk", adapters=True))
register_transport(TransportSpec("collective", build="hpcrl.weights.collective:open_collective"))
