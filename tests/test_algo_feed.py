"""DAPO dynamic sampling through the real spool and admission ledger; overlong shaping in to_sequences."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from hpcrl.admission.config import AdmissionConfig
from hpcrl.admission.ledger import AdmissionLedger
from hpcrl.algo.config import AlgoConfig
from hpcrl.spool.format import Sample, TrajectoryGroup
from hpcrl.spool.store import Spool
from hpcrl.trainer import batch as B
from hpcrl.trainer.feed import BatchFeed


def group(ticket: int, rewards: list[float], lengths: list[int] | None = None,
          ledger: AdmissionLedger | None = None) -> TrajectoryGroup:
    """A group; with ``ledger``, it carries its ticket's dataset position as the rollout writes it."""
    lengths = lengths or [3] * len(rewards)
    samples = [Sample(response_ids=np.full(n, 5, np.int32), behav_logprobs=np.full(n, -1.0, np.float32),
                      versions=np.zeros(n, np.int32), loss_mask=np.ones(n, np.uint8), reward=r,
                      finish_reason="stop") for r, n in zip(rewards, lengths)]
    meta = {"epoch": ledger.ticket(ticket).epoch, "row": ledger.ticket(ticket).row} if ledger else {}
    return TrajectoryGroup(ticket=ticket, writer="w", prompt_ids=np.array([7, 8], np.int32), samples=samples,
                           meta=meta)


def test_dynamic_sampling_drops_uniform_groups_and_frees_admission(tmp_path) -> None:
    spool = Spool(tmp_path / "spool")
    ledger = AdmissionLedger(tmp_path / "admission", AdmissionConfig(batch_size=2, max_staleness=0), 100)
    for _ in range(2):
        assert ledger.try_admit(0, "w") is not None
    assert ledger.try_admit(0, "w") is None  # the bound (B = 2, eta = 0) is reached
    for t, rewards in enumerate([[1.0, 1.0], [0.0, 1.0]]):
        spool.publish(group(t, rewards, ledger=ledger))
    feed = BatchFeed(spool, ledger, batch_size=2, max_staleness=0, timeout_s=5,
                     keep=B.informative_filter(AlgoConfig(dynamic_sampling=True)))
    admitted = []

    def wait() -> None:  # the rollout's side: a freed slot is admitted and filled with an informative group
        ticket = ledger.try_admit(0, "w")
        if ticket is not None:
            admitted.append(ticket)
            spool.publish(group(ticket.index, [0.0, 0.5], ledger=ledger))

    groups = feed.next_batch(0, wait)
    assert sorted(g.ticket for g in groups) == [1, 2]
    assert len(admitted) == 1 and feed.dropped["uniform"] == 1
    assert ledger.dropped() == {0: "uniform"}
    assert [e.ticket for e in spool.dropped()] == [0]
    assert spool.reason(spool.dropped()[0])["reason"] == "uniform"


def test_without_dynamic_sampling_uniform_groups_are_kept() -> None:
    assert B.informative_filter(AlgoConfig()) is None


def test_overlong_penalty_shapes_rewards_and_uniformity() -> None:
    cfg = AlgoConfig(adv_estimator="dr_grpo", overlong_buffer=2, overlong_max_tokens=6)
    # all correct, but two responses run into the buffer: no longer uniform after shaping
    g = group(0, [1.0, 1.0, 1.0, 1.0], lengths=[3, 4, 5, 6])
    assert B.shaped_rewards(g, cfg) == pytest.approx([1.0, 1.0, 0.5, 0.0])
    seqs, n_uniform = B.to_sequences([g], cfg)
    assert n_uniform == 0
    assert [s.advantage for s in seqs] == pytest.approx([0.375, 0.375, -0.125, -0.625])
    _, n_uniform = B.to_sequences([g], AlgoConfig(adv_estimator="dr_grpo"))
    assert n_uniform == 1


def test_batch_level_std_spans_all_groups() -> None:
    cfg = AlgoConfig(adv_estimator="lite_ppo")
    groups = [group(0, [0.0, 1.0]), group(1, [0.0, 0.0]), group(2, [1.0, 1.0]), group(3, [1.0, 0.0])]
    seqs, n_uniform = B.to_sequences(groups, cfg)
    assert n_uniform == 2
    std = np.std([0.0, 1.0, 1.0, 0.0])  # the batch std of the kept groups' rewards
    a = 0.5 / (std + 1e-6)
    assert [s.advantage for s in seqs] == pytest.approx([-a, a, a, -a])


def test_a_wait_without_news_spares_the_listing_but_not_for_longer_than_relook_s(tmp_path, monkeypatch) -> None:
    spool = Spool(tmp_path / "spool")
    ledger = AdmissionLedger(tmp_path / "admission", AdmissionConfig(batch_size=1, max_staleness=1), 100)
    feed = BatchFeed(spool, ledger, batch_size=1, max_staleness=1, timeout_s=5, relook_s=0.3)
    listings = []
    real_ready = spool.ready
    monkeypatch.setattr(spool, "ready", lambda: listings.append(time.monotonic()) or real_ready())
    ticket = ledger.try_admit(0, "w")
    calls = []

    def wait() -> bool:  # a colocated loop whose writer published without telling: only relook_s finds it
        calls.append(time.monotonic())
        if len(calls) == 3:
            spool.publish(group(ticket.index, [0.0, 1.0], ledger=ledger))
        time.sleep(0.01)
        return False

    t0 = time.monotonic()
    assert [g.ticket for g in feed.next_batch(0, wait)] == [0]
    assert len(calls) > 10 and len(listings) == 2  # once at the start, once when relook_s had passed
    assert listings[1] - t0 >= 0.3

    news = []

    def wait_with_news() -> bool:  # says so when it published: looked at right away
        t = ledger.try_admit(1, "w")
        if t is not None:
            spool.publish(group(t.index, [0.0, 1.0], ledger=ledger))
            news.append(t.index)
        return bool(news)

    feed.commit(0)
    listings.clear()
    start = time.monotonic()
    assert [g.ticket for g in feed.next_batch(1, wait_with_news)] == [1]
    assert len(listings) == 2 and time.monotonic() - start < 0.3


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_wait_that_counts_arrivals_has_the_spool_looked_at_once_they_can_complete_the_batch(
        tmp_path, monkeypatch, dynamic: bool) -> None:
    """The colocated loop says how many groups it published: without a filter the feed looks at the spool when
    enough arrived to complete the batch (a look before that would only cost its listing and claims, in the same
    thread as the generation), with one (dynamic sampling) at every arrival, so a rejected group frees its slot."""
    spool = Spool(tmp_path / "spool")
    ledger = AdmissionLedger(tmp_path / "admission", AdmissionConfig(batch_size=3, max_staleness=0), 100)
    keep = B.informative_filter(AlgoConfig(dynamic_sampling=True)) if dynamic else None
    feed = BatchFeed(spool, ledger, batch_size=3, max_staleness=0, timeout_s=5, relook_s=60.0, keep=keep)
    listings = []
    real_ready = spool.ready
    monkeypatch.setattr(spool, "ready", lambda: listings.append(len(os.listdir(spool.ready_dir))) or real_ready())

    def wait() -> int:  # one informative group per call
        ticket = ledger.try_admit(0, "w")
        if ticket is None:
            return 0
        spool.publish(group(ticket.index, [0.0, 1.0], ledger=ledger))
        return 1

    assert [g.ticket for g in feed.next_batch(0, wait)] == [0, 1, 2]
    assert listings == ([0, 1, 1, 1] if dynamic else [0, 3])
