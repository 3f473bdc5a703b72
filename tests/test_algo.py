"""hpcrl.algo against plain-Python float64 references: advantages, token logprobs, decoupled PPO loss."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcrl.algo import (
    AlgoConfig,
    decoupled_ppo_loss,
    group_advantages,
    loss_normaliser,
    token_logprobs,
    uniform_groups,
)

torch.set_num_threads(1)

AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
F64 = torch.float64


# ---------------------------------------------------------------- references (plain Python floats)

def ref_advantages(rows: list[list[float]], estimator: str, eps: float) -> list[list[float]]:
    out = []
    for r in rows:
        g = len(r)
        mean = sum(r) / g
        if all(x == r[0] for x in r):
            out.append([0.0] * g)
        elif estimator == "grpo":
            std = math.sqrt(sum((x - mean) ** 2 for x in r) / g)
            out.append([(x - mean) / (std + eps) for x in r])
        elif estimator == "dr_grpo":
            out.append([x - mean for x in r])
        else:
            out.append([x - (sum(r) - x) / (g - 1) for x in r])
    return out


def ref_token_loss(lp, px, bh, a, lo, hi, cap):
    r = math.exp(lp - px)
    w = math.exp(px - bh)
    if cap is not None:
        w = min(w, cap)
    return w * max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))


def ref_loss(logp, prox, behav, adv, mask, cfg, sequences, normaliser=None):
    """sequences: list of lists of (b, t) positions; adv is per token [B][T] lists."""
    per_seq = []
    for positions in sequences:
        per_seq.append([
            ref_token_loss(logp[b][t], prox[b][t], behav[b][t], adv[b][t], cfg.eps_clip, cfg.clip_high,
                           cfg.behav_imp_weight_cap)
            for b, t in positions if mask[b][t]
        ])
    nonempty = [v for v in per_seq if v]
    if cfg.loss_agg == "token_mean":
        total, count = sum(sum(v) for v in nonempty), sum(len(v) for v in nonempty)
    elif cfg.loss_agg == "seq_mean_token_mean":
        total, count = sum(sum(v) / len(v) for v in nonempty), len(nonempty)
    else:
        total, count = sum(sum(v) for v in nonempty), len(nonempty)
    return total / (normaliser if normaliser is not None else count)


def row_sequences(b: int, t: int) -> list[list[tuple[int, int]]]:
    return [[(i, j) for j in range(t)] for i in range(b)]


def random_batch(seed: int, b: int = 5, t: int = 7, garbage: bool = True):
    g = torch.Generator().manual_seed(seed)
    logp_prox = -torch.rand(b, t, generator=g, dtype=F64) * 3
    logp = logp_prox + 0.4 * torch.randn(b, t, generator=g, dtype=F64)
    logp_behav = logp_prox + 0.8 * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, generator=g, dtype=F64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[-1] = 0  # one fully padded row
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if garbage:  # padded positions hold values that poison any multiplication
        junk = torch.where(torch.arange(t)[None, :] % 2 == 0, -math.inf, math.nan)
        logp = torch.where(mask, logp, junk.to(F64).expand_as(logp))
        logp_prox = torch.where(mask, logp_prox, torch.full_like(logp, -math.inf))
        logp_behav = torch.where(mask, logp_behav, torch.full_like(logp, math.nan))
    return logp, logp_prox, logp_behav, adv, mask


# ---------------------------------------------------------------- advantages

@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_match_python_loop(estimator):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 8, generator=g, dtype=F64)
    rewards[2] = 0.7  # a uniform group
    rewards[3] = (torch.rand(8, generator=g) > 0.5).to(F64)
    got = group_advantages(rewards, estimator, eps=1e-6)
    want = torch.tensor(ref_advantages(rewards.tolist(), estimator, 1e-6), dtype=F64)
    assert got.shape == rewards.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(-100, 100), min_size=2, max_size=9).map(tuple), min_size=1, max_size=5)
       .filter(lambda rows: len({len(r) for r in rows}) == 1))
def test_grpo_advantages_sum_to_zero_per_group(rows):
    adv = group_advantages(torch.tensor(rows, dtype=F64), "grpo")
    assert torch.isfinite(adv).all()
    sums = adv.sum(dim=1)
    assert torch.allclose(sums, torch.zeros_like(sums), atol=1e-6 * adv.shape[1])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_uniform_group_gives_exact_zeros(estimator):
    rewards = torch.tensor([[0.1] * 7, [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float32)
    adv = group_advantages(rewards, estimator)
    assert not torch.isnan(adv).any()
    assert torch.equal(adv[0], torch.zeros(7))
    assert (adv[1] != 0).all()
    assert uniform_groups(rewards).tolist() == [True, False]


def test_advantages_reject_bad_input():
    with pytest.raises(ValueError, match="^adv_estimator"):
        group_advantages(torch.zeros(2, 3), "ppo")
    with pytest.raises(ValueError, match="^rewards"):
        group_advantages(torch.zeros(6), "grpo")
    with pytest.raises(ValueError, match="^group_size"):
        group_advantages(torch.tensor([[1.0], [2.0]]), "rloo")


# ---------------------------------------------------------------- decoupled loss vs the loop

@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("cap", [None, 1.3])
def test_decoupled_loss_matches_python_loop(agg, cap):
    cfg = AlgoConfig(loss_agg=agg, behav_imp_weight_cap=cap, eps_clip=0.2, eps_clip_high=0.28)
    logp, prox, behav, adv, mask = random_batch(seed=1)
    out = decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg)
    adv_tok = adv[:, None].expand_as(logp).tolist()
    want = ref_loss(logp.tolist(), prox.tolist(), behav.tolist(), adv_tok, mask.tolist(), cfg,
                    row_sequences(*logp.shape))
    assert math.isfinite(out.loss.item())
    assert out.loss.item() == pytest.approx(want, rel=1e-12, abs=1e-14)
    assert out.stats["n_tokens"] == mask.sum().item()
    if cap is not None:  # the cap is active on this data, so the test would see a missing clamp
        assert 0 < out.stats["imp_weight_capped_fraction"] < 1


@pytest.mark.parametrize("agg", AGGS)
def test_packed_sequences_match_python_loop(agg):
    cfg = AlgoConfig(loss_agg=agg)
    g = torch.Generator().manual_seed(2)
    lengths = [3, 5, 1, 6, 9]  # consecutive sequences in a packed [2, 12] batch
    logp, prox, behav, _, _ = random_batch(seed=3, b=2, t=12, garbage=False)
    mask = torch.rand(2, 12, generator=g) > 0.3
    mask[0, 8] = False  # the 1-token sequence is fully masked
    seq_adv = torch.randn(len(lengths), generator=g, dtype=F64)
    out = decoupled_ppo_loss(logp, prox, behav, seq_adv, mask, cfg, seq_lengths=torch.tensor(lengths))
    positions = [(i // 12, i % 12) for i in range(24)]
    sequences, start = [], 0
    for n in lengths:
        sequences.append(positions[start:start + n])
        start += n
    adv_tok = [[0.0] * 12 for _ in range(2)]
    for s, seq in enumerate(sequences):
        for b, t in seq:
            adv_tok[b][t] = seq_adv[s].item()
    want = ref_loss(logp.tolist(), prox.tolist(), behav.tolist(), adv_tok, mask.tolist(), cfg, sequences)
    assert out.loss.item() == pytest.approx(want, rel=1e-12)


def reference_expression(logp, prox, behav, adv, mask, cfg):
    """The loss written directly in torch float64 (valid tokens only, no NaN guards)."""
    r = torch.exp(logp - prox)
    w = torch.exp(prox - behav)
    if cfg.behav_imp_weight_cap is not None:
        w = w.clamp(max=cfg.behav_imp_weight_cap)
    a = adv[:, None]
    lt = w * torch.maximum(-a * r, -a * r.clamp(1 - cfg.eps_clip, 1 + cfg.clip_high)) * mask
    if cfg.loss_agg == "token_mean":
        return lt.sum() / mask.sum()
    n = mask.sum(-1)
    keep = n > 0
    per_seq = lt.sum(-1)[keep]
    if cfg.loss_agg == "seq_mean_token_mean":
        per_seq = per_seq / n[keep]
    return per_seq.sum() / keep.sum()


@pytest.mark.parametrize("agg", AGGS)
def test_gradients_match_autograd_of_reference(agg):
    cfg = AlgoConfig(loss_agg=agg, behav_imp_weight_cap=1.5)
    clean = random_batch(seed=4, b=4, t=6, garbage=False)
    dirty = random_batch(seed=4, b=4, t=6, garbage=True)
    mask = clean[4].to(F64)
    x_ref = clean[0].clone().requires_grad_(True)
    reference_expression(x_ref, clean[1], clean[2], clean[3], mask, cfg).backward()
    x = dirty[0].clone().requires_grad_(True)
    decoupled_ppo_loss(x, *dirty[1:], cfg).loss.backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[~clean[4]] == 0).all()
    assert x_ref.grad.abs().sum() > 0
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-15)


def test_masked_garbage_does_not_leak():
    cfg = AlgoConfig()
    logp, prox, behav, adv, mask = random_batch(seed=5)
    base = decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg)
    noisy = [t.clone() for t in (logp, prox, behav)]
    for t in noisy:
        t[~mask] = 1e30
    noisy[0].requires_grad_(True)
    other = decoupled_ppo_loss(*noisy, adv, mask, cfg)
    other.loss.backward()
    assert torch.isfinite(noisy[0].grad).all() and (noisy[0].grad[~mask] == 0).all()
    assert other.loss.item() == base.loss.item()
    assert other.stats == base.stats
    empty = decoupled_ppo_loss(logp, prox, behav, adv, torch.zeros_like(mask), cfg)
    assert empty.loss.item() == 0.0 and empty.stats["n_tokens"] == 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), eps=st.floats(0.05, 0.5), agg=st.sampled_from(AGGS))
def test_equal_behaviour_and_proximal_is_plain_ppo(seed, eps, agg):
    cfg = AlgoConfig(eps_clip=eps, loss_agg=agg, behav_imp_weight_cap=2.0)
    logp, old, _, adv, mask = random_batch(seed, garbage=False)
    out = decoupled_ppo_loss(logp, old, old.clone(), adv, mask, cfg)
    r = torch.exp(logp - old)
    a = adv[:, None]
    lt = torch.maximum(-a * r, -a * r.clamp(1 - eps, 1 + eps)) * mask
    n = mask.sum(-1)
    if agg == "token_mean":
        want = lt.sum() / mask.sum()
    elif agg == "seq_mean_token_mean":
        want = (lt.sum(-1)[n > 0] / n[n > 0]).sum() / (n > 0).sum()
    else:
        want = lt.sum(-1)[n > 0].sum() / (n > 0).sum()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-10, abs=1e-14)
    assert out.stats["imp_weight_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batches_with_global_normaliser_sum_to_whole(agg):
    cfg = AlgoConfig(loss_agg=agg)
    logp, prox, behav, adv, mask = random_batch(seed=6, b=9, t=8)
    x = logp.clone().requires_grad_(True)
    whole = decoupled_ppo_loss(x, prox, behav, adv, mask, cfg).loss
    whole.backward()
    whole_grad = x.grad.clone()
    x.grad = None
    splits = [slice(0, 2), slice(2, 7), slice(7, 9)]
    norm = sum(loss_normaliser(mask[s], agg) for s in splits)
    assert norm == loss_normaliser(mask, agg)
    parts = [decoupled_ppo_loss(x[s], prox[s], behav[s], adv[s], mask[s], cfg, normaliser=norm).loss
             for s in splits]
    total = sum(parts)
    total.backward()
    assert total.item() == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(x.grad, whole_grad, rtol=1e-12, atol=1e-15)
    local = decoupled_ppo_loss(x[splits[1]], prox[splits[1]], behav[splits[1]], adv[splits[1]],
                               mask[splits[1]], cfg).loss
    assert local.item() != pytest.approx(parts[1].item())  # the normaliser argument is used


def test_stats_match_loop():
    cfg = AlgoConfig(eps_clip=0.1, behav_imp_weight_cap=1.2)
    logp, prox, behav, adv, mask = random_batch(seed=7, garbage=True)
    s = decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg).stats
    clipped, ws, ratios, kls = 0, [], [], []
    for b, t in zip(*torch.nonzero(mask, as_tuple=True)):
        d = (logp[b, t] - prox[b, t]).item()
        r, a = math.exp(d), adv[b].item()
        clipped += -a * r < -a * min(max(r, 0.9), 1.1)
        ws.append(math.exp((prox[b, t] - behav[b, t]).item()))
        ratios.append(r)
        kls.append(math.exp(-d) - 1 + d)
    n = len(ws)
    assert s["n_tokens"] == n
    assert s["clip_fraction"] == pytest.approx(clipped / n) and 0 < clipped < n
    assert s["imp_weight_mean"] == pytest.approx(sum(ws) / n)
    assert s["imp_weight_max"] == pytest.approx(max(ws))
    assert s["imp_weight_capped_fraction"] == pytest.approx(sum(w > 1.2 for w in ws) / n)
    assert s["ratio_mean"] == pytest.approx(sum(ratios) / n)
    assert s["approx_kl"] == pytest.approx(sum(kls) / n) and s["approx_kl"] > 0


# ---------------------------------------------------------------- M2PO's second-moment mask

def ref_m2po_keep(m2: list[float], threshold: float) -> list[bool]:
    """M2PO as its paper states it: mask the largest m2 first until the mean of the rest is below threshold."""
    order = sorted(range(len(m2)), key=lambda i: -m2[i])
    keep = [True] * len(m2)
    rest = list(m2)
    for i in order:
        if sum(rest) / len(rest) < threshold if rest else True:
            break
        keep[i] = False
        rest.remove(m2[i])
    return keep


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("threshold", [0.02, 0.3, 5.0])
def test_m2po_cutoff_keeps_what_largest_first_masking_keeps_in_any_number_of_chunks(seed, threshold):
    from hpcrl.algo.m2po import m2_values, m2po_cutoff

    logp, prox, behav, _, mask = random_batch(seed=seed, b=9, t=13)
    behav = torch.where(torch.rand(behav.shape, generator=torch.Generator().manual_seed(seed)) < 0.1,
                        behav - 3.0, behav)  # a few outliers, as stale tokens give
    m2 = m2_values(prox, behav, mask)
    assert m2.numel() == int(mask.sum()) and bool(torch.isfinite(m2).all())
    want = ref_m2po_keep(m2.tolist(), threshold)
    cutoff = m2po_cutoff([m2], threshold)
    assert (m2 <= cutoff).tolist() == want
    if all(want):
        assert cutoff == math.inf
    else:
        kept = m2[m2 <= cutoff]
        assert 0 < kept.numel() < m2.numel() and float(kept.mean()) < threshold
    chunks = [m2_values(prox[i:i + 2], behav[i:i + 2], mask[i:i + 2]) for i in range(0, 9, 2)]
    assert m2po_cutoff(chunks, threshold) == cutoff  # micro-batches: the same cutoff


def test_m2po_cutoff_summed_over_ranks_is_the_one_of_all_tokens_and_edge_cases():
    """Two ranks (threads whose ``global_sum`` adds both, as an all-reduce does) find the cutoff of all tokens."""
    import threading

    from hpcrl.algo.m2po import m2po_cutoff

    ranks = [torch.tensor([0.01, 0.02, 4.0], dtype=F64), torch.tensor([0.03, 9.0], dtype=F64)]
    assert ref_m2po_keep([0.01, 0.02, 4.0, 0.03, 9.0], 0.5) == [True, True, False, True, False]
    barrier, box, got = threading.Barrier(2), [None, None], [None, None]

    def rank(r: int) -> None:
        def global_sum(local: torch.Tensor) -> torch.Tensor:
            box[r] = local.clone()
            barrier.wait()
            total = box[0] + box[1]
            barrier.wait()
            return total
        got[r] = m2po_cutoff([ranks[r]], 0.5, global_sum)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert got[0] == got[1] == m2po_cutoff([torch.cat(ranks)], 0.5) and 0.03 <= got[0] < 4.0
    with pytest.raises(ValueError, match="threshold"):
        m2po_cutoff(ranks, 0.0)
    assert m2po_cutoff([torch.tensor([2.0, 3.0], dtype=F64)], 1.0) < 2.0  # even the smallest too far: all masked
    assert m2po_cutoff([torch.zeros(0, dtype=F64)], 1.0) == math.inf
    # a token with m2 = inf (a -inf logprob) is masked alone: it neither sinks the others nor stays
    finite = torch.tensor([0.001] * 99, dtype=F64)
    for others in (finite, torch.cat([finite, torch.tensor([0.5, 0.6], dtype=F64)])):
        m2 = torch.cat([others, torch.tensor([math.inf], dtype=F64)])
        c = m2po_cutoff([m2], 0.04)
        assert (m2 <= c).tolist() == ref_m2po_keep(others.tolist(), 0.04) + [False]


@pytest.mark.parametrize("agg", AGGS)
def test_loss_with_an_m2_cutoff_gives_the_masked_tokens_weight_zero(agg):
    from hpcrl.algo.m2po import m2_values, m2po_cutoff

    cfg = AlgoConfig(loss_agg=agg, behav_imp_weight_cap=None, m2_threshold=0.3)
    logp, prox, behav, adv, mask = random_batch(seed=4)
    cutoff = m2po_cutoff([m2_values(prox, behav, mask)], cfg.m2_threshold)
    out = decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg, m2_cutoff=cutoff)
    masked = mask & ((behav - prox) ** 2 > cutoff)
    assert 0 < int(masked.sum()) < int(mask.sum())
    zero_adv = torch.where(masked, 0.0, adv[:, None].expand_as(logp))  # weight 0 == advantage 0 for the loss
    want = ref_loss(logp.tolist(), prox.tolist(), behav.tolist(), zero_adv.tolist(), mask.tolist(), cfg,
                    row_sequences(*logp.shape))
    assert out.loss.item() == pytest.approx(want, rel=1e-12, abs=1e-14)
    assert out.stats["m2_masked_fraction"] == pytest.approx(int(masked.sum()) / int(mask.sum()))
    m2 = m2_values(prox, behav, mask)
    assert out.stats["imp_weight_m2"] == pytest.approx(float(m2.mean())) and out.stats["imp_weight_m2"] >= 0.3
    plain = decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg)
    assert plain.stats["m2_masked_fraction"] == 0 and plain.loss.item() != pytest.approx(out.loss.item())


# ---------------------------------------------------------------- token logprobs and config

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_log_softmax(temperature):
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 5, 11, generator=g, dtype=F64) * 4
    targets = torch.randint(0, 11, (3, 5), generator=g)
    want = torch.log_softmax(logits / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
    got = token_logprobs(logits, targets, temperature)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    low = token_logprobs(logits.to(torch.bfloat16), targets, temperature)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low.double(), want, rtol=0.05, atol=0.1)


@pytest.mark.parametrize("kwargs, field", [
    ({"adv_estimator": "ppo"}, "adv_estimator"),
    ({"loss_agg": "sum"}, "loss_agg"),
    ({"eps_clip": 1.0}, "eps_clip"),
    ({"eps_clip": 0.0}, "eps_clip"),
    ({"eps_clip_high": -0.1}, "eps_clip_high"),
    ({"behav_imp_weight_cap": 1.0}, "behav_imp_weight_cap"),
    ({"temperature": 0.0}, "temperature"),
    ({"adv_eps": 0.0}, "adv_eps"),
    ({"m2_threshold": 0.0}, "m2_threshold"),
    ({"m2_threshold": 0.04, "prox_approx": True}, "m2_threshold"),
    ({"m2_threshold": 0.04, "decoupled": False}, "m2_threshold"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        AlgoConfig(**kwargs)


def test_config_defaults_and_omegaconf():
    from omegaconf import OmegaConf

    cfg = AlgoConfig()
    assert cfg.clip_high == cfg.eps_clip == 0.2
    merged = OmegaConf.merge(OmegaConf.structured(AlgoConfig), {"eps_clip_high": 0.28, "loss_agg": "seq_mean_token_sum"})
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, AlgoConfig) and obj.clip_high == 0.28
