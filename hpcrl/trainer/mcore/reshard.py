"""A megatron engine checkpoint onto other tensor- and pipeline-parallel sizes.

The engine saves each rank's own slices of the weights and of AdamW's
moments under names that carry its place (:func:`prefix`:
``tp<T>.<rank>[.pp<P>.<stage>]/<megatron name>``), so a checkpoint loads in
place only onto the sizes that wrote it. :func:`reshard` gives one rank of
another layout its state from such a checkpoint, a piece at a time (the
embedding, each decoder layer, the final norm and output layer): it reads
the saved slices of that piece from every TP rank of the stage that held it
(DCP with ``no_dist``, only those tensors), merges them into the HF tensor
(:mod:`hpcrl.trainer.mcore.convert`) and cuts this rank's slice out of it.
AdamW's moments are elementwise, so they go through the same re-layout as
the weights; its step count is copied. A critic (PPO with GAE) is the same
decoder with a value head in place of the output layer, replicated on every
TP rank: it reshards the same way, under its own parts. Nothing is computed, only moved, so
the result is exact (``tests/test_megatron.py``), and a rank holds one
piece's full tensors at a time, not the model.

Every rank of the new layout calls :func:`reshard` for itself, without a
process group; data-parallel replicas read the same slices.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import torch.distributed.checkpoint as dcp

from hpcrl.trainer.mcore import convert

log = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")
EMBEDDING, FINAL_NORM, OUTPUT = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight", \
    "output_layer.weight"
VALUE_BIAS = "output_layer.bias"  # a critic's value head: OUTPUT [1, hidden] and this, on every TP rank


def prefix(tp: int, tp_rank: int, pp: int, stage: int) -> str:
    """Where a slice sits, as its checkpoint name starts: ``tp<T>.<rank>`` (and ``.pp<P>.<stage>`` when P > 1)."""
    at = f"tp{tp}.{tp_rank}"
    return f"{at}.pp{pp}.{stage}" if pp > 1 else at


def saved_layout(keys: Iterable[str]) -> tuple[int, int] | None:
    """(TP, PP) of a megatron engine checkpoint from its flattened keys (``model.tp2.0/...``); None for a
    checkpoint of another engine."""
    for k in keys:
        if k.startswith("model.tp") and "/" in k:
            at = k[len("model."):].split("/", 1)[0].split(".")
            return int(at[0][2:]), int(at[2][2:]) if len(at) > 2 else 1
    return None


def layout_name(keys: Iterable[str]) -> str | None:
    """The layout of a megatron engine checkpoint (``megatron TP=t PP=p``); None for another engine's."""
    sizes = saved_layout(keys)
    return None if sizes is None else f"megatron TP={sizes[0]} PP={sizes[1]}"


def hf_weights(ckpt: Path, hf_config) -> dict[str, torch.Tensor]:
    """HF-named weights from a megatron engine checkpoint: every TP rank's slices of every stage, merged
    (:func:`hpcrl.trainer.mcore.convert.mcore_to_hf`)."""
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    keys = [k for k in meta if k.startswith("model.tp")]
    state = {"model": {k[len("model."):]: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype)
                       for k in keys}}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    tp, pp = saved_layout(keys)
    shards: list[list[dict[str, torch.Tensor]]] = [[{} for _ in range(tp)] for _ in range(pp)]
    for key, t in state["model"].items():
        layout, name = key.split("/", 1)
        parts = layout.split(".")
        shards[int(parts[3]) if pp > 1 else 0][int(parts[1])][name] = t
    return convert.mcore_to_hf(shards, hf_config)


class _Source:
    """The slices of one model a checkpoint holds (``part``: the policy's ``model`` or the ``critic``; ``optim``:
    its AdamW state's part, or None), read a stage and a few names at a time."""

    def __init__(self, ckpt: Path, part: str, optim: str | None) -> None:
        self.ckpt, self.part, self.optim_part, self.optim = ckpt, part, optim, optim is not None
        self.meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
        layout = saved_layout(self.meta)
        if layout is None:
            raise ValueError(f"{ckpt} was not written by the megatron engine")
        self.tp, self.pp = layout

    def names(self, stage: int, start: str) -> list[str]:
        """The megatron names of stage ``stage`` (TP rank 0) that begin with ``start``."""
        head = f"{self.part}.{prefix(self.tp, 0, self.pp, stage)}/"
        return [k[len(head):] for k in self.meta if k.startswith(head + start)]

    def read(self, stage: int, names: list[str]) -> list[dict[str, dict[str, torch.Tensor]]]:
        """For every TP rank of ``stage``: ``{"model" | "exp_avg" | "exp_avg_sq" | "step": {name: tensor}}``."""
        want: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optim": {}}
        for r in range(self.tp):
            for n in names:
                key = f"{prefix(self.tp, r, self.pp, stage)}/{n}"
                want["model"][key] = self._empty(f"{self.part}.{key}")
                if self.optim:
                    for k in (*MOMENTS, "step"):
                        want["optim"][f"{key}/{k}"] = self._empty(f"{self.optim_part}.{key}/{k}")
        loads = {self.part: want["model"]}
        if self.optim:
            loads[self.optim_part] = want["optim"]
        dcp.load(loads, checkpoint_id=str(self.ckpt), no_dist=True)
        out = []
        for r in range(self.tp):
            at = prefix(self.tp, r, self.pp, stage)
            kinds = {"model": {n: want["model"][f"{at}/{n}"] for n in names}}
            if self.optim:
                kinds.update({k: {n: want["optim"][f"{at}/{n}/{k}"] for n in names} for k in (*MOMENTS, "step")})
            out.append(kinds)
        return out

    def _empty(self, key: str) -> torch.Tensor:
        if key not in self.meta:
            raise ValueError(f"{self.ckpt} has no {key!r}: not a whole megatron engine checkpoint")
        m = self.meta[key]
        return torch.empty(tuple(m.size), dtype=m.properties.dtype)


def reshard(ckpt: Path, hf_config: Any, layout, parts: Iterable[str], pad_vocab_to: int = 1) -> dict[str, Any]:
    """This rank's ``parts`` (``model`` and ``critic``, with their optimizers ``optim`` and ``critic_optim``) of a
    megatron engine checkpoint of other TP/PP sizes, under the names
    :meth:`MegatronEngine.checkpoint_state` gives them for ``layout``."""
    parts, state = set(parts), {}
    for part, optim, critic in (("model", "optim", False), ("critic", "critic_optim", True)):
        if part in parts:
            src = _Source(Path(ckpt), part, optim if optim in parts else None)
            state.update(_reshard_model(src, hf_config, layout, pad_vocab_to, critic))
    return state


def _reshard_model(src: _Source, hf_config: Any, layout, pad_vocab_to: int, critic: bool) -> dict[str, Any]:
    t0 = time.time()
    layers = int(hf_config.num_hidden_layers)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    kinds = ("model", *MOMENTS) if src.optim else ("model",)
    mine: dict[str, dict[str, torch.Tensor]] = {k: {} for k in (*kinds, "step")}

    def put(saved: list[Mapping[str, Mapping[str, torch.Tensor]]], made: dict[str, dict[str, torch.Tensor]]) -> None:
        for kind, tensors in made.items():
            mine[kind].update(tensors)
        if src.optim:  # AdamW counts its steps per tensor; every tensor took each step
            step = next(iter(saved[0]["step"].values()))
            mine["step"].update({n: step.clone() for n in made["model"]})

    def vocab(stage: int, name: str, to: str) -> None:
        saved = src.read(stage, [name])
        put(saved, {k: {to: convert.vocab_to_mcore(convert.vocab_to_hf([s[k][name] for s in saved], hf_config),
                                                   hf_config, layout.tp, layout.tp_rank, pad_vocab_to)}
                    for k in kinds})

    def replicated(stage: int, names: list[str]) -> None:  # the same on every TP rank: TP rank 0's
        saved = src.read(stage, names)
        put(saved, {k: {n: saved[0][k][n].clone() for n in names} for k in kinds})

    per_saved = layers // src.pp
    if layout.first_stage:
        vocab(0, EMBEDDING, EMBEDDING)
    for local, i in enumerate(convert.stage_layers(layers, layout.pp, layout.stage)):
        stage, at = divmod(i, per_saved)
        head = f"decoder.layers.{at}."
        names = src.names(stage, head)
        saved = src.read(stage, names)
        made = {}
        for k in kinds:
            hf = convert.layer_to_hf([{n[len(head):]: s[k][n] for n in names} for s in saved], hf_config)
            made[k] = {f"decoder.layers.{local}.{n}": t for n, t in
                       convert.layer_to_mcore(hf, hf_config, layout.tp, layout.tp_rank).items()}
        put(saved, made)
    if layout.last_stage:
        replicated(src.pp - 1, [FINAL_NORM])
        if critic:  # the value head (a critic never ties it to the embedding)
            replicated(src.pp - 1, [OUTPUT, VALUE_BIAS])
        elif not tied:
            vocab(src.pp - 1, OUTPUT, OUTPUT)
        elif layout.pp > 1:  # the last stage's copy of the tied embedding
            vocab(0, EMBEDDING, OUTPUT)
    at = prefix(layout.tp, layout.tp_rank, layout.pp, layout.stage)
    state: dict[str, Any] = {src.part: {f"{at}/{n}": t for n, t in mine["model"].items()}}
    if src.optim:
        state[src.optim_part] = {f"{at}/{n}/{k}": mine[k][n] for n in mine["model"] for k in (*MOMENTS, "step")}
    log.info("checkpoint %s (%s) of TP=%d PP=%d resharded onto TP rank %d of %d, stage %d of %d: %d tensors in "
             "%.2fs", src.ckpt, src.part, src.tp, src.pp, layout.tp_rank, layout.tp, layout.stage, layout.pp,
             len(mine["model"]), time.time() - t0)
    return state
