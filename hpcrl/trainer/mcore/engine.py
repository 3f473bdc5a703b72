"""The megatron-core train engine (``trainer.engine: megatron``): one instance per trainer rank.

Lifecycle: megatron-core's parallel groups over the trainer's ranks
(``trainer.megatron.tensor_parallel`` x data parallel; on a machine without
CUDA the redirection of :mod:`hpcrl.trainer.mcore.cpu`) -> this rank's
GPTModel from the HF folder (:mod:`hpcrl.trainer.mcore.model`), torch AdamW
over its local parameters and the LR schedule; a critic with its own when
the algorithm needs one; a frozen reference GPTModel when a KL term is on
-> per step :meth:`train_step`, the algorithm every engine shares
(:class:`hpcrl.trainer.policy.PolicyTrainer`): the ranks of one
tensor-parallel group see the same micro-batches, the data-parallel ranks
different ones -> :meth:`full_state_dict` gathers the HF-named weights on
rank 0 for publication -> checkpoints: every rank's own slices of the model
and of AdamW's state, under names that carry its TP rank, for DCP.

Gradients, after the backward passes of a minibatch and before the step
(what megatron-core's ``finalize_model_grads`` does for its own DDP): the
q/k layer-norm weights, which each TP rank applies to its own heads only,
are summed over the TP group; every gradient is averaged over the
data-parallel group (each micro-batch loss was multiplied by its size);
the norm counts each tensor-parallel slice once and each replicated
parameter once. So one step equals the FSDP2 engine's step on the same batch
(``tests/test_megatron.py``).

Pipeline parallelism (``trainer.megatron.pipeline_parallel``): the
training passes run in the 1F1B schedule (:mod:`hpcrl.trainer.mcore.pipeline`:
hidden states sent on point to point, their gradients sent back, the stages
computing at the same time); the losses and the update's statistics are
the last stage's, which it shares with the other stages after the passes.
Passes without gradients (proximal and reference logprobs, the critic's
values) overlap the stages too (forward passes only); the last stage then
broadcasts the per-token tensors to every stage (each computes the
advantages). A tied
embedding has a copy on the last stage; their gradients are summed over the
embedding group, and the norm counts it once.

``trainer.activation_checkpointing`` recomputes each transformer layer in
the backward pass (:func:`hpcrl.trainer.mcore.model.checkpoint_layers`).

``model.dtype: bfloat16``: bf16 parameters and compute, float32 master
weights in the optimizer (``masters``), each micro-batch's gradient summed
into the master's in float32; checkpoints and published weights are the
masters.

A critic (``algo.adv_estimator: gae``): a second GPTModel of the same
layout with a value head in place of the output layer
(:class:`hpcrl.trainer.mcore.model.ValueHead`), trained beside the policy by
its own AdamW and schedule under the same gradient rules; its values come
from the last stage as the logprobs do.

Checkpoints hold each rank's own slices (of the critic too, as the parts
``critic`` and ``critic_optim``); a resume onto other tensor- or
pipeline-parallel sizes reshards them as it loads (:meth:`convert_checkpoint`).

Not yet: LoRA, refused by name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from hpcrl.algo import token_entropy
from hpcrl.algo.config import AlgoConfig
from hpcrl.algo.losses import token_logprobs
from hpcrl.runtime.dist import DistContext
from hpcrl.trainer import batch as B
from hpcrl.trainer.config import TrainerConfig
from hpcrl.trainer.mcore import model as M
from hpcrl.trainer.mcore.pipeline import forward_only, one_forward_one_backward
from hpcrl.trainer.mcore.reshard import prefix, reshard, saved_layout
from hpcrl.trainer.policy import PolicyTrainer, lr_factor

log = logging.getLogger(__name__)

_ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


class MegatronEngine(PolicyTrainer):
    """megatron-core implementation of :class:`hpcrl.trainer.engine.TrainEngine`."""

    def __init__(self, model_path: str | Path, cfg: TrainerConfig, algo: AlgoConfig, ctx: DistContext,
                 pad_id: int, dtype: torch.dtype = torch.float32) -> None:
        settings = cfg.megatron
        for refused, why in ((cfg.lora.rank > 0, "trainer.lora: LoRA is not built for the megatron engine yet"),
                             (dtype == torch.float16, "model.dtype=float16: training in float16 needs loss "
                              "scaling, which the megatron engine does not do; use bfloat16")):
            if refused:
                raise ValueError(why)
        self.cfg, self.algo, self.ctx, self.pad_id, self.dtype = cfg, algo, ctx, pad_id, dtype
        self.layout = M.init_parallel(settings.tensor_parallel, settings.pipeline_parallel, device=ctx.device)
        from megatron.core import parallel_state as ps

        self.dp_rank, self.dp_size, self.dp_group = self.layout.dp_rank, self.layout.dp, ps.get_data_parallel_group()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.mp_group = ps.get_model_parallel_group()  # TP x PP: the ranks that hold one replica's parameters
        # the weights each optimizer updates (``masters``): the parameters themselves in float32; float32 copies
        # of them (of the HF weights, not of their bfloat16 rounding) when the models compute in bfloat16
        self._names: dict[torch.Tensor, str] = {}
        self.masters: dict[torch.Tensor, torch.Tensor] = {}
        hf_state = M.hf_weights(model_path)
        self.model = self._trained(M.build(model_path, self.layout, dtype, hf_state=hf_state, device=ctx.device),
                                   hf_state)
        self.optimizer, self.scheduler = self._adamw(self.model, cfg.lr)
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        if algo.adv_estimator == "gae":  # the same decoder with a value head, trained alongside by its own AdamW
            self.critic = self._trained(M.build(model_path, self.layout, dtype, hf_state=hf_state, critic=True,
                                                device=ctx.device), hf_state)
            self.critic_optimizer, self.critic_scheduler = self._adamw(self.critic, algo.critic_lr)
        del hf_state
        self.version = 0
        self._warned_bubble = False
        self.ref_model = None
        if algo.needs_reference:
            self.ref_model = M.build(model_path, self.layout, dtype, device=ctx.device).eval()
            self.ref_model.requires_grad_(False)
        log.info("megatron engine: TP %d x PP %d x DP %d (this rank: TP rank %d, stage %d, DP rank %d)%s",
                 self.layout.tp, self.layout.pp, self.layout.dp, self.layout.tp_rank, self.layout.stage,
                 self.layout.dp_rank, ", with a critic" if self.critic is not None else "")

    def _trained(self, model: torch.nn.Module, hf_state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """``model`` made ready to train: its layers recomputed in the backward pass when activation
        checkpointing is on, its parameters named and given their float32 masters."""
        if self.cfg.activation_checkpointing:
            M.checkpoint_layers(model)
        self._names.update({p: n for n, p in model.named_parameters()})
        if self.dtype == torch.float32:
            self.masters.update({p: p for p in model.parameters()})
            return model
        own = M.rank_weights(model, hf_state, self.layout)
        for n, p in model.named_parameters():
            self.masters[p] = own[n].to(device=p.device, dtype=torch.float32).clone()
            p.register_post_accumulate_grad_hook(self._to_master_grad)  # each micro-batch's gradient, in float32
        return model

    def _adamw(self, model: torch.nn.Module, lr: float) -> tuple[torch.optim.Optimizer, Any]:
        """AdamW over ``model``'s master weights and its LR schedule."""
        optimizer = torch.optim.AdamW([self.masters[p] for p in model.parameters()], lr=lr,
                                      betas=tuple(self.cfg.betas), weight_decay=self.cfg.weight_decay)
        if self.dtype != torch.float32:
            optimizer.register_step_post_hook(lambda *_: self._masters_to_model(model))
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, self.cfg))

    # -- the model side of PolicyTrainer ----------------------------------------
    def _forward(self, mb: B.MicroBatch, model: torch.nn.Module | None = None,
                 entropy: str | None = "detached") -> tuple[torch.Tensor, torch.Tensor | None]:
        model = model or self.model
        out = M.stage_forward(model, mb.input_ids, self.layout)  # right padding: the causal mask is enough
        computed = self._from_last_stage(out, mb, self._per_token(model, mb, entropy), 1 if entropy is None else 2)
        return computed[0], computed[1] if entropy is not None else None

    def _values(self, mb: B.MicroBatch) -> torch.Tensor:
        out = M.stage_forward(self.critic, mb.input_ids, self.layout)
        return self._from_last_stage(out, mb, self._per_token(self.critic, mb), 1)[0]

    def _per_token(self, model: torch.nn.Module, mb: B.MicroBatch, entropy: str | None = None
                   ) -> Callable[[torch.Tensor], list[torch.Tensor]]:
        """What the last stage computes from its output for ``mb``: the critic's values; the policy's token
        logprobs (and entropies: ``entropy`` ``"detached"`` or ``"grad"``; None: without)."""
        if model is self.critic:
            return lambda values: [values[:, :-1, 0].float()]

        def from_logits(out: torch.Tensor) -> list[torch.Tensor]:
            logits = out[:, :-1, : model.hf_config.vocab_size].float()
            logp = token_logprobs(logits, mb.targets.to(logits.device), self.algo.temperature)
            if entropy is None:
                return [logp]
            return [logp, token_entropy(logits if entropy == "grad" else logits.detach(), self.algo.temperature)]

        return from_logits

    def _from_last_stage(self, out: torch.Tensor, mb: B.MicroBatch,
                         compute: Callable[[torch.Tensor], list[torch.Tensor]], n: int) -> list[torch.Tensor]:
        """The ``n`` per-token tensors the last stage computes from its output (``compute``), on every stage
        (broadcast by the last), for a pass without gradients; passes with gradients go through
        :meth:`_passes`."""
        if self.layout.pp == 1:
            return compute(out)
        if torch.is_grad_enabled():
            raise RuntimeError("with pipeline stages a pass with gradients runs in the 1F1B schedule (_passes)")
        from megatron.core import parallel_state as ps

        src, group = ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()
        if self.layout.last_stage:
            computed = compute(out)
            for t in computed:  # (a slice of the output is not contiguous: broadcast would send its storage)
                dist.broadcast(t.contiguous(), src=src, group=group)
            return computed
        received = [torch.empty(mb.targets.shape, device=self.ctx.device) for _ in range(n)]
        for t in received:
            dist.broadcast(t, src=src, group=group)
        return received

    def _passes(self, model: torch.nn.Module, mbs: list[B.MicroBatch],
                loss_of: Callable[[int, list[torch.Tensor]], torch.Tensor], entropy: str | None = None) -> None:
        """With pipeline stages, the 1F1B schedule (:mod:`hpcrl.trainer.mcore.pipeline`); the losses are the
        last stage's."""
        if self.layout.pp == 1:
            return super()._passes(model, mbs, loss_of, entropy)
        if len(mbs) < 2 * self.layout.pp and not self._warned_bubble:
            self._warned_bubble = True
            log.warning("pipeline: an update of %d micro-batch(es) on %d stages leaves the stages idle %.0f%% of the "
                        "time (the pipeline fills and drains once per update); a smaller trainer.micro_batch_tokens "
                        "makes more micro-batches", len(mbs), self.layout.pp,
                        100 * (self.layout.pp - 1) / (len(mbs) + self.layout.pp - 1))
        one_forward_one_backward(model, self.layout, [mb.input_ids for mb in mbs],
                                 lambda i, out: loss_of(i, self._per_token(model, mbs[i], entropy)(out)))

    def _no_grad_passes(self, model: torch.nn.Module, mbs: list[B.MicroBatch]) -> list[torch.Tensor]:
        """With pipeline stages, every micro-batch's forward pass with the stages at the same time
        (:func:`hpcrl.trainer.mcore.pipeline.forward_only`), then the last stage broadcasts what it computed."""
        if self.layout.pp == 1:
            return super()._no_grad_passes(model, mbs)
        from megatron.core import parallel_state as ps

        computed = forward_only(model, self.layout, [mb.input_ids for mb in mbs],
                                lambda i, out: self._per_token(model, mbs[i])(out)[0])
        src, group = ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()
        out = []
        for i, mb in enumerate(mbs):
            t = computed[i].contiguous() if self.layout.last_stage else torch.empty(mb.targets.shape,
                                                                                     device=self.ctx.device)
            dist.broadcast(t, src=src, group=group)
            out.append(t)
        return out

    def _from_loss_ranks(self, obj: Any) -> Any:
        """``obj`` as the last stage holds it, on every stage (pickled: an update's statistics)."""
        if self.layout.pp == 1:
            return obj
        from megatron.core import parallel_state as ps

        box = [obj]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    def _grad_scale(self) -> int:
        return self.dp_size  # gradients are averaged over the data-parallel group in _clip

    def _clip(self, model: torch.nn.Module) -> float:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        params = [p for p in model.parameters() if self.masters[p].grad is not None]
        grads = {p: self.masters[p].grad for p in params}
        if self.layout.pp > 1 and model.share_embeddings_and_output_weights and ps.is_rank_in_embedding_group():
            # the first stage's embedding and the last stage's copy of it for the output layer are one weight
            shared = model.shared_embedding_or_output_weight()
            if shared not in grads:
                grads[shared] = self.masters[shared].grad = torch.zeros_like(self.masters[shared])
                params.append(shared)
            dist.all_reduce(grads[shared], group=ps.get_embedding_group())
        if self.layout.tp > 1:  # each TP rank normalised its own heads' q/k: the weight's gradient is the sum
            for p in params:
                if "q_layernorm" in self._names[p] or "k_layernorm" in self._names[p]:
                    dist.all_reduce(grads[p], group=self.tp_group)
        if self.dp_size > 1:
            for p in params:
                dist.all_reduce(grads[p], group=self.dp_group)
                grads[p].div_(self.dp_size)
        sq = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)
        for p in params:
            if param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p):
                sq += grads[p].double().pow(2).sum()
        if self.layout.tp * self.layout.pp > 1:  # every rank ends with the same clipping coefficient
            dist.all_reduce(sq, group=self.mp_group)
        norm = float(sq.sqrt().item())
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        coef = min(max_norm / (norm + 1e-6), 1.0)  # as torch.nn.utils.clip_grad_norm_
        if coef < 1.0:
            for p in params:
                grads[p].mul_(coef)
        return norm

    def _to_master_grad(self, p: torch.Tensor) -> None:
        master, grad = self.masters[p], p.grad.to(torch.float32)
        master.grad = grad if master.grad is None else master.grad.add_(grad)
        p.grad = None

    def _masters_to_model(self, model: torch.nn.Module) -> None:
        """After an optimizer step: ``model`` computes with its master weights, rounded to its dtype."""
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(self.masters[p])

    # -- weights and checkpoints ---------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named full weights of the policy on rank 0 (empty elsewhere); every rank must call it."""
        return M.gather_hf(self.model, self.layout, {n: self.masters[p] for n, p in self.model.named_parameters()})

    def _key(self, name: str) -> str:
        return f"{prefix(self.layout.tp, self.layout.tp_rank, self.layout.pp, self.layout.stage)}/{name}"

    def _trained_parts(self) -> list[tuple[str, str, torch.nn.Module, torch.optim.Optimizer]]:
        """(model part, optimizer part, model, its optimizer) of each trained model, as checkpoints name them."""
        parts = [("model", "optim", self.model, self.optimizer)]
        if self.critic is not None:
            parts.append(("critic", "critic_optim", self.critic, self.critic_optimizer))
        return parts

    def checkpoint_state(self) -> dict[str, Any]:
        """This rank's slices of the model (and of the critic) and of AdamW's moments, under names that carry
        its TP rank and stage (data-parallel replicas hold the same ones), so DCP stores each slice once and
        loads it in place."""
        state: dict[str, Any] = {}
        for model_part, optim_part, model, optimizer in self._trained_parts():
            state[model_part] = {self._key(n): self.masters[p].detach() for n, p in model.named_parameters()}
            optim: dict[str, Any] = {}
            for name, p in model.named_parameters():
                master = self.masters[p]
                moments = optimizer.state[master]
                if not moments:  # before the first step: the zeros AdamW would start from, so a load has targets
                    moments.update(exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master),
                                   step=torch.tensor(0.0))
                for k in _ADAM_KEYS:
                    optim[f"{self._key(name)}/{k}"] = moments[k]
            state[optim_part] = optim
        return state

    def convert_checkpoint(self, path: Path, parts: set[str]) -> dict[str, Any] | None:
        """This rank's ``parts`` from a megatron engine checkpoint of other TP/PP sizes
        (:func:`hpcrl.trainer.mcore.reshard.reshard`); None for another engine's checkpoint."""
        import torch.distributed.checkpoint as dcp

        if saved_layout(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata) is None:
            return None
        return reshard(path, self.model.hf_config, self.layout, parts, self.model.pad_vocab_to)

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Apply what DCP loaded in place (:meth:`checkpoint_state`'s tensors are this engine's own: the
        parameters were written directly; the optimizer's moments are its state's tensors)."""
        for model_part, optim_part, model, optimizer in self._trained_parts():
            if model_part in state:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        src, master = state[model_part][self._key(n)], self.masters[p]
                        if src.data_ptr() != master.data_ptr():
                            master.copy_(src)
                        if master is not p:
                            p.copy_(master)
            if optim_part in state:
                for name, p in model.named_parameters():
                    master = self.masters[p]
                    saved = {k: state[optim_part][f"{self._key(name)}/{k}"] for k in _ADAM_KEYS}
                    # moments resharded from a checkpoint come on the CPU; AdamW keeps its step count there
                    optimizer.state[master].update({k: t if k == "step" else t.to(master.device)
                                                    for k, t in saved.items()})
