"""The FSDP2 train engine: one instance per trainer rank.

Lifecycle: build (load the HF model, shard every decoder layer and the root
with ``fully_shard``, create AdamW and the LR schedule; a frozen reference
model when a KL term is on; a critic with its own AdamW for
``adv_estimator: gae``) -> for each step, :meth:`FSDPEngine.train_step`
(the algorithm is :class:`hpcrl.trainer.policy.PolicyTrainer`'s, shared with
every engine; this module provides the model side):
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
from pathlib import Path
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hpcrl.algo import token_entropy
from hpcrl.algo.config import AlgoConfig
from hpcrl.algo.losses import token_logprobs
from hpcrl.runtime.dist import DistContext
from hpcrl.model.hf_io import load_model
from hpcrl.trainer import batch as B
from hpcrl.trainer.config import TrainerConfig
from hpcrl.trainer.policy import PolicyTrainer, initial_value_head, lr_factor  # noqa: F401 (lr_factor re-exported)

log = logging.getLogger(__name__)


class FSDPEngine(PolicyTrainer):
    """FSDP2 implementation of :class:`hpcrl.trainer.engine.TrainEngine` (``trainer.engine: fsdp``).

    Parameters, gradients and optimizer state are float32 whatever ``dtype``;
    a ``dtype`` of bfloat16 (``model.dtype``) runs forward and
    backward in it (FSDP2's MixedPrecisionPolicy: parameters cast at
    all-gather, gradients reduced in float32); logprobs and losses are float32.
    float16 is refused: it would need a gradient scaler.
    ``trainer.activation_checkpointing`` recomputes each decoder layer in the
    backward pass (HF gradient checkpointing, non-reentrant) of the policy
    and the critic. ``trainer.lora.rank > 0`` trains PEFT LoRA adapters of
    the policy only (:mod:`hpcrl.trainer.lora`); published weights are merged,
    or the adapters alone (``trainer.lora.publish: adapter``).
    """

    def __init__(self, model_path: str | Path, cfg: TrainerConfig, algo: AlgoConfig, ctx: DistContext,
                 pad_id: int, dtype: torch.dtype = torch.float32) -> None:
        self.cfg, self.algo, self.ctx, self.pad_id = cfg, algo, ctx, pad_id
        self.dp_rank, self.dp_size = ctx.rank, ctx.world_size  # every rank holds other data
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
            weight, bias = initial_value_head(critic.config.hidden_size, critic.config.initializer_range)
            head = getattr(critic, "score", None) or critic.classifier  # (HF's name for it in older models)
            with torch.no_grad():
                head.weight.copy_(weight)
                head.bias.copy_(bias)
            self.critic = shard(critic)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=algo.critic_lr,
                                                      betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
            self.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(self.critic_optimizer,
                                                                      lambda s: lr_factor(s, cfg))

    # -- forward ---------------------------------------------------------
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
    def _grad_scale(self) -> int:
        return self.ctx.world_size  # FSDP2 averages gradients over every rank

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
        """Unsharded CPU weights on rank 0 (empty elsewhere), HF names (LoRA adapters merged; with
        ``trainer.lora.publish: adapter`` the adapters alone, :func:`hpcrl.weights.adapter.from_engine`); every
        rank must call it."""
        if self.lora_scalings is not None and self.cfg.lora.publish == "adapter":
            return self._adapters()
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=opts)
        if self.lora_scalings is not None and state:
            from hpcrl.trainer.lora import merge_lora

            state = merge_lora(state, self.lora_scalings)
        return state

    def _adapters(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters alone, unsharded on rank 0 under PEFT's names: only the trained parameters are
        gathered (their shards, one parameter after another on every rank), never the frozen base."""
        from hpcrl.weights.adapter import from_engine

        state = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                if self.ctx.rank == 0:
                    state[name] = full.detach().cpu().clone()
        return from_engine(state) if self.ctx.rank == 0 else {}

    def checkpoint_state(self) -> dict[str, Any]:
        """Sharded policy and optimizer state, plus the critic and its optimizer (PPO), for DCP."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.critic is not None:
            state["critic"], state["critic_optim"] = get_state_dict(self.critic, self.critic_optimizer)
        return state

    def convert_checkpoint(self, path: Path, parts: set[str]) -> None:
        """None: DCP reshards an FSDP2 checkpoint onto any number of ranks itself, and another engine's
        checkpoint does not load into this one (``--from`` takes its exported weights instead)."""
        return None

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        _set(self.model, self.optimizer, state.get("model"), state.get("optim"))
        if self.critic is not None and "critic" in state:
            _set(self.critic, self.critic_optimizer, state["critic"], state.get("critic_optim"))


def _set(model, optimizer, model_sd, optim_sd) -> None:
    if model_sd is None:
        return
    if optim_sd is not None:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        set_model_state_dict(model, model_sd)


def _shard(model: torch.nn.Module, mesh, policy: MixedPrecisionPolicy | None = None) -> torch.nn.Module:
    """FSDP2: every decoder layer, then the root."""
    model.config.use_cache = False
    kw = {"mp_policy": policy} if policy is not None else {}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model
