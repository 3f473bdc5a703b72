"""The FSDP2 train engine: one instance per trainer rank.

Lifecycle: build (load the HF model, shard every decoder layer and the root
with ``fully_shard``, create AdamW and the LR schedule; a frozen reference
model when a KL term is on; a critic with its own AdamW for
``adv_estimator: gae``) -> for each step, :meth:`FSDPEngine.train_step`:
(1) no-grad passes over the whole step batch: proximal logprobs (skipped with
``prox_approx``, for plain PPO, and for the first update, whose own forward
pass runs the step-start weights), reference logprobs, critic values; (2) token-level
advantages (KL reward penalty, GAE/returns, whitening with moments summed over
all ranks) for token-level estimators; (3) ``n_minibatches`` optimizer updates
of the decoupled PPO loss (+ KL loss term, entropy bonus) and the clipped
value loss; the first update also measures the train-inference mismatch
(``mismatch/*``: trainer vs engine logprobs of the tokens the step-start
weights generated) -> :meth:`full_state_dict` for publishing (collective: every rank
calls it). Trainer state to checkpoint: ``model``, ``optimizer``,
``scheduler``, ``critic``, ``critic_optimizer``, ``critic_scheduler``,
``version`` (``ref_model`` is the frozen initial policy).

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
import time
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hpcrl.algo import (
    aggregate,
    approx_prox_logprobs,
    batch_moments,
    gae,
    kl_estimate,
    masked_moments,
    resolve_levels,
    token_entropy,
    token_rewards,
    value_loss_per_token,
    whiten,
)
from hpcrl.algo.config import AlgoConfig
from hpcrl.algo.losses import decoupled_ppo_loss, loss_normaliser, token_logprobs
from hpcrl.runtime.dist import DistContext
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
    """FSDP2 implementation of :class:`hpcrl.trainer.engine.TrainEngine` (``trainer.engine: fsdp``).

    Parameters, gradients and optimizer state are float32 whatever ``dtype``;
    a ``dtype`` of bfloat16 (``model.dtype``) runs forward and
    backward in it (FSDP2's MixedPrecisionPolicy: parameters cast at
    all-gather, gradients reduced in float32); logprobs and losses are float32.
    float16 is refused: it would need a gradient scaler.
    ``trainer.activation_checkpointing`` recomputes each decoder layer in the
    backward pass (HF gradient checkpointing, non-reentrant) of the policy
    and the critic. ``trainer.lora.rank > 0`` trains PEFT LoRA adapters of
    the policy only (:mod:`hpcrl.trainer.lora`); published weights are merged.
    """

    def __init__(self, model_path: str | Path, cfg: TrainerConfig, algo: AlgoConfig, ctx: DistContext,
                 pad_id: int, dtype: torch.dtype = torch.float32) -> None:
        self.cfg, self.algo, self.ctx, self.pad_id = cfg, algo, ctx, pad_id
        if dtype == torch.float16:
            raise ValueError("FSDPEngine: float16 needs loss scaling, which this engine does not do; "
                             "use bfloat16 or float32")
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        policy = None if dtype == torch.float32 else MixedPrecisionPolicy(param_dtype=dtype,
                                                                          reduce_dtype=torch.float32)

        def shard(model: torch.nn.Module, trained: bool = True) -> torch.nn.Module:
            if trained and cfg.activation_checkpointing:  # inside each layer's FSDP2 hooks: the recompute
                # all-gathers that layer again; parameter names (checkpoints, published weights) unchanged
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return _shard(model.to(ctx.device), mesh, policy)

        policy_model, self.lora_scalings = load_model(model_path, dtype=torch.float32), None
        if cfg.lora.rank:  # adapters injected in place before sharding; the base weights frozen
            from hpcrl.trainer.lora import apply_lora

            self.lora_scalings = apply_lora(policy_model, cfg.lora)
        self.model = shard(policy_model)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
                                           betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg))
        self.version = 0  # policy version at the start of the next step (used by prox_approx)
        self.ref_model = None
        if algo.needs_reference:  # the frozen initial policy
            self.ref_model = shard(load_model(model_path, dtype=torch.float32), trained=False).eval()
            self.ref_model.requires_grad_(False)
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        if algo.adv_estimator == "gae":
            from transformers import AutoModelForTokenClassification

            critic = AutoModelForTokenClassification.from_pretrained(
                str(model_path), num_labels=1, dtype=torch.float32, local_files_only=True)
            self.critic = shard(critic)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=algo.critic_lr,
                                                      betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
            self.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(self.critic_optimizer,
                                                                      lambda s: lr_factor(s, cfg))

    # -- forward ---------------------------------------------------------
    def _logprobs(self, mb: B.MicroBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        return self._forward(mb, model, entropy=None)[0]

    def _forward(self, mb: B.MicroBatch, model: torch.nn.Module | None = None,
                 entropy: str | None = "detached") -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token logprobs and, unless ``entropy`` is None, entropies ('detached' or 'grad')."""
        out = (model or self.model)(input_ids=mb.input_ids.to(self.ctx.device),
                                    attention_mask=mb.attention_mask.to(self.ctx.device))
        logits = out.logits[:, :-1].float()
        logp = token_logprobs(logits, mb.targets.to(self.ctx.device), self.algo.temperature)
        if entropy is None:
            return logp, None
        return logp, token_entropy(logits if entropy == "grad" else logits.detach(), self.algo.temperature)

    def _values(self, mb: B.MicroBatch) -> torch.Tensor:
        out = self.critic(input_ids=mb.input_ids.to(self.ctx.device),
                          attention_mask=mb.attention_mask.to(self.ctx.device))
        return out.logits[:, :-1, 0].float()

    def _global_count(self, local: int) -> int:
        t = torch.tensor([local], dtype=torch.long, device=self.ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _global_sum(self, local: float | torch.Tensor) -> float | torch.Tensor:
        t = torch.as_tensor(local, dtype=torch.float64).reshape(-1).to(self.ctx.device).clone()
        dist.all_reduce(t)
        return float(t.item()) if t.numel() == 1 and not torch.is_tensor(local) else t.cpu()

    def _micro_batches(self, seqs: list[B.TrainSequence]) -> list[B.MicroBatch]:
        groups = B.pack(B.shard(seqs, self.ctx.rank, self.ctx.world_size), self.cfg.micro_batch_tokens)
        n = self._global_count(len(groups))
        return [B.collate(g, self.pad_id) for g in groups] + [B.collate([], self.pad_id)] * (n - len(groups))

    # -- one training step ---------------------------------------------------
    def train_step(self, seqs: list[B.TrainSequence], version: int | None = None) -> dict[str, float]:
        """Prepare passes + ``n_minibatches`` updates over ``seqs`` (the same list on every rank).

        ``version`` is the policy version at the start of the step (default:
        the count of steps this engine has made).
        """
        self.model.train()
        if version is not None:
            self.version = version
        t0 = time.perf_counter()
        minibatches = [self._micro_batches(mb) for mb in B.split_minibatches(seqs, self.cfg.n_minibatches)]
        with torch.no_grad():
            aux = [[self._prepare(mb, prox=not self._prox_in_forward(k)) for mb in mbs]
                   for k, mbs in enumerate(minibatches)]
        stats = self._token_advantages(minibatches, aux) if self.algo.token_level_advantages else {}
        stats.update(self._advantage_stats([mb for mbs in minibatches for mb in mbs]))
        stats["time/prepare_s"] = time.perf_counter() - t0
        self._mismatch = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)  # |d| sum, tokens, |d| max
        for k, (mbs, aux_k) in enumerate(zip(minibatches, aux)):
            for key, v in self._update(mbs, aux_k, k, len(minibatches)).items():
                stats[key] = stats.get(key, 0.0) + v / len(minibatches)
        stats.update(self._mismatch_stats())
        self.version += 1
        return stats

    def _record_mismatch(self, logp: torch.Tensor, behav: torch.Tensor, versions: torch.Tensor,
                         mask: torch.Tensor) -> None:
        """Train-inference mismatch: |trainer logprob - engine logprob| on tokens the same weights generated.

        The first update's forward runs the step-start weights, version v;
        a token generated at version v was sampled by those very weights, so
        any difference is the engine's numerics against the trainer's.
        """
        sel = ((mask > 0) & (versions == self.version)).double()
        d = (logp.detach().double() - behav.double()).abs() * sel  # stays on the device: no sync per micro-batch
        m = self._mismatch
        m[0] += d.sum()
        m[1] += sel.sum()
        m[2] = torch.maximum(m[2], d.max()) if d.numel() else m[2]

    def _mismatch_stats(self) -> dict[str, float]:
        sums, hi = self._mismatch[:2].clone(), self._mismatch[2:].clone()
        dist.all_reduce(sums)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        total, n = sums.tolist()
        if n == 0:
            return {"mismatch/tokens": 0.0}
        return {"mismatch/tokens": n, "mismatch/abs_mean": total / n, "mismatch/abs_max": float(hi.item())}

    def _prox_in_forward(self, k: int) -> bool:
        """Whether update ``k`` takes the proximal logprobs from its own forward pass.

        The proximal policy is the one at the start of the step. The first
        update's forward runs those very weights on the same tokens, so its
        detached logprobs are the proximal ones and a separate no-grad pass
        (a third of the step's compute at one update per step) is skipped.
        Later updates run moved weights and need the pass; so does a KL
        penalty folded into the reward, which reads the proximal logprobs
        before any update.
        """
        return (k == 0 and self.algo.decoupled and not self.algo.prox_approx
                and not (self.algo.kl_mode == "reward" and self.algo.kl_coef > 0))

    def _prepare(self, mb: B.MicroBatch, prox: bool = True) -> dict[str, torch.Tensor]:
        """No-grad passes of one micro-batch: proximal (if ``prox``) and reference logprobs, critic values."""
        aux = {}
        if prox and self.algo.decoupled and not self.algo.prox_approx:
            aux["prox"] = self._logprobs(mb)
        if self.ref_model is not None:
            aux["ref"] = self._logprobs(mb, self.ref_model)
        if self.critic is not None:
            aux["values"] = self._values(mb)
        return aux

    def _token_advantages(self, minibatches: list[list[B.MicroBatch]],
                          aux: list[list[dict[str, torch.Tensor]]]) -> dict[str, float]:
        """Per-token advantages in place of ``mb.advantages``; whitening moments summed over all ranks."""
        algo, dev = self.algo, self.ctx.device
        lam = algo.lam if algo.adv_estimator == "gae" else 1.0
        kl_coef = algo.kl_coef if algo.kl_mode == "reward" else 0.0
        kl_sum = torch.zeros(3, dtype=torch.float64)
        for mb, a in ((mb, a) for mbs, auxs in zip(minibatches, aux) for mb, a in zip(mbs, auxs)):
            mask = mb.mask.to(dev)
            kl = None
            if kl_coef:
                base = a.get("prox", mb.behav_logprobs.to(dev))
                kl = kl_estimate(base, a["ref"], algo.kl_estimator, mask)
                kl_sum += masked_moments(kl, mask).cpu()
            rewards = token_rewards(mb.seq_scores.to(dev), mask, kl, kl_coef)
            mb.advantages, a["returns"] = gae(rewards, a.get("values"), mask, algo.gamma, lam)
        every = [mb for mbs in minibatches for mb in mbs]
        moments, center = batch_moments(((mb.advantages, mb.mask.to(dev)) for mb in every), self._global_sum)
        mean_lv, std_lv = resolve_levels(algo.adv_estimator, algo.adv_mean_level, algo.adv_std_level, "token")
        for mb in every:
            mb.advantages = whiten(mb.advantages, mb.mask.to(dev), moments, shift_mean=mean_lv == "batch",
                                   scale=std_lv == "batch", unbiased=algo.adv_std_unbiased, eps=algo.adv_eps,
                                   center=center)
        stats = {"adv/return_mean": center}
        if kl_coef:
            kl_sum = self._global_sum(kl_sum)
            stats["kl/reward_penalty_mean"] = float(kl_sum[0] / max(float(kl_sum[2]), 1.0))
        return stats

    def _advantage_stats(self, mbs: list[B.MicroBatch]) -> dict[str, float]:
        """Mean/std over all ranks' trained tokens; max/min of this rank's tokens."""
        hi, lo = -math.inf, math.inf
        for mb in mbs:
            valid = mb.mask > 0
            if bool(valid.any()):
                adv = mb.advantages.detach().cpu()[valid]
                hi, lo = max(hi, float(adv.max())), min(lo, float(adv.min()))
        moments, center = batch_moments(((mb.advantages.detach().cpu(), mb.mask) for mb in mbs), self._global_sum)
        s, ss, n = moments.tolist()
        if n == 0:
            return {}
        out = {"adv/mean": center + s / n, "adv/std": math.sqrt(max(ss / n - (s / n) ** 2, 0.0))}
        if math.isfinite(hi):
            out.update({"adv/max": hi, "adv/min": lo})
        return out

    def _update(self, mbs: list[B.MicroBatch], aux: list[dict[str, torch.Tensor]], k: int,
                n_updates: int) -> dict[str, float]:
        agg = self.algo.loss_agg
        norm = self._global_sum(sum(loss_normaliser(mb.mask, agg) for mb in mbs))
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        sums, acc, tokens = {"loss/value": 0.0, "loss/pg_loss": 0.0, "value/loss": 0.0}, {}, 0
        for mb, a in zip(mbs, aux):
            out = self._policy_loss(mb, a, k, n_updates, max(norm, 1.0))
            (out.loss * self.ctx.world_size).backward()
            sums["loss/value"] += float(out.loss.item())
            sums["loss/pg_loss"] += out.stats.pop("pg_loss")
            if self.critic is not None:
                value_loss, value_stats = self._critic_backward(mb, a, max(norm, 1.0))
                sums["value/loss"] += value_loss
                out.stats.update(value_stats)
            n = mb.n_tokens
            tokens += n
            for key, v in out.stats.items():
                if key == "n_tokens" or n == 0 or not math.isfinite(v):
                    continue
                acc[key] = max(acc.get(key, v), v) if key.endswith("_max") else acc.get(key, 0.0) + v * n
        grad_norm = self._step(norm)
        stats = {(k if "/" in k else f"loss/{k}"): v if k.endswith("_max") else v / tokens
                 for k, v in acc.items()} if tokens else {}
        if self.critic is None:
            sums.pop("value/loss")
        stats.update({k: self._global_sum(v) for k, v in sums.items()})
        stats.update({"grad/norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"]})
        return stats

    def _policy_loss(self, mb: B.MicroBatch, aux: dict[str, torch.Tensor], k: int, n_updates: int,
                     norm: float):
        dev = self.ctx.device
        logp, entropy = self._forward(mb, entropy="grad" if self.algo.entropy_coef > 0 else "detached")
        mask, behav = mb.mask.to(dev), mb.behav_logprobs.to(dev)
        if k == 0:
            self._record_mismatch(logp, behav, mb.versions.to(dev), mask)
        prox = aux.get("prox")
        if not self.algo.decoupled:  # plain PPO: the behaviour policy is the anchor, every weight is 1
            prox = behav
        elif prox is None and self._prox_in_forward(k):  # these are the step-start weights
            prox = logp.detach()
        elif prox is None:  # the k-th update's weights are version v + k / n
            prox = approx_prox_logprobs(behav, logp, mb.versions.to(dev), float(self.version),
                                        self.version + k / n_updates, mask)
        return decoupled_ppo_loss(logp, prox, behav, mb.advantages.to(dev), mask, self.algo, normaliser=norm,
                                  logp_ref=aux.get("ref"), entropy=entropy)

    def _critic_backward(self, mb: B.MicroBatch, aux: dict[str, torch.Tensor], norm: float
                         ) -> tuple[float, dict[str, float]]:
        """Clipped value loss of one micro-batch, backward into the critic; (its loss share, token means)."""
        mask = mb.mask.to(self.ctx.device)
        values = self._values(mb)
        per_token, clipped = value_loss_per_token(values, aux["values"], aux["returns"], mask, self.algo.value_clip)
        loss = self.algo.value_loss_coef * aggregate(per_token, mask > 0, self.algo.loss_agg, norm)
        (loss * self.ctx.world_size).backward()
        n = max(float(mask.sum()), 1.0)
        with torch.no_grad():
            means = {"value/clip_fraction": float(clipped.sum()) / n,
                     "value/mean": float((values * mask).sum()) / n,
                     "value/return_mean": float((aux["returns"] * mask).sum()) / n}
        return float(loss.item()), means

    def _step(self, norm: float) -> float:
        """Clip and step the policy (and critic) optimizers; the policy's gradient norm."""
        grad_norm = self._clip(self.model)
        if norm > 0:
            self.optimizer.step()
        self.scheduler.step()
        if self.critic is not None:
            self._clip(self.critic)
            if norm > 0:
                self.critic_optimizer.step()
            self.critic_scheduler.step()
        return grad_norm

    def _clip(self, model: torch.nn.Module) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm.item())

    # -- weights and checkpoints -----------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded CPU weights on rank 0 (empty elsewhere), HF names (LoRA adapters merged); every rank
        must call it."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=opts)
        if self.lora_scalings is not None and state:
            from hpcrl.trainer.lora import merge_lora

            state = merge_lora(state, self.lora_scalings)
        return state

    def checkpoint_state(self) -> dict[str, Any]:
        """Sharded policy and optimizer state, plus the critic and its optimizer (PPO), for DCP."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.critic is not None:
            state["critic"], state["critic_optim"] = get_state_dict(self.critic, self.critic_optimizer)
        return state

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        _set(self.model, self.optimizer, state.get("model"), state.get("optim"))
        if self.critic is not None and "critic" in state:
            _set(self.critic, self.critic_optimizer, state["critic"], state.get("critic_optim"))

    def schedule_state(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(),
                "critic_scheduler": self.critic_scheduler.state_dict() if self.critic_scheduler else None}

    def load_schedule_state(self, saved: Mapping[str, Any], position_only: bool = False) -> None:
        pairs = [(self.scheduler, self.optimizer, "scheduler")]
        if self.critic_scheduler is not None:
            pairs.append((self.critic_scheduler, self.critic_optimizer, "critic_scheduler"))
        for scheduler, optimizer, key in pairs:
            if position_only:
                _continue_schedule(scheduler, optimizer, saved.get(key))
            elif key in saved:
                scheduler.load_state_dict(saved[key])
            else:  # resuming this run without its schedule would restart the warm-up silently
                raise ValueError(f"checkpoint has no {key} state (saved: {sorted(saved)}); "
                                 f"it was not written by this run's trainer")


def _set(model, optimizer, model_sd, optim_sd) -> None:
    if model_sd is None:
        return
    if optim_sd is not None:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        set_model_state_dict(model, model_sd)


def _continue_schedule(scheduler, optimizer, saved: Mapping[str, Any] | None) -> None:
    """This run's base learning rates and schedule, at the saved position (else at 0); rates an optimizer
    state loaded from another run carried are replaced."""
    if saved:
        scheduler.last_epoch = int(saved["last_epoch"])
    lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr, base in zip(optimizer.param_groups, lrs, scheduler.base_lrs):
        group["lr"], group["initial_lr"] = lr, base
    scheduler._last_lr = lrs


def _shard(model: torch.nn.Module, mesh, policy: MixedPrecisionPolicy | None = None) -> torch.nn.Module:
    """FSDP2: every decoder layer, then the root."""
    model.config.use_cache = False
    kw = {"mp_policy": policy} if policy is not None else {}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model
