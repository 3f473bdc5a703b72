"""The train-engine registry: the one place that maps ``trainer.engine`` to an implementation.

A :class:`TrainEngineSpec` says how to build the engine, what the config may
ask of it (its own checks), how its checkpoints are laid out and read back as
HuggingFace weights, and which of its settings a resumed run may change.
:data:`TRAIN_ENGINES` holds the built-in ones (``fsdp``, ``megatron``),
:func:`register_train_engine` adds another within one process (a run's
processes each load the config, so an engine of your own is named there by
import path, below); the config's choices and errors,
``--from`` across engines (:mod:`hpcrl.init_from`), the export to HuggingFace
(:mod:`hpcrl.trainer.export`) and ``--resume`` (:mod:`hpcrl.launch.resume`)
all ask the spec, so a new engine is one module and one registration. An
engine outside hpcrl is named by import path: ``trainer.engine:
my_pkg.engines:SPEC``.

This module is light (no torch): the config layer imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from hpcrl.plugins import Registry

if TYPE_CHECKING:
    from hpcrl.trainer.config import TrainerConfig

__all__ = ["HF_LAYOUT", "TRAIN_ENGINES", "TrainEngineSpec", "register_train_engine", "train_engine_spec"]

HF_LAYOUT = "fsdp"  # checkpoints that hold the policy under HuggingFace names (``model.<name>``), as FSDP2 writes


@dataclass(frozen=True)
class TrainEngineSpec:
    name: str
    # the engine class, or its "module:Class": (model_path, cfg: TrainerConfig, algo, ctx, pad_id, dtype=) ->
    # TrainEngine (imported when a trainer builds it)
    build: str | Callable[..., Any]
    lora: bool = True  # trains LoRA adapters (trainer.lora.rank > 0)
    check: Callable[[TrainerConfig], None] | None = None  # its own checks of the trainer config (ValueError)
    # the layout its checkpoints are written in, for a config ("megatron TP=2 PP=1"); None: its name
    layout: Callable[[TrainerConfig], str] | None = None
    # (the flattened keys of a checkpoint) -> its layout when this engine wrote it, else None; or "module:fn".
    # None: its checkpoints hold the policy under HuggingFace names (``model.<name>``), as FSDP2's do (HF_LAYOUT)
    recognise: str | Callable[[Iterable[str]], str | None] | None = None
    # (checkpoint dir, HF config) -> the policy's HuggingFace-named weights, for a checkpoint it recognised
    weights: str | Callable[..., Any] | None = None
    resumable: tuple[str, ...] = ()  # config keys of its own that a resumed run may change (its checkpoints adapt)

    def checked(self, cfg: TrainerConfig) -> None:
        """Its checks of the trainer config (LoRA, then ``check``); ValueError names the key relative to
        ``trainer`` (the config loader adds the section)."""
        if cfg.lora.rank and not self.lora:
            raise ValueError(f"lora.rank: LoRA is not built for trainer.engine={self.name} (docs/trainer.md says "
                             f"why); use trainer.engine={', '.join(s.name for s in TRAIN_ENGINES.values() if s.lora)}")
        if self.check is not None:
            self.check(cfg)

    def layout_of(self, cfg: TrainerConfig) -> str:
        """How the checkpoints of a trainer with ``cfg`` are laid out: its own layout, or, for an engine whose
        checkpoints hold HuggingFace names (no ``recognise``), FSDP2's (:data:`HF_LAYOUT`)."""
        if self.layout is not None:
            return self.layout(cfg)
        return HF_LAYOUT if self.recognise is None else self.name


TRAIN_ENGINES = Registry("trainer.engine", TrainEngineSpec)
register_train_engine = TRAIN_ENGINES.register  # make a spec a choice of trainer.engine (within this process)
train_engine_spec = TRAIN_ENGINES.lookup  # the spec a value of trainer.engine names (a name, or module:attr)


def _megatron_check(cfg: TrainerConfig) -> None:
    parallel = cfg.megatron.tensor_parallel * cfg.megatron.pipeline_parallel
    if cfg.world_size % parallel:
        raise ValueError(f"world_size: {cfg.world_size} is not a multiple of megatron.tensor_parallel x "
                         f"megatron.pipeline_parallel = {parallel}")


def _megatron_layout(cfg: TrainerConfig) -> str:
    return f"megatron TP={cfg.megatron.tensor_parallel} PP={cfg.megatron.pipeline_parallel}"


register_train_engine(TrainEngineSpec("fsdp", build="hpcrl.trainer.fsdp:FSDPEngine"))
register_train_engine(TrainEngineSpec(
    "megatron", build="hpcrl.trainer.mcore.engine:MegatronEngine", lora=False, check=_megatron_check,
    layout=_megatron_layout, recognise="hpcrl.trainer.mcore.reshard:layout_name",
    weights="hpcrl.trainer.mcore.reshard:hf_weights", resumable=("trainer.megatron.*",)))
