"""The check of the pipeline simulator against bench_async runs: ``scripts/sim_calibrate.py --check``.

What crosses processes is taken from the run being checked: the trainer's publish time per step
(``time/publish_s``: collective or disk) and the rollout's weight receive + load per version; and from the
baseline run (``colocated_t1``) alone, what the measured pieces leave out (:func:`baseline_costs`). Where the
results file has the baseline's time split, the levels of decode, admission prefill and the train step are fitted
to it (:func:`hpcrl.sim.fit.fit_phases`), and every mode is simulated with the same factors. :func:`check` plays
every mode it knows (not the vLLM ones) and prints the predicted ratio to ``colocated_t1`` next to the measured
one; with several results files, also the mean ratios, mode by mode, with their standard errors. The whole
story is in scripts/sim_calibrate.py's docstring.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np

from _bench import ROOT
from _sim_task import B, G, ROWS, group_shapes, task_lengths

sys.path.insert(0, str(ROOT))
from hpcrl.sim import Costs, Workload, fit_phases, simulate  # noqa: E402
from hpcrl.sim.fit import scaled  # noqa: E402


def uniform_share(baseline: dict, measured: dict) -> float:
    """The share of groups GRPO left out of the loss in the baseline run: its own count where the results file has
    it, else what its training time per step implies under the measured train-step cost."""
    if "uniform_share" in baseline:
        return baseline["uniform_share"]
    lengths, prompt = task_lengths()
    update = (baseline["trainer_busy"] - baseline["publish_share"]) * baseline["trainer_loop_s"] / baseline["steps"]
    c = measured["threads1"]
    tokens = B * G * (float(np.mean(lengths)) + prompt)
    return min(0.95, max(0.0, 1.0 - (update - c["train_step_s"]) / (c["train_per_token_s"] * tokens)))


# threads whose CPU is not the pipeline's side work: the generating thread, the torch pool, and the reward calls the
# generating thread waits for (their time is in its "reward" phase)
NOT_SIDE_THREADS = ("MainThread", "native", "reward-call")


def side_cpu_per_group(run: dict) -> float | None:
    """The CPU seconds the process's other threads burned per group it published (the spool writer, the read-ahead,
    an unnamed library thread, ...: every thread but NOT_SIDE_THREADS; bench_async's ``generator_cpu_threads``),
    None where the run did not record them."""
    threads = run.get("generator_cpu_threads")
    if not threads:
        return None
    groups = (run.get("rollout_stats") or {}).get("groups_published") or run["samples"] / G
    return sum(s for name, s in threads.items() if name not in NOT_SIDE_THREADS) / groups


def baseline_costs(run: dict, spool_per_group_s: float, side_cpu: bool = True) -> dict:
    """What the engine and trainer measurements leave out, from the baseline (colocated_t1) run's own split of its
    generating time: scoring per sample, the ledger per admitted group, the feed's look at the spool between two
    engine steps (its time over the run's decode steps, estimated as the steps a batch of the task takes); and
    from its threads' CPU, the side work per group (:func:`side_cpu_per_group`; one torch thread leaves it a core,
    so the baseline does not pay for it; ``side_cpu`` False: left out)."""
    generating = run["rollout_busy"] * run["trainer_loop_s"]
    split, samples = run["rollout_time_split"], run["samples"]
    lengths, _ = task_lengths()
    batches = samples / ROWS  # the engine decodes ~ROWS rows at once, each for the longest of its rows, roughly
    engine_steps = batches * float(np.mean(sorted(lengths)[int(0.9 * len(lengths)):]))
    spool_s = run["spool_share"] * run["trainer_loop_s"] - (samples / G) * spool_per_group_s  # claims, reads: in train
    return {"reward_per_sample_s": split["reward"] * generating / samples,
            "admit_s": split["ledger"] * generating / (samples / G),  # every ask, the refused ones too, per group
            "colocated_pass_s": max(0.0, spool_s) / engine_steps,
            "side_cpu_per_group_s": (side_cpu_per_group(run) or 0.0) if side_cpu else 0.0}


# bench_async's rollout time split -> the simulator's phases; the first four are what the baseline fit scales
SPLIT_PHASES = {"decode": "rollout/decode", "admit_prefill": "rollout/admit_prefill", "reward": "rollout/reward",
                "ledger": "rollout/ledger", "rebuild_prefill": "rollout/rebuild_prefill",
                "weights_transfer": "rollout/weights"}
FITTED = ("rollout/decode", "rollout/admit_prefill", "trainer/update")


def measured_phases(run: dict) -> dict[str, float]:
    """A bench_async run's seconds in each simulator phase (the rollout's split of its wall time, or of the
    colocated loop's generating time; the trainer's update and publish)."""
    loop = run["trainer_loop_s"]
    return {**measured_rollout_phases(run), "trainer/update": run["update_s_per_step"] * run["steps"],
            "trainer/publish": run["publish_share"] * loop}


def measured_rollout_phases(run: dict) -> dict[str, float]:
    """The generating side's seconds in each simulator phase, its first look for weights left out (joining the
    trainer's weights, before the trainer's loop starts)."""
    generating = run.get("rollout_wall_s") or run["rollout_busy"] * run["trainer_loop_s"]
    out = {phase: run["rollout_time_split"][k] * generating for k, phase in SPLIT_PHASES.items()}
    out["rollout/weights"] -= run.get("rollout_weights_first_s") or 0.0
    return out


def mode_setup(name: str, run: dict, measured: dict, uniform: float = 0.0, task_only: bool = False,
               shapes: tuple = (), cores: int | None = None) -> tuple[Workload, Costs]:
    """The simulator's workload and costs for one bench_async mode (scripts/bench_async.py MODES). Each group
    draws the shape of one of the run's own trained groups where the run recorded them (else of ``shapes``, the
    same mode's in another run); without any (or with ``task_only``) each sample draws its own length from the task
    and every prompt is the mean one. ``cores``: the run's machine's (None: this one's)."""
    lengths, prompt = task_lengths()
    threads = 2 if name == "colocated_t2" else 1
    extra = measured.get("baseline", {})
    costs = Costs(**{**measured[f"threads{threads}"], **extra}, shared_slowdown=measured["shared_slowdown"]["mean"])
    base = dict(steps=run["steps"], batch_groups=B, group_size=G, max_batch_rows=ROWS, prompt_tokens=round(prompt),
                response_tokens=tuple(lengths), uniform_share=uniform, queued_groups=1,  # hpcrl's worker holds one
                group_shapes=() if task_only else (group_shapes(run) or shapes))
    if name.startswith("colocated"):  # its torch threads fill the cores of the machine the run had
        full = threads >= (cores or len(os.sched_getaffinity(0)))
        return Workload(mode="colocated", max_staleness=0, compute_fills_cores=full, **base), costs
    eta = int(name.split("eta")[1].split("_")[0])
    steps = run["steps"]
    publish = run["publish_share"] * run["trainer_loop_s"] / steps  # the trainer's publish per version, measured
    load = costs.weights_load_s
    if run.get("rollout_wall_s") and run.get("rollout_weight_updates"):  # the rollout's receive + load per version
        load = measured_rollout_phases(run)["rollout/weights"] / run["rollout_weight_updates"]
    alone = measured["threads1"]
    rebuild = {"rebuild_prefill_s": alone.get("rebuild_prefill_s", alone["prefill_s"]),  # one call over every row:
               "rebuild_prefill_per_token_s": alone.get("rebuild_prefill_per_token_s", alone["prefill_per_token_s"])}
    costs = Costs(**{**alone, **extra, **rebuild, "publish_s": publish, "weights_load_s": load,
                     "weights_poll_s": 0.0 if "disk" in name else 0.02,
                     # rollout.poll_interval_s and the trainer's batch wait (hpcrl.trainer.main.batch_wait)
                     "rollout_idle_poll_s": 0.02, "trainer_poll_s": 0.01},
                  shared_slowdown=measured["shared_slowdown"]["mean"])
    kv = "keep" if "keepkv" in name else "recompute"
    return Workload(max_staleness=eta, kv_on_update=kv, shared_cores=True, **base), costs


def simulate_run(measured: dict, results_file: Path, fit: bool = True, task_only: bool = False,
                 summed: bool = False, shapes: dict | None = None, side_cpu: bool = True) -> dict:
    """Play every mode of one bench_async results file with the cost model ``measured``: its rows (measured and
    simulated samples/s and ratios to ``colocated_t1``, phases, set-asides), the uniform share and fitted factors.
    ``task_only`` and ``shapes`` (mode -> its groups' shapes in another run): see :func:`mode_setup`.
    ``summed``: the engine model before 2026-11-28 with this cost model's coefficients: contexts summed, no merge,
    the rebuild priced on the admissions' prefill line. ``side_cpu`` False: the other threads' CPU left out (the
    model before 2026-11-29, :func:`baseline_costs`)."""
    if summed:
        drop = ("rebuild_prefill_s", "rebuild_prefill_per_token_s")
        measured = {k: {**{f: x for f, x in v.items() if f not in drop}, "padded_cache": False,
                        "merge_per_token_s": 0.0} if k.startswith("threads") else v for k, v in measured.items()}
    if side_cpu and measured.get("companion_groups_per_s"):
        print(f"note: this cost model's engine was measured beside a spool writer "
              f"({measured['companion_groups_per_s']:.0f} groups/s) and the simulator charges the other threads' CPU "
              "too: the writer counts twice where the cores are full (--no-side-cpu leaves the charge out)")
    results = json.loads(results_file.read_text())
    runs, cores = results["runs"], results.get("meta", {}).get("cpu_count", 2)  # 2: every file before it was recorded
    if "colocated_t1" not in runs:
        raise SystemExit(f"{results_file}: no colocated_t1 run to take ratios against")
    missing = [k for k in ("rollout_time_split", "spool_share") if k not in runs["colocated_t1"]]
    if missing:
        raise SystemExit(f"{results_file}: written by an older bench_async.py (colocated_t1 lacks {missing}); "
                         "run it again")
    rows, factors = {}, {}
    uniform = uniform_share(runs["colocated_t1"], measured)
    measured = {**measured, "baseline": baseline_costs(runs["colocated_t1"], measured["threads1"]["spool_per_group_s"],
                                                       side_cpu)}
    print(f"{results_file}: groups left out of the loss (uniform rewards): {100 * uniform:.0f} %; from the baseline "
          "run: " + ", ".join(f"{k} {v:.3g}" for k, v in measured["baseline"].items()))
    if fit and "update_s_per_step" in runs["colocated_t1"]:  # levels fitted on the baseline's own time split
        work, costs = mode_setup("colocated_t1", runs["colocated_t1"], measured, uniform, task_only,
                                 (shapes or {}).get("colocated_t1", ()), cores)
        phases = measured_phases(runs["colocated_t1"])
        _, factors = fit_phases(work, costs, {k: phases[k] for k in FITTED})
        print("fitted on colocated_t1: " + ", ".join(f"{k} x{v:.2f}" for k, v in factors.items()))
    for name, run in runs.items():
        if name.startswith("vllm") or not (name.startswith("colocated") or "eta" in name):
            print(f"{name}: skipped (another engine, or a mode this script does not know)")
            continue
        work, costs = mode_setup(name, run, measured, uniform, task_only, (shapes or {}).get(name, ()), cores)
        costs = scaled(costs, factors)  # the loop's overhead on each piece, as the baseline measured it
        sims = [simulate(dataclasses.replace(work, seed=s), costs) for s in range(3)]
        engine = (run.get("rollout_stats") or {}).get("engine") or {}
        rows[name] = {"measured_samples_per_s": run["samples_per_s"],
                      # each round's ratio against its own round's baseline (bench_async since 2026-11-28)
                      "measured_ratio_rounds": run.get("ratio_samples_rounds"),
                      "simulated_samples_per_s": float(np.mean([r.samples_per_s for r in sims])),
                      "simulated_trainer_busy": float(np.mean([r.trainer_busy for r in sims])),
                      "simulated_rollout_busy": float(np.mean([r.rollout_busy for r in sims])),
                      # groups set aside as stale and generated again, simulated / measured (None: not measured)
                      "stale_set_asides": (float(np.mean([r.dropped_groups for r in sims])),
                                           run.get("stale_set_asides")),
                      # the engine's prefill calls (admissions and rebuilds), simulated / measured (None: not measured)
                      "prefill_calls": (float(np.mean([r.prefill_calls for r in sims])),
                                        engine.get("prefill_calls")),
                      # samples generated again (stale or parked, and rebuilt rows), simulated / measured per run
                      "restarted_samples": (float(np.mean([r.restarted_samples for r in sims])),
                                            run.get("rollout_stats", {}).get("samples_restarted")),
                      # the engine's decode steps and their mean batch (rows), simulated / measured (None: not measured)
                      "decode_steps": (float(np.mean([r.decode_steps for r in sims])), engine.get("decode_steps")),
                      "decode_batch": (float(np.mean([r.decode_rows / max(1, r.decode_steps) for r in sims])),
                                       engine.get("mean_running_batch_size")),
                      # the real engine's decode steps by rows (bench_async since 2026-11-29): ms a step measured
                      # and as the played cost model prices a step of the bin's mean rows and context (its fitted
                      # level; the shared-core slowdown left out)
                      "decode_by_rows": decode_by_rows(engine, costs),
                      # seconds per trainer step in each phase, simulated and (where the run has its split) measured
                      "phases_per_step": {k: (float(np.mean([r.phases.get(k, 0.0) for r in sims])) / run["steps"],
                                              v / run["steps"]) for k, v in phases_of(run).items()}}
    base = rows["colocated_t1"]
    for r in rows.values():
        r["measured_ratio"] = r["measured_samples_per_s"] / base["measured_samples_per_s"]
        r["simulated_ratio"] = r["simulated_samples_per_s"] / base["simulated_samples_per_s"]
        r["error"] = r["simulated_ratio"] / r["measured_ratio"] - 1
    return {"modes": rows, "uniform_share": uniform, "fitted_on_baseline": factors}


def mean_of_runs(played: list[dict]) -> dict[str, dict]:
    """Per mode found in every run: the mean measured and the mean simulated ratio, and the error between them
    (each run noisy on its own, its baseline included: the mean is what the simulator should reproduce)."""
    names = [n for n in played[0]["modes"] if all(n in p["modes"] for p in played)]
    out = {}
    for n in names:
        measured = float(np.mean([p["modes"][n]["measured_ratio"] for p in played]))
        simulated = float(np.mean([p["modes"][n]["simulated_ratio"] for p in played]))
        out[n] = {"measured_ratio": measured, "simulated_ratio": simulated, "error": simulated / measured - 1,
                  "measured_ratios": [p["modes"][n]["measured_ratio"] for p in played],
                  "measured_ratio_se": ratio_se([p["modes"][n] for p in played])}
    return out


def ratio_se(rows: list[dict]) -> float | None:
    """The standard error of a mode's measured ratio, from its rounds' ratios over ``rows`` (one per run; each
    round's ratio against its own round's baseline): what the machine's noise leaves uncertain in the mean. None
    where fewer than two rounds recorded their ratio."""
    rounds = [x for r in rows for x in (r.get("measured_ratio_rounds") or ()) if x is not None]
    return float(np.std(rounds, ddof=1) / np.sqrt(len(rounds))) if len(rounds) > 1 else None


def check(costs_file: Path, results_files: list[Path], out: Path | None, fit: bool = True, **variant) -> None:
    """Compare the simulator with one or more bench_async runs (with several: also their means, mode by mode);
    ``variant``: :func:`simulate_run`'s ``task_only``, ``summed`` and ``side_cpu``, recorded in ``out``. A run that
    did not record its groups' shapes plays those of the same mode in the first of the files that did."""
    measured = json.loads(costs_file.read_text())
    shapes: dict[str, tuple] = {}
    for f in results_files:
        for name, run in json.loads(f.read_text())["runs"].items():
            if not shapes.get(name):
                shapes[name] = group_shapes(run)
    played = [simulate_run(measured, f, fit, shapes=shapes, **variant) for f in results_files]
    for f, p in zip(results_files, played):
        print(f"{f}:\n{'mode':28s} {'measured':>9} {'simulated':>9} {'error':>7}   (ratio to colocated_t1; samples/s)")
        for name, r in p["modes"].items():
            print(f"{name:28s} {r['measured_ratio']:9.2f} {r['simulated_ratio']:9.2f} {100 * r['error']:+6.1f}%   "
                  f"({r['measured_samples_per_s']:.0f} vs {r['simulated_samples_per_s']:.0f})")
            if r["phases_per_step"]:  # ms per step, simulated / measured
                print("    " + ", ".join(f"{k.split('/')[1]} {1e3 * a:.0f}/{1e3 * b:.0f}"
                                         for k, (a, b) in r["phases_per_step"].items())
                      + (f"; stale set-asides {r['stale_set_asides'][0]:.0f}/{r['stale_set_asides'][1]:.0f}"
                         if r["stale_set_asides"][1] is not None else "")
                      + (f"; prefill calls {r['prefill_calls'][0]:.0f}/{r['prefill_calls'][1]:.0f}"
                         if r["prefill_calls"][1] is not None else "")
                      + (f"; samples restarted {r['restarted_samples'][0]:.0f}/{r['restarted_samples'][1]:.0f}"
                         if r["restarted_samples"][1] is not None else "")
                      + (f"; decode steps {r['decode_steps'][0]:.0f}/{r['decode_steps'][1]:.0f} of "
                         f"{r['decode_batch'][0]:.1f}/{r['decode_batch'][1]:.1f} rows"
                         if r["decode_steps"][1] is not None else ""))
            if r.get("decode_by_rows"):  # ms a decode step, measured / the model's, by rows (steps)
                print("    decode by rows, ms a step measured/model: " + ", ".join(
                    f"<={k} {a:.1f}/{b:.1f} ({n})" for k, (a, b, n) in r["decode_by_rows"].items()))
    rows = played[0]["modes"] if len(played) == 1 else mean_of_runs(played)
    for r in rows.values():  # one run's rounds give their own spread
        r.setdefault("measured_ratio_se", ratio_se([r]))
    if len(played) > 1:
        print(f"mean of {len(played)} runs:\n{'mode':28s} {'measured':>9} {'simulated':>9} {'error':>7}")
        for name, r in rows.items():
            se = r["measured_ratio_se"]
            print(f"{name:28s} {r['measured_ratio']:9.2f} {r['simulated_ratio']:9.2f} {100 * r['error']:+6.1f}%   "
                  f"(measured " + ", ".join(f"{x:.2f}" for x in r["measured_ratios"])
                  + (f"; rounds' standard error {100 * se / r['measured_ratio']:.1f}%" if se else "") + ")")
    worst = max(abs(r["error"]) for r in rows.values())
    within = sum(abs(r["error"]) <= 0.10 for r in rows.values())
    print(f"largest ratio error {100 * worst:.1f}% (target 10%); {within} of {len(rows)} modes within 10%")
    if out:
        single = played[0] if len(played) == 1 else {"runs": {str(f): p for f, p in zip(results_files, played)}}
        out.write_text(json.dumps({"costs": str(costs_file), "variant": variant,
                                   "results": [str(f) for f in results_files]
                                   if len(played) > 1 else str(results_files[0]), **single, "modes": rows,
                                   "largest_error": worst, "within_10_percent": within}, indent=1))
        print(f"wrote {out}")


def decode_by_rows(engine: dict, costs: Costs) -> dict[str, tuple[float, float, int]]:
    """Per bin of the engine's ``decode_by_rows``: (ms a step measured, ms a step as ``costs`` price the bin's mean
    rows and context, steps); empty for a run that did not record them."""
    out = {}
    for key, b in sorted(engine.get("decode_by_rows", {}).items(), key=lambda kv: int(kv[0])):
        if b.get("steps"):
            n = b["steps"]
            out[key] = (1e3 * b["s"] / n, 1e3 * costs.decode(b["rows"] / n, b["context"] / n), round(n))
    return out


def phases_of(run: dict) -> dict[str, float]:
    return measured_phases(run) if "update_s_per_step" in run and "rollout_time_split" in run else {}
