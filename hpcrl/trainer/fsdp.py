"""The FSDP2 train engine: one instance per trainer rank.

Lifecycle: build (load the HF model, shard every decoder layer and the root
with ``fully_shard``, create AdamW and the LR schedule) -> for each step,
:meth:`FSDPEngine.train_step` (recompute proximal logprobs with the current
weights, then ``n_minibatches`` optimizer updates of the decoupled PPO loss)
-> :meth:`full_state_dict` for publishing (collective: every rank calls it).

Every rank runs the same number of forward/backward passes (FSDP's
collectives demand it): ranks with less data run empty micro-batches. The
loss of each micro-batch is divided by the global normaliser (all ranks, all
micro-batches of the minibatch) and multiplied by the world size, because
FSDP averages gradients over ranks; the accumulated gradient then equals that
of the whole minibatch computed at once.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hpcrl.algo.config import AlgoConfig
from hpcrl.algo.losses import decoupled_ppo_loss, loss_normaliser, token_logprobs
from hpcrl.launch.dist import DistContext
from hpcrl.model.hf_io import load_model
from hpcrl.trainer import batch as B
from hpcrl.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """Multiplier of the peak lr at optimizer update ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return 1.0
    total = cfg.total_steps * cfg.n_minibatches
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    if cfg.lr_schedule == "linear":
        return 1.0 - (1.0 - cfg.min_lr_ratio) * progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class FSDPEngine:
    def __init__(self, model_path: str | Path, cfg: TrainerConfig, algo: AlgoConfig, ctx: DistContext,
                 pad_id: int, dtype: torch.dtype = torch.float32) -> None:
        self.cfg, self.algo, self.ctx, self.pad_id = cfg, algo, ctx, pad_id
        model = load_model(model_path, dtype=dtype).to(ctx.device)
        model.config.use_cache = False
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg))

    # -- forward ---------------------------------------------------------
    def _logprobs(self, mb: B.MicroBatch) -> torch.Tensor:
        out = self.model(input_ids=mb.input_ids.to(self.ctx.device),
                         attention_mask=mb.attention_mask.to(self.ctx.device))
        return token_logprobs(out.logits[:, :-1].float(), mb.targets.to(self.ctx.device), self.algo.temperature)

    def _global_count(self, local: int) -> int:
        t = torch.tensor([local], dtype=torch.long, device=self.ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _global_sum(self, local: float) -> float:
        t = torch.tensor([local], dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(t)
        return float(t.item())

    def _micro_batches(self, seqs: list[B.TrainSequence]) -> list[B.MicroBatch]:
        groups = B.pack(B.shard(seqs, self.ctx.rank, self.ctx.world_size), self.cfg.micro_batch_tokens)
        n = self._global_count(len(groups))
        return [B.collate(g, self.pad_id) for g in groups] + [B.collate([], self.pad_id)] * (n - len(groups))

    # -- one training step ---------------------------------------------------
    def train_step(self, seqs: list[B.TrainSequence]) -> dict[str, float]:
        """Prox recompute + ``n_minibatches`` updates over ``seqs`` (the same list on every rank)."""
        self.model.train()
        minibatches = [self._micro_batches(mb) for mb in B.split_minibatches(seqs, self.cfg.n_minibatches)]
        with torch.no_grad():
            prox = [[self._logprobs(mb).detach() for mb in mbs] for mbs in minibatches]
        stats: dict[str, float] = {}
        for mbs, prox_mbs in zip(minibatches, prox):
            for k, v in self._update(mbs, prox_mbs).items():
                stats[k] = stats.get(k, 0.0) + v / len(minibatches)
        return stats

    def _update(self, mbs: list[B.MicroBatch], prox: list[torch.Tensor]) -> dict[str, float]:
        agg = self.algo.loss_agg
        norm = self._global_sum(sum(loss_normaliser(mb.mask, agg) for mb in mbs))
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, acc, tokens = 0.0, {}, 0
        for mb, logp_prox in zip(mbs, prox):
            logp = self._logprobs(mb)
            out = decoupled_ppo_loss(logp, logp_prox, mb.behav_logprobs.to(logp.device), mb.advantages.to(logp.device),
                                     mb.mask.to(logp.device), self.algo, normaliser=max(norm, 1.0))
            (out.loss * self.ctx.world_size).backward()
            total_loss += float(out.loss.item())
            n = mb.n_tokens
            tokens += n
            for k, v in out.stats.items():
                if k == "n_tokens" or n == 0 or not math.isfinite(v):
                    continue
                acc[k] = max(acc.get(k, v), v) if k.endswith("_max") else acc.get(k, 0.0) + v * n
        grad_norm = self._clip()
        if norm > 0:
            self.optimizer.step()
        self.scheduler.step()
        stats = {f"loss/{k}": v if k.endswith("_max") else v / tokens for k, v in acc.items()} if tokens else {}
        stats.update({"loss/value": self._global_sum(total_loss), "grad/norm": grad_norm,
                      "lr": self.optimizer.param_groups[0]["lr"]})
        return stats

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm.item())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded CPU weights on rank 0 (empty elsewhere); every rank must call it."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=opts)
