"""A discrete-event simulator of the pipeline: rollout replicas, the admission bound, the trainer.

    from hpcrl.sim import Costs, Workload, simulate
    result = simulate(Workload(max_staleness=4, replicas=2), Costs())
    result.samples_per_s

It plays the protocol hpcrl runs, at the granularity of engine steps, with
every duration taken from a :class:`~hpcrl.sim.model.Costs` model instead of
measured:

* **Admission** (design.md §3.2): a replica asks for a ticket at its own
  weights' version ``v``; the ledger grants one while
  ``created - pending reissues - dropped < (v + eta + 1) * B``, a pending
  reissue first. A group is admitted whole (``G`` rows) when the engine has
  ``G`` free rows.
* **A replica** runs engine steps back to back: look for new weights every
  ``weights_poll_s`` (load them; in ``recompute`` mode prefill every
  in-flight row's prompt and tokens again, a context rows of one group
  share once: :func:`~hpcrl.sim.rows.distinct_rows`), admit what fits (one prefill call
  for the groups admitted together, each group's prompt once), decode one
  token on every active row. With a left-padded cache (``Costs.padded_cache``,
  hpcrl's embedded engine) every row costs as much as the longest, and an
  admission into a running batch merges the running cache with the new one. A finished group is scored
  and handed to the spool at the end of the step (the other threads' work for it, the spool writer's,
  lengthens that step when no core is idle for it: :meth:`Pipeline.side_cpu`); a sample that finishes
  with its first token more than ``eta`` versions behind the replica's
  weights is generated again, and so is a finished row of a group still
  generating once new weights leave it that far behind (looked at when the
  replica loads them; as hpcrl's worker does). A group that completes with
  its oldest token ``eta`` behind the version whose batch the trainer has in
  hand (its mark, :mod:`hpcrl.spool.taken`; not in colocated mode) is parked
  instead, and all its rows start again when the replica next loads new
  weights (:meth:`_Replica.left_behind`). With nothing to decode and
  no ticket it waits for the next version or a reissued ticket, which it
  sees at its next look (every ``rollout_idle_poll_s`` from when it went
  idle; at once when 0).
* **The trainer** takes ``B`` ready groups whose oldest token is at most
  ``eta`` versions behind, oldest first, trains the tokens of those that are
  not uniform (``Workload.uniform_share``), publishes, and wakes the
  waiting replicas; waiting for a batch, it looks at the spool every
  ``trainer_poll_s`` from the end of its last step; a group that went stale is set aside and its ticket
  reissued.
* **Colocated** (``Workload.mode``): one process alternates, which is the
  same protocol at ``eta = 0`` with the publish done in memory and no poll.
* **Failures**: a replica fails at the given rate (Poisson), loses its
  in-flight groups (their tickets are reissued) and comes back after
  ``restart_s`` with the current weights.

Lifecycle: :func:`simulate` builds a fresh :class:`Pipeline`, runs its event
loop until the trainer has made ``Workload.steps`` steps, and returns a
:class:`~hpcrl.sim.model.Result`. It is deterministic for a given seed.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from typing import Callable

from hpcrl.sim.model import Costs, Result, Workload
from hpcrl.sim.rows import Group, Row, distinct_rows


class _Ledger:
    def __init__(self, work: Workload) -> None:
        self.batch, self.eta = work.batch_groups, work.max_staleness
        self.created = self.dropped = 0
        self.reissued: list[int] = []

    def try_admit(self, version: int) -> int | None:
        limit = (version + self.eta + 1) * self.batch + len(self.reissued) + self.dropped
        if self.created >= limit:
            return None
        if self.reissued:
            return self.reissued.pop(0)
        self.created += 1
        return self.created - 1


class Pipeline:
    """One simulated run (use :func:`simulate`)."""

    def __init__(self, work: Workload, costs: Costs) -> None:
        self.work, self.costs = work, costs
        self.rng = random.Random(work.seed)
        self.now, self._seq = 0.0, 0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self.ledger = _Ledger(work)
        self.colocated = work.mode == "colocated"
        self.version = 0  # the trainer's published version
        self.taken = -1  # the version whose batch the trainer has in hand (hpcrl.spool.taken)
        self.ready: list[Group] = []
        self.trainer_busy = False
        self.trainer_busy_s = 0.0
        self.trainer_side_cpu = 0.0  # the trainer's share of the other threads' work, paid at its next step
        self.waiting_since = 0.0  # when the trainer last started waiting for a batch (its polls count from there)
        self.samples = self.tokens = self.dropped_groups = self.failures = self.offered = self.restarted = 0
        self.prefill_calls = self.decode_steps = self.decode_rows = 0
        self.staleness: Counter = Counter()
        self.phases: Counter = Counter()  # "trainer/update", "rollout/decode", ...: seconds of finished work
        self.trained_tickets: list[int] = []
        self.replicas = [_Replica(self, i) for i in range(work.replicas)]

    # -- the event loop ----------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn))

    def run(self, stall_events: int | None = None) -> Result:
        """Play events until the last step is published. A run that hands no finished group to the trainer and
        makes no step in ``stall_events`` events (default: 2M or four times the decode steps of the longest
        response on every replica, whichever is larger; replicas failing before they finish anything, say) is a
        stall and raises."""
        longest = max([*self.work.response_tokens, *(n for shape in self.work.group_shapes for n in shape[1])])
        limit = stall_events or max(2_000_000, 4 * self.work.replicas * longest)
        for r in self.replicas:
            r.start()
        since, last = 0, (self.version, self.offered)
        while self.version < self.work.steps:
            if not self._events or since > limit:
                raise RuntimeError(f"the simulation stalled at version {self.version} (t={self.now:.3f}s, "
                                   f"{since} events without a finished group or a step)")
            self.now, _, fn = heapq.heappop(self._events)
            fn()
            now = (self.version, self.offered)
            since, last = (0, now) if now != last else (since + 1, last)
        for r in self.replicas:
            r.stop()  # a step still running counts up to now
        return Result(wall_s=self.now, samples=self.samples, tokens=self.tokens, trainer_busy_s=self.trainer_busy_s,
                      rollout_busy_s=[r.busy_s for r in self.replicas], dropped_groups=self.dropped_groups,
                      staleness_hist=dict(sorted(self.staleness.items())), failures=self.failures,
                      restarted_samples=self.restarted, prefill_calls=self.prefill_calls,
                      decode_steps=self.decode_steps, decode_rows=self.decode_rows,
                      phases=dict(sorted(self.phases.items())))

    def slowdown(self, other_busy: bool) -> float:
        return self.costs.shared_slowdown if (self.work.shared_cores and other_busy) else 1.0

    def side_cpu(self, groups: int) -> tuple[float, float]:
        """What the other threads' work for ``groups`` groups a step hands over (Costs.side_cpu_per_group_s) adds
        to that step and to the trainer: nothing while a core is idle for it; all of it to the step where the
        generating process's compute fills the cores (a parallel step waits for its slowest thread); where a rollout
        shares the cores with a busy trainer (two compute threads, shared_slowdown's two cores), half each: three
        threads on two cores lose the same. The trainer's half is owed once the step hands its groups over (not if
        the replica fails first) and paid at its next step; what is owed when the run ends is left out."""
        cost = self.costs.side_cpu_per_group_s * groups
        if self.work.compute_fills_cores:
            return cost, 0.0
        return (cost / 2, cost / 2) if self.work.shared_cores and self.trainer_busy else (0.0, 0.0)

    # -- the trainer --------------------------------------------------------------------------------
    def offer(self, group: Group) -> None:
        self.offered += 1
        self.ready.append(group)
        self.try_train()

    def try_train(self) -> None:
        if self.trainer_busy or self.version >= self.work.steps:
            return
        floor = self.version - self.work.max_staleness
        stale = [g for g in self.ready if g.min_version < floor]
        for g in stale:  # set aside, generated again
            self.ready.remove(g)
            self.ledger.reissued.append(g.ticket)
            self.dropped_groups += 1
        if stale:
            self.wake()
        if len(self.ready) < self.work.batch_groups:
            return
        self.ready.sort(key=lambda g: (g.min_version, g.ticket))
        batch, self.ready = self.ready[: self.work.batch_groups], self.ready[self.work.batch_groups:]
        self.trainer_busy, self.taken = True, self.version
        # begins once the event that completed the batch is over (a replica handing its last group over is busy
        # until then, and only its next step says whether the rollout side is), at the waiting trainer's next look
        poll = 0.0 if self.colocated else self.costs.trainer_poll_s
        self.at(next_tick(self.waiting_since, self.now, poll), lambda: self._train(batch))

    def _train(self, batch: list[Group]) -> None:
        g_size = self.work.group_size
        trained = [g for g in batch if self.rng.random() >= self.work.uniform_share]  # uniform groups: no loss
        tokens = sum(g.tokens + g_size * g.prompt for g in trained)
        publish = self.costs.colocated_publish_s if self.colocated else self.costs.publish_s
        slow = self.slowdown(any(r.busy for r in self.replicas))
        parts = {"update": self.costs.train(tokens, 0), "spool": self.costs.spool_per_group_s * len(batch),
                 "publish": publish}
        self.phases.update({f"trainer/{k}": v * slow for k, v in parts.items()})
        side, self.trainer_side_cpu = self.trainer_side_cpu, 0.0  # CPU seconds: not slowed by the sharing
        if side > 0:
            self.phases["trainer/side_cpu"] += side
        cost = sum(parts.values()) * slow + side
        self.trainer_busy_s += cost
        for g in batch:
            self.trained_tickets.append(g.ticket)
            self.samples += g_size
            self.tokens += g.tokens
            for v, n in g.versions.items():
                self.staleness[self.version - v] += n
        self.at(self.now + cost, self._published)

    def _published(self) -> None:
        self.trainer_busy = False
        self.waiting_since = self.now
        self.version += 1
        self.wake()
        self.try_train()

    def new_group(self, ticket: int) -> Group:
        """Ticket ``ticket``'s group: its prompt and, with ``Workload.group_shapes``, its samples' lengths, drawn."""
        work = self.work
        if not work.group_shapes:
            return Group(ticket, work.group_size, prompt=work.prompt_tokens)
        prompt, lengths, *shared = self.rng.choice(work.group_shapes)
        return Group(ticket, work.group_size, prompt=prompt, lengths=tuple(lengths),
                     shared=tuple(shared[0]) if shared else ())

    def new_rows(self, group: Group) -> list[Row]:
        """A new group's samples: its shape's, or each one's own draw."""
        n = len(group.lengths)
        if n == self.work.group_size:  # in a random order: an engine short of rows takes the first
            return [Row(group, group.lengths[i], index=i) for i in self.rng.sample(range(n), n)]
        return [Row(group, self.row_length(group)) for _ in range(self.work.group_size)]

    def row_length(self, group: Group) -> int:
        """One sample's response tokens, drawn from its group's shape (or from the workload's lengths)."""
        return self.rng.choice(group.lengths or self.work.response_tokens)

    def wake(self) -> None:
        """New weights or reissued tickets: replicas waiting for either look again."""
        for r in self.replicas:
            r.wake()


class _Replica:
    """One rollout replica's engine as a chain of steps."""

    def __init__(self, pipe: Pipeline, index: int) -> None:
        self.pipe, self.index = pipe, index
        self.work, self.costs = pipe.work, pipe.costs
        self.version = 0
        self.rows: list[Row] = []  # in the engine
        self.waiting: list[Row] = []  # admitted, waiting for free rows (Workload.queued_groups)
        self.busy = False  # a step is running
        self.up = True
        self.busy_s = 0.0
        self.next_poll = 0.0
        self.life = 0  # bumped at each failure: events of an earlier life are ignored
        self._finishing: list[Group] = []
        self.parked: list[Group] = []  # complete but left behind (left_behind): generated again at new weights
        self._started = 0.0  # when the running step started
        self._parts: Counter = Counter()  # the running step's seconds by phase (added to the run's when it ends)
        self._trainer_side = 0.0  # what the running step's side work costs the trainer (Pipeline.side_cpu)
        self._idle_since = 0.0  # when it last found nothing to do (its sleeps between looks count from there)
        self._look_due = False  # a look at the end of the current sleep is scheduled

    def start(self) -> None:
        if self.work.rollout_failures_per_hour > 0:
            self._schedule_failure()
        self._step()

    def wake(self) -> None:
        """New weights or a reissued ticket: an idle replica sees it at its next look."""
        if not self.up or self.busy or self._look_due:
            return
        poll = 0.0 if self.pipe.colocated else self.costs.rollout_idle_poll_s
        if poll <= 0:
            self._step()
            return
        self._look_due, life = True, self.life
        self.pipe.at(next_tick(self._idle_since, self.pipe.now, poll), lambda: self._look(life))

    def _look(self, life: int) -> None:
        self._look_due = False
        if life == self.life and self.up and not self.busy:
            self._step()

    def _step(self) -> None:
        pipe, costs, work = self.pipe, self.costs, self.work
        parts = self._parts = Counter()  # this step's seconds by phase, before the shared-core slowdown
        poll = pipe.colocated or costs.weights_poll_s <= 0 or pipe.now >= self.next_poll or not self.rows
        if poll and pipe.version > self.version:
            self.next_poll = pipe.now + costs.weights_poll_s
            parts["weights"] += 0.0 if pipe.colocated else costs.weights_load_s  # colocated: loaded by the publish
            if work.kv_on_update == "recompute" and self.rows:
                parts["rebuild_prefill"] += costs.rebuild(self._context(distinct=True))
                pipe.prefill_calls += 1
            self.version = pipe.version
            again = [row for g in {id(r.group): r.group for r in self.rows + self.waiting}.values()
                     for row in g.restart_doomed(self.version - work.max_staleness, pipe.row_length)]
            again += [row for g in self.parked for row in g.restart_doomed(math.inf, pipe.row_length)]  # all rows
            self.parked = []
            self.waiting += again  # finished rows the new weights leave behind, at once
            pipe.restarted += len(again)
        elif poll:
            self.next_poll = pipe.now + costs.weights_poll_s
        admitted, cap = 0, work.max_batch_rows + work.queued_groups * work.group_size
        share = self._share()
        while cap - len(self.rows) - len(self.waiting) >= work.group_size and share > 0:
            ticket = pipe.ledger.try_admit(self.version)
            if ticket is None:
                break
            group = pipe.new_group(ticket)
            self.waiting += pipe.new_rows(group)
            admitted, share = admitted + 1, share - 1
        parts["ledger"] += admitted * costs.admit_s
        free = work.max_batch_rows - len(self.rows)
        if self.waiting and free >= min(work.group_size, len(self.waiting)):  # the engine admits G rows or more
            entering, self.waiting = self.waiting[:free], self.waiting[free:]
            # one prefill call for them, each group's prompt once; a running batch's cache is merged with theirs
            prompts = [g.prompt for g in {id(r.group): r.group for r in entering}.values()]
            parts["admit_prefill"] += costs.prefill(costs.context(len(prompts), sum(prompts), max(prompts)))
            if self.rows and costs.padded_cache:
                longest = max(max(prompts), max(r.group.prompt + r.done for r in self.rows))
                parts["admit_prefill"] += costs.merge_per_token_s * (len(self.rows) + len(entering)) * longest
            self.rows += entering
            pipe.prefill_calls += 1
        finished: list[Group] = []
        if not self.rows:
            if sum(parts.values()) == 0:
                self.busy, self._idle_since = False, pipe.now
                return  # wait for new weights or a reissued ticket (Pipeline.wake)
            self._busy_for(pipe.slowdown(pipe.trainer_busy), finished)  # loaded weights, nothing to decode
            return
        context, n = self._context(), len(self.rows)
        # k decode steps in one event, up to the first row's end (the context grows by n tokens a step): exact for
        # the linear cost model; only looks for weights and admissions wait for the event's end
        k = min(work.tokens_per_event, min(r.length - r.done for r in self.rows))
        parts["decode"] += k * costs.decode(n, context) + costs.decode_per_context_token_s * n * k * (k - 1) / 2
        pipe.decode_steps, pipe.decode_rows = pipe.decode_steps + k, pipe.decode_rows + k * n
        parts["spool_look"] += k * costs.colocated_pass_s if pipe.colocated else 0.0
        restarted = []
        for r in self.rows:
            r.head = self.version if r.head is None else r.head
            r.done += k
            r.versions[self.version] += k
            if r.done < r.length:
                continue
            if r.head < self.version - work.max_staleness:  # its head went stale: the worker generates it again
                restarted.append(Row(r.group, pipe.row_length(r.group)))
                continue
            r.group.tokens += r.length
            r.group.versions.update(r.versions)
            r.group.finished.append(r)
            r.group.rows_left -= 1
            if r.group.rows_left == 0:  # complete: handed over, or parked if the batch taken left it behind
                (self.parked if self.left_behind(r.group) else finished).append(r.group)
        self.rows = [r for r in self.rows if r.done < r.length]
        self.waiting += restarted  # at the end of the engine's queue, as a new request
        pipe.restarted += len(restarted)
        parts["reward"] += len(finished) * work.group_size * costs.reward_per_sample_s
        parts["spool_write"] += len(finished) * costs.spool_write_per_group_s
        self._busy_for(pipe.slowdown(pipe.trainer_busy), finished, *pipe.side_cpu(len(finished)))

    def left_behind(self, group: Group) -> bool:
        """Whether the complete ``group`` is stale for every batch the trainer has still to take: its oldest token
        ``eta`` behind the version whose batch the trainer has in hand (trusted one version past this replica's
        weights at most, as hpcrl's worker does). Colocated mode has no mark."""
        if self.pipe.colocated:
            return False
        return group.min_version < min(self.pipe.taken, self.version + 1) + 1 - self.work.max_staleness

    def _context(self, distinct: bool = False) -> int:
        """The tokens the running rows hold, as the engine's cache costs them (Costs.context); ``distinct``: each
        context once, however many rows hold it (:func:`distinct_rows`; the prefill that rebuilds the cache)."""
        held = [r.group.prompt + r.done for r in (distinct_rows(self.rows) if distinct else self.rows)]
        return self.costs.context(len(held), sum(held), max(r.group.prompt + r.done for r in self.rows))

    def _share(self) -> float:
        """Groups this replica may still take: unlimited, or with ``Workload.spread_tickets`` its even share of what
        the bound lets be outstanding, ceil((eta + 1) B / replicas), less the groups it holds."""
        work = self.work
        if not work.spread_tickets:
            return math.inf
        held = len({id(r.group) for r in self.rows + self.waiting}) + len(self.parked)
        return math.ceil((work.max_staleness + 1) * work.batch_groups / work.replicas) - held

    def _busy_for(self, slow: float, finished: list[Group], side_cpu: float = 0.0, trainer_side: float = 0.0) -> None:
        """Run this step's parts (times ``slow``, the shared-core slowdown) and ``side_cpu`` seconds of the other
        threads' work, ``trainer_side`` owed by the trainer at its end (Pipeline.side_cpu); ``finished`` is handed
        over at its end."""
        self._parts = Counter({k: v * slow for k, v in self._parts.items()})
        if side_cpu > 0:
            self._parts["side_cpu"] += side_cpu
        self._trainer_side = trainer_side
        cost = sum(self._parts.values())
        self.busy = True
        self._started = self.pipe.now
        self._finishing = finished  # done by this step, handed over at its end: lost if the replica fails first
        life = self.life
        self.pipe.at(self.pipe.now + cost, lambda: self._stepped(life, finished))

    def stop(self) -> None:
        """A step still running counts as busy up to now (the run is over, or the replica failed)."""
        if self.busy:
            self.busy_s += self.pipe.now - self._started
            self._started = self.pipe.now

    def _stepped(self, life: int, finished: list[Group]) -> None:
        if life != self.life:
            return
        self.busy_s += self.pipe.now - self._started
        self.pipe.phases.update({f"rollout/{k}": v for k, v in self._parts.items()})
        self.pipe.trainer_side_cpu += self._trainer_side
        for g in finished:  # still busy meanwhile: a wake from the trainer must not start a second step
            self.pipe.offer(g)
        self.busy = False
        self._step()

    # -- failures -----------------------------------------------------------------------------------
    def _schedule_failure(self) -> None:
        rate = self.work.rollout_failures_per_hour / 3600.0
        life = self.life
        self.pipe.at(self.pipe.now + self.pipe.rng.expovariate(rate), lambda: self._fail(life))

    def _fail(self, life: int) -> None:
        if life != self.life or not self.up:
            return
        self.life += 1
        # the groups in its engine, and those its running step finished but has not handed over yet
        lost = {id(g): g for g in [r.group for r in self.rows + self.waiting] + self.parked
                + (self._finishing if self.busy else [])}
        self.stop()  # the step it was running counts up to the failure
        self.up, self.busy, self._look_due = False, False, False  # a look scheduled before is of the old life
        self.pipe.failures += 1
        self.pipe.ledger.reissued += sorted(g.ticket for g in lost.values())
        self.rows, self.waiting, self._finishing, self.parked = [], [], [], []
        if lost:
            self.pipe.wake()
        self.pipe.at(self.pipe.now + self.work.restart_s, self._restart)

    def _restart(self) -> None:
        self.up = True
        self.version = -1  # a fresh process: it loads the current weights at its first step
        self._schedule_failure()
        self._step()


def next_tick(since: float, now: float, every: float) -> float:
    """The first of the looks ``since``, ``since + every``, ... at or after ``now`` (``now`` when ``every`` is 0)."""
    if every <= 0 or now <= since:
        return now
    return max(now, since + math.ceil((now - since) / every - 1e-9) * every)


def simulate(work: Workload, costs: Costs) -> Result:
    """Play ``work`` with ``costs``; see the module docstring."""
    return Pipeline(work, costs).run()
