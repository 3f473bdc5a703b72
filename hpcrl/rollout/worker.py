"""The rollout loop: admit prompt groups, generate, score, publish to the spool.

Lifecycle of one prompt group: a ticket is taken from the global admission
ledger under the staleness bound (using the version of the weights this
worker generates with) -> ``group_size`` episodes start
(:mod:`hpcrl.rollout.episodes`: with :class:`SingleTurn`, which the job passes in unless agents run,
one episode is one request of the prompt), their requests enter the engine,
whose continuous batching keeps every slot busy -> when all episodes are
done they are scored (the reward function, or the episodes' own rewards)
-> the group is published atomically to the spool as one HDF5 file, one
sample per episode (an agent episode exported ``individual`` is one sample
per model call, so the group may hold more than ``group_size``), by a
writer thread while generation goes on
(:mod:`hpcrl.rollout.publisher`; :meth:`RolloutWorker.flush` waits for it,
:meth:`RolloutWorker.close` stops it).

Ordering rules, checked at every :meth:`RolloutWorker.pump`:

1. new weights first: when a newer version is published the engine is
   interrupted and continues under it (tokens keep their versions);
2. then admission, keeping the engine's slots plus one group's worth of
   queue filled (``max_batch_size + group_size`` unfinished episodes; one
   request each with SingleTurn); with ``rollout.ticket_share=even`` at most
   the replica's even share of the groups the staleness bound lets be
   outstanding (:meth:`RolloutWorker.share_cap`);
3. then one engine poll (one decode step of the embedded engine, a short
   wait for responses of a server engine), its completions handed to the
   episode runner, and the episodes the runner finished taken from it. A
   finished episode whose oldest token is already more than
   ``max_staleness`` versions behind the weights in hand could never be
   trained (and one holding tokens of rolled-back weights must not be), so
   it is started again rather than published. So is a finished episode of a
   group still generating once newer weights leave it that far behind (looked
   at after each weight update): no group is published already stale against
   the weights in hand, for the trainer to set aside and have generated again
   whole. With ``taken`` (the trainer's mark of the batch it has in hand,
   :mod:`hpcrl.spool.taken`; the rollout job passes it, colocated mode, which
   generates only while its trainer waits, does not) a group that completes
   after the trainer took the batch of its oldest token's last trainable
   version (its head ``max_staleness`` behind the version of that batch) is
   not published either: its file could only be set aside. It is parked,
   keeping its ticket, and at the next new weights all its episodes start
   again under them, as the trainer's reissue would have had it generated
   (restarting only the old episodes at once would leave the group's other
   episodes aging while it waits). The mark is read only when a group
   completes whose head it could doom, at most once per :meth:`pump`, and
   trusted at most one version past the weights in hand; a worker without a
   weight source never parks (nothing would release the group).

A group whose scoring failed for a reason that is not its samples' (a
result with status ``infra_error``: the reward sandbox could not start) is
not published with those zeros: it is held and scored again, first after
``reward.infra_retry_s`` and then at doubling intervals (at most 30 s); while it waits the
loop goes on. A group still failing after ``reward.infra_max_wait_s`` ends
the job with an error (the watchdog restarts it, and its tickets are
reissued), so a broken scorer never turns into rewards of 0.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from hpcrl.admission.config import AdmissionConfig
from hpcrl.admission.ledger import AdmissionLedger, Ticket
from hpcrl.data.rows import Row
from hpcrl.model.hf_io import encode_prompt
from hpcrl.reward.scorer import Scorer
from hpcrl.rollout.config import RolloutConfig
from hpcrl.rollout.engine import InferenceEngine
from hpcrl.rollout.episodes import Episode, EpisodeKey, EpisodeRunner
from hpcrl.rollout.publisher import BackgroundPublisher
from hpcrl.runtime.cputime import thread_cpu_s
from hpcrl.spool.format import Sample, TrajectoryGroup
from hpcrl.spool.store import Spool
from hpcrl.weights.transport import WeightTransport
from hpcrl.weights.version import WeightVersion

log = logging.getLogger(__name__)


@dataclass
class _Group:
    ticket: Ticket
    row: Row
    prompt_ids: list[int]
    done: list[Episode | None]
    parked: bool = False  # complete, but the batch the trainer took leaves it stale: generated again at new weights


_MAX_RETRY_S = 30.0  # the longest a held group waits between two scorings


class ScoringUnavailable(RuntimeError):
    """A group's scoring kept failing for the scorer's own reasons past ``reward.infra_max_wait_s``."""


@dataclass
class _Held:
    group: _Group
    due: float  # time.monotonic() of its next scoring
    since: float  # of its first failed scoring
    tries: int = 1


@dataclass
class RolloutStats:
    groups_published: int = 0
    samples_infra_error: int = 0  # sample scorings that failed for the scorer's own reasons (status infra_error)
    groups_rescored: int = 0  # groups held for such a failure and scored again
    samples_generated: int = 0
    tokens_generated: int = 0
    samples_restarted: int = 0
    weight_updates: int = 0
    started: float = field(default_factory=time.time)
    cpu_started: float = field(default_factory=time.process_time)  # this process's CPU seconds, every thread
    cpu_threads_started: dict = field(default_factory=thread_cpu_s)  # and each live thread's, by name
    # seconds spent in each part of pump(): engine steps (busy), weights (poll + transfer + cache
    # rebuild), admission (ledger tickets), reward and spool (scoring, and handing published groups
    # to the writer thread or waiting for it, inside the busy time)
    busy_s: float = 0.0
    weights_s: float = 0.0
    # of it, the first look, before anything was generated: joining the trainer's weights (the collective transport
    # waits there until the trainer admits this rollout), not a cost of each version
    weights_first_s: float | None = None
    admit_s: float = 0.0
    reward_s: float = 0.0
    spool_s: float = 0.0
    # seconds the writer thread spent publishing (overlapped with generation)
    spool_write_s: float = 0.0


class RolloutWorker:
    def __init__(self, cfg: RolloutConfig, admission: AdmissionConfig, *, engine: InferenceEngine, tokenizer,
                 rows: list[Row], ledger: AdmissionLedger, spool: Spool, reward: Scorer, writer: str,
                 episodes: EpisodeRunner, weights: WeightTransport | None = None, chat_template: bool = False,
                 infra_retry_s: float = 2.0, infra_max_wait_s: float = 600.0,
                 fleet_size: Callable[[], int] | None = None, taken: Callable[[], int | None] | None = None) -> None:
        """``episodes``: what a sample is (:class:`~hpcrl.rollout.episodes.SingleTurn` scored by ``reward``, or an
        agent's episodes); ``reward``: the job's scorer, which the job closes; ``infra_retry_s`` and
        ``infra_max_wait_s``: how a group whose scoring failed is scored again (module docstring); ``fleet_size``:
        the rollout replicas the run has now, for ``rollout.ticket_share=even`` (default ``rollout.replicas``);
        ``taken``: reads the version whose batch the trainer has in hand (:meth:`TakenMark.read
        <hpcrl.spool.taken.TakenMark.read>`; None: no such mark, the weights in hand alone bound staleness)."""
        self.cfg, self.admission = cfg, admission
        self.engine, self.tokenizer, self.rows = engine, tokenizer, rows
        self.ledger, self.spool, self.reward, self.weights = ledger, spool, reward, weights
        self.writer, self.chat_template = writer, chat_template
        self.episodes = episodes
        self.groups: dict[int, _Group] = {}
        self.held: list[_Held] = []  # groups whose scoring failed (infra_error), to be scored again
        self.infra_retry_s, self.infra_max_wait_s = infra_retry_s, infra_max_wait_s
        self.stats = RolloutStats()
        self.publisher = BackgroundPublisher(spool, self._published)
        self.fleet_size = fleet_size or (lambda: cfg.replicas)
        self.taken = taken
        self._taken_seen: tuple[int | None] | None = None  # the mark as read in this pump (None: not read yet)

    def run(self, should_stop: Callable[[], bool], on_idle: Callable[[], None] | None = None) -> None:
        """Pump until ``should_stop()``; sleep briefly whenever there is nothing to do."""
        while not should_stop():
            if not self.pump():
                if on_idle:
                    on_idle()
                time.sleep(self.cfg.poll_interval_s)

    def flush(self) -> None:
        """Wait until every finished group is in the spool (raises a failed write)."""
        t0 = time.perf_counter()
        self.publisher.drain()
        self.stats.spool_s += time.perf_counter() - t0

    def close(self) -> None:
        """Publish what is pending, stop the writer thread and close the episode runner."""
        try:
            self.publisher.close()
        finally:
            self.episodes.close()

    def release_unfinished(self) -> int:
        """Hand the tickets of unfinished groups back to the ledger (graceful exit); returns the count."""
        indices = [*self.groups, *(h.group.ticket.index for h in self.held)]
        for index in indices:
            self.ledger.reissue(index, f"rollout {self.writer} stopped before finishing it")
        self.groups, self.held = {}, []
        return len(indices)

    def pump(self) -> bool:
        """One iteration of the loop; False when blocked (no admission, nothing running)."""
        t0 = time.perf_counter()
        self._taken_seen = None  # the trainer's mark is read again, if needed, in this pass
        self._maybe_update_weights()
        t1 = time.perf_counter()
        self._admit()
        if self.held:
            self._rescore()
        t2 = time.perf_counter()
        self.stats.weights_s += t1 - t0
        if self.stats.weights_first_s is None:
            self.stats.weights_first_s = t1 - t0
        self.stats.admit_s += t2 - t1
        generating, waiting = self.engine.num_in_flight() > 0, False
        if generating:
            for completion in self.engine.poll(self.cfg.poll_interval_s):
                self.episodes.collect(completion)
        elif self.unfinished():  # episodes busy outside the engine (a tool, an agent between calls)
            self.episodes.wait(self.cfg.poll_interval_s)
            waiting = True
        finished = self.episodes.finished()
        for key, episode in finished:
            self._finish(key, episode)
        if not generating and not finished:
            if self.publisher.pending:  # nothing generates: make what is finished visible
                self.flush()
                return True
            return waiting  # waited already: no extra sleep in run()
        self.stats.busy_s += time.perf_counter() - t2
        return True

    def unfinished(self) -> int:
        """Episodes started and not finished yet, and those of groups held to be scored again: the loop's load,
        whatever each one waits for (so a broken scorer also stops admission)."""
        return (sum(d is None for group in self.groups.values() for d in group.done)
                + sum(len(h.group.done) for h in self.held))

    # -- steps of the loop -----------------------------------------------------
    def _maybe_update_weights(self) -> None:
        if self.weights is None:
            return
        latest = self.weights.latest_version()
        if latest == self.engine.version:
            return
        try:
            weights = self.weights.locate(latest)
            if latest < self.engine.version:
                self._regress(weights)
            else:
                self.engine.update_weights(weights)
        except FileNotFoundError:  # replaced between the two reads: look again next time
            return
        for index, group in self.groups.items():  # finished episodes the new version leaves behind: at once
            self._restart_doomed(index, group)
        self.stats.weight_updates += 1
        log.debug("weights updated to version %d", latest)

    def _regress(self, weights: WeightVersion) -> None:
        """The trainer restarted from an older checkpoint: samples with newer tokens are regenerated."""
        version = weights.version
        aborted = self.engine.abort_all()
        try:
            self.engine.update_weights(weights)
        finally:  # a failed load (version pruned meanwhile) loses nothing: the next poll tries again
            for request in aborted:
                self.engine.submit(request)
        for held in [h for h in self.held if any(e.newest_version is not None and e.newest_version > version
                                                  for e in h.group.done)]:
            self.held.remove(held)  # holds tokens of rolled-back weights: generated again, not scored again
            self.groups[held.group.ticket.index] = held.group
        for index, group in self.groups.items():
            for i, e in enumerate(group.done):
                if e is not None and e.newest_version is not None and e.newest_version > version:
                    group.done[i] = None
                    self.episodes.start((index, i), group.prompt_ids, group.row)
        self.stats.samples_restarted += len(aborted)
        log.warning("weights went back to version %d (trainer resumed); regenerating %d in-flight samples",
                    version, len(aborted))

    def share_cap(self) -> int | None:
        """With ``rollout.ticket_share=even``: the groups this replica may hold (generating, or held to be scored
        again), its even share of the groups the staleness bound lets be outstanding, at least one; None: no cap
        (``fill``)."""
        if self.cfg.ticket_share != "even":
            return None
        outstanding = (self.admission.max_staleness + 1) * self.admission.batch_size
        return max(1, -(-outstanding // max(1, self.fleet_size())))

    def _admit(self) -> None:
        cap = self.episodes.max_unfinished(self.cfg.max_batch_size + self.cfg.group_size)
        share = self.share_cap()
        while self.unfinished() < cap and (share is None or len(self.groups) + len(self.held) < share):
            ticket = self.ledger.try_admit(self.engine.version, self.writer)
            if ticket is None:
                return
            self.admit_ticket(ticket)

    def admit_ticket(self, ticket: Ticket) -> None:
        row = self.rows[ticket.row]
        prompt_ids = encode_prompt(self.tokenizer, row.prompt, self.chat_template)
        self.groups[ticket.index] = _Group(ticket, row, prompt_ids, [None] * self.cfg.group_size)
        for i in range(self.cfg.group_size):
            self.episodes.start((ticket.index, i), prompt_ids, row)

    def _finish(self, key: EpisodeKey, episode: Episode) -> None:
        index, i = key
        group = self.groups[index]
        if self._doomed(episode):
            self.stats.samples_restarted += 1
            self.episodes.start((index, i), group.prompt_ids, group.row)
            return
        group.done[i] = episode
        self.stats.samples_generated += 1
        self.stats.tokens_generated += _trained_tokens(episode)
        if all(d is not None for d in group.done):
            if self._left_behind(group):
                group.parked = True
            else:
                self._publish(self.groups.pop(index))

    def _doomed(self, episode: Episode) -> bool:
        """Whether ``episode`` could never be trained now: its oldest token more than ``max_staleness`` versions
        behind the weights in hand (the trainer is at that version or past it), or tokens of weights rolled back."""
        head, newest = episode.head_version, episode.newest_version
        lost = newest is not None and newest > self.engine.version
        return lost or (head is not None and head < self.engine.version - self.admission.max_staleness)

    def _left_behind(self, group: _Group) -> bool:
        """Whether the complete ``group`` is stale for every batch the trainer has still to take: its oldest token
        ``max_staleness`` behind the version whose batch the trainer has in hand (the mark, trusted one version past
        the weights in hand at most), or more."""
        version, eta = self.engine.version, self.admission.max_staleness
        head = min((e.head_version for e in group.done if e.head_version is not None), default=None)
        if self.taken is None or self.weights is None or head is None or head > version + 1 - eta:
            return False  # no mark, nothing to release a parked group, or no batch it can have taken dooms it
        if self._taken_seen is None:
            self._taken_seen = (self.taken(),)
        taken = self._taken_seen[0]
        return taken is not None and head < min(taken, version + 1) + 1 - eta

    def _restart_doomed(self, index: int, group: _Group) -> None:
        """Start again the finished episodes of ``group`` (still generating) that the weights just loaded leave
        doomed: published with them, its file would only be set aside by the trainer and the whole group generated
        again; all its episodes if it is parked (:meth:`_left_behind`). Their samples and tokens no longer count as
        generated. (A group held to be scored again keeps its episodes: it is published as it is, and the trainer
        judges it.)"""
        for i, e in enumerate(group.done):
            if e is not None and (group.parked or self._doomed(e)):
                group.done[i] = None
                self.stats.samples_generated -= 1
                self.stats.tokens_generated -= _trained_tokens(e)
                self.stats.samples_restarted += 1
                self.episodes.start((index, i), group.prompt_ids, group.row)
        group.parked = False

    def _rescore(self) -> None:
        now = time.monotonic()
        for held in [h for h in self.held if h.due <= now]:
            self.held.remove(held)
            self.stats.groups_rescored += 1
            self._publish(held.group, held)

    def _publish(self, group: _Group, held: _Held | None = None) -> None:
        texts = [e.text for e in group.done]
        row = group.row
        t0 = time.perf_counter()
        results = self.episodes.score(row, group.done)
        failed = [r for r in results if r.status == "infra_error"]
        if failed:
            self.stats.reward_s += time.perf_counter() - t0
            self._hold(group, held, failed)
            return
        prompt_ids, samples, owners = spool_samples(group.ticket.index, group.prompt_ids, group.done,
                                                    [r.reward for r in results], self.engine.version)
        self.stats.reward_s += time.perf_counter() - t0
        meta = {"version": self.engine.version, "prompt": row.prompt, "answer": row.answer, "row": group.ticket.row,
                "epoch": group.ticket.epoch, "responses": texts, "reward_status": [r.status for r in results]}
        if any(e.parts is not None for e in group.done):  # which episode each sample is a part of
            meta["sample_episodes"] = owners
        t0 = time.perf_counter()
        self.publisher.submit(TrajectoryGroup(ticket=group.ticket.index, writer=self.writer,
                                              prompt_ids=np.asarray(prompt_ids, np.int32),
                                              samples=samples, meta=meta))
        self.stats.spool_s += time.perf_counter() - t0

    def _hold(self, group: _Group, held: _Held | None, failed: list) -> None:
        """Keep a group whose scoring failed for the scorer's own reasons, to score it again later."""
        now = time.monotonic()
        self.stats.samples_infra_error += len(failed)
        held = held or _Held(group, due=now, since=now, tries=0)
        if now - held.since >= self.infra_max_wait_s:
            self.held.append(held)  # its ticket is reissued if the job exits gracefully
            raise ScoringUnavailable(f"reward: scoring ticket {group.ticket.index} has failed for "
                                     f"{now - held.since:.0f} s (reward.infra_max_wait_s={self.infra_max_wait_s:g}), "
                                     f"{held.tries + 1} tries: {failed[0].detail}")
        held.tries += 1
        # doubling, at most _MAX_RETRY_S apart, and a last try when the bound is reached
        held.due = min(now + min(self.infra_retry_s * 2 ** (held.tries - 1), _MAX_RETRY_S),
                       held.since + self.infra_max_wait_s)
        self.held.append(held)
        (log.warning if held.tries == 1 else log.info)(
            "scoring ticket %d failed for %d of %d samples (infra_error: %s); held, scored again in %.1f s",
            group.ticket.index, len(failed), len(group.done), failed[0].detail, held.due - now)

    def _published(self, group: TrajectoryGroup, seconds: float) -> None:  # on the writer thread
        self.stats.spool_write_s += seconds
        self.stats.groups_published += 1


def _trained_tokens(episode: Episode) -> int:
    """The tokens of ``episode`` the loss counts (its loss mask's ones)."""
    return sum(sum(s.loss_mask) for s in episode.samples())


def spool_samples(ticket: int, prompt_ids: list[int], episodes: list[Episode], rewards: list[float],
                  version: int) -> tuple[list[int], list[Sample], list[int]]:
    """A finished group's spool prompt, its samples, and the index of the episode each sample comes from.

    An episode is one sample, or one per part (an agent's calls exported ``individual``), each part with its
    share of the episode's reward (``reward_scale``). Samples with a prompt of their own share the group's
    prompt, the longest common prefix of those prompts; the rest of each one's prompt starts its response,
    loss-masked, at the version of its first token (``version``, the weights in hand, if it has none)."""
    parts = [(i, s, float(reward) * s.reward_scale) for i, (e, reward) in enumerate(zip(episodes, rewards))
             for s in e.samples()]
    prompt, heads = _common_prompt(ticket, prompt_ids, [s for _, s, _ in parts])
    samples = [Sample(response_ids=np.asarray([*head, *s.response_ids], np.int32),
                      behav_logprobs=np.asarray([*[0.0] * len(head), *s.logprobs], np.float32),
                      versions=np.asarray([*[s.versions[0] if s.versions else version] * len(head), *s.versions],
                                          np.int32),
                      loss_mask=np.asarray([*[0] * len(head), *s.loss_mask], np.uint8),
                      reward=reward, finish_reason=s.finish_reason)
               for (_, s, reward), head in zip(parts, heads)]
    return prompt, samples, [i for i, _, _ in parts]


def _common_prompt(ticket: int, prompt_ids: list[int], samples: list[Episode]) -> tuple[list[int], list[list[int]]]:
    """The group's prompt and, per sample, the start of its own prompt beyond it (loss-masked context).

    Samples with a prompt of their own (agents) share the longest common prefix of those prompts; a sample
    without tokens adds nothing and is left out of the comparison."""
    own = [e.prompt_ids for e in samples if e.prompt_ids is not None and e.response_ids]
    if not own:
        return list(prompt_ids), [[] for _ in samples]
    n = min(len(p) for p in own)
    for p in own[1:]:
        n = next((i for i in range(n) if p[i] != own[0][i]), n)
    if n == 0:
        raise ValueError(f"ticket {ticket}: the episodes' own prompts share no first token, so they cannot be "
                         "one prompt group (give every episode of a row the same opening)")
    return list(own[0][:n]), [list(e.prompt_ids[n:]) if e.prompt_ids is not None and e.response_ids else []
                              for e in samples]
