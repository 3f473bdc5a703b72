"""Configuration of the supervised warm start (kept free of heavy imports: loading a config must not pull in torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SFTConfig:
    enabled: bool = True  # run the warm start before RL (false: RL starts from the base model)
    lr: float = 2e-3  # AdamW learning rate after warm-up
    batch_size: int = 128  # rows per optimizer step
    max_steps: int = 2000  # give up (keeping the best model) after this many steps
    warmup_steps: int = 20  # linear learning-rate warm-up
    eval_every: int = 25  # greedy accuracy is checked every this many steps
    eval_size: int = 500  # ...on the first eval_size eval rows
    target_accuracy: float = 0.2  # stop as soon as reached (RL then has room to improve)
    # top of the band the warm start should end in: a check above it goes back to the check before and replays the
    # same batches checking twice as often, until one lands in [target_accuracy, max_accuracy] (or checks are every
    # step); 1.0 = no band (stop at the first check at or above the target, however far above)
    max_accuracy: float = 1.0
    seed: int = 0  # batch order seed
    threads: int = 2  # torch intra-op threads while training
    cache_dir: str = "~/.cache/hpcrl/sft"  # finished warm starts are cached here by content hash
    # "pkg.module:function" of `def f(data: dict) -> {"messages": [...], "tools": [...]}`: train each row's demonstrated
    # conversation (assistant turns, chat template) instead of prompt -> answer (hpcrl/sft/demonstrations.py)
    demonstrations: str = ""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        for name in ("batch_size", "max_steps", "eval_every", "eval_size", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.target_accuracy:
            raise ValueError(f"target_accuracy: must be >= 0, got {self.target_accuracy}")
        if not self.max_accuracy <= 1.0 or (self.max_accuracy < 1.0 and self.max_accuracy < self.target_accuracy):
            raise ValueError(f"max_accuracy: must be in [target_accuracy, 1] = [{self.target_accuracy}, 1], "
                             f"got {self.max_accuracy}")
        if not self.cache_dir:
            raise ValueError("cache_dir: must be a non-empty path")
        if self.demonstrations and ":" not in self.demonstrations:
            raise ValueError(f"demonstrations: expected 'package.module:function', got {self.demonstrations!r}")
