"""The train-engine boundary of the trainer component (design.md §3.4).

One seam for every training backend: FSDP2 (:mod:`hpcrl.trainer.fsdp`) and
megatron-core (:mod:`hpcrl.trainer.mcore.engine`, tensor x pipeline x data parallel).
Both share the algorithm of a step (:class:`hpcrl.trainer.policy.PolicyTrainer`). The trainer loop
(:func:`hpcrl.trainer.main.train_loop`), the checkpointer
(:class:`hpcrl.trainer.checkpoint.Checkpointer`), colocated mode and the
weight transports use an engine only through :class:`TrainEngine`; none of
them touches a model, an optimizer or a process-group layout.

Lifecycle of an engine, one instance per trainer rank, every call collective
(each rank makes it, in the same order):

1. Built by :func:`build_train_engine` from the initial policy's HuggingFace
   folder; ``trainer.engine`` names the implementation's spec
   (:mod:`hpcrl.trainer.registry`).
2. Maybe restored: :meth:`~TrainEngine.checkpoint_state` gives the sharded
   state by part (``model``, ``optim``, and ``critic``, ``critic_optim``
   where a critic exists), which DCP loads in place;
   :meth:`~TrainEngine.load_checkpoint_state` applies the parts loaded (a
   subset when a run starts from another run's checkpoint: weights only,
   say); a checkpoint whose tensors do not match this engine's layout goes
   through :meth:`~TrainEngine.convert_checkpoint` instead of loading in
   place (the megatron engine reshards its checkpoints onto other TP/PP
   sizes); :meth:`~TrainEngine.load_schedule_state` puts the LR schedules back.
   ``version`` is set to the checkpoint's policy version.
3. Per step: :meth:`~TrainEngine.train_step` (all updates of one policy
   version, ``version`` then grows by one), then
   :meth:`~TrainEngine.full_state_dict` (HuggingFace-named full tensors on
   rank 0, for publishing to the rollouts and for evaluation).
4. Checkpoints: :meth:`~TrainEngine.checkpoint_state` and
   :meth:`~TrainEngine.schedule_state` at any step boundary.

An engine owns its devices, parallel layout, optimizers and LR schedules;
the losses come from :mod:`hpcrl.algo` whatever the engine, so every engine
optimises the same objective.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from hpcrl.algo.config import AlgoConfig
from hpcrl.model.hf_io import torch_dtype
from hpcrl.runtime.dist import DistContext
from hpcrl.trainer.batch import TrainSequence
from hpcrl.trainer.config import TrainerConfig
from hpcrl.plugins import resolve
from hpcrl.trainer.registry import train_engine_spec

__all__ = ["TrainEngine", "build_train_engine"]


@runtime_checkable
class TrainEngine(Protocol):
    """What the trainer loop, the checkpointer and colocated mode need of a training backend."""

    version: int  # policy version at the start of the next train_step

    def train_step(self, seqs: list[TrainSequence], version: int | None = None) -> dict[str, float]:
        """Every optimizer update of one policy version over ``seqs`` (the same list on every rank); metrics."""

    def full_state_dict(self) -> Mapping[str, torch.Tensor]:
        """What is published of the policy, on rank 0 (CPU), empty elsewhere: its full weights under HuggingFace
        names; with ``trainer.lora.publish: adapter`` its LoRA adapters under PEFT's names
        (:mod:`hpcrl.weights.adapter`)."""

    def checkpoint_state(self) -> dict[str, Any]:
        """The sharded state to checkpoint, by part: ``model``, ``optim`` (+ ``critic``, ``critic_optim``).

        Values are state dicts DCP can save and load in place (so a
        checkpoint reloads onto another number of ranks)."""

    def convert_checkpoint(self, path: Path, parts: set[str]) -> dict[str, Any] | None:
        """``parts`` of :meth:`checkpoint_state`, read from a checkpoint of this engine that does not load in
        place (saved with another parallel layout) and converted to this rank's; None where the engine cannot
        (the checkpointer then refuses the checkpoint, naming the difference)."""

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Apply parts of :meth:`checkpoint_state` that were loaded in place (any subset of its keys)."""

    def schedule_state(self) -> dict[str, Any]:
        """The LR schedules' state: ``scheduler`` (+ ``critic_scheduler`` or None); JSON-serialisable."""

    def load_schedule_state(self, saved: Mapping[str, Any], position_only: bool = False) -> None:
        """Restore :meth:`schedule_state`. ``position_only``: keep this run's schedule (base rate,
        warm-up, length) and take only the position from ``saved`` (or none: start at 0)."""


def build_train_engine(name: str, model_path: str | Path, cfg: TrainerConfig, algo: AlgoConfig,
                       ctx: DistContext, pad_id: int, dtype: str = "float32") -> TrainEngine:
    """The engine ``name`` (``trainer.engine``, :mod:`hpcrl.trainer.registry`) over the HuggingFace model at
    ``model_path``; its module is imported here, so a backend's dependencies load only where it runs."""
    engine_cls = resolve(train_engine_spec(name).build, "trainer.engine")
    return engine_cls(model_path, cfg, algo, ctx, pad_id, dtype=torch_dtype(dtype))
