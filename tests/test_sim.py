"""The pipeline simulator against answers worked out by hand, and the protocol's invariants under it."""

from __future__ import annotations

import dataclasses
import heapq
import json
import statistics
import sys

import pytest

from hpcrl.sim import Costs, Pipeline, Workload, simulate

# only what a test names costs anything
ZERO = Costs(decode_s=0.0, decode_per_row_s=0.0, prefill_s=0.0, prefill_per_token_s=0.0, weights_load_s=0.0,
             weights_poll_s=0.0, train_step_s=0.0, train_per_token_s=0.0, spool_per_group_s=0.0, publish_s=0.0,
             colocated_publish_s=0.0)


def assert_no_ticket_lost(pipe: Pipeline) -> None:
    """Every ticket the ledger created was trained once, or is still on its way (in an engine, ready, reissued)."""
    groups_in_engines = {id(row.group): row.group for r in pipe.replicas for row in r.rows + r.waiting}.values()
    everywhere = (pipe.trained_tickets + [g.ticket for g in pipe.ready] + pipe.ledger.reissued
                  + [g.ticket for g in groups_in_engines]
                  + [g.ticket for r in pipe.replicas if r.busy for g in r._finishing]  # finished in a running step
                  + [g.ticket for r in pipe.replicas for g in r.parked])  # complete, left behind by the batch taken
    assert sorted(everywhere) == list(range(pipe.ledger.created))  # each ticket in exactly one place


def test_colocated_step_is_generation_then_training() -> None:
    costs = dataclasses.replace(ZERO, decode_s=1e-3, decode_per_row_s=1e-4, decode_per_context_token_s=1e-6,
                                prefill_s=2e-3, prefill_per_token_s=1e-5, reward_per_sample_s=3e-4,
                                train_step_s=0.05, train_per_token_s=2e-5, spool_per_group_s=4e-4,
                                colocated_publish_s=7e-3)
    b, g, length, prompt, steps = 3, 4, 5, 6, 7
    work = Workload(mode="colocated", max_staleness=0, steps=steps, batch_groups=b, group_size=g,
                    response_tokens=(length,), prompt_tokens=prompt, max_batch_rows=64)
    rows = b * g
    decode = sum(1e-3 + 1e-4 * rows + 1e-6 * rows * (prompt + k) for k in range(length))
    generate = (2e-3 + 1e-5 * b * prompt) + decode + b * g * 3e-4  # the B groups admitted in one prefill call
    train = 0.05 + 2e-5 * rows * (length + prompt) + 4e-4 * b + 7e-3
    r = simulate(work, costs)
    assert r.wall_s == pytest.approx(steps * (generate + train), rel=1e-9)
    assert (r.samples, r.tokens) == (steps * rows, steps * rows * length)
    assert r.staleness_hist == {0: steps * rows * length}  # synchronous: every token from the trained version
    assert r.trainer_busy == pytest.approx(train / (generate + train))
    assert r.phases == pytest.approx({  # the time split bench_async measures, phase by phase
        "rollout/admit_prefill": steps * (2e-3 + 1e-5 * b * prompt), "rollout/decode": steps * decode,
        "rollout/ledger": 0.0, "rollout/reward": steps * b * g * 3e-4, "rollout/spool_look": 0.0,
        "rollout/spool_write": 0.0, "rollout/weights": 0.0, "trainer/publish": steps * 7e-3,
        "trainer/spool": steps * 4e-4 * b, "trainer/update": steps * (0.05 + 2e-5 * rows * (length + prompt))},
        rel=1e-9)


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_the_phases_add_up_to_the_busy_time_on_shared_cores(kv: str) -> None:
    work = Workload(steps=30, max_staleness=3, replicas=2, kv_on_update=kv, shared_cores=True, response_tokens=(4, 30),
                    prompt_tokens=10, max_batch_rows=24)
    pipe = Pipeline(work, dataclasses.replace(Costs(), shared_slowdown=1.7, reward_per_sample_s=1e-4, admit_s=1e-4))
    r = pipe.run()
    rollout = sum(v for k, v in r.phases.items() if k.startswith("rollout/"))
    running = sum(sum(rep._parts.values()) for rep in pipe.replicas if rep.busy)  # cut by the run's end: not finished
    assert rollout <= sum(r.rollout_busy_s) + 1e-9 and sum(r.rollout_busy_s) <= rollout + running + 1e-9
    assert sum(v for k, v in r.phases.items() if k.startswith("trainer/")) == pytest.approx(r.trainer_busy_s, rel=1e-9)
    assert (r.phases.get("rollout/rebuild_prefill", 0) > 0) == (kv == "recompute") and r.phases["rollout/weights"] > 0


def test_the_other_threads_cpu_costs_the_generating_steps_only_where_no_core_is_idle_for_it() -> None:
    """Costs.side_cpu_per_group_s: free beside one torch thread; with the compute on every core (colocated) each
    group handed over lengthens its step by it; on shared cores only while the trainer is busy, half on the rollout's
    step and half on the trainer's next, unscaled by the shared-core slowdown (CPU seconds, not a slower step)."""
    side = 0.013
    costs = dataclasses.replace(ZERO, decode_s=1e-3, train_step_s=0.02, side_cpu_per_group_s=side)
    work = Workload(mode="colocated", max_staleness=0, steps=10, batch_groups=3, group_size=4, response_tokens=(5,))
    free, full = simulate(work, costs), simulate(dataclasses.replace(work, compute_fills_cores=True), costs)
    assert free == simulate(work, dataclasses.replace(costs, side_cpu_per_group_s=0.0))  # a core left for it
    assert full.phases["rollout/side_cpu"] == pytest.approx(10 * 3 * side)  # every group handed over, once
    assert full.wall_s == pytest.approx(free.wall_s + 10 * 3 * side)  # colocated: nothing overlaps it
    shared = Workload(steps=40, max_staleness=2, shared_cores=True, response_tokens=(3, 9))
    slowed = dataclasses.replace(costs, train_step_s=0.01, shared_slowdown=1.7)
    failing = dataclasses.replace(shared, replicas=2, rollout_failures_per_hour=3600 * 4, restart_s=0.05)
    for work in (shared, failing):
        pipe = Pipeline(work, slowed)
        r = pipe.run()
        charged = 2 * r.phases["rollout/side_cpu"] / side  # groups handed over while the trainer was busy, half each
        assert 0 < charged < pipe.offered and charged == pytest.approx(round(charged), abs=1e-6)
        # the trainer's half, owed for the groups handed over (a failed step's are not) and paid at its next step
        paid = r.phases["trainer/side_cpu"] + pipe.trainer_side_cpu
        assert paid == pytest.approx(r.phases["rollout/side_cpu"]) and r.phases["trainer/side_cpu"] > 0
        assert sum(v for k, v in r.phases.items() if k.startswith("trainer/")) == pytest.approx(r.trainer_busy_s)
    assert r.failures > 5
    assert "rollout/side_cpu" not in simulate(dataclasses.replace(shared, shared_cores=False), slowed).phases


def test_an_unbounded_rollout_keeps_its_engine_full() -> None:
    # one replica holding k groups decodes k*G samples every L steps of D seconds; the trainer is instant
    k, g, length, d = 4, 8, 10, 0.01
    work = Workload(max_staleness=16, steps=200, batch_groups=4, group_size=g, max_batch_rows=k * g,
                    response_tokens=(length,))
    r = simulate(work, dataclasses.replace(ZERO, decode_s=d))
    assert r.samples_per_s == pytest.approx(k * g / (length * d), rel=0.01)
    assert r.rollout_busy == pytest.approx(1.0, rel=1e-3)
    # its decode steps, every one of k*G rows, are all it spent its time on
    assert r.decode_rows / r.decode_steps == pytest.approx(k * g, rel=0.01)
    assert r.decode_steps * d == pytest.approx(r.rollout_busy_s[0], rel=1e-3)  # the last one cut by the end


def test_a_slow_trainer_sets_the_pace_and_staleness_stays_within_the_bound() -> None:
    b, g = 4, 8
    work = Workload(max_staleness=2, steps=100, batch_groups=b, group_size=g, response_tokens=(3, 9, 27))
    costs = dataclasses.replace(ZERO, decode_s=1e-4, train_step_s=0.2, publish_s=0.01)
    r = simulate(work, costs)
    assert r.samples_per_s == pytest.approx(b * g / 0.21, rel=0.02)
    assert r.trainer_busy == pytest.approx(1.0, rel=0.02)
    assert max(r.staleness_hist) <= 2


def test_disaggregated_synchronous_matches_colocated_when_moving_weights_is_free() -> None:
    base = dict(steps=20, batch_groups=4, group_size=4, response_tokens=(2, 5, 11), seed=3)
    costs = Costs(weights_load_s=0.0, weights_poll_s=0.0, publish_s=1e-3, colocated_publish_s=1e-3)
    colocated = simulate(Workload(mode="colocated", max_staleness=0, **base), costs)
    disaggregated = simulate(Workload(max_staleness=0, **base), costs)
    assert disaggregated.wall_s == pytest.approx(colocated.wall_s, rel=1e-9)


@pytest.mark.parametrize("eta", [1, 2, 4, 8])
def test_asynchrony_overlaps_generation_and_training(eta: int) -> None:
    base = dict(steps=40, batch_groups=8, group_size=8, response_tokens=(2, 3, 4, 6, 10, 20))
    sync = simulate(Workload(max_staleness=0, **base), Costs())
    run = simulate(Workload(max_staleness=eta, **base), Costs())
    assert run.samples_per_s > 1.2 * sync.samples_per_s
    assert max(run.staleness_hist) <= eta  # what is older is set aside, never trained
    keep = simulate(Workload(max_staleness=eta, kv_on_update="keep", **base), Costs())
    assert keep.samples_per_s > run.samples_per_s  # no prefill rebuilding the cache after each version


def test_failed_replicas_lose_their_groups_and_every_ticket_is_trained_once() -> None:
    work = Workload(max_staleness=2, steps=60, batch_groups=4, group_size=4, replicas=3, response_tokens=(5, 40),
                    rollout_failures_per_hour=3600 * 2, restart_s=0.3)  # about two failures a second each
    pipe = Pipeline(work, Costs())
    r = pipe.run()
    assert r.failures > 10 and r.samples == 60 * 4 * 4
    assert_no_ticket_lost(pipe)  # the failed replicas' groups were reissued and trained once
    calm = simulate(dataclasses.replace(work, rollout_failures_per_hour=0.0), Costs())
    assert calm.samples_per_s > r.samples_per_s


def test_the_same_seed_gives_the_same_run_and_shared_cores_slow_both_sides() -> None:
    work = Workload(max_staleness=2, response_tokens=(1, 4, 16), seed=5)
    assert simulate(work, Costs()) == simulate(work, Costs())
    shared = dataclasses.replace(work, shared_cores=True)
    alone = simulate(shared, Costs())  # shared_slowdown 1: sharing costs nothing
    slowed = simulate(shared, dataclasses.replace(Costs(), shared_slowdown=1.5))
    assert alone == simulate(work, Costs())
    assert slowed.samples_per_s < alone.samples_per_s


def test_uniform_groups_are_read_but_not_trained() -> None:
    work = Workload(max_staleness=4, steps=50, response_tokens=(4, 8))
    costs = dataclasses.replace(ZERO, decode_s=1e-5, train_per_token_s=1e-4)  # the trainer sets the pace
    full, most_uniform = simulate(work, costs), simulate(dataclasses.replace(work, uniform_share=0.75), costs)
    assert most_uniform.samples == full.samples
    assert most_uniform.trainer_busy_s == pytest.approx(full.trainer_busy_s / 4, rel=0.15)


def test_weights_are_looked_for_only_every_poll_interval_while_decoding() -> None:
    base = Workload(max_staleness=8, steps=60, response_tokens=(40,))
    costs = dataclasses.replace(Costs(), decode_s=1e-3, train_step_s=5e-3, weights_poll_s=0.0)
    every_step = simulate(base, costs)
    rarely = simulate(base, dataclasses.replace(costs, weights_poll_s=0.2))
    mean = lambda r: sum(k * n for k, n in r.staleness_hist.items()) / sum(r.staleness_hist.values())  # noqa: E731
    assert mean(rarely) > mean(every_step) + 0.3  # tokens keep coming from old weights between two looks


def test_a_run_that_cannot_progress_stops_with_an_error() -> None:
    # every replica fails long before it can finish a group: no group reaches the trainer, events go on forever
    work = Workload(steps=5, response_tokens=(10_000,), rollout_failures_per_hour=3600 * 1000, restart_s=0.001)
    with pytest.raises(RuntimeError, match="stalled at version 0"):
        Pipeline(work, Costs()).run(stall_events=20_000)


def test_a_workload_the_bound_cannot_serve_is_refused() -> None:
    with pytest.raises(ValueError, match="max_batch_rows"):
        Workload(group_size=8, max_batch_rows=4)
    with pytest.raises(ValueError, match="colocated"):
        Workload(mode="colocated", max_staleness=2)
    with pytest.raises(ValueError, match="mode"):
        Workload(mode="colocatd")
    with pytest.raises(ValueError, match="kv_on_update"):
        Workload(kv_on_update="recomp")
    with pytest.raises(ValueError, match="queued_groups"):
        Workload(queued_groups=-1)


@pytest.mark.parametrize("seed", range(12))
def test_no_ticket_is_lost_whatever_fails_when(seed: int) -> None:
    for eta in (0, 1, 3):
        work = Workload(max_staleness=eta, steps=30, batch_groups=4, group_size=4, replicas=3, uniform_share=0.3,
                        response_tokens=(2, 5, 40), rollout_failures_per_hour=3600 * 3, restart_s=0.2, seed=seed,
                        queued_groups=seed % 3, max_batch_rows=10)  # rows enter the engine part of a group too
        pipe = Pipeline(work, Costs())
        r = pipe.run()
        assert_no_ticket_lost(pipe)
        assert max(r.staleness_hist) <= eta


def test_a_group_that_went_stale_is_set_aside_and_its_ticket_generated_again() -> None:
    # a long group admitted early finishes after its slot's step: at eta = 1 it is too old when it arrives
    work = Workload(max_staleness=1, steps=40, batch_groups=8, group_size=8, response_tokens=(2, 3, 4, 6, 10, 40))
    pipe = Pipeline(work, Costs())
    r = pipe.run()
    assert r.dropped_groups > 0 and max(r.staleness_hist) <= 1
    assert r.samples == 40 * 8 * 8
    assert_no_ticket_lost(pipe)


def test_the_command_sweeps_a_setting_and_refuses_unknown_ones(tmp_path, capsys) -> None:
    from hpcrl.sim.__main__ import main

    costs = tmp_path / "costs.json"
    costs.write_text('{"train_step_s": 0.1}')
    out = tmp_path / "rows.json"
    main(["--costs", str(costs), "--sweep", "max_staleness=0,4", "steps=30", "response_tokens=2/8/32",
          "--json", str(out)])
    rows = __import__("json").loads(out.read_text())
    assert [r["setting"] for r in rows["rows"]] == [{"max_staleness": "0"}, {"max_staleness": "4"}]
    assert rows["costs"]["train_step_s"] == 0.1 and rows["workload"]["response_tokens"] == [2, 8, 32]
    assert rows["rows"][1]["samples_per_s"] > rows["rows"][0]["samples_per_s"]
    assert "max_staleness" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown setting 'nope'"):
        main(["nope=1"])
    with pytest.raises(SystemExit, match="colocated"):
        main(["mode=colocated", "max_staleness=2"])
    main(["mode=colocated", "max_staleness=0", "steps=3"])  # settings apply together, in any order
    main(["--sweep", "max_staleness=0", "mode=colocated", "steps=3"])  # a sweep value completes the settings
    for bad, said in (("steps=3.5", "an integer"), ("train_step_s=inf", "a finite number"),
                      ("response_tokens=8/x", "integers joined by /")):
        with pytest.raises(SystemExit, match=said):
            main([bad])
    calibrated = tmp_path / "model.json"  # what scripts/sim_calibrate.py --out writes
    calibrated.write_text('{"threads1": {"train_step_s": 0.2}, "threads2": {"train_step_s": 0.1}, '
                          '"shared_slowdown": {"mean": 1.1}}')
    main(["--costs", str(calibrated), "--threads", "2", "steps=3", "--json", str(out)])
    assert __import__("json").loads(out.read_text())["costs"]["train_step_s"] == 0.1


def test_the_fit_finds_the_levels_a_measured_run_had() -> None:
    """A 'measured' run is simulated with some costs 1.6x and 0.7x what the model says; fitted on its time split,
    the model finds those factors, and predicts another mode it was not fitted on."""
    from hpcrl.sim import fit_phases
    from hpcrl.sim.fit import scaled

    work = Workload(mode="colocated", max_staleness=0, steps=20, response_tokens=(6, 12, 30), prompt_tokens=9)
    model = dataclasses.replace(Costs(), reward_per_sample_s=1e-4, admit_s=2e-4)
    truth = {"rollout/decode": 1.6, "rollout/admit_prefill": 0.7, "rollout/reward": 2.0, "trainer/update": 1.3}
    real = scaled(model, truth)
    measured = {k: v for k, v in simulate(work, real).phases.items() if k in truth}
    fitted, factors = fit_phases(work, model, measured, seeds=(0,))
    assert factors == pytest.approx(truth, rel=1e-6)
    other = Workload(max_staleness=2, steps=20, response_tokens=(6, 12, 30), prompt_tokens=9)
    assert simulate(other, fitted).samples_per_s == pytest.approx(simulate(other, real).samples_per_s, rel=1e-6)
    with pytest.raises(ValueError, match="does not know"):
        fit_phases(work, model, {"rollout/idle": 1.0})


def test_an_idle_rollout_and_a_waiting_trainer_see_news_at_their_next_look() -> None:
    """One group of one token per step, synchronous: a decode step d, a train step t. A rollout that sleeps p
    between looks resumes on its grid of looks (a period of d + ceil(t/p) p); a trainer that looks every q
    starts on its own (ceil(d/q) q + t). Colocated, neither polls: one process hands over in memory."""
    from hpcrl.sim.pipeline import next_tick

    d, t, n = 0.01, 0.025, 5
    costs = dataclasses.replace(ZERO, decode_s=d, train_step_s=t)
    work = Workload(steps=n, batch_groups=1, group_size=1, max_staleness=0, response_tokens=(1,), prompt_tokens=1,
                    max_batch_rows=1)
    assert simulate(work, costs).wall_s == pytest.approx(n * (d + t))
    slept = simulate(work, dataclasses.replace(costs, rollout_idle_poll_s=0.02))
    assert slept.wall_s == pytest.approx((n - 1) * (d + 0.04) + d + t)
    looked = simulate(work, dataclasses.replace(costs, trainer_poll_s=0.015))
    assert looked.wall_s == pytest.approx(n * (0.015 + t))
    colocated = dataclasses.replace(work, mode="colocated")
    assert (simulate(colocated, dataclasses.replace(costs, rollout_idle_poll_s=0.02, trainer_poll_s=0.015)).wall_s
            == pytest.approx(simulate(colocated, costs).wall_s))
    assert [next_tick(1.0, x, 0.5) for x in (0.5, 1.0, 1.2, 1.5, 1.51)] == [0.5, 1.0, 1.5, 1.5, 2.0]


def test_a_replica_holds_tickets_for_one_group_beyond_its_rows_and_its_engine_takes_them_as_rows_free() -> None:
    work = Workload(steps=3, batch_groups=2, group_size=2, max_batch_rows=4, max_staleness=4, queued_groups=1,
                    response_tokens=(3,))
    pipe = Pipeline(work, dataclasses.replace(ZERO, decode_s=1e-3))
    replica = pipe.replicas[0]
    replica.start()
    assert pipe.ledger.created == 3 and len(replica.rows) == 4 and len(replica.waiting) == 2
    for _ in range(3):  # three decode steps: the first two groups finish, the waiting one enters, a fourth waits
        pipe.now, _, fn = heapq.heappop(pipe._events)
        fn()
    assert pipe.ledger.created == 5 and [r.group.ticket for r in replica.rows] == [2, 2, 3, 3]
    assert [r.group.ticket for r in replica.waiting] == [4, 4]


def test_decode_steps_played_in_chunks_cost_exactly_what_they_cost_one_by_one() -> None:
    """Colocated (no polls, no weights mid-generation), chunks change nothing but the number of events."""
    costs = dataclasses.replace(ZERO, decode_s=1e-3, decode_per_row_s=1e-4, decode_per_context_token_s=1e-6,
                                prefill_s=1e-3, train_step_s=0.01)
    work = Workload(mode="colocated", max_staleness=0, steps=4, batch_groups=3, group_size=4, max_batch_rows=8,
                    queued_groups=1, response_tokens=(5, 37, 100), prompt_tokens=7)
    one, chunked = simulate(work, costs), simulate(dataclasses.replace(work, tokens_per_event=64), costs)
    assert chunked.wall_s == pytest.approx(one.wall_s, rel=1e-9) and chunked.tokens == one.tokens
    assert chunked.phases == pytest.approx(one.phases, rel=1e-9)


@pytest.mark.parametrize("padded", [False, True])
def test_a_padded_cache_prices_every_row_as_the_longest_and_an_admission_merges_the_running_cache(padded) -> None:
    """hpcrl's embedded engine keeps one left-padded cache: the rebuild after new weights, an admission's prefill
    and a decode step over rows of unequal age cost rows times the longest, and groups admitted into a running
    batch copy the running cache (Costs.padded_cache)."""
    from hpcrl.sim.rows import Group, Row

    costs = dataclasses.replace(ZERO, decode_per_context_token_s=1e-5, prefill_s=1e-3, prefill_per_token_s=1e-4,
                                rebuild_prefill_s=2e-3, rebuild_prefill_per_token_s=3e-5, merge_per_token_s=1e-6,
                                padded_cache=padded)
    work = Workload(steps=2, batch_groups=1, group_size=2, max_batch_rows=6, max_staleness=4, queued_groups=0,
                    prompt_tokens=10, response_tokens=(8,))
    pipe = Pipeline(work, costs)
    replica, old = pipe.replicas[0], Group(ticket=0, rows_left=2, prompt=10)
    short, long = Group(ticket=1, rows_left=2, prompt=6), Group(ticket=2, rows_left=2, prompt=14)
    replica.rows = [Row(old, 8, done=5), Row(old, 8, done=1)]
    replica.waiting = [Row(short, 8), Row(short, 8), Row(long, 8), Row(long, 8)]
    pipe.ledger.created, pipe.version = 99, 1  # no ticket to take; new weights to load
    replica._step()  # rebuilds the running two, admits both waiting groups in one call, decodes one step over six
    assert [r.group.ticket for r in replica.rows] == [0, 0, 1, 1, 2, 2] and pipe.prefill_calls == 2
    rebuilt = 2 * 15 if padded else 15 + 11
    assert replica._parts["rebuild_prefill"] == pytest.approx(2e-3 + 3e-5 * rebuilt)
    prefilled, merged = (2 * 14, 6 * 15) if padded else (6 + 14, 0)  # merged: six rows as long as the longest
    assert replica._parts["admit_prefill"] == pytest.approx(1e-3 + 1e-4 * prefilled + 1e-6 * merged)
    context = 6 * 15 if padded else 15 + 11 + 6 + 6 + 14 + 14
    assert replica._parts["decode"] == pytest.approx(1e-5 * context)


@pytest.mark.parametrize("padded", [False, True])
def test_the_rebuild_prefills_a_context_the_rows_of_a_group_share_once(padded) -> None:
    """Rows of one group ``d`` tokens in hold one context when their responses agree on the first ``d - 1``
    (the shape's shared prefixes: the least over the neighbours between two rows); the rebuild after new weights
    prefills it once, the decode step still runs every row (hpcrl's engine: ``_prefill_shared``). A sample drawn
    again, or a group whose shape did not record what its rows share, holds its own."""
    from hpcrl.sim.rows import Group, Row, distinct_rows

    # responses in token order, lengths 5, 5, 9, 6; neighbours share 5, 2 and 1 tokens
    group = Group(ticket=0, rows_left=4, prompt=10, lengths=(5, 5, 9, 6), shared=(5, 2, 1))
    rows = lambda done: [Row(group, n, done=done, index=i) for i, n in enumerate(group.lengths)]  # noqa: E731
    assert [len(distinct_rows(rows(d))) for d in (1, 2, 3, 4)] == [1, 1, 2, 3]  # 3 in: two held, the last differs
    assert len(distinct_rows(rows(3)[::2])) == 1  # rows 0 and 2 agree on the least between them, 2 tokens
    unknown = Group(ticket=1, rows_left=2, prompt=10, lengths=(5, 5))
    again = Row(group, 5, done=3)  # a sample generated again: its own
    assert len(distinct_rows([*rows(3), again, Row(unknown, 5, done=3, index=0), Row(unknown, 5, done=3, index=1)])) \
        == 2 + 1 + 2
    costs = dataclasses.replace(ZERO, decode_per_context_token_s=1e-5, rebuild_prefill_s=2e-3,
                                rebuild_prefill_per_token_s=3e-5, padded_cache=padded)
    pipe = Pipeline(Workload(steps=2, batch_groups=1, group_size=4, max_batch_rows=8, max_staleness=4), costs)
    replica = pipe.replicas[0]
    replica.rows, pipe.ledger.created, pipe.version = [*rows(4), again], 99, 1
    replica._step()  # rebuilds: three contexts of the group, 10 + 4 tokens each, and the sample drawn again
    assert replica._parts["rebuild_prefill"] == pytest.approx(2e-3 + 3e-5 * (4 * 14 if padded else 3 * 14 + 13))
    assert replica._parts["decode"] == pytest.approx(1e-5 * (5 * 14 if padded else 4 * 14 + 13))
    shapes = ((10, (5, 5, 9, 6), (5, 2, 1)), (6, (3, 3, 3, 3), (3, 3, 3)))  # whole runs play such shapes
    assert simulate(dataclasses.replace(pipe.work, group_shapes=shapes), costs).tokens in {2 * 25, 25 + 12, 2 * 12}
    for bad in ((10, (5, 5), (6,)), (10, (5, 5, 9), (5,))):  # longer than a neighbour; one too few
        with pytest.raises(ValueError, match="shared prefixes"):
            Workload(group_shapes=(bad,))


def test_groups_drawn_whole_from_measured_shapes_keep_their_prompt_and_their_samples_lengths() -> None:
    """Workload.group_shapes: each group is one measured group's prompt and response lengths; the trainer's tokens
    count each group's own prompt once per sample, and a sample generated again takes one of its group's lengths."""
    g, b, steps, per_token = 4, 3, 20, 1e-6
    shapes = ((4, (2, 2, 3, 2)), (20, (9, 26, 9, 9)))  # 9 and 53 response tokens a group
    work = Workload(mode="colocated", max_staleness=0, steps=steps, batch_groups=b, group_size=g,
                    group_shapes=shapes, max_batch_rows=64)
    r = simulate(work, dataclasses.replace(ZERO, decode_s=1e-3, train_per_token_s=per_token))
    groups = steps * b
    long_groups = (r.tokens - 9 * groups) / (53 - 9)  # whole groups of one shape or the other
    assert long_groups == int(long_groups) and 0 < long_groups < groups
    short = groups - long_groups
    assert r.phases["trainer/update"] == pytest.approx(per_token * (short * (9 + g * 4) + long_groups * (53 + g * 20)))
    pipe = Pipeline(work, ZERO)
    group = pipe.new_group(0)
    assert (group.prompt, tuple(sorted(group.lengths))) in {(p, tuple(sorted(n))) for p, n in shapes}
    assert {pipe.row_length(group) for _ in range(50)} == set(group.lengths)
    with pytest.raises(ValueError, match="group_shapes"):
        Workload(group_shapes=((4, ()),))


def test_gpu_costs_follow_the_roofline_of_the_published_figures() -> None:
    from hpcrl.sim.gpu import H800, R1_DISTILL_QWEN_1_5B as m, gpu_costs, kv_rows

    assert m.kv_bytes_per_token == 2 * 28 * 2 * 128 * 2  # K and V, 28 layers, 2 KV heads of 128, 2 bytes
    from hpcrl.sim.gpu import step_overhead_s

    assert step_overhead_s(m) == pytest.approx(1 / 183.33 - 2 * 1.78e9 / 2.039e12)  # ~3.7 ms a step, batch 1
    c = gpu_costs(m, H800, 4, 10_000, train_flops_per_gpu=400e12, decode_bw_efficiency=0.5, decode_mfu=0.25,
                  decode_step_overhead_s=1e-3)
    assert c.decode_s == pytest.approx(1e-3 + 2 * 1.78e9 / (3.35e12 * 0.5))  # the weights, once a step
    assert c.decode_per_context_token_s == pytest.approx(28672 / (3.35e12 * 0.5))
    assert c.decode_per_row_s == pytest.approx(2 * 1.78e9 / (989.4e12 * 0.25))
    assert c.train_per_token_s == pytest.approx((8 * 1.78e9 + 16 * 28 * 1536 * 5_000) / (4 * 400e12))
    assert kv_rows(m, H800, 8_000) == int((0.85 * 80e9 - 2 * 1.78e9) / (28672 * 8_000))
    with pytest.raises(ValueError, match="fractions"):
        gpu_costs(m, H800, 4, 10_000, train_flops_per_gpu=400e12, decode_mfu=1.5)


def test_a_sample_whose_head_went_stale_is_generated_again_and_nothing_trains_beyond_the_bound() -> None:
    """The worker restarts a sample that finishes with its first token more than eta versions behind its weights;
    long samples beside short ones under a fast trainer do that."""
    costs = dataclasses.replace(ZERO, decode_s=1e-3, train_step_s=1e-3)
    work = Workload(steps=40, batch_groups=2, group_size=2, max_staleness=1, response_tokens=(2, 2, 2, 60),
                    max_batch_rows=8, queued_groups=1)
    pipe = Pipeline(work, costs)
    r = pipe.run()
    assert r.restarted_samples > 0 and max(r.staleness_hist) <= 1
    assert_no_ticket_lost(pipe)


def test_tickets_spread_evenly_over_replicas_only_when_asked() -> None:
    """hpcrl's workers each take what their rows hold; a dispatcher (spread_tickets) gives each its even share."""
    work = Workload(steps=2, batch_groups=8, group_size=2, max_staleness=0, replicas=4, max_batch_rows=64,
                    response_tokens=(5,))
    for spread, held in ((False, [16, 0, 0, 0]), (True, [4, 4, 4, 4])):
        pipe = Pipeline(dataclasses.replace(work, spread_tickets=spread), dataclasses.replace(ZERO, decode_s=1e-3))
        for r in pipe.replicas:
            r.start()
        assert [len(r.rows) + len(r.waiting) for r in pipe.replicas] == held
    from hpcrl.sim.pipeline import next_tick

    assert next_tick(0.0, 5e-10, 1.0) >= 5e-10  # never before now


def test_the_fit_leaves_alone_a_phase_it_has_nothing_to_scale_in() -> None:
    from hpcrl.sim import fit_phases

    work = Workload(mode="colocated", max_staleness=0, steps=5, response_tokens=(6, 12))
    _, factors = fit_phases(work, Costs(), {"rollout/decode": 1.0, "rollout/rebuild_prefill": 1.0}, seeds=(0,))
    assert set(factors) == {"rollout/decode"}  # the rebuild's own costs are unset: priced as an admission's


def test_the_gpu_plans_split_the_gpus_as_asked_and_count_preemptions(monkeypatch) -> None:
    """scripts/sim_predict.py's play, as scripts/sim_plan.py drives it: the share of GPUs generating, and replicas
    preempted at a rate (16 prompts a step, short responses, few steps: well under a second)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import sim_predict

    monkeypatch.setattr(sim_predict, "PROMPTS", 16)
    play = sim_predict.play
    half = play("1.5B", 16, 8, 200, 3, rollout_share=0.5)
    assert (half["rollout_gpus"], half["train_gpus"], half["failures"]) == (8, 8, 0)
    calm = play("1.5B", 16, 8, 200, 3)
    assert (calm["rollout_gpus"], calm["train_gpus"]) == (12, 4)  # AReaL's 3:1 by default
    hit = play("1.5B", 16, 8, 200, 3, work={"rollout_failures_per_hour": 360.0, "restart_s": 1.0, "seed": 1})
    assert hit["failures"] > 0 and hit["samples_per_s"] < calm["samples_per_s"]
    with pytest.raises(ValueError, match="no GPU to training"):
        play("1.5B", 16, 8, 200, 3, rollout_share=1.0)


def test_the_plan_takes_the_trainer_measured_on_a_gpu_in_the_simulators_accounting(tmp_path, monkeypatch) -> None:
    """scripts/sim_plan.py --trainer-from: a device check's fsdp row becomes FLOP/s per GPU counted as the GPU cost
    model counts a trained token (8 P + causal attention), and a slower trainer is busier at the same split."""
    import json
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import sim_plan
    import sim_predict

    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"steps": {
        "model": {"status": "ok", "result": {"size": "tiny", "params": 1_000_000}},
        "fsdp": {"status": "ok", "result": {"tokens_per_s": 2000.0, "seq_len": 64}}}}))
    flops, source = sim_plan.measured_train_flops(summary)
    # tiny: 4 layers of 4 heads of 32 (scripts/device_bench.py SIZES); sequences of 64, causal: 32 attended
    assert source["flops_per_token_counted"] == 8 * 1_000_000 + 16 * 4 * 4 * 32 * 32
    assert source["flops_per_token_done"] == 6 * 1_000_000 + 12 * 4 * 4 * 32 * 32
    assert flops == 2000.0 * source["flops_per_token_counted"]
    assert flops == pytest.approx(source["achieved_flops_per_gpu"] * 4 / 3)
    summary.write_text(json.dumps({"steps": {"model": {"status": "ok", "result": {}}, "fsdp": {"status": "failed"}}}))
    with pytest.raises(SystemExit, match="no measured fsdp row"):
        sim_plan.measured_train_flops(summary)

    monkeypatch.setattr(sim_predict, "PROMPTS", 16)
    areal = sim_predict.play("1.5B", 16, 8, 200, 3, rollout_share=0.5)
    slow = sim_predict.play("1.5B", 16, 8, 200, 3, rollout_share=0.5, train_flops=sim_predict.TRAIN_FLOPS["1.5B"] / 20)
    assert slow["trainer_busy"] > areal["trainer_busy"] and slow["samples_per_s"] < areal["samples_per_s"]


def test_a_group_is_handed_over_only_while_its_oldest_token_is_within_the_bound() -> None:
    """A row that finished early and that later weights leave more than eta versions behind is generated again
    before its group is handed over (as the worker does): no group reaches the spool stale already."""
    work = Workload(max_staleness=1, steps=40, batch_groups=8, group_size=8, response_tokens=(2, 3, 4, 6, 10, 40))
    pipe = Pipeline(work, Costs())
    replica, margins = pipe.replicas[0], []
    offer = pipe.offer

    def checked(group) -> None:
        margins.append(group.min_version - (replica.version - work.max_staleness))
        offer(group)

    pipe.offer = checked
    r = pipe.run()
    assert min(margins) >= 0 and r.restarted_samples > 0
    assert r.samples == 40 * 8 * 8
    assert_no_ticket_lost(pipe)


def test_the_check_on_several_runs_compares_their_mean_ratios(tmp_path, monkeypatch) -> None:
    """scripts/sim_calibrate.py --check (scripts/_sim_check.py) with repeated runs: each is played on its own, and
    the check is made on the mean ratios (the same run twice: the mean is that run)."""
    from chaos_script import ROOT, load_script

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # its _bench
    chk = load_script("_sim_check")
    costs, run = ROOT / "bench" / "sim_costs_gate.json", ROOT / "bench" / "results_gate.json"
    out = tmp_path / "check.json"
    chk.check(costs, [run, run], out)
    got = json.loads(out.read_text())
    one = got["runs"][str(run)]["modes"]
    assert got["modes"].keys() == one.keys() and "async_eta4" in one
    for name, r in got["modes"].items():
        assert r["measured_ratio"] == pytest.approx(one[name]["measured_ratio"])
        assert r["simulated_ratio"] == pytest.approx(one[name]["simulated_ratio"])
        assert r["measured_ratios"] == [one[name]["measured_ratio"]] * 2
    assert got["within_10_percent"] == sum(abs(r["error"]) <= 0.10 for r in one.values())
    mean = chk.mean_of_runs([{"modes": {"a": {"measured_ratio": 1.0, "simulated_ratio": 1.2,
                                              "measured_ratio_rounds": [0.9, 1.1]}}},
                             {"modes": {"a": {"measured_ratio": 1.4, "simulated_ratio": 1.2,
                                              "measured_ratio_rounds": [1.3, None, 1.5]},
                                        "b": {"measured_ratio": 1.0, "simulated_ratio": 1.0}}}])
    assert mean.keys() == {"a"} and mean["a"]["error"] == pytest.approx(0.0)  # b is not in every run
    # the mean's standard error from the four rounds' ratios (a round without one left out)
    assert mean["a"]["measured_ratio_se"] == pytest.approx(statistics.stdev([0.9, 1.1, 1.3, 1.5]) / 2)
    assert chk.ratio_se([{"measured_ratio_rounds": [1.2]}]) is None and chk.ratio_se([{}]) is None


def test_bench_async_means_its_rounds_and_keeps_each_rounds_ratio(monkeypatch) -> None:
    """Each mode runs once per round, the baseline twice (first and last); a field is the mean over the runs (a
    count a round lacks is 0 there, a None left out, text as the first round had it), and each round's ratio is
    taken against the mean of the same round's baseline runs; a mode named twice is refused."""
    from chaos_script import ROOT, load_script

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # its _bench
    bench = load_script("bench_async")
    row = {"steps": 60, "wall_s": 30.0}
    base = [{**row, "samples_per_s": 400.0, "tokens_per_s": 4000.0, "spool_admission_share": 0.01,
             "stale_set_asides": 0, "staleness_hist": {"0": 10}, "final_accuracy": None},
            {**row, "samples_per_s": 500.0, "tokens_per_s": 5000.0, "spool_admission_share": 0.02,
             "stale_set_asides": 0, "staleness_hist": {"0": 20}, "final_accuracy": 0.5}]
    fast = [{**row, "samples_per_s": 600.0, "tokens_per_s": 6000.0, "spool_admission_share": 0.03,
             "stale_set_asides": 4, "staleness_hist": {"0": 6, "1": 4}, "final_accuracy": 0.25},
            {**row, "samples_per_s": 600.0, "tokens_per_s": 6000.0, "spool_admission_share": 0.01,
             "stale_set_asides": 2, "staleness_hist": {"0": 10}, "final_accuracy": 0.5}]
    results = {"colocated_t1": bench.merge_rounds(base), "async_eta1": bench.merge_rounds(fast)}
    bench.add_ratios(results)
    r = results["async_eta1"]
    assert r["samples_per_s"] == 600.0 and r["spool_admission_share"] == pytest.approx(0.02)
    assert r["steps"] == 60 and isinstance(r["steps"], int)  # the simulator takes it as its step count
    assert r["staleness_hist"] == {"0": 8.0, "1": 2.0} and r["stale_set_asides"] == 3.0
    assert r["final_accuracy"] == 0.375 and results["colocated_t1"]["final_accuracy"] == 0.5  # None: left out
    assert r["ratio_samples"] == pytest.approx(600 / 450)  # against the baseline's mean
    assert r["ratio_samples_rounds"] == pytest.approx([1.5, 1.2])  # each round against its own baseline
    assert [x["samples_per_s"] for x in r["rounds"]] == [600.0, 600.0]
    assert results["colocated_t1"]["ratio_samples"] == 1.0
    assert "each mode once" in bench.refused(["colocated_t1", "colocated_t1"], 3)
    assert "unknown" in bench.refused(["colocated_t3"], 3) and "--rounds" in bench.refused(["colocated_t1"], 0)
    assert bench.refused(["colocated_t1", "async_eta1"], 1) is None
    # the baseline bracketing each round (first and last): each round's ratio against the mean of its two runs
    assert bench.round_order(["async_eta1", "colocated_t1", "colocated_t2"]) == [
        "colocated_t1", "async_eta1", "colocated_t2", "colocated_t1"]
    assert bench.round_order(["colocated_t1"]) == ["colocated_t1"] and bench.round_order(["a", "b"]) == ["a", "b"]
    twice = [{**b, "round": k // 2} for k, b in enumerate([base[0], {**base[0], "samples_per_s": 500.0},
                                                          base[1], {**base[1], "samples_per_s": 300.0}])]
    results = {"colocated_t1": bench.merge_rounds(twice),
               "async_eta1": bench.merge_rounds([{**f, "round": k} for k, f in enumerate(fast)])}
    bench.add_ratios(results)
    assert results["colocated_t1"]["samples_per_s"] == 425.0 and "round" not in results["colocated_t1"]
    assert [x["round"] for x in results["colocated_t1"]["rounds"]] == [0, 0, 1, 1]
    assert results["async_eta1"]["ratio_samples_rounds"] == pytest.approx([600 / 450, 600 / 400])
    assert results["colocated_t1"]["ratio_samples_rounds"] == pytest.approx([1.0, 1.0])
    assert results["async_eta1"]["ratio_samples"] == pytest.approx(600 / 425)
    late = bench.merge_rounds([{"staleness_hist": {"0": 1, "2": 1}}, {"staleness_hist": {"0": 1, "1": 2, "2": 1}}])
    assert list(late["staleness_hist"]) == ["0", "1", "2"]  # a version only a later round reached, in its place
    assert bench.mean_of([None, None]) is None and bench.mean_of(["a", "b"]) == "a"


def test_the_calibration_fits_each_thread_count_to_its_median_run(monkeypatch) -> None:
    """scripts/sim_calibrate.py's median run: the run whose typical decode step is the median one, taken whole (its
    samples stay together), so that one noisy run can neither set the cost model nor pull it halfway."""
    from chaos_script import ROOT, load_script

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    cal = load_script("sim_calibrate")

    def engine(ms: float) -> dict:  # decode steps that cost ms whatever their rows and context
        return {"decode": [(n, c, ms / 1e3) for n in (1, 16, 64) for c in (10, 200, 900)], "prefill": [], "load": []}

    runs = [engine(2.0), engine(5.5), engine(2.6)]  # the middle one is the outlier
    chosen = cal.median_run(runs, cal.typical_decode_s)
    assert chosen is runs[2] and cal.typical_decode_s(chosen) == pytest.approx(2.6e-3)
    assert cal.median_run(runs[:1], cal.typical_decode_s) is runs[0]


@pytest.mark.parametrize("beside", [False, True])
def test_the_calibration_alternates_its_runs_and_takes_the_median_of_each_slowdown(tmp_path, monkeypatch,
                                                                                     beside) -> None:
    """measure(): per repeat one run of each piece with 1 and 2 threads, then each side's paired slowdown beside the
    other process; the cost model takes each thread count's median run, each slowdown the median of its repeats;
    every run's typical step is kept. --shared-only keeps a cost model's pieces and measures the slowdowns again."""
    from chaos_script import ROOT, load_script

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    cal = load_script("sim_calibrate")

    def engine(ms: float) -> dict:
        return {"decode": [(n, c, ms / 1e3) for n in (1, 16, 64) for c in (10, 200, 900)],
                "prefill": [(t, ms / 1e4) for t in (10, 100, 400)], "load": [0.001]}

    def trainer(ms: float) -> dict:
        return {"train": [(t, ms / 1e3) for t in (500, 1500, 3000)], "handover": 0.01, "admit_s": 1e-4,
                "spool_per_group_s": 1e-3}

    one = iter([2.0, 5.0, 3.0])  # the one-thread decode of each repeat: the median run is the third
    calls = []

    def run_child(kind, threads, model_path, seconds=0.0, companion=False):
        calls.append((kind, threads, seconds))
        assert companion == (beside and kind == "engine")  # the engine beside a spool writer only when asked
        if kind == "engine":
            return engine(next(one) if threads == 1 else 1.5)
        return trainer(300.0 if threads == 1 else 200.0)

    paired = {"engine": iter([1.2, 0.8, 1.1, 1.3]), "trainer": iter([1.1, 1.0, 1.05, 1.0])}

    def paired_slowdown(kind, other, model_path):
        calls.append(("paired-" + kind, other))
        return {"slowdown": next(paired[kind])}

    monkeypatch.setattr(cal, "_model", lambda tmp: tmp / "model")
    monkeypatch.setattr(cal, "run_child", run_child)
    monkeypatch.setattr(cal, "paired_slowdown", paired_slowdown)
    out = tmp_path / "costs.json"
    cal.measure(out, repeats=3, seconds=4.0, companion=beside)
    got = json.loads(out.read_text())
    assert calls[:6] == [("engine", 1, 4.0), ("trainer", 1, 4.0), ("engine", 2, 4.0), ("trainer", 2, 4.0),
                         ("paired-engine", "trainer"), ("paired-trainer", "engine")] and len(calls) == 18
    assert got["repeats"]["threads1"]["decode_ms"] == pytest.approx([2.0, 5.0, 3.0])
    assert got["repeats"]["threads2"]["writer_groups_per_s"] == [None, None, None]  # the fakes kept no rate
    assert got["repeats"]["shared_slowdown"]["decode"] == pytest.approx([1.2, 0.8, 1.1])
    slow = got["shared_slowdown"]
    assert slow["decode"] == pytest.approx(1.1) and slow["train"] == pytest.approx(1.05)
    assert slow["mean"] == pytest.approx(1.075)
    assert got["companion_groups_per_s"] == (cal.COMPANION_GROUPS_PER_S if beside else None)
    c1 = got["threads1"]
    assert c1["decode_s"] + 32 * c1["decode_per_row_s"] + 640 * c1["decode_per_context_token_s"] == pytest.approx(3e-3)
    again = tmp_path / "again.json"
    cal.measure_shared_only(out, again, repeats=1)
    redone = json.loads(again.read_text())
    assert redone["threads1"] == got["threads1"] and redone["pieces_from"] == str(out)
    assert redone["shared_slowdown"] == pytest.approx({"decode": 1.3, "train": 1.0, "mean": 1.15})


def test_the_check_takes_the_side_threads_cpu_from_the_baseline_and_charges_it_where_torch_fills_the_cores(
        monkeypatch) -> None:
    """sim_calibrate: the baseline's threads' CPU per group, the generating thread, the torch pool and the reward
    calls it waits for left out; colocated_t2 fills the cores of a two-core machine (not of a four-core one, nor
    does colocated_t1); --no-side-cpu leaves it out."""
    from chaos_script import ROOT, load_script

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    cal, chk = load_script("sim_calibrate"), load_script("_sim_check")
    run = json.loads((ROOT / "bench" / "results_s25.json").read_text())["runs"]["colocated_t1"]
    run = {**run, "generator_cpu_threads": {"MainThread": 24.0, "native": 0.1, "reward-call": 0.3,
                                            "spool-publisher": 2.3, "spool-read-ahead": 0.1, "Thread-1": 0.2}}
    groups = run["samples"] / cal.G
    assert chk.side_cpu_per_group(run) == pytest.approx(2.6 / groups)
    assert chk.side_cpu_per_group({"samples": 80}) is None
    assert chk.baseline_costs(run, 1e-3)["side_cpu_per_group_s"] == pytest.approx(2.6 / groups)
    assert chk.baseline_costs(run, 1e-3, side_cpu=False)["side_cpu_per_group_s"] == 0.0
    measured = json.loads((ROOT / "bench" / "sim_costs_s24.json").read_text())
    fills = {(name, cores): chk.mode_setup(name, run, measured, cores=cores)[0].compute_fills_cores
             for name in ("colocated_t1", "colocated_t2") for cores in (2, 4)}
    assert fills == {("colocated_t1", 2): False, ("colocated_t1", 4): False, ("colocated_t2", 2): True,
                     ("colocated_t2", 4): False}
    seen = []
    monkeypatch.setattr(cal, "check", lambda *a, **variant: seen.append(variant["side_cpu"]))
    for flags in ([], ["--no-side-cpu"]):
        monkeypatch.setattr(sys, "argv", ["sim_calibrate.py", "--costs", "c.json", "--check", "r.json", *flags])
        cal.main()
    assert seen == [True, False]


def test_the_engine_pieces_companion_publishes_real_spool_files_at_its_rate_until_it_is_left(monkeypatch) -> None:
    """sim_calibrate.Companion: a thread beside the measured engine publishing the task's groups into a spool of its
    own at its rate (each file fsynced, renamed, then removed), stopped and joined on exit."""
    import time

    from chaos_script import ROOT, load_script

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    cal = load_script("sim_calibrate")
    published = []
    from hpcrl.spool import store

    real = store.Spool.publish

    def publish(self, group):
        path = real(self, group)
        published.append((path, path.stat().st_size, group.ticket))
        return path

    monkeypatch.setattr(store.Spool, "publish", publish)
    t0 = time.monotonic()
    with cal.Companion(groups_per_s=50.0) as companion:
        deadline = t0 + 60
        while len(published) < 5 and time.monotonic() < deadline:  # however slow this machine's fsyncs are
            time.sleep(0.01)
    elapsed = time.monotonic() - t0
    assert not companion._thread.is_alive()  # stopped and joined on exit
    assert companion.published == len(published) and 5 <= len(published) <= 50 * elapsed + 1  # never above its rate
    assert [t for *_, t in published] == list(range(len(published)))  # one ticket each: no name collides
    assert all(size > 1000 and not path.exists() for path, size, _ in published)  # real files, removed after

    def broken(self, group):
        raise OSError("disk full")

    monkeypatch.setattr(store.Spool, "publish", broken)
    with pytest.raises(RuntimeError, match="spool writer"):  # a measurement never goes on without it unnoticed
        with cal.Companion(groups_per_s=50.0):
            time.sleep(0.05)


def test_the_engine_is_measured_beside_the_companion_only_when_asked_and_reports_the_rate_it_kept(monkeypatch,
                                                                                                 tmp_path) -> None:
    """measure_engine(companion=True) runs its grid inside a Companion at COMPANION_GROUPS_PER_S and records the
    rate the writer kept; without it, alone (rate None); the child's command line carries the choice."""
    from chaos_script import ROOT, load_script

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    cal = load_script("sim_calibrate")
    started = []

    class Writer:
        def __init__(self, rate):
            started.append(rate)
            self.published = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    def batch(engine, rng, rows, records):
        records["decode"].append((rows, rows, 0.001))

    monkeypatch.setattr(cal, "Companion", Writer)
    monkeypatch.setattr(cal, "_engine", lambda path: None)
    monkeypatch.setattr(cal, "_measure_batch", batch)
    beside = cal.measure_engine(tmp_path, companion=True)
    assert started == [cal.COMPANION_GROUPS_PER_S] and beside["companion_groups_per_s"] == 0.0
    alone = cal.measure_engine(tmp_path)
    assert started == [cal.COMPANION_GROUPS_PER_S] and alone["companion_groups_per_s"] is None
    assert len(alone["decode"]) == 6
    argv = []
    monkeypatch.setattr(cal.subprocess, "Popen", lambda cmd, env: argv.append(cmd))
    cal._child("engine", 2, tmp_path, 1.0, None, companion=True)
    cal._child("engine", 2, tmp_path, 1.0, None)
    assert "--_companion" in argv[0] and "--_companion" not in argv[1]


def test_the_calibration_prices_a_merge_and_a_rebuild_apart_from_an_admission_into_an_empty_engine(monkeypatch) -> None:
    """costs_from: admissions into an empty engine and into a running batch fit one prefill line plus a merge term;
    the rebuild gets its own line; an engine run of the older format (summed contexts, one prefill line) does not
    claim a padded cache."""
    from chaos_script import ROOT, load_script

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    cal = load_script("sim_calibrate")
    trainer = {"train": [(t, 1e-3 + 2e-6 * t) for t in (500, 1500, 3000)], "handover": 0.01, "admit_s": 1e-4,
               "spool_per_group_s": 1e-3}
    engine = {"decode": [(n, c, 2e-3 + 5e-5 * n + 1e-6 * c) for n in (1, 16, 64) for c in (10, 200, 900)],
              "prefill": [(t, 1e-3 + 2e-5 * t) for t in (10, 100, 400)], "load": [0.002],
              "merge": [(t, m, 1e-3 + 2e-5 * t + 3e-7 * m) for t, m in ((9, 300), (20, 1200), (28, 2000))],
              "rebuild": [(t, 4e-3 + 5e-5 * t) for t in (200, 800, 2000)], "padded": True}
    got = cal.costs_from(engine, trainer)
    assert got["padded_cache"] is True
    for key, want in {"prefill_s": 1e-3, "prefill_per_token_s": 2e-5, "merge_per_token_s": 3e-7, "decode_s": 2e-3,
                      "decode_per_context_token_s": 1e-6, "rebuild_prefill_s": 4e-3,
                      "rebuild_prefill_per_token_s": 5e-5}.items():
        assert got[key] == pytest.approx(want, rel=1e-6), key
    older = cal.costs_from({k: engine[k] for k in ("decode", "prefill", "load")}, trainer)
    assert not {"padded_cache", "merge_per_token_s", "rebuild_prefill_s"} & set(older)
    assert older["prefill_per_token_s"] == pytest.approx(2e-5, rel=1e-6)


def test_bench_async_records_each_trained_groups_shape_and_the_check_plays_them(tmp_path, monkeypatch) -> None:
    """bench_async's spool scan keeps every trained group's prompt, its responses' lengths in the order of their
    tokens and the prefix each two neighbours share; sim_calibrate reads them back as the workload it plays for that
    run (a shape recorded before the shared prefixes were: lengths only)."""
    import numpy as np

    from chaos_script import ROOT, load_script
    from hpcrl.spool.format import Sample, TrajectoryGroup, file_name, write_group

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    bench, task = load_script("bench_async"), load_script("_sim_task")
    step = tmp_path / "spool" / "trained" / "step_000003"
    step.mkdir(parents=True)
    groups = [(7, [[4, 4, 4], [2], [2, 5]]), (12, [[1, 2, 9, 9, 9, 9, 9, 9, 9], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])]
    for ticket, (prompt, responses) in enumerate(groups):
        samples = [Sample(np.array(r, np.int32), np.zeros(len(r), np.float32), np.full(len(r), 2, np.int32),
                          np.ones(len(r), np.uint8), 0.0, "stop") for r in responses]
        group = TrajectoryGroup(ticket, "r0", np.arange(prompt, dtype=np.int32), samples)
        write_group(step / file_name(group), group)
    hist, _, files, shapes = bench.spool_scan(tmp_path)
    assert files == 2 and shapes == ["12:5,5,9:5,2", "7:1,2,3:1,0"] and hist == {1: 6 + 19}
    assert task.group_shapes({"group_shapes": shapes}) == ((12, (5, 5, 9), (5, 2)), (7, (1, 2, 3), (1, 0)))
    assert task.group_shapes({"group_shapes": ["7:3,0,2"]}) == ((7, (3, 1, 2)),)
    assert task.group_shapes({}) == ()


def test_a_group_the_taken_batch_leaves_behind_is_parked_not_set_aside(monkeypatch) -> None:
    """As hpcrl's worker reads the trainer's mark: a group that completes stale for every batch still to come is not
    handed over but generated again, so the trainer sets aside fewer groups; no ticket is lost either way."""
    work = Workload(max_staleness=1, steps=40, batch_groups=8, group_size=8, response_tokens=(2, 3, 4, 6, 10, 40))
    with_mark = Pipeline(work, Costs())
    parked = with_mark.run()
    assert_no_ticket_lost(with_mark)
    monkeypatch.setattr("hpcrl.sim.replica.Replica.left_behind", lambda self, group: False)  # no mark
    without = Pipeline(work, Costs())
    set_aside = without.run()
    assert_no_ticket_lost(without)
    assert parked.dropped_groups < set_aside.dropped_groups
    assert parked.restarted_samples > set_aside.restarted_samples


def test_the_shared_core_slowdown_pairs_each_running_window_with_the_stopped_one_before_it(monkeypatch) -> None:
    """scripts/sim_calibrate.py's paired measurement: steps are sorted into the windows they lie wholly in (one that
    straddles a switch, or runs past the last window's end, is left out), and each cycle's mean step running is
    divided by the same cycle's mean step stopped: a machine that runs twice as fast in one cycle as in another
    (its drift) moves no cycle's ratio, where pooling the windows would."""
    from chaos_script import ROOT, load_script

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    cal = load_script("sim_calibrate")
    switches = [(0.0, False), (1.0, True), (2.0, False), (3.0, True)]

    def steps(start: float, end: float, step: float) -> list[tuple[float, float]]:
        return [(start + k * step, start + (k + 1) * step) for k in range(round((end - start) / step))]

    # cycle 1 on a machine four times slower than in cycle 2: 5 steps of 0.2 s stopped, 3 of 0.26 running; cycle 2:
    # 20 of 0.05 stopped and 14 of 0.065 running
    stopped, running = steps(0, 1, 0.2) + steps(2, 3, 0.05), steps(1, 1.78, 0.26) + steps(3, 3.91, 0.065)
    ops = stopped + running
    assert cal.cycle_ratios(ops, switches, end=4.0) == pytest.approx([1.3, 1.3])
    pooled = statistics.mean(b - a for a, b in running) / statistics.mean(b - a for a, b in stopped)
    assert pooled == pytest.approx(1.243, abs=1e-3)  # what pooling the two cycles' windows would read
    # a step across a switch, and one running past the end, would each pull a ratio if they were counted
    assert cal.cycle_ratios([*ops, (0.95, 1.9), (3.5, 4.9)], switches, end=4.0) == pytest.approx([1.3, 1.3])
    assert cal.cycle_ratios([*ops, (3.5, 3.99)], switches, end=4.0)[1] == pytest.approx(
        (0.91 + 0.49) / 15 / 0.05)
    with pytest.raises(ValueError, match="in turn"):
        cal.cycle_ratios(ops, [(0.0, True), (1.0, False)], end=2.0)
    with pytest.raises(ValueError, match="in turn"):
        cal.cycle_ratios(ops, switches[:3], end=4.0)
    only_across = [(0.5, 1.5), (2.5, 3.5)]  # no step wholly inside a window, only across the switches
    with pytest.raises(ValueError, match="longer windows"):
        cal.cycle_ratios(only_across, switches, end=4.0)
    assert cal.cycle_ratios([(0.5, 1.5), *steps(2, 3, 0.05), *steps(3, 3.91, 0.065)], switches, end=4.0) == \
        pytest.approx([1.3])  # the first cycle has no whole step stopped: left out
    import subprocess
    import sys

    refused = subprocess.run([sys.executable, str(ROOT / "scripts" / "sim_calibrate.py"), "--shared-only", "--costs",
                              str(ROOT / "bench" / "sim_costs_s24.json")], capture_output=True, text=True)
    assert refused.returncode == 2 and "--shared-only needs --out" in refused.stderr


def test_the_check_prices_each_bin_of_real_decode_steps_at_its_mean_rows_and_context(monkeypatch) -> None:
    """sim_calibrate.decode_by_rows: a bin's measured ms a step against the cost model's price of a step of the bin's
    mean rows and mean context (linear: the mean of the steps' prices), in the order of the bins' rows."""
    from chaos_script import ROOT, load_script

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    chk = load_script("_sim_check")
    costs = Costs(decode_s=1e-3, decode_per_row_s=1e-4, decode_per_context_token_s=1e-6)
    engine = {"decode_by_rows": {"64": {"steps": 4, "rows": 240, "s": 0.04, "context": 8000},
                                 "8": {"steps": 2, "rows": 10, "s": 0.004, "context": 100}, "16": {"steps": 0}}}
    got = chk.decode_by_rows(engine, costs)
    assert list(got) == ["8", "64"]  # a bin without steps is left out
    assert got["8"] == pytest.approx((2.0, 1.0 + 0.5 + 0.05, 2))
    assert got["64"] == pytest.approx((10.0, 1.0 + 6.0 + 2.0, 4))
    assert chk.decode_by_rows({}, costs) == {}
