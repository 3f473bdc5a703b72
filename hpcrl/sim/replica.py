"""One rollout replica of the simulated pipeline (:mod:`hpcrl.sim.pipeline`): its engine as a chain of steps.

Each step looks for new weights (and in ``recompute`` mode prefills the
in-flight rows again), takes tickets while its rows allow, admits waiting
rows, decodes, and hands finished groups to the :class:`~hpcrl.sim.pipeline.Pipeline`
at its end; a failure loses what it holds and the replica comes back after
``Workload.restart_s``. Lifecycle: built by the pipeline, started by
:meth:`Replica.start`, driven by the pipeline's events until the run ends
(:meth:`Replica.stop` counts a step still running).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

from hpcrl.sim.rows import Group, Row, distinct_rows

if TYPE_CHECKING:
    from hpcrl.sim.pipeline import Pipeline


class Replica:
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
