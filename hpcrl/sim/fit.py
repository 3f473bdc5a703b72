"""Fit a cost model to one measured run, phase by phase.

Costs measured piece by piece (each operation in a fresh process of its
own, at most beside a stand-in for one of the loop's threads) miss what the
real loop adds around them: Python between the calls, the allocator, caches
shared with the other side. :func:`fit_phases` scales
each group of :class:`~hpcrl.sim.model.Costs` fields by one factor so that
the simulated run spends, in each phase, the seconds the real run spent
there (``scripts/bench_async.py``'s time split): the shape of every cost
(per row, per token, per call) stays the measured one, only its level
moves. Fitted on one run (the synchronous baseline), the model is then
checked against runs it was not fitted on.

Lifecycle: a pure function; it simulates the workload a few times (the
factors change the timing, the timing changes what each phase costs: a
fixed point, reached in a few rounds on these models).
"""

from __future__ import annotations

import dataclasses

from hpcrl.sim.model import Costs, Workload
from hpcrl.sim.pipeline import simulate

# phase (as Result.phases names it) -> the Costs fields its time comes from
PHASE_FIELDS: dict[str, tuple[str, ...]] = {
    "rollout/decode": ("decode_s", "decode_per_row_s", "decode_per_context_token_s"),
    # an admission's prefill and merge (and the rebuild's prefill, unless it has its own)
    "rollout/admit_prefill": ("prefill_s", "prefill_per_token_s", "merge_per_token_s"),
    "rollout/rebuild_prefill": ("rebuild_prefill_s", "rebuild_prefill_per_token_s"),
    "rollout/reward": ("reward_per_sample_s",),
    "rollout/ledger": ("admit_s",),
    "rollout/spool_write": ("spool_write_per_group_s",),
    "rollout/spool_look": ("colocated_pass_s",),
    "rollout/weights": ("weights_load_s",),
    "trainer/update": ("train_step_s", "train_per_token_s"),
    "trainer/spool": ("spool_per_group_s",),
    "trainer/publish": ("publish_s", "colocated_publish_s"),
}


def scaled(costs: Costs, factors: dict[str, float]) -> Costs:
    """``costs`` with every field of each phase in ``factors`` multiplied by that phase's factor."""
    changes = {f: getattr(costs, f) * k for phase, k in factors.items() for f in PHASE_FIELDS[phase]
               if getattr(costs, f) is not None}
    return dataclasses.replace(costs, **changes)


def fit_phases(work: Workload, costs: Costs, measured: dict[str, float], rounds: int = 4,
               seeds: tuple[int, ...] = (0, 1, 2)) -> tuple[Costs, dict[str, float]]:
    """Factors per phase (of :data:`PHASE_FIELDS`, those in ``measured`` with a simulated time > 0) such that the
    simulated ``work`` spends ``measured[phase]`` seconds in each; returns the scaled costs and the factors."""
    unknown = sorted(set(measured) - set(PHASE_FIELDS))
    if unknown:
        raise ValueError(f"phases the fit does not know: {unknown}; known: {sorted(PHASE_FIELDS)}")
    factors = {phase: 1.0 for phase in measured  # a phase whose cost fields are all unset has nothing to scale
               if any(getattr(costs, f) is not None for f in PHASE_FIELDS[phase])}
    for _ in range(rounds):
        fitted = scaled(costs, factors)
        sims = [simulate(dataclasses.replace(work, seed=s), fitted).phases for s in seeds]
        for phase in factors:
            want, got = measured[phase], sum(p.get(phase, 0.0) for p in sims) / len(sims)
            if got > 0 and want > 0:
                factors[phase] *= want / got
    return scaled(costs, factors), factors
