"""Prompt groups of different sizes (agent episodes exported ``individual``) through the advantages and the
trainer's batch, against a float64 reference computed group by group in plain Python."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hpcrl.algo import AlgoConfig, group_advantages, uniform_groups
from hpcrl.spool.format import Sample, TrajectoryGroup
from hpcrl.trainer import batch as B

torch.set_num_threads(1)

F64 = torch.float64
# estimator, its (mean, std) levels at the sequence stage, explicit level overrides
CASES = [
    ("grpo", "group", "group", {}), ("dr_grpo", "group", "none", {}), ("rloo", "loo", "none", {}),
    ("lite_ppo", "group", "batch", {}), ("reinforce_pp", "none", "none", {}),
    ("reinforce_pp_baseline", "group", "none", {}), ("gae", "none", "none", {}),
    ("grpo", "batch", "batch", {"mean_level": "batch", "std_level": "batch"}),
    ("dr_grpo", "group", "group", {"std_level": "group"}),
    ("grpo", "none", "group", {"mean_level": "none"}),
]


def _std(xs: list[float], unbiased: bool) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - (1 if unbiased else 0)))


def ref_ragged(rows: list[list[float]], mean_lv: str, std_lv: str, unbiased: bool, eps: float) -> list[list[float]]:
    """Each group on its own: its mean/std over its own samples; batch level over every sample."""
    flat = [x for r in rows for x in r]
    batch_mean = sum(flat) / len(flat)
    batch_std = _std(flat, unbiased) if len(flat) > 1 else 0.0
    out = []
    for r in rows:
        g = len(r)
        if mean_lv in ("group", "loo") and len(set(r)) == 1:
            out.append([0.0] * g)
            continue
        row = []
        for x in r:
            if mean_lv == "loo":
                c = x - (sum(r) - x) / (g - 1)
            else:
                c = x - {"group": sum(r) / g, "batch": batch_mean, "none": 0.0}[mean_lv]
            scale = {"group": _std(r, unbiased) if std_lv == "group" else 0.0, "batch": batch_std}.get(std_lv)
            row.append(c if scale is None else c / (scale + eps))
        out.append(row)
    return out


def ragged_rows(seed: int) -> list[list[float]]:
    """Groups of 2..9 samples: random, uniform, 0/1, and discounted rewards (r * d**k) as individual makes."""
    rng = np.random.default_rng(seed)
    rows = [rng.normal(size=int(rng.integers(2, 10))).tolist() for _ in range(4)]
    rows.append([0.25] * 5)  # uniform
    rows.append([float(x) for x in rng.integers(0, 2, size=7)] + [0.0, 1.0])
    rows.append([1.0 * 0.9 ** k for k in (2, 1, 0)] + [0.5 * 0.9 ** k for k in (1, 0)] + [0.0])
    return rows


@pytest.mark.parametrize("estimator, mean_lv, std_lv, levels", CASES)
@pytest.mark.parametrize("unbiased", [False, True])
def test_ragged_groups_match_the_per_group_reference(estimator, mean_lv, std_lv, levels, unbiased):
    rows = ragged_rows(3)
    sizes = [len(r) for r in rows]
    assert len(set(sizes)) > 1
    flat = torch.tensor([x for r in rows for x in r], dtype=F64)
    got = group_advantages(flat, estimator, 1e-6, unbiased=unbiased, group_sizes=sizes, **levels)
    want = [x for r in ref_ragged(rows, mean_lv, std_lv, unbiased, 1e-6) for x in r]
    assert got.shape == flat.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("estimator, mean_lv, std_lv, levels", CASES)
def test_ragged_path_on_equal_groups_agrees_with_the_2d_path(estimator, mean_lv, std_lv, levels):
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(4, 6, generator=g, dtype=F64)
    rewards[2] = 1.5
    two_d = group_advantages(rewards, estimator, 1e-6, **levels)
    flat = group_advantages(rewards.reshape(-1), estimator, 1e-6, group_sizes=[6] * 4, **levels)
    torch.testing.assert_close(flat.reshape(4, 6), two_d, rtol=1e-12, atol=1e-12)


def test_ragged_uniform_groups_are_found_and_zero_not_nan():
    rows = [[0.3, 0.3, 0.3], [1.0], [0.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0], [5.0, 5.0, 5.0, 4.0]]
    flat = torch.tensor([x for r in rows for x in r], dtype=torch.float32)
    sizes = [len(r) for r in rows]
    assert uniform_groups(flat, sizes).tolist() == [True, True, False, True, False]
    adv = group_advantages(flat, "grpo", group_sizes=sizes)
    assert torch.isfinite(adv).all()
    assert (adv[:4] == 0).all() and (adv[6:13] == 0).all()
    assert (adv[4:6] != 0).all() and (adv[13:] != 0).all()
    assert abs(float(adv[13:].sum())) < 1e-5  # a group's GRPO advantages sum to zero


def test_ragged_groups_reject_bad_input_naming_the_option():
    flat = torch.tensor([1.0, 0.0, 1.0, 0.5], dtype=F64)
    with pytest.raises(ValueError, match="^group_sizes: sum to 5"):
        group_advantages(flat, "grpo", group_sizes=[2, 3])
    with pytest.raises(ValueError, match="^group_sizes: every group needs at least one sample"):
        group_advantages(flat, "grpo", group_sizes=[2, 0, 2])
    with pytest.raises(ValueError, match="^rewards: with group_sizes"):
        group_advantages(flat.reshape(2, 2), "grpo", group_sizes=[2, 2])
    with pytest.raises(ValueError, match="^group_size: rloo needs at least 2 samples per group, got 1"):
        group_advantages(flat, "rloo", group_sizes=[3, 1])
    with pytest.raises(ValueError, match="^group_size: an unbiased group std"):
        group_advantages(flat, "grpo", unbiased=True, group_sizes=[1, 3])
    # no group std, no leave-one-out: a group of one is fine
    assert torch.isfinite(group_advantages(flat, "dr_grpo", unbiased=True, group_sizes=[1, 3])).all()


# ---------------------------------------------------------------- the trainer's batch

def group(ticket: int, rewards: list[float], seed: int) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    samples = []
    for r in rewards:
        n = int(rng.integers(1, 6))
        samples.append(Sample(response_ids=rng.integers(3, 40, size=n).astype(np.int32),
                              behav_logprobs=(-rng.random(n)).astype(np.float32),
                              versions=rng.integers(0, 3, size=n).astype(np.int32),
                              loss_mask=np.ones(n, np.uint8), reward=r, finish_reason="stop"))
    return TrajectoryGroup(ticket=ticket, writer="w", prompt_ids=np.array([5, 6, 7], np.int32), samples=samples)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "lite_ppo", "reinforce_pp_baseline"])
def test_to_sequences_trains_groups_of_different_sizes(estimator):
    rows = [[1.0, 0.9, 0.81, 0.0, 0.5], [0.7, 0.7, 0.7], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.25, 0.5, 1.0]]
    groups = [group(t, r, seed=t) for t, r in enumerate(rows)]
    cfg = AlgoConfig(adv_estimator=estimator, kl_coef=0.0)
    seqs, n_uniform = B.to_sequences(groups, cfg)
    assert n_uniform == 1  # the all-0.7 group
    kept = [rows[0], rows[2], rows[3]]
    mean_lv, std_lv = {"grpo": ("group", "group"), "rloo": ("loo", "none"), "lite_ppo": ("group", "batch"),
                       "reinforce_pp_baseline": ("group", "none")}[estimator]
    want = [x for r in ref_ragged(kept, mean_lv, std_lv, False, cfg.adv_eps) for x in r]
    assert [s.ticket for s in seqs] == [0] * 5 + [2] * 3 + [3] * 7
    assert [s.advantage for s in seqs] == pytest.approx(want, rel=1e-9, abs=1e-12)
    # each sample keeps its own tokens and per-token versions
    for s, sample in zip(seqs, [x for g in (groups[0], groups[2], groups[3]) for x in g.samples]):
        np.testing.assert_array_equal(s.tokens[3:], sample.response_ids)
        np.testing.assert_array_equal(s.versions, sample.versions)


def test_to_sequences_keeps_every_group_when_uniform_groups_are_not_dropped():
    rows = [[0.7, 0.7, 0.7], [0.0, 1.0], [1.0, 0.0, 0.0, 1.0]]
    seqs, n_uniform = B.to_sequences([group(t, r, seed=t) for t, r in enumerate(rows)],
                                     AlgoConfig(drop_uniform_groups=False))
    assert n_uniform == 0 and len(seqs) == 9
    assert [s.advantage for s in seqs[:3]] == [0.0] * 3  # a uniform group is exactly zero, never NaN
    want = [x for r in ref_ragged(rows[1:], "group", "group", False, 1e-6) for x in r]
    assert [s.advantage for s in seqs[3:]] == pytest.approx(want, rel=1e-9, abs=1e-12)
