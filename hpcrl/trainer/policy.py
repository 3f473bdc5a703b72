"""The policy-training step every train engine shares: micro-batches, no-grad passes, advantages, updates.

:class:`PolicyTrainer` holds the algorithm of one :meth:`train_step` (design.md
§3.4) in terms of a few things an engine provides, so that the FSDP2 and the
megatron-core engines optimise exactly the same objective with the same
statistics:

- ``model``, ``optimizer``, ``scheduler`` (and ``ref_model``, ``critic``,
  ``critic_optimizer``, ``critic_scheduler`` where the algorithm needs them);
- ``dp_rank``, ``dp_size``, ``dp_group``: this rank's place among the ranks
  that hold *different data* (FSDP2: every rank; megatron-core: the
  data-parallel group, the tensor-parallel ranks of one replica seeing the
  same micro-batches), over which the loss normaliser, the advantage moments
  and the statistics are summed;
- the abstract hooks ``_forward(mb, model, entropy)``: token logprobs (and
  entropies) of a micro-batch; ``_values(mb)``: the critic's values;
- ``_passes(model, mbs, loss_of, entropy)`` and ``_no_grad_passes(model,
  mbs)`` (optional): the order of an update's forward and backward passes
  and of the passes without gradients; one micro-batch after another
  unless the engine overrides them (the megatron engine's pipeline
  schedules), with ``_from_loss_ranks`` to share what only the ranks that
  computed the losses know;
- ``_grad_scale()``: what each micro-batch loss is multiplied by before its
  backward, so that the engine's gradient reduction yields the gradient of
  the whole minibatch (FSDP2 averages over every rank: its world size);
- ``_clip(model)``: clip the gradients, return their global norm, after
  whatever gradient reduction the engine does.

Lifecycle of one step: micro-batches of this rank's share of each minibatch
(every data-parallel rank runs the same number, empty ones where it has less)
-> no-grad passes (proximal and reference logprobs, critic values) -> token
advantages for token-level estimators -> ``n_minibatches`` updates (the first
measures the train-inference mismatch) -> ``version`` + 1.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from hpcrl.algo import (
    aggregate,
    approx_prox_logprobs,
    batch_moments,
    gae,
    kl_estimate,
    masked_moments,
    resolve_levels,
    token_rewards,
    value_loss_per_token,
    whiten,
)
from hpcrl.algo.losses import decoupled_ppo_loss, loss_normaliser
from hpcrl.algo.m2po import m2_values, m2po_cutoff
from hpcrl.trainer import batch as B
from hpcrl.trainer.config import TrainerConfig

VALUE_HEAD_SEED = 0


def initial_value_head(hidden_size: int, initializer_range: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's value head at the start of a run, ``(weight [1, hidden], bias [1])``: the HF initialisation
    of a token-classification head (normal weights, zero bias) from a generator of its own, so every engine,
    every layout and every rank starts from the same head whatever else drew random numbers before."""
    gen = torch.Generator().manual_seed(VALUE_HEAD_SEED)
    return torch.randn(1, hidden_size, generator=gen) * initializer_range, torch.zeros(1)


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


class PolicyTrainer(ABC):
    """The shared :meth:`train_step`; see the module docstring for what a subclass provides. The hooks the step
    calls are declared here: an engine that misses one cannot be built."""

    dp_group = None  # None: the default process group

    @abstractmethod
    def _forward(self, mb: B.MicroBatch, model: torch.nn.Module | None = None,
                 entropy: str | None = "detached") -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token logprobs of ``mb`` under ``model`` (the policy when None) and, unless ``entropy`` is None,
        entropies ('detached' or 'grad')."""

    @abstractmethod
    def _values(self, mb: B.MicroBatch) -> torch.Tensor:
        """The critic's value of every token position of ``mb``."""

    @abstractmethod
    def _grad_scale(self) -> int:
        """What each micro-batch loss is multiplied by before its backward, so that the engine's gradient
        reduction yields the gradient of the whole minibatch."""

    @abstractmethod
    def _clip(self, model: torch.nn.Module) -> float:
        """Clip ``model``'s gradients (after the engine's reduction); their global norm."""

    def _logprobs(self, mb: B.MicroBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        return self._forward(mb, model, entropy=None)[0]

    def _global_count(self, local: int) -> int:
        t = torch.tensor([local], dtype=torch.long, device=self.ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
        return int(t.item())

    def _global_sum(self, local: float | torch.Tensor) -> float | torch.Tensor:
        t = torch.as_tensor(local, dtype=torch.float64).reshape(-1).to(self.ctx.device).clone()
        dist.all_reduce(t, group=self.dp_group)
        return float(t.item()) if t.numel() == 1 and not torch.is_tensor(local) else t.cpu()

    def _micro_batches(self, seqs: list[B.TrainSequence]) -> list[B.MicroBatch]:
        groups = B.pack(B.shard(seqs, self.dp_rank, self.dp_size), self.cfg.micro_batch_tokens)
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
            aux = self._prepare(minibatches)
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
        dist.all_reduce(sums, group=self.dp_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.dp_group)
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
        before any update, and M2PO, whose mask needs every token's before any.
        """
        return (k == 0 and self.algo.decoupled and not self.algo.prox_approx and self.algo.m2_threshold is None
                and not (self.algo.kl_mode == "reward" and self.algo.kl_coef > 0))

    def _prepare(self, minibatches: list[list[B.MicroBatch]]) -> list[list[dict[str, torch.Tensor]]]:
        """The no-grad passes of a step, by minibatch and micro-batch: proximal logprobs (``prox``, where the
        update does not take them from its own forward pass), reference logprobs (``ref``), critic values
        (``values``)."""
        aux: list[list[dict[str, torch.Tensor]]] = [[{} for _ in mbs] for mbs in minibatches]
        every = range(len(minibatches))
        passes = []
        if self.algo.decoupled and not self.algo.prox_approx:
            passes.append(("prox", self.model, [k for k in every if not self._prox_in_forward(k)]))
        if self.ref_model is not None:
            passes.append(("ref", self.ref_model, every))
        if self.critic is not None:
            passes.append(("values", self.critic, every))
        for key, model, ks in passes:
            where = [(k, j) for k in ks for j in range(len(minibatches[k]))]
            for (k, j), t in zip(where, self._no_grad_passes(model, [minibatches[k][j] for k, j in where])):
                aux[k][j][key] = t
        return aux

    def _no_grad_passes(self, model: torch.nn.Module, mbs: list[B.MicroBatch]) -> list[torch.Tensor]:
        """Per-token tensors of ``model`` for each of ``mbs``, without gradients, on every rank: the critic's
        values, else logprobs. One micro-batch after another; an engine with pipeline stages overlaps them."""
        return [self._values(mb) if model is self.critic else self._logprobs(mb, model) for mb in mbs]

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
        tally = _Tally(critic=self.critic is not None)
        if self.algo.m2_threshold is not None:  # one cutoff for the update's tokens on every rank
            dev = self.ctx.device
            cutoff = m2po_cutoff([m2_values(a["prox"], mb.behav_logprobs.to(dev), mb.mask.to(dev))
                                  for mb, a in zip(mbs, aux)], self.algo.m2_threshold, self._global_sum)
            aux = [{**a, "m2_cutoff": cutoff} for a in aux]

        def policy_loss(i: int, tensors: list[torch.Tensor]) -> torch.Tensor:
            out = self._policy_loss(mbs[i], aux[i], k, n_updates, max(norm, 1.0), *tensors)
            tally.add(mbs[i].n_tokens, out.stats, loss=float(out.loss.item()), pg_loss=out.stats.pop("pg_loss"))
            return out.loss * self._grad_scale()

        def value_loss(i: int, tensors: list[torch.Tensor]) -> torch.Tensor:
            loss, stats = self._value_loss(mbs[i], aux[i], max(norm, 1.0), tensors[0])
            tally.add(mbs[i].n_tokens, stats, value=float(loss.item()))
            return loss * self._grad_scale()

        self._passes(self.model, mbs, policy_loss, "grad" if self.algo.entropy_coef > 0 else "detached")
        if self.critic is not None:
            self._passes(self.critic, mbs, value_loss)
        tally, mismatch = self._from_loss_ranks((tally, self._mismatch.tolist()))  # (no device in the pickle)
        self._mismatch = torch.tensor(mismatch, dtype=torch.float64, device=self.ctx.device)
        grad_norm = self._step(norm)
        stats = tally.means()
        stats.update({k: self._global_sum(v) for k, v in tally.sums.items()})
        stats.update({"grad/norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"]})
        return stats

    def _passes(self, model: torch.nn.Module, mbs: list[B.MicroBatch],
                loss_of: Callable[[int, list[torch.Tensor]], torch.Tensor], entropy: str | None = None) -> None:
        """The forward and backward passes of one update of ``model`` (the policy or the critic) over ``mbs``:
        ``loss_of(i, tensors)`` is micro-batch ``i``'s loss from its per-token tensors (the policy's logprobs
        and entropies, ``entropy`` as :meth:`_forward` takes it; the critic's values), to run backward.

        One micro-batch after another. An engine with pipeline stages orders the passes itself (the megatron
        engine's 1F1B schedule), computing ``loss_of`` only where the last stage's output is; it then says
        so in :meth:`_from_loss_ranks`."""
        for i, mb in enumerate(mbs):
            tensors = [self._values(mb)] if model is self.critic else list(self._forward(mb, model, entropy))
            loss_of(i, tensors).backward()

    def _from_loss_ranks(self, obj: Any) -> Any:
        """``obj`` as the ranks that computed the losses of :meth:`_passes` hold it (every rank here)."""
        return obj

    def _policy_loss(self, mb: B.MicroBatch, aux: dict[str, torch.Tensor], k: int, n_updates: int,
                     norm: float, logp: torch.Tensor, entropy: torch.Tensor | None):
        """The clipped, decoupled policy loss of one micro-batch from its logprobs (and entropies)."""
        dev = self.ctx.device
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
                                  logp_ref=aux.get("ref"), entropy=entropy, m2_cutoff=aux.get("m2_cutoff"))

    def _value_loss(self, mb: B.MicroBatch, aux: dict[str, torch.Tensor], norm: float, values: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Clipped value loss of one micro-batch from the critic's values; (the loss, token means)."""
        mask = mb.mask.to(self.ctx.device)
        per_token, clipped = value_loss_per_token(values, aux["values"], aux["returns"], mask, self.algo.value_clip)
        loss = self.algo.value_loss_coef * aggregate(per_token, mask > 0, self.algo.loss_agg, norm)
        n = max(float(mask.sum()), 1.0)
        with torch.no_grad():
            means = {"value/clip_fraction": float(clipped.sum()) / n,
                     "value/mean": float((values * mask).sum()) / n,
                     "value/return_mean": float((aux["returns"] * mask).sum()) / n}
        return loss, means

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

    # -- LR schedules (policy and critic) ------------------------------------------
    def schedule_state(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(),
                "critic_scheduler": self.critic_scheduler.state_dict() if self.critic_scheduler else None}

    def load_schedule_state(self, saved: Mapping[str, Any], position_only: bool = False) -> None:
        pairs = [(self.scheduler, self.optimizer, "scheduler")]
        if self.critic_scheduler is not None:
            pairs.append((self.critic_scheduler, self.critic_optimizer, "critic_scheduler"))
        for scheduler, optimizer, key in pairs:
            if position_only:
                continue_schedule(scheduler, optimizer, saved.get(key))
            elif key in saved:
                scheduler.load_state_dict(saved[key])
                # the rate of the next update: an optimizer whose state carries no param groups (megatron's
                # per-slice state) still holds its constructor's rate
                for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
                    group["lr"] = lr
            else:  # resuming this run without its schedule would restart the warm-up silently
                raise ValueError(f"checkpoint has no {key} state (saved: {sorted(saved)}); "
                                 f"it was not written by this run's trainer")


class _Tally:
    """The statistics of one update's micro-batches: loss shares summed, token statistics weighted by each
    micro-batch's tokens (``*_max`` ones maxed)."""

    def __init__(self, critic: bool) -> None:
        self.sums = {"loss/value": 0.0, "loss/pg_loss": 0.0, **({"value/loss": 0.0} if critic else {})}
        self.weighted: dict[str, float] = {}
        self.tokens = 0  # the policy's micro-batches' (the critic's are the same ones)

    def add(self, n_tokens: int, stats: Mapping[str, float], loss: float | None = None,
            pg_loss: float | None = None, value: float | None = None) -> None:
        for key, v in (("loss/value", loss), ("loss/pg_loss", pg_loss), ("value/loss", value)):
            if v is not None:
                self.sums[key] += v
        if value is None:
            self.tokens += n_tokens
        for key, v in stats.items():
            if key == "n_tokens" or n_tokens == 0 or not math.isfinite(v):
                continue
            w = self.weighted
            w[key] = max(w.get(key, v), v) if key.endswith("_max") else w.get(key, 0.0) + v * n_tokens

    def means(self) -> dict[str, float]:
        """Token means (maxima of ``*_max``) under their metric names (``loss/`` where a name has no group)."""
        if not self.tokens:
            return {}
        return {(k if "/" in k else f"loss/{k}"): v if k.endswith("_max") else v / self.tokens
                for k, v in self.weighted.items()}


def continue_schedule(scheduler, optimizer, saved: Mapping[str, Any] | None) -> None:
    """This run's base learning rates and schedule, at the saved position (else at 0); rates an optimizer
    state loaded from another run carried are replaced."""
    if saved:
        scheduler.last_epoch = int(saved["last_epoch"])
    lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr, base in zip(optimizer.param_groups, lrs, scheduler.base_lrs):
        group["lr"], group["initial_lr"] = lr, base
    scheduler._last_lr = lrs
