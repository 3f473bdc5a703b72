"""The GRPO/PPO family against float64 references written as plain Python loops.

Every estimator and loss variant is checked on random inputs whose padded
positions hold -inf/NaN garbage (which must change nothing and never leak).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcrl.algo import (
    AlgoConfig,
    approx_prox_logprobs,
    batch_moments,
    decoupled_ppo_loss,
    gae,
    group_advantages,
    kl_estimate,
    loss_normaliser,
    masked_moments,
    overlong_penalty,
    token_entropy,
    token_rewards,
    value_loss_per_token,
    whiten,
)

torch.set_num_threads(1)
F64 = torch.float64
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


def batch(seed: int, b: int = 6, t: int = 7, holes: bool = True):
    """Random float64 inputs; masked positions (padding and holes inside rows) hold garbage."""
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(b, t, generator=g, dtype=F64) * 3
    logp = prox + 0.3 * torch.randn(b, t, generator=g, dtype=F64)
    behav = prox + 0.6 * torch.randn(b, t, generator=g, dtype=F64)
    ref = prox + 0.5 * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, generator=g, dtype=F64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[-1] = 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if holes:
        mask &= torch.rand(b, t, generator=g) > 0.2
    junk = torch.where(torch.arange(t)[None, :] % 2 == 0, -math.inf, math.nan).to(F64).expand(b, t)
    dirty = [torch.where(mask, x, junk) for x in (logp, prox, behav, ref)]
    return dirty, adv, mask


# ---------------------------------------------------------------- advantages

def ref_adv(rows, mean_lv, std_lv, unbiased, eps):
    flat = [x for r in rows for x in r]
    sd = statistics.stdev if unbiased else statistics.pstdev
    out = []
    for r in rows:
        g = len(r)
        row = []
        for x in r:
            if mean_lv == "group":
                c = x - sum(r) / g
            elif mean_lv == "batch":
                c = x - sum(flat) / len(flat)
            elif mean_lv == "loo":
                c = x - (sum(r) - x) / (g - 1)
            else:
                c = x
            if std_lv == "group":
                c /= sd(r) + eps
            elif std_lv == "batch":
                c /= sd(flat) + eps
            row.append(c)
        if mean_lv in ("group", "loo") and len(set(r)) == 1:
            row = [0.0] * g
        out.append(row)
    return out


@pytest.mark.parametrize("estimator, mean_lv, std_lv, levels", [
    ("grpo", "group", "group", {}), ("dr_grpo", "group", "none", {}), ("rloo", "loo", "none", {}),
    ("lite_ppo", "group", "batch", {}), ("reinforce_pp", "none", "none", {}),
    ("reinforce_pp_baseline", "group", "none", {}), ("gae", "none", "none", {}),
    ("grpo", "batch", "batch", {"mean_level": "batch", "std_level": "batch"}),
    ("dr_grpo", "group", "group", {"std_level": "group"}),
    ("grpo", "none", "group", {"mean_level": "none"}),
])
@pytest.mark.parametrize("unbiased", [False, True])
def test_estimators_match_loop(estimator, mean_lv, std_lv, levels, unbiased):
    g = torch.Generator().manual_seed(11)
    rewards = torch.randn(5, 6, generator=g, dtype=F64)
    rewards[1] = 0.25
    rewards[3] = (torch.rand(6, generator=g) > 0.5).to(F64)
    got = group_advantages(rewards, estimator, 1e-6, unbiased=unbiased, **levels)
    want = torch.tensor(ref_adv(rewards.tolist(), mean_lv, std_lv, unbiased, 1e-6), dtype=F64)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 1.0, 0.5]), min_size=2, max_size=6).map(tuple), min_size=1,
                max_size=6).filter(lambda rows: len({len(r) for r in rows}) == 1),
       st.sampled_from(["grpo", "dr_grpo", "rloo", "lite_ppo", "reinforce_pp_baseline"]))
def test_group_baselines_sum_to_zero_and_never_nan(rows, estimator):
    adv = group_advantages(torch.tensor(rows, dtype=F64), estimator)
    assert torch.isfinite(adv).all()
    assert torch.allclose(adv.sum(dim=1), torch.zeros(len(rows), dtype=F64), atol=1e-9)


# ---------------------------------------------------------------- token stage: rewards, GAE, whitening

def ref_gae_row(rewards, values, mask, gamma, lam):
    """Compact the valid positions, run the textbook reverse loop, scatter back."""
    idx = [t for t, m in enumerate(mask) if m]
    adv, ret = [0.0] * len(mask), [0.0] * len(mask)
    running = 0.0
    for j in reversed(range(len(idx))):
        t = idx[j]
        next_v = values[idx[j + 1]] if j + 1 < len(idx) else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        running = delta + gamma * lam * running
        adv[t], ret[t] = running, running + values[t]
    return adv, ret


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reverse_loop_with_holes(gamma, lam):
    (_, _, _, _), _, mask = batch(seed=12, b=7, t=9)
    g = torch.Generator().manual_seed(13)
    rewards = torch.randn(7, 9, generator=g, dtype=F64)
    values = torch.randn(7, 9, generator=g, dtype=F64)
    garbage_r = torch.where(mask, rewards, torch.full_like(rewards, math.nan))
    garbage_v = torch.where(mask, values, torch.full_like(values, math.inf))
    adv, ret = gae(garbage_r, garbage_v, mask, gamma, lam)
    for b in range(7):
        want_a, want_r = ref_gae_row(rewards[b].tolist(), values[b].tolist(), mask[b].tolist(), gamma, lam)
        assert adv[b].tolist() == pytest.approx(want_a, rel=1e-12, abs=1e-12)
        assert ret[b].tolist() == pytest.approx(want_r, rel=1e-12, abs=1e-12)
    assert torch.isfinite(adv).all() and (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_token_rewards_and_returns_match_loop():
    (logp, _, _, ref), _, mask = batch(seed=14)
    scores = torch.tensor([1.0, -0.5, 0.0, 2.0, 0.3, 7.0], dtype=F64)
    kl = kl_estimate(logp, ref, "k1", mask)
    r = token_rewards(scores, mask, kl, kl_coef=0.1)
    ret, _ = gae(r, None, mask, 0.9, 1.0)
    for b in range(6):
        valid = [t for t in range(7) if mask[b, t]]
        want_r = [0.0] * 7
        for t in valid:
            want_r[t] = -0.1 * (logp[b, t] - ref[b, t]).item()
        if valid:
            want_r[valid[-1]] += scores[b].item()
        assert r[b].tolist() == pytest.approx(want_r, abs=1e-12)
        acc, want_ret = 0.0, [0.0] * 7
        for t in reversed(valid):
            acc = want_r[t] + 0.9 * acc
            want_ret[t] = acc
        assert ret[b].tolist() == pytest.approx(want_ret, abs=1e-12)


@pytest.mark.parametrize("unbiased", [False, True])
def test_whiten_with_split_moments_matches_loop(unbiased):
    g = torch.Generator().manual_seed(15)
    x = torch.randn(6, 5, generator=g, dtype=F64)
    mask = torch.rand(6, 5, generator=g) > 0.3
    x_dirty = torch.where(mask, x, torch.full_like(x, math.nan))
    moments = masked_moments(x_dirty[:2], mask[:2]) + masked_moments(x_dirty[2:], mask[2:])
    got = torch.cat([whiten(x_dirty[:2], mask[:2], moments, unbiased=unbiased, eps=1e-8),
                     whiten(x_dirty[2:], mask[2:], moments, unbiased=unbiased, eps=1e-8)])
    vals = x[mask].tolist()
    mu = sum(vals) / len(vals)
    sd = (statistics.stdev if unbiased else statistics.pstdev)(vals)
    want = torch.where(mask, (x - mu) / (sd + 1e-8), torch.zeros_like(x))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_whiten_keeps_its_digits_far_from_zero():
    """Values around 1e8 with a spread of 1e-2 (returns of a long episode with a large constant reward): the
    two-pass moments whiten them exactly as the float64 loop does, split over micro-batches; the one-pass
    E[x^2] - E[x]^2 (a zero center) loses the variance to rounding."""
    g = torch.Generator().manual_seed(21)
    x = 1e8 + 1e-2 * torch.randn(6, 5, generator=g, dtype=F64)
    mask = torch.rand(6, 5, generator=g) > 0.3
    moments, center = batch_moments([(x[:2], mask[:2]), (x[2:], mask[2:])])
    got = torch.cat([whiten(x[:2], mask[:2], moments, eps=0.0, center=center),
                     whiten(x[2:], mask[2:], moments, eps=0.0, center=center)])
    vals = x[mask].tolist()
    mu, sd = statistics.fmean(vals), statistics.pstdev(vals)
    want = torch.where(mask, (x - mu) / sd, torch.zeros_like(x))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    one_pass = whiten(x, mask, masked_moments(x, mask), eps=0.0)
    assert not torch.allclose(one_pass, want, rtol=1e-2, atol=1e-2)  # what the old formula gave


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_loop(clip):
    (v, old, ret, _), _, mask = batch(seed=16)
    got, flags = value_loss_per_token(v, old, ret, mask, clip)
    for b, t in [(b, t) for b in range(6) for t in range(7)]:
        if not mask[b, t]:
            assert got[b, t] == 0 and not flags[b, t]
            continue
        vv, oo, rr = v[b, t].item(), old[b, t].item(), ret[b, t].item()
        want = (vv - rr) ** 2
        if clip is not None:
            want = max(want, (min(max(vv, oo - clip), oo + clip) - rr) ** 2)
        assert got[b, t].item() == pytest.approx(0.5 * want, rel=1e-12)
    if clip is not None:
        assert 0 < flags.sum() < mask.sum()


# ---------------------------------------------------------------- KL, entropy, DAPO, prox approximation

@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_match_formulas(est):
    (logp, _, _, ref), _, mask = batch(seed=17)
    got = kl_estimate(logp, ref, est, mask)
    for b, t in torch.nonzero(mask).tolist():
        d = logp[b, t].item() - ref[b, t].item()
        want = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[est]
        assert got[b, t].item() == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert (got[~mask] == 0).all()


def test_k3_keeps_its_precision_in_float32_for_small_differences():
    """exp(-d) - 1 + d in float32 loses most digits to cancellation at |d| <= 1e-3 (2 % at 1e-3, far more
    below); expm1 keeps them."""
    d = torch.tensor([1e-3, -1e-3, 1e-4, 3e-5, -9e-3, 2e-2, -0.5, 3.0], dtype=torch.float32)
    got = kl_estimate(torch.zeros_like(d), -d, "k3")
    want = torch.expm1(-d.double()) + d.double()
    assert torch.allclose(got.double(), want, rtol=2e-5, atol=0), (got.double() / want - 1).abs().max()


def test_an_unbiased_std_with_groups_of_one_is_refused_only_where_a_group_std_is_used():
    rewards = torch.tensor([[1.0], [0.0], [1.0]], dtype=F64)
    for estimator in ("dr_grpo", "reinforce_pp_baseline", "lite_ppo", "reinforce_pp"):
        adv = group_advantages(rewards, estimator, unbiased=True)  # no group std: nothing divides by n - 1 = 0
        assert torch.isfinite(adv).all(), estimator
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(rewards, "grpo", unbiased=True)


def test_kl_estimators_are_unbiased_where_claimed():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=F64)
    exact = (p * (p / q).log()).sum()
    lp, lq = p.log(), q.log()  # expectation over x ~ p of each estimator
    for est in ("k1", "k3"):
        assert (p * kl_estimate(lp, lq, est)).sum().item() == pytest.approx(exact.item(), rel=1e-12)
    assert (p * kl_estimate(lp, lq, "k2")).sum().item() != pytest.approx(exact.item(), rel=1e-3)


def test_entropy_matches_loop():
    g = torch.Generator().manual_seed(18)
    logits = torch.randn(2, 3, 5, generator=g, dtype=F64) * 3
    got = token_entropy(logits, temperature=0.8)
    for b in range(2):
        for t in range(3):
            z = [x / 0.8 for x in logits[b, t].tolist()]
            m = max(z)
            ps = [math.exp(x - m) for x in z]
            ps = [p / sum(ps) for p in ps]
            assert got[b, t].item() == pytest.approx(-sum(p * math.log(p) for p in ps), rel=1e-12)


def test_overlong_penalty_by_hand():
    got = overlong_penalty(torch.tensor([0, 5, 6, 7, 8, 9, 10, 20]), max_tokens=10, buffer=4, factor=0.5)
    assert got.tolist() == pytest.approx([0, 0, 0, -0.125, -0.25, -0.375, -0.5, -0.5])
    with pytest.raises(ValueError, match="^overlong_max_tokens"):
        overlong_penalty(torch.tensor([1]), max_tokens=4, buffer=4)


def test_prox_approximation_matches_loop():
    (logp, _, behav, _), _, mask = batch(seed=19)
    versions = torch.randint(3, 8, mask.shape)
    got = approx_prox_logprobs(behav, logp, versions, prox_version=7.0, theta_version=7.5, mask=mask)
    for b, t in torch.nonzero(mask).tolist():
        vb = versions[b, t].item()
        alpha = (7.0 - vb) / (7.5 - vb)
        want = behav[b, t].item() + alpha * (logp[b, t].item() - behav[b, t].item())
        assert got[b, t].item() == pytest.approx(want, rel=1e-12)
    assert torch.isfinite(got).all() and (got[~mask] == 0).all()
    exact = approx_prox_logprobs(behav, logp, versions, 7.0, 7.0, mask)  # first update: the weights are prox
    assert torch.equal(exact[mask], logp[mask])


# ---------------------------------------------------------------- the policy loss, every option

def ref_policy_loss(logp, prox, behav, adv, mask, cfg, ref=None, ent=None, normaliser=None):
    per_seq = []
    for b in range(len(mask)):
        pos = [t for t in range(len(mask[b])) if mask[b][t]]
        if not pos:
            continue
        lr = {t: logp[b][t] - prox[b][t] for t in pos}
        lw = {t: prox[b][t] - behav[b][t] for t in pos}
        if cfg.ratio_level == "sequence":
            lr = dict.fromkeys(pos, sum(lr.values()) / len(pos))
        metric = {}
        for t in pos:
            d = -(prox[b][t] - behav[b][t])
            metric[t] = {"ratio": math.exp(lw[t]), "k1": d, "k2": d * d / 2,
                         "k3": math.exp(-d) - 1 + d}[cfg.behav_imp_weight_metric]
        if cfg.behav_imp_weight_level == "sequence":
            lw = dict.fromkeys(pos, sum(lw.values()) / len(pos))
            if cfg.behav_imp_weight_metric == "ratio":
                metric = {t: math.exp(lw[t]) for t in pos}
            else:
                metric = dict.fromkeys(pos, sum(metric.values()) / len(pos))
        losses = []
        for t in pos:
            r, w, a = math.exp(lr[t]), math.exp(lw[t]), adv[b]
            cap, low = cfg.behav_imp_weight_cap, cfg.behav_imp_weight_lower
            if cfg.behav_imp_weight_mode == "cap":
                w = w if cap is None else min(w, cap)
            elif (cap is not None and metric[t] > cap) or (low is not None and metric[t] < low):
                w = 0.0
            pg = max(-a * r, -a * min(max(r, 1 - cfg.eps_clip), 1 + cfg.clip_high))
            if cfg.dual_clip is not None and a < 0:
                pg = min(pg, -a * cfg.dual_clip)
            term = w * pg
            if ref is not None and cfg.kl_mode == "loss":
                d = logp[b][t] - ref[b][t]
                term += cfg.kl_coef * {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[cfg.kl_estimator]
            if ent is not None:
                term -= cfg.entropy_coef * ent[b][t]
            losses.append(term)
        per_seq.append(losses)
    if cfg.loss_agg == "token_mean":
        total, count = sum(sum(v) for v in per_seq), sum(len(v) for v in per_seq)
    elif cfg.loss_agg == "seq_mean_token_mean":
        total, count = sum(sum(v) / len(v) for v in per_seq), len(per_seq)
    else:
        total, count = sum(sum(v) for v in per_seq), len(per_seq)
    return total / (normaliser or count)


VARIANTS = [
    dict(eps_clip=0.1, eps_clip_high=0.3),
    dict(dual_clip=1.1, eps_clip=0.05),
    dict(ratio_level="sequence", eps_clip=0.05, eps_clip_high=0.08),
    dict(behav_imp_weight_level="sequence", behav_imp_weight_cap=1.2),
    dict(behav_imp_weight_mode="mask", behav_imp_weight_cap=1.5, behav_imp_weight_lower=0.7),
    dict(behav_imp_weight_mode="mask", behav_imp_weight_metric="k3", behav_imp_weight_cap=0.05),
    dict(behav_imp_weight_mode="mask", behav_imp_weight_metric="k1", behav_imp_weight_cap=0.1,
         behav_imp_weight_level="sequence"),
    dict(behav_imp_weight_mode="mask", behav_imp_weight_metric="k2", behav_imp_weight_cap=0.05),
    dict(kl_mode="loss", kl_estimator="k3", kl_coef=0.3, entropy_coef=0.05),
    dict(kl_mode="loss", kl_estimator="k2", kl_coef=0.1, dual_clip=3.0, ratio_level="sequence"),
]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
def test_policy_loss_variants_match_loop(variant, agg):
    cfg = AlgoConfig(loss_agg=agg, **variant)
    (logp, prox, behav, ref), adv, mask = batch(seed=20)
    ent = torch.rand(mask.shape, dtype=F64, generator=torch.Generator().manual_seed(21))
    ent_dirty = torch.where(mask, ent, torch.full_like(ent, math.nan))
    x = logp.clone().requires_grad_(True)
    out = decoupled_ppo_loss(x, prox, behav, adv, mask, cfg, logp_ref=ref, entropy=ent_dirty)
    want = ref_policy_loss(logp.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist(), cfg,
                           ref=ref.tolist(), ent=ent.tolist())
    assert out.loss.item() == pytest.approx(want, rel=1e-11, abs=1e-14)
    out.loss.backward()
    assert torch.isfinite(x.grad).all() and (x.grad[~mask] == 0).all() and x.grad.abs().sum() > 0
    for v in out.stats.values():
        assert math.isfinite(v)
    if cfg.behav_imp_weight_mode == "mask":  # the bounds bite on this data: a missing mask would show
        assert 0 < out.stats["imp_weight_capped_fraction"] < 1
    if cfg.dual_clip == 1.1:
        assert out.stats["dual_clip_fraction"] > 0


def test_gspo_gradient_is_sequence_level():
    """GSPO: every token of a sequence gets the same gradient weight (1/len * ratio * A)."""
    cfg = AlgoConfig(ratio_level="sequence", loss_agg="seq_mean_token_mean", behav_imp_weight_cap=None)
    (logp, prox, behav, _), adv, mask = batch(seed=22, holes=False)
    x = logp.clone().requires_grad_(True)
    decoupled_ppo_loss(x, prox, prox.clone(), adv, mask, cfg).loss.backward()
    for b in range(mask.shape[0]):
        g = x.grad[b][mask[b]]
        if g.numel():
            assert torch.allclose(g, g[0].expand_as(g), rtol=1e-12)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), agg=st.sampled_from(AGGS), dual=st.sampled_from([None, 2.0]),
       level=st.sampled_from(["token", "sequence"]))
def test_decoupled_with_behaviour_equal_proximal_is_plain_ppo(seed, agg, dual, level):
    cfg = AlgoConfig(loss_agg=agg, dual_clip=dual, behav_imp_weight_level=level, behav_imp_weight_cap=1.5)
    (logp, prox, _, _), adv, mask = batch(seed)
    plain = AlgoConfig(loss_agg=agg, dual_clip=dual, behav_imp_weight_cap=None)
    got = decoupled_ppo_loss(logp, prox, prox.clone(), adv, mask, cfg)
    want = ref_policy_loss(logp.tolist(), prox.tolist(), prox.tolist(), adv.tolist(), mask.tolist(), plain)
    assert got.loss.item() == pytest.approx(want, rel=1e-11, abs=1e-14)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), agg=st.sampled_from(AGGS), variant=st.sampled_from(VARIANTS),
       cuts=st.lists(st.integers(1, 8), min_size=0, max_size=4, unique=True), ranks=st.integers(1, 3))
def test_aggregation_invariant_to_micro_batches_and_ranks(seed, agg, variant, cuts, ranks):
    """Rows dealt to ``ranks`` simulated ranks, each cut into micro-batches: losses and grads add up."""
    cfg = AlgoConfig(loss_agg=agg, **variant)
    (logp, prox, behav, ref), adv, mask = batch(seed, b=9)
    x = logp.clone().requires_grad_(True)
    whole = decoupled_ppo_loss(x, prox, behav, adv, mask, cfg, logp_ref=ref)
    whole.loss.backward()
    g_whole, x.grad = x.grad.clone(), None
    parts = []
    for r in range(ranks):
        rows = list(range(r, 9, ranks))
        bounds = [0] + sorted(c for c in cuts if c < len(rows)) + [len(rows)]
        parts += [rows[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    norm = sum(loss_normaliser(mask[p], agg) for p in parts)
    total = sum(decoupled_ppo_loss(x[p], prox[p], behav[p], adv[p], mask[p], cfg, normaliser=norm,
                                   logp_ref=ref[p]).loss for p in parts)
    total.backward()
    assert total.item() == pytest.approx(whole.loss.item(), rel=1e-10, abs=1e-14)
    torch.testing.assert_close(x.grad, g_whole, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("kwargs, field", [
    ({"dual_clip": 1.0}, "dual_clip"), ({"ratio_level": "group"}, "ratio_level"),
    ({"behav_imp_weight_mode": "drop"}, "behav_imp_weight_mode"),
    ({"behav_imp_weight_metric": "k3"}, "behav_imp_weight_metric"),
    ({"behav_imp_weight_lower": 0.5}, "behav_imp_weight_lower"),
    ({"kl_mode": "loss"}, "kl_coef"), ({"kl_mode": "reward", "kl_coef": 0.1}, "kl_mode"),
    ({"kl_estimator": "k4"}, "kl_estimator"), ({"gamma": 1.5}, "gamma"), ({"lam": -0.1}, "lam"),
    ({"overlong_buffer": 4, "overlong_max_tokens": 4}, "overlong_max_tokens"),
    ({"adv_std_level": "global"}, "adv_std_level"), ({"entropy_coef": -1.0}, "entropy_coef"),
    ({"value_clip": 0.0}, "value_clip"), ({"adv_estimator": "rloo", "adv_mean_level": "batch"}, "adv_mean_level"),
])
def test_new_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        AlgoConfig(**kwargs)
