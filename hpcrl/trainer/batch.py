"""From spool prompt groups to padded micro-batches (pure functions).

Ordering rules: advantages are computed per prompt group *before* anything is
split; groups whose rewards are all equal are left out of the loss when
``drop_uniform_groups`` is set (they carry no signal); the remaining sequences
are split into ``n_minibatches`` minibatches (one optimizer update each), each
minibatch is dealt round-robin to the ranks by decreasing length (balanced
work), and each rank packs its share into micro-batches whose padded size
fits ``micro_batch_tokens``.

Position ``t`` of a micro-batch row holds the prediction of token ``t + 1``:
``targets[:, t] = input_ids[:, t + 1]``; response token ``j`` of a sequence
with prompt length ``P`` sits at ``t = P - 1 + j``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hpcrl.algo.advantages import group_advantages, uniform_groups
from hpcrl.algo.config import AlgoConfig
from hpcrl.spool.format import TrajectoryGroup


@dataclass
class TrainSequence:
    tokens: np.ndarray  # int64 [P + L], prompt then response
    prompt_len: int
    behav_logprobs: np.ndarray  # float32 [L]
    versions: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L]
    advantage: float
    ticket: int

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # int64 [b, T]
    attention_mask: torch.Tensor  # int64 [b, T]
    targets: torch.Tensor  # int64 [b, T-1]
    mask: torch.Tensor  # float32 [b, T-1], 1 on trained response tokens
    behav_logprobs: torch.Tensor  # float32 [b, T-1]
    advantages: torch.Tensor  # float32 [b, T-1]
    versions: torch.Tensor  # int64 [b, T-1], -1 off the response

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum().item())


def to_sequences(groups: list[TrajectoryGroup], cfg: AlgoConfig) -> tuple[list[TrainSequence], int]:
    """All trainable sequences of ``groups`` and the number of uniform groups left out."""
    seqs, n_uniform = [], 0
    for group in groups:
        rewards = torch.tensor([[s.reward for s in group.samples]], dtype=torch.float64)
        if cfg.drop_uniform_groups and bool(uniform_groups(rewards)[0]):
            n_uniform += 1
            continue
        adv = group_advantages(rewards, cfg.adv_estimator, cfg.adv_eps)[0]
        prompt = np.asarray(group.prompt_ids, dtype=np.int64)
        for sample, a in zip(group.samples, adv.tolist()):
            if len(sample.response_ids) == 0:
                continue
            seqs.append(TrainSequence(
                tokens=np.concatenate([prompt, np.asarray(sample.response_ids, dtype=np.int64)]),
                prompt_len=len(prompt), behav_logprobs=np.asarray(sample.behav_logprobs, dtype=np.float32),
                versions=np.asarray(sample.versions), loss_mask=np.asarray(sample.loss_mask),
                advantage=float(a), ticket=group.ticket))
    return seqs, n_uniform


def split_minibatches(seqs: list[TrainSequence], n: int) -> list[list[TrainSequence]]:
    """``n`` contiguous, nearly equal minibatches (some may be empty if few sequences)."""
    bounds = np.linspace(0, len(seqs), n + 1).round().astype(int)
    return [seqs[bounds[i]:bounds[i + 1]] for i in range(n)]


def shard(seqs: list[TrainSequence], rank: int, world_size: int) -> list[TrainSequence]:
    """This rank's share: by decreasing length, dealt round-robin."""
    order = sorted(range(len(seqs)), key=lambda i: (-len(seqs[i]), i))
    return [seqs[i] for i in order[rank::world_size]]


def pack(seqs: list[TrainSequence], token_budget: int) -> list[list[TrainSequence]]:
    """Greedy packing of length-sorted sequences into rows x max_len <= budget."""
    out: list[list[TrainSequence]] = []
    current: list[TrainSequence] = []
    for seq in sorted(seqs, key=len, reverse=True):
        width = max([len(s) for s in current] + [len(seq)])
        if current and width * (len(current) + 1) > token_budget:
            out.append(current)
            current = []
        current.append(seq)
    if current:
        out.append(current)
    return out


def collate(seqs: list[TrainSequence], pad_id: int) -> MicroBatch:
    """Right-padded tensors for one micro-batch (an empty list gives a 1-row dummy with no tokens)."""
    if not seqs:
        seqs = [TrainSequence(np.array([pad_id, pad_id]), 1, np.zeros(1, np.float32), np.zeros(1, np.int32),
                              np.zeros(1, np.uint8), 0.0, -1)]
    b, width = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width - 1))
    behav = torch.zeros((b, width - 1))
    adv = torch.zeros((b, width - 1))
    vers = torch.full((b, width - 1), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        n, p, L = len(s), s.prompt_len, len(s.tokens) - s.prompt_len
        ids[i, :n] = torch.from_numpy(s.tokens)
        attn[i, :n] = 1
        span = slice(p - 1, p - 1 + L)
        mask[i, span] = torch.from_numpy(s.loss_mask.astype(np.float32))
        behav[i, span] = torch.from_numpy(s.behav_logprobs)
        adv[i, span] = s.advantage
        vers[i, span] = torch.from_numpy(s.versions.astype(np.int64))
    if seqs[0].ticket < 0:
        mask.zero_()
    return MicroBatch(ids, attn, ids[:, 1:].clone(), mask, behav, adv, vers)
