"""A HuggingFace causal LM as a megatron-core GPTModel on tensor- and pipeline-parallel ranks.

Lifecycle, every call collective over the trainer's ranks: :func:`init_parallel`
(once per process, after ``torch.distributed`` is up: megatron-core's
parallel groups, and on a machine without CUDA the redirection of
:mod:`hpcrl.trainer.mcore.cpu`) -> :func:`build` (this rank's GPTModel with
the HF model's weights, its stage's layers and its TP slices) ->
:func:`forward_logits` (one pipeline pass over a padded batch) ->
:func:`gather_hf` (the full weights under HF names on rank 0, for
publication and HF export).

The layer spec is megatron-core's local one (no Transformer Engine), so the
same model runs on CUDA, on Ascend through torch-npu, and on the CPU over
gloo.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.trainer.mcore import convert, cpu

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: TP rank of ``tp``, pipeline stage of ``pp``, data-parallel rank of ``dp``."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    stage: int
    dp_rank: int

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pp - 1


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, device: torch.device | None = None) -> Layout:
    """megatron-core's model-parallel groups over the current process group (world = tp * pp * dp); ``device``
    is this rank's (the CPU: megatron-core's CUDA calls redirected, :mod:`hpcrl.trainer.mcore.cpu`)."""
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"trainer.world_size={world}: must be a multiple of tensor_parallel x pipeline_parallel "
                         f"= {tp} x {pp}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if not cpu.apply(seed, device):
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return Layout(tp, pp, world // (tp * pp), ps.get_tensor_model_parallel_rank(),
                  ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank())


class ValueHead(torch.nn.Module):
    """The critic's output layer in place of the vocabulary projection: one value per token from the final
    hidden states (``[seq, batch, 1]``), as HF's token-classification head with one label. Replicated on every
    tensor-parallel rank: its input is, so each rank computes the same value and the same gradient (the
    clipping norm counts it once, as every parameter without a ``tensor_model_parallel`` mark)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def build(model_path: str | Path, layout: Layout, dtype: torch.dtype = torch.float32, pad_vocab_to: int = 1,
          hf_state: dict[str, torch.Tensor] | None = None, critic: bool = False,
          device: torch.device | str = "cpu"):
    """This rank's GPTModel (its stage, its TP slices) with the weights of the HF model at ``model_path``
    (``hf_state``: weights to use instead, e.g. a published version), on ``device`` (built on the CPU, then
    moved, as megatron-core's own training loop does with ``use_cpu_initialization``). ``critic``: the same
    decoder with a :class:`ValueHead` (:func:`hpcrl.trainer.policy.initial_value_head`) instead of the output
    layer, and embeddings of its own (never tied)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(model_path), local_files_only=True)
    config = convert.transformer_config(hf_config, layout.tp, layout.pp, dtype)
    spec = get_gpt_layer_local_spec(qk_layernorm=convert.has_qk_norm(hf_config), normalization="RMSNorm")
    kwargs = convert.model_kwargs(hf_config, layout.tp, pad_vocab_to)
    if critic:
        kwargs["share_embeddings_and_output_weights"] = False
    with cpu.building():
        model = GPTModel(config, transformer_layer_spec=spec, pre_process=layout.first_stage,
                         post_process=layout.last_stage, parallel_output=False, **kwargs)
    if critic and layout.last_stage:
        from hpcrl.trainer.policy import initial_value_head

        model.output_layer = ValueHead(*initial_value_head(hf_config.hidden_size,
                                                           getattr(hf_config, "initializer_range", 0.02)))
    load_hf(model, hf_weights(model_path) if hf_state is None else hf_state, hf_config, layout, pad_vocab_to,
            critic=critic)
    # every parameter, norms included, in ``dtype``, as megatron-core's Float16Module casts them
    model.to(device=device, dtype=dtype)
    model.hf_config = hf_config
    model.pad_vocab_to = pad_vocab_to
    model.is_critic = critic
    return model


def checkpoint_layers(model) -> int:
    """Activation checkpointing (``trainer.activation_checkpointing``): every transformer layer of this stage
    keeps only its inputs for the backward pass and runs its forward again there (torch's non-reentrant
    checkpoint; megatron-core's own ``recompute_granularity`` replays its CUDA RNG tracker's states, and with
    dropout 0 there is nothing random to replay). Returns the number of layers wrapped."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    layers = list(model.decoder.layers)
    for layer in layers:
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)
    return len(layers)


def hf_weights(model_path: str | Path) -> dict[str, torch.Tensor]:
    """The HF folder's weights, as stored."""
    from hpcrl.model.hf_io import stored_weights

    return stored_weights(model_path)


def rank_weights(model, hf_state: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """This rank's share of ``hf_state`` under the names of ``model``'s parameters, in the dtype stored (the
    float32 master weights of a model that computes in bfloat16)."""
    state = convert.hf_to_mcore(hf_state, model.hf_config, layout.tp, layout.tp_rank, layout.pp, layout.stage,
                                model.pad_vocab_to)
    if model.is_critic and layout.last_stage:  # the value head the critic starts from, not the vocabulary
        from hpcrl.trainer.policy import initial_value_head

        state["output_layer.weight"], state["output_layer.bias"] = initial_value_head(
            model.hf_config.hidden_size, getattr(model.hf_config, "initializer_range", 0.02))
    return {n: state[n] for n, _ in model.named_parameters()}


def load_hf(model: torch.nn.Module, hf_state: dict[str, torch.Tensor], hf_config: Any, layout: Layout,
            pad_vocab_to: int = 1, critic: bool = False) -> None:
    """Put HF weights into this rank's GPTModel; every parameter must be covered (but a critic's value head)."""
    if "lm_head.weight" not in hf_state and not getattr(hf_config, "tie_word_embeddings", False):
        raise ValueError("untied model without lm_head.weight")
    state = convert.hf_to_mcore(hf_state, hf_config, layout.tp, layout.tp_rank, layout.pp, layout.stage,
                                pad_vocab_to)
    if critic:
        state = {k: v for k, v in state.items() if not k.startswith("output_layer.")}
    params = dict(model.state_dict())
    state = {k: v.to(params[k].dtype) for k, v in state.items() if k in params}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and not (critic and k.startswith("output_layer"))]
    if missing or unexpected:
        raise ValueError(f"HF -> megatron weights: missing {missing[:5]}, unexpected {unexpected[:5]}")


def run_stage(model, input_ids: torch.Tensor, received: torch.Tensor | None = None) -> torch.Tensor:
    """This stage's forward pass over a batch (token ids ``[batch, seq]``, right-padded: the causal mask is
    enough): from the token ids on the first stage, from ``received`` (the previous stage's hidden states
    ``[seq, batch, hidden]``) on the others. The last stage returns the logits ``[batch, seq, padded vocab]``,
    the others their hidden states."""
    device = device_of(model)
    b, s = input_ids.shape
    input_ids = input_ids.to(device)
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    if received is not None:
        model.set_input_tensor(received)
    return model(input_ids if received is None else None, positions, attention_mask=cpu.causal_mask(s, device))


def device_of(model) -> torch.device:
    """Where ``model``'s parameters (and so its inputs and the hidden states it passes on) are."""
    return next(model.parameters()).device


def hidden_shape(model, input_ids: torch.Tensor) -> tuple[int, int, int]:
    """The shape of the hidden states a stage passes on for ``input_ids``: ``[seq, batch, hidden]``."""
    b, s = input_ids.shape
    return s, b, model.config.hidden_size


def stage_forward(model, input_ids: torch.Tensor, layout: Layout, sends: list | None = None) -> torch.Tensor:
    """This stage's part of a forward pass without gradients of a batch every rank of the model-parallel group
    passes identically (:func:`run_stage`): a stage after the first receives its input from the previous one,
    a stage before the last sends its output on. ``sends``: send without blocking and add the pending sends to
    it (the caller waits for them); else each send blocks. (Passes with gradients go through
    :mod:`hpcrl.trainer.mcore.pipeline`.)"""
    from megatron.core import parallel_state as ps

    if layout.pp == 1:
        return run_stage(model, input_ids)
    received = None
    if not layout.first_stage:
        received = torch.empty(hidden_shape(model, input_ids), dtype=model.config.params_dtype,
                               device=device_of(model))
        dist.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
    out = run_stage(model, input_ids, received)
    if not layout.last_stage:
        nxt = ps.get_pipeline_model_parallel_next_rank()
        if sends is None:
            dist.send(out.detach().contiguous(), dst=nxt)
        else:
            sends.append(dist.isend(out.detach().contiguous(), dst=nxt))
    return out


@torch.no_grad()
def forward_logits(model, input_ids: torch.Tensor, layout: Layout) -> torch.Tensor | None:
    """Full-vocabulary logits ``[batch, seq, vocab]`` of the HF model's vocabulary on the last stage (None on
    the others), for a batch every rank of the model-parallel group passes identically."""
    out = stage_forward(model, input_ids, layout)
    if not layout.last_stage:
        return None
    return out[..., : model.hf_config.vocab_size]


def gather_hf(model, layout: Layout, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The full weights under HF names on global rank 0 ({} elsewhere); every rank must call it.
    ``weights``: tensors to send in place of the model's own of these names (its float32 master weights).

    A piece at a time (the embedding, each decoder layer, the final norm with the output layer), in model
    order: the TP ranks of the stage that holds it gather their slices on its TP rank 0 (tensor collectives
    over the TP group; data-parallel replicas hold the same weights and only the first takes part), which
    merges them into the HF tensors (:mod:`hpcrl.trainer.mcore.convert`) and, on a later stage, sends those
    to rank 0 (their names and shapes, then the tensors, point to point). Rank 0 holds the HF model as it
    grows and one piece's slices, never every rank's shards at once, and nothing but names and shapes is
    pickled."""
    if layout.dp_rank != 0:
        return {}
    from megatron.core import parallel_state as ps

    mine = {k: (weights or {}).get(k, v).detach() for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    hf_config, leader = model.hf_config, layout.tp_rank == 0
    out: dict[str, torch.Tensor] = {}
    for names, to_hf in _pieces(mine, hf_config, layout):
        slices = _gather_slices(mine, names, layout, ps)
        if not leader:
            continue
        hf = to_hf(slices)
        if dist.get_rank() == 0:
            out.update({k: v.cpu() for k, v in hf.items()})
        else:
            _send_piece(hf)
    if dist.get_rank() != 0:
        if leader:
            dist.send_object_list([None], dst=0)  # this stage is done
        return {}
    stage_leaders = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()) if layout.pp > 1 else [0]
    for src in stage_leaders[1:]:
        while (hf := _recv_piece(src, next(iter(mine.values())).device)) is not None:
            out.update({k: v.cpu() for k, v in hf.items()})
    if getattr(hf_config, "tie_word_embeddings", False):
        out["lm_head.weight"] = out["model.embed_tokens.weight"]  # one tensor, as HF's state_dict() has it
    return {k: v.contiguous() for k, v in out.items()}


def _pieces(mine: dict[str, torch.Tensor], hf_config: Any, layout: Layout):
    """This stage's pieces in model order: (their megatron names, slices of every TP rank -> HF tensors)."""
    vocab = convert.vocab_to_hf
    if layout.first_stage:
        name = "embedding.word_embeddings.weight"
        yield [name], lambda sl: {"model.embed_tokens.weight": vocab([s[name] for s in sl], hf_config)}
    layers = convert.stage_layers(int(hf_config.num_hidden_layers), layout.pp, layout.stage)
    for local, i in enumerate(layers):
        head = f"decoder.layers.{local}."
        names = [k for k in mine if k.startswith(head)]

        def layer(sl, head=head, i=i):
            merged = convert.layer_to_hf([{k[len(head):]: v for k, v in s.items()} for s in sl], hf_config)
            return {f"model.layers.{i}.{k}": v for k, v in merged.items()}

        yield names, layer
    if layout.last_stage:
        norm, output = "decoder.final_layernorm.weight", "output_layer.weight"
        untied = not getattr(hf_config, "tie_word_embeddings", False)  # (a tied head's copy here is the embedding)

        def last(sl):
            return {"model.norm.weight": sl[0][norm],
                    **({"lm_head.weight": vocab([s[output] for s in sl], hf_config)} if untied else {})}

        yield [norm, output] if untied else [norm], last


def _gather_slices(mine: dict[str, torch.Tensor], names: list[str], layout: Layout, ps
                   ) -> list[dict[str, torch.Tensor]] | None:
    """Every TP rank's tensors ``names`` on this stage's TP rank 0 (by TP rank); None on the other TP ranks."""
    if layout.tp == 1:
        return [{n: mine[n] for n in names}]
    group, dst = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()
    leader = layout.tp_rank == 0
    slices: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.tp)]
    for n in names:
        t = mine[n].contiguous()
        into = [torch.empty_like(t) for _ in range(layout.tp)] if leader else None
        dist.gather(t, into, dst=dst, group=group)
        if leader:
            for r, got in enumerate(into):
                slices[r][n] = got
    return slices if leader else None


def _send_piece(hf: dict[str, torch.Tensor]) -> None:
    dist.send_object_list([[(k, tuple(v.shape), v.dtype) for k, v in hf.items()]], dst=0)
    for v in hf.values():
        dist.send(v.contiguous(), dst=0)


def _recv_piece(src: int, device: torch.device) -> dict[str, torch.Tensor] | None:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src)
    if box[0] is None:
        return None
    out = {}
    for k, shape, dtype in box[0]:
        out[k] = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out[k], src=src)
    return out
