"""The groups and rows a simulated engine holds (:mod:`hpcrl.sim.pipeline`).

A :class:`Group` is one ticket's group: its prompt, its samples' lengths as its shape says (or drawn one by one),
the tokens and versions of its finished rows. A :class:`Row` is one sample in an engine. Lifecycle: the pipeline
makes a group when a replica takes a ticket and its rows when the group is admitted; a row ends finished (it joins
its group) or started again; a group ends trained, set aside or lost with its replica. Neither holds a clock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Group:
    ticket: int
    rows_left: int
    prompt: int = 0  # its prompt's tokens
    lengths: tuple[int, ...] = ()  # its samples' response tokens (Workload.group_shapes); (): each draws its own
    shared: tuple[int, ...] = ()  # the response tokens each two neighbours in ``lengths`` share; (): not known
    tokens: int = 0  # response tokens generated so far, all rows
    versions: Counter = field(default_factory=Counter)  # weights version -> tokens generated with it
    finished: list[Row] = field(default_factory=list)  # its rows done so far

    @property
    def min_version(self) -> int:
        return min(self.versions)

    def restart_doomed(self, floor: int, length: Callable[[Group], int]) -> list[Row]:
        """Take back the finished rows whose first token is older than ``floor`` (the group's file would only be
        set aside); returns the rows that generate them again (as hpcrl's worker does), each as long as
        ``length(group)`` says."""
        doomed = [r for r in self.finished if r.head < floor]
        for r in doomed:
            self.finished.remove(r)
            self.tokens -= r.length
            self.versions -= r.versions
            self.rows_left += 1
        return [Row(self, length(self)) for _ in doomed]


@dataclass
class Row:
    group: Group
    length: int  # response tokens it will generate
    done: int = 0
    head: int | None = None  # the version of its first token
    index: int | None = None  # its place in its group's shape (None: a sample drawn again, its own)
    versions: Counter = field(default_factory=Counter)  # weights version -> its tokens generated with it


def distinct_rows(rows: list[Row]) -> list[Row]:
    """One row for each context ``rows`` hold: rows of one group whose responses, ``d`` tokens in, agree on the
    ``d - 1`` the cache holds (their shape's shared prefixes say so) hold one context, which hpcrl's engine
    prefills once. A row without a place in its group's shape holds its own."""
    out, peers = [], {}
    for r in rows:
        if r.index is None or not r.group.shared:
            out.append(r)
        else:
            peers.setdefault((id(r.group), r.done), []).append(r)
    for same in peers.values():
        same.sort(key=lambda r: r.index)
        shared = same[0].group.shared  # the prefix two rows share is the least over the neighbours between them
        out += [same[0], *(b for a, b in zip(same, same[1:]) if min(shared[a.index:b.index]) < b.done - 1)]
    return out
