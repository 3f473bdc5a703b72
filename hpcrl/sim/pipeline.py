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
  weights (:meth:`~hpcrl.sim.replica.Replica.left_behind`). With nothing to decode and
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
import random
from collections import Counter
from typing import Callable

from hpcrl.sim.model import Costs, Result, Workload
from hpcrl.sim.replica import Replica, next_tick
from hpcrl.sim.rows import Group, Row


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
        self.replicas = [Replica(self, i) for i in range(work.replicas)]

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


def simulate(work: Workload, costs: Costs) -> Result:
    """Play ``work`` with ``costs``; see the module docstring."""
    return Pipeline(work, costs).run()
