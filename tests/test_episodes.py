"""The episode seam of the rollout loop: the loop publishes whatever episodes a runner assembles.

A real rollout worker (the embedded torch engine on a tiny model, the admission
ledger, the spool, the reward runner) drives a two-turn runner: each episode
is a first completion, a fixed feedback text the model did not write, and a
second completion on the whole conversation so far. The spool groups must
hold every token of the episode, the feedback masked out of the loss with no
behaviour logprob, and the runner's own rewards.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hpcrl.admission.config import AdmissionConfig
from hpcrl.admission.ledger import AdmissionLedger
from hpcrl.data.rows import Row
from hpcrl.model.hf_io import load_model, load_tokenizer
from hpcrl.model.tiny import TinyModelConfig, build_tiny_model
from hpcrl.reward.config import RewardConfig
from hpcrl.reward.runner import RewardResult, RewardRunner
from hpcrl.rollout.config import RolloutConfig
from hpcrl.rollout.engine import Completion, Request, SamplingParams
from hpcrl.rollout.episodes import Episode, EpisodeRunner, SingleTurn
from hpcrl.rollout.torch_engine import TorchEngine
from hpcrl.rollout.worker import RolloutWorker, ScoringUnavailable
from hpcrl.spool.format import read_group
from hpcrl.spool.store import Spool
from hpcrl.weights.version import WeightVersion

FEEDBACK = " try again "


class TwoTurn:
    """Episode = completion 1 + FEEDBACK (masked) + completion 2; reward = the episode's total length.

    Between the turns the episode is busy outside the engine, as an agent running a tool is: its second
    request is made on a timer thread and queued; the runner submits it from ``finished`` (only the
    loop's thread touches the engine)."""

    def __init__(self, engine, tokenizer, think_s: float = 0.02) -> None:
        self.engine, self.tokenizer, self.first, self.think_s = engine, tokenizer, {}, think_s
        self.feedback = tokenizer.encode(FEEDBACK, add_special_tokens=False)
        self.waiting: queue.SimpleQueue = queue.SimpleQueue()  # requests made off the loop's thread
        self.done: list = []

    def max_unfinished(self, slots: int) -> int:
        return slots

    def start(self, key, prompt_ids, row) -> None:
        self.first.pop(key, None)
        self.engine.submit(Request(id=(*key, 0), prompt_ids=prompt_ids))

    def collect(self, c: Completion) -> None:
        key, turn = (c.id[0], c.id[1]), c.id[2]
        if turn == 0:
            self.first[key] = c
            second = Request(id=(*key, 1), prompt_ids=[*c.prompt_ids, *c.output_ids, *self.feedback])
            threading.Timer(self.think_s, self.waiting.put, args=(second,)).start()
            return
        one, fb = self.first.pop(key), self.feedback
        ids = [*one.output_ids, *fb, *c.output_ids]
        self.done.append((key, Episode(
            response_ids=ids, logprobs=[*one.logprobs, *[0.0] * len(fb), *c.logprobs],
            versions=[*one.versions, *[c.versions[0] if c.versions else 0] * len(fb), *c.versions],
            loss_mask=[1] * len(one.output_ids) + [0] * len(fb) + [1] * len(c.output_ids),
            text=self.tokenizer.decode(ids), finish_reason=c.finish_reason)))

    def wait(self, timeout_s: float) -> None:
        time.sleep(min(timeout_s, 0.002))

    def finished(self):
        while not self.waiting.empty():
            self.engine.submit(self.waiting.get())
        done, self.done = self.done, []
        return done

    def score(self, row, episodes):
        return [RewardResult(reward=float(len(e.response_ids)), status="ok") for e in episodes]

    def close(self) -> None:
        pass


class TwoCalls(TwoTurn):
    """TwoTurn's episodes exported one sample per request (as an agent's ``individual`` export): each part is
    its request's prompt and output, the first with half the episode's reward (the total output length)."""

    def collect(self, c: Completion) -> None:
        if c.id[2] == 0:
            return super().collect(c)
        key = (c.id[0], c.id[1])
        parts = [Episode(response_ids=list(x.output_ids), logprobs=list(x.logprobs), versions=list(x.versions),
                         loss_mask=[1] * len(x.output_ids), text="", finish_reason=x.finish_reason,
                         prompt_ids=list(x.prompt_ids), reward_scale=scale)
                 for x, scale in ((self.first.pop(key), 0.5), (c, 1.0))]
        self.done.append((key, Episode(response_ids=[], logprobs=[], versions=[], loss_mask=[], text="",
                                       finish_reason=c.finish_reason, parts=parts)))

    def score(self, row, episodes):
        return [RewardResult(reward=float(sum(len(p.response_ids) for p in e.parts)), status="ok") for e in episodes]


class Versions:
    """A weight source whose newest version the test sets; every version is the same tensors."""

    def __init__(self, model, latest: int) -> None:
        self.model, self.latest = model, latest

    def latest_version(self) -> int:
        return self.latest

    def locate(self, version: int) -> WeightVersion:
        return WeightVersion(version, state=self.model.state_dict())


class FlakyScoring(SingleTurn):
    """Single-turn episodes whose scorer fails for its own reasons (``infra_error``) on the first ``fails``
    scorings of each group, or always."""

    fails: int | None = 2

    def __init__(self, engine, tokenizer) -> None:
        super().__init__(engine, tokenizer, RewardRunner(RewardConfig()))
        self.tries: dict[str, int] = {}

    def score(self, row, episodes):
        n = self.tries[row.prompt] = self.tries.get(row.prompt, 0) + 1
        if self.fails is None or n <= self.fails:
            return [RewardResult(0.0, "infra_error", "the sandbox could not start")] * len(episodes)
        return super().score(row, episodes)


def make_worker(tmp_path: Path, runner_cls=None, weights=None, max_staleness: int = 0,
                **kwargs) -> tuple[RolloutWorker, Spool]:
    model_dir = build_tiny_model(tmp_path / "model", TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2,
                                                                     num_kv_heads=2, head_dim=16,
                                                                     intermediate_size=64))
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir)
    engine = TorchEngine(model, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, max_batch_size=8,
                         sampling=SamplingParams(max_new_tokens=4), seed=0)
    rows = [Row(prompt=f"{i}+{i}=", answer=str(2 * i), index=i) for i in range(4)]
    admission = AdmissionConfig(batch_size=2, max_staleness=max_staleness)
    spool, reward = Spool(tmp_path / "spool"), RewardRunner(RewardConfig())
    runner = runner_cls(engine, tokenizer) if runner_cls else SingleTurn(engine, tokenizer, reward)
    worker = RolloutWorker(RolloutConfig(group_size=3, max_batch_size=8, max_new_tokens=4), admission,
                           engine=engine, tokenizer=tokenizer, rows=rows,
                           ledger=AdmissionLedger(tmp_path / "admission", admission, len(rows)), spool=spool,
                           reward=reward, writer="w0", episodes=runner,
                           weights=weights(model) if weights else None, **kwargs)
    return worker, spool


def run_to_idle(worker: RolloutWorker, timeout_s: float = 60.0) -> int:
    """Pump until nothing is left to do; returns the most unfinished episodes seen at once."""
    deadline, most = time.time() + timeout_s, 0
    while time.time() < deadline:
        busy = worker.pump()
        most = max(most, worker.unfinished())
        if not busy and not worker.unfinished():
            break
        if not busy:
            time.sleep(0.005)  # episodes busy outside the engine: what RolloutWorker.run does
    worker.close()
    return most


def test_a_multi_turn_runner_publishes_whole_episodes_with_context_masked(tmp_path) -> None:
    worker, spool = make_worker(tmp_path, TwoTurn)
    assert isinstance(worker.episodes, EpisodeRunner)
    most = run_to_idle(worker)
    assert 0 < most <= 8 + 3  # episodes between turns count as load: slots + one group, never more
    groups = [read_group(e.path) for e in spool.ready()]
    assert sorted(g.ticket for g in groups) == [0, 1]  # eta = 0, batch 2: two groups admitted, both finished
    feedback = worker.episodes.feedback
    for g in groups:
        assert len(g.samples) == 3
        for s in g.samples:
            mask = s.loss_mask.astype(bool)
            starts = [i for i in range(len(mask)) if not mask[i] and (i == 0 or mask[i - 1])]
            assert len(starts) == 1 and (~mask).sum() == len(feedback)  # one masked span: the feedback
            span = slice(starts[0], starts[0] + len(feedback))
            assert s.response_ids[span].tolist() == feedback
            assert np.all(s.behav_logprobs[span] == 0.0) and np.all(s.behav_logprobs[mask] < 0.0)
            assert 1 <= mask[: starts[0]].sum() <= 4 and 1 <= mask[starts[0]:].sum() <= 4
            assert s.reward == len(s.response_ids)  # the runner's reward, not the reward function's
    assert worker.stats.samples_generated == 6
    assert worker.stats.tokens_generated == sum(int(s.loss_mask.sum()) for g in groups for s in g.samples)


def test_a_runner_exporting_each_request_publishes_one_sample_per_request(tmp_path) -> None:
    worker, spool = make_worker(tmp_path, TwoCalls)
    run_to_idle(worker)
    groups = [read_group(e.path) for e in spool.ready()]
    assert sorted(g.ticket for g in groups) == [0, 1]
    feedback = worker.episodes.feedback
    for g in groups:
        assert len(g.samples) == 6 and g.meta["sample_episodes"] == [0, 0, 1, 1, 2, 2]
        for first, second in zip(g.samples[0::2], g.samples[1::2]):
            n1 = len(first.response_ids)
            assert 1 <= n1 <= 4 and first.loss_mask.all() and np.all(first.behav_logprobs < 0)
            # the second request's prompt: the first's prompt and output, then the feedback, all masked
            assert second.response_ids[:n1].tolist() == first.response_ids.tolist()
            assert second.response_ids[n1:n1 + len(feedback)].tolist() == feedback
            assert second.loss_mask.tolist() == [0] * (n1 + len(feedback)) + [1] * (len(second.response_ids) - n1
                                                                                      - len(feedback))
            assert np.all(second.behav_logprobs[:n1 + len(feedback)] == 0)
            total = n1 + int(second.loss_mask.sum())
            assert (first.reward, second.reward) == (0.5 * total, float(total))
    assert worker.stats.samples_generated == 6  # episodes
    assert worker.stats.tokens_generated == sum(int(s.loss_mask.sum()) for g in groups for s in g.samples)


def test_the_default_runner_is_one_trained_completion_per_sample(tmp_path) -> None:
    worker, spool = make_worker(tmp_path)
    assert isinstance(worker.episodes, SingleTurn)
    run_to_idle(worker)
    groups = [read_group(e.path) for e in spool.ready()]
    assert sorted(g.ticket for g in groups) == [0, 1]
    for g in groups:
        assert g.meta["responses"] == [worker.tokenizer.decode(s.response_ids, skip_special_tokens=True)
                                       for s in g.samples]
        for s in g.samples:
            assert 1 <= len(s.response_ids) <= 4 and s.loss_mask.all() and np.all(s.behav_logprobs < 0.0)
            assert s.reward in (0.0, 1.0)  # math_reward on the untrained model's text


def test_a_group_whose_scoring_failed_is_held_and_scored_again_never_published_as_zeros(tmp_path) -> None:
    worker, spool = make_worker(tmp_path, FlakyScoring, infra_retry_s=0.05)
    run_to_idle(worker)
    groups = [read_group(e.path) for e in spool.ready()]
    assert sorted(g.ticket for g in groups) == [0, 1]
    assert all(g.meta["reward_status"] == ["ok"] * 3 for g in groups)  # only the third scoring was published
    assert worker.stats.samples_infra_error == 2 * 2 * 3 and worker.stats.groups_rescored == 2 * 2
    assert worker.episodes.tries and set(worker.episodes.tries.values()) == {3}


def test_a_scorer_failing_past_its_bound_ends_the_job_instead_of_training_zeros(tmp_path) -> None:
    FlakyScoring.fails = None
    try:
        worker, spool = make_worker(tmp_path, FlakyScoring, infra_retry_s=0.02, infra_max_wait_s=0.3)
        with pytest.raises(ScoringUnavailable, match="reward.infra_max_wait_s=0.3.*the sandbox could not start"):
            run_to_idle(worker, timeout_s=30)
    finally:
        FlakyScoring.fails = 2
    assert not spool.ready()  # nothing was published with rewards it never got
    assert worker.release_unfinished() == 2  # graceful exit: both tickets go back to the ledger


def test_an_episode_with_a_turn_of_rolled_back_weights_starts_again(tmp_path) -> None:
    """The trainer resumes from an older checkpoint while episodes are between turns.

    Their second turns are aborted and finish under the older weights, but
    their first turns were written by the lost version 2: such an episode is
    regenerated, never published beside version-1 tokens.
    """
    source = {}
    worker, spool = make_worker(tmp_path, TwoTurn, weights=lambda m: source.setdefault("v", Versions(m, 2)))
    runner = worker.episodes
    for _ in range(200):
        worker.pump()
        if runner.first:
            break
    assert worker.engine.version == 2 and runner.first, "no episode reached its second turn"
    between_turns = set(runner.first)
    source["v"].latest = 1
    run_to_idle(worker)
    assert worker.engine.version == 1
    groups = [read_group(e.path) for e in spool.ready()]
    published = {(g.ticket, i): s for g in groups for i, s in enumerate(g.samples)}
    for key in between_turns:
        if key in published:  # its group was published after the rollback, so the episode was regenerated
            assert published[key].versions.max() <= 1, f"episode {key} mixes lost version-2 tokens in"
    assert any(key in published for key in between_turns)
    assert worker.stats.samples_restarted >= len(between_turns)


def test_an_episode_exported_per_request_with_a_call_of_rolled_back_weights_starts_again(tmp_path) -> None:
    """As above with one sample per request: the lost version-2 tokens are in the episode's first part only,
    and they still make the whole episode run again."""
    source = {}
    worker, spool = make_worker(tmp_path, TwoCalls, weights=lambda m: source.setdefault("v", Versions(m, 2)))
    runner = worker.episodes
    for _ in range(200):
        worker.pump()
        if runner.first:
            break
    assert worker.engine.version == 2 and runner.first, "no episode reached its second request"
    between_turns = set(runner.first)
    source["v"].latest = 1
    run_to_idle(worker)
    groups = [read_group(e.path) for e in spool.ready()]
    published: dict = {}
    for g in groups:
        for sample, episode in zip(g.samples, g.meta["sample_episodes"]):
            published.setdefault((g.ticket, episode), []).append(sample)
    for key in between_turns & set(published):
        assert all(s.versions.max() <= 1 for s in published[key]), f"episode {key} mixes lost version-2 tokens in"
    assert between_turns & set(published)
    assert worker.stats.samples_restarted >= len(between_turns)


def test_status_shows_the_scorings_that_failed(tmp_path) -> None:
    from hpcrl.launch.control import format_status

    keys = ("step", "total_steps", "version", "reward_mean", "accuracy", "accuracy_step", "staleness_max",
            "staleness_mean_token", "samples_per_s", "elapsed_s", "metrics_age_s", "checkpoint",
            "tickets_admitted", "tickets_dropped", "reissues_waiting")
    component = {"job_id": "1", "state": "running", "restarts": 0, "heartbeat_age_s": 1.0}
    st = {"name": "r", "run_dir": str(tmp_path), "state": "running", "cancel": None, "supervisor": {"state": "none"},
          "progress": dict.fromkeys(keys, 0), "components": {"trainer": {**component, "infra_errors": 0},
                                                             "rollout-0": {**component, "infra_errors": 12}}}
    assert "(infra_error; held and scored again, never trained as 0): rollout-0 12" in format_status(st)
    st["components"]["rollout-0"]["infra_errors"] = 0
    assert "infra_error" not in format_status(st)
    assert "rollout replicas" not in format_status(st)  # a snapshot without the fleet (written before it existed)
    st["fleet"] = {"wanted": 2, "request": None, "autoscale": True,
                   "assessment": {"wait_share": 0.25, "window_s": 60, "ready_groups": 3, "bound_groups": 48,
                                  "last_decision": {"wanted": 1, "decision": 2, "reason": "the trainer waited"}}}
    st["components"]["rollout-0"]["alive"] = True
    text = format_status(st)
    assert "rollout replicas: 2 wanted (rollout.replicas of the config), 1 running" in text, text
    assert "autoscale: trainer waited 25% of the last 60s, ready groups 3/48; last decision: 1 -> 2 (the trainer " \
        "waited)" in text, text


def test_an_even_ticket_share_caps_a_replica_at_its_part_of_the_bound(tmp_path) -> None:
    """rollout.ticket_share=even: a replica holds at most ceil((eta + 1) B / replicas) groups, however far their
    episodes got, so a synchronous batch spreads over the fleet instead of filling the first engine that asks;
    fill (the default) takes all (a review found the first version counting episodes, not groups)."""
    fleet = [2]
    worker, _ = make_worker(tmp_path, fleet_size=lambda: fleet[0])  # eta 0, B = 2 groups of 3
    try:
        assert worker.share_cap() is None
        worker.cfg = dataclasses.replace(worker.cfg, ticket_share="even")
        assert worker.share_cap() == 1  # ceil(1 * 2 / 2)
        worker._admit()
        assert sorted(worker.groups) == [0] and worker.unfinished() == 3
        worker.groups[0].done[0] = object()  # one episode of the group finished: room for episodes, not groups
        worker._admit()
        assert sorted(worker.groups) == [0] and worker.unfinished() == 2
        fleet[0] = 1  # the other replica is gone (drained): the whole bound is this one's share
        assert worker.share_cap() == 2
        worker._admit()
        assert sorted(worker.groups) == [0, 1]
    finally:
        worker.close()


class Uneven(SingleTurn):
    """Single-turn episodes of which the first of each group stops after one token and the others run on:
    the first finishes long before its group does."""

    def start(self, key, prompt_ids, row) -> None:
        self.engine.submit(Request(id=key, prompt_ids=prompt_ids, max_new_tokens=1 if key[1] == 0 else 4))


def test_a_finished_episode_that_newer_weights_leave_behind_is_generated_again_not_published(tmp_path) -> None:
    """eta = 0: the first episode of each group finished under version 0, then version 1 came while the others
    generated. The group's file would be stale at the trainer, so the worker starts that episode again under
    version 1 and publishes the group whole and fresh."""
    source = {}
    worker, spool = make_worker(tmp_path, lambda engine, tok: Uneven(engine, tok, RewardRunner(RewardConfig())),
                                weights=lambda m: source.setdefault("v", Versions(m, 0)))
    early: set = set()
    for _ in range(50):
        worker.pump()
        early = {(index, i) for index, g in worker.groups.items() for i, e in enumerate(g.done) if e is not None}
        if early:
            break
    assert early and worker.engine.version == 0, "no episode finished before its group"
    source["v"].latest = 1
    run_to_idle(worker)
    assert worker.engine.version == 1 and worker.stats.samples_restarted >= len(early)
    groups = [read_group(e.path) for e in spool.ready()]
    assert {index for index, _ in early} <= {g.ticket for g in groups}  # (version 1 admits tickets 2 and 3 too)
    for g in groups:  # every sample, the early ones included, holds version-1 tokens only
        assert all(s.versions.min() == 1 for s in g.samples), [s.versions for s in g.samples]


class Joining(Versions):
    """A weight source whose first look waits, as the collective transport's join waits for the trainer to admit
    the rollout."""

    joined = False

    def latest_version(self) -> int:
        if not self.joined:
            time.sleep(0.3)
            self.joined = True
        return super().latest_version()


def test_the_first_look_for_weights_is_counted_apart_from_the_looks_of_each_version(tmp_path) -> None:
    """RolloutStats.weights_first_s: joining the trainer's weights happens once, before anything is generated; the
    benchmark's per-version cost of new weights leaves it out (scripts/sim_calibrate.py)."""
    worker, _ = make_worker(tmp_path, weights=lambda m: Joining(m, 0))
    run_to_idle(worker)
    s = worker.stats
    assert s.weights_first_s >= 0.3 and s.weights_s - s.weights_first_s < 0.3 and s.samples_generated > 0
