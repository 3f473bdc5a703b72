"""From spool prompt groups to padded micro-batches (pure functions).

Ordering rules: rewards are shaped (overlong penalty) and advantages computed
on whole prompt groups and the whole step batch *before* anything is split
(token-level estimators get per-sequence scores here and per-token advantages
in the engine); groups whose rewards are all equal are left out of the loss when
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
from typing import Callable

import numpy as np
import torch

from hpcrl.algo.advantages import group_advantages
from hpcrl.algo.config import AlgoConfig
from hpcrl.algo.dapo import is_informative, overlong_penalty
from hpcrl.spool.format import TrajectoryGroup


@dataclass
class TrainSequence:
    tokens: np.ndarray  # int64 [P + L], prompt then response
    prompt_len: int
    behav_logprobs: np.ndarray  # float32 [L]
    versions: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L]
    advantage: float  # sequence advantage, or the sequence score for token-level estimators
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
    seq_scores: torch.Tensor | None = None  # float32 [b], TrainSequence.advantage of each row

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum().item())


def shaped_rewards(group: TrajectoryGroup, cfg: AlgoConfig) -> list[float]:
    """The group's rewards after reward shaping (DAPO's soft overlong penalty when ``overlong_buffer > 0``)."""
    rewards = [float(s.reward) for s in group.samples]
    if cfg.overlong_buffer > 0:
        lengths = torch.tensor([len(s.response_ids) for s in group.samples])
        penalty = overlong_penalty(lengths, cfg.overlong_max_tokens, cfg.overlong_buffer, cfg.overlong_penalty_factor)
        rewards = [r + p for r, p in zip(rewards, penalty.tolist())]
    return rewards


def informative_filter(cfg: AlgoConfig) -> Callable[[TrajectoryGroup], bool] | None:
    """DAPO dynamic sampling: the feed's test for groups worth training on (None when it is off)."""
    if not cfg.dynamic_sampling:
        return None
    return lambda group: is_informative(shaped_rewards(group, cfg))


def to_sequences(groups: list[TrajectoryGroup], cfg: AlgoConfig) -> tuple[list[TrainSequence], int]:
    """All trainable sequences of ``groups`` and the number of uniform groups left out.

    Advantages (or, for token-level estimators, sequence scores) are computed
    on the shaped rewards of all kept groups at once, so batch-level
    statistics cover the whole step batch. Groups may differ in size (agent
    episodes exported ``individual``); see :func:`advantages`.
    """
    kept, rows, n_uniform = [], [], 0
    for group in groups:
        rewards = shaped_rewards(group, cfg)
        if cfg.drop_uniform_groups and not is_informative(rewards):
            n_uniform += 1
            continue
        kept.append(group)
        rows.append(rewards)
    if not kept:
        return [], n_uniform
    seqs = []
    for group, adv_row in zip(kept, advantages(rows, cfg)):
        prompt = np.asarray(group.prompt_ids, dtype=np.int64)
        for sample, a in zip(group.samples, adv_row):
            if len(sample.response_ids) == 0:
                continue
            seqs.append(TrainSequence(
                tokens=np.concatenate([prompt, np.asarray(sample.response_ids, dtype=np.int64)]),
                prompt_len=len(prompt), behav_logprobs=np.asarray(sample.behav_logprobs, dtype=np.float32),
                versions=np.asarray(sample.versions), loss_mask=np.asarray(sample.loss_mask),
                advantage=float(a), ticket=group.ticket))
    return seqs, n_uniform


def advantages(rows: list[list[float]], cfg: AlgoConfig) -> list[list[float]]:
    """Per-sample advantages (or scores) of groups of rewards, in float64.

    Groups of one size go through the 2-D estimators; groups of different sizes (agent episodes exported
    ``individual``: one sample per model call) through the ragged ones, whose group statistics are over
    each group's own samples (see :mod:`hpcrl.algo.advantages`)."""
    kw = dict(mean_level=cfg.adv_mean_level, std_level=cfg.adv_std_level, unbiased=cfg.adv_std_unbiased)
    sizes = [len(r) for r in rows]
    if len(set(sizes)) == 1:
        return group_advantages(torch.tensor(rows, dtype=torch.float64), cfg.adv_estimator, cfg.adv_eps,
                                **kw).tolist()
    flat = group_advantages(torch.tensor([x for r in rows for x in r], dtype=torch.float64), cfg.adv_estimator,
                            cfg.adv_eps, group_sizes=sizes, **kw).tolist()
    ends = np.cumsum(sizes).tolist()
    return [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]


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
    scores = torch.tensor([s.advantage for s in seqs], dtype=torch.float32)
    return MicroBatch(ids, attn, ids[:, 1:].clone(), mask, behav, adv, vers, scores)
