"""Configuration of the trainer component."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hpcrl.trainer.registry import train_engine_spec


@dataclass
class LoraSettings:
    """``trainer.lora``. There is no adapter dropout: the no-grad proximal pass and an update's own forward
    must compute the same function, or the PPO ratio of on-policy tokens is noise instead of 1."""

    rank: int = 0  # adapter rank r; 0 = full fine-tuning
    alpha: float = 16.0  # scaling = alpha / rank
    # module names (suffixes) that get an adapter: attention and MLP projections of Qwen/Llama layers
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"])
    # what a published version holds: merged = the whole policy (model.safetensors, any rollout engine); adapter =
    # the adapters alone in PEFT's format (hpcrl/weights/adapter.py), loaded by vLLM as a LoRA adapter
    publish: Literal["merged", "adapter"] = "merged"

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank: must be >= 0 (0 = no LoRA), got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"alpha: must be > 0, got {self.alpha}")
        if self.rank and not self.target_modules:
            raise ValueError("target_modules: LoRA needs at least one module name")
        if self.publish == "adapter" and not self.rank:
            raise ValueError("publish: adapter publishes LoRA adapters; set trainer.lora.rank > 0")


@dataclass
class MegatronSettings:
    """``trainer.megatron``: the parallel layout of ``trainer.engine: megatron``; ``trainer.world_size`` =
    tensor_parallel x pipeline_parallel x data parallel."""

    tensor_parallel: int = 1  # ranks a layer's weights are split across (must divide the key/value heads)
    pipeline_parallel: int = 1  # stages the layers are split into (trained in the 1F1B schedule)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


@dataclass
class TrainerConfig:
    # training backend (hpcrl/trainer/registry.py): fsdp = FSDP2 over all ranks; megatron = megatron-core GPTModel,
    # tensor x pipeline x data parallel (trainer.megatron; docs/trainer.md#megatron-core); or "module:attr" of a
    # TrainEngineSpec of your own
    engine: str = "fsdp"
    world_size: int = 1  # trainer ranks (processes); FSDP2 shards parameters across them
    total_steps: int = 100  # training steps; the policy version after the run equals this
    lr: float = 1e-4  # peak learning rate (AdamW)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # decay after warm-up
    warmup_steps: int = 5  # linear warm-up from 0 to lr
    min_lr_ratio: float = 0.1  # final lr / peak lr for linear and cosine decay
    betas: tuple[float, float] = (0.9, 0.99)  # AdamW betas
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global gradient norm (0 = off)
    n_minibatches: int = 1  # optimizer updates per training step (the batch is split into this many)
    micro_batch_tokens: int = 4096  # token budget of one forward/backward micro-batch (padding included)
    threads: int = 1  # torch threads per trainer rank
    # recompute each decoder layer's activations during backward instead of keeping them (policy and
    # critic): activation memory of a layer's inputs only, for about one more forward pass of compute
    activation_checkpointing: bool = False
    lora: LoraSettings = field(default_factory=LoraSettings)  # LoRA adapters (PEFT) instead of full fine-tuning
    megatron: MegatronSettings = field(default_factory=MegatronSettings)  # engine=megatron: its parallel layout
    backend: Literal["auto", "gloo", "nccl", "hccl"] = "auto"  # process-group backend; auto picks by device
    batch_timeout_s: float = 600.0  # fail if no batch arrives for this long
    # parse the ready spool files in a background thread during each step (hpcrl.spool.readahead); claims and
    # checks still happen when the next step takes its batch
    read_ahead: bool = True
    # retention, applied after every checkpoint: the data of the newest this many set-aside (stale, lost,
    # uniform) spool files is kept for inspection, older ones keep only their reason record
    keep_dropped_files: int = 512

    def __post_init__(self) -> None:
        for name in ("world_size", "total_steps", "n_minibatches", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if self.micro_batch_tokens < 16:
            raise ValueError(f"micro_batch_tokens: must be >= 16, got {self.micro_batch_tokens}")
        if self.keep_dropped_files < 0:
            raise ValueError(f"keep_dropped_files: must be >= 0, got {self.keep_dropped_files}")
        train_engine_spec(self.engine, key="engine").checked(self)  # the engine's own checks (layout, LoRA)
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip: must be >= 0, got {self.grad_clip}")
