"""Quality at speed: held-out accuracy versus step and versus wall-clock for each staleness bound.

    python scripts/bench_quality.py --steps 250 --out bench/quality.json

The AReaL staleness table on our task: the quickstart (2-digit addition, the
~1M-parameter model, the cached SFT warm start, GRPO) run one after another
on the same cores with the same seed, for

* ``eta{0,1,2,4,8}``: decoupled PPO (the default objective) with
  ``admission.max_staleness`` = eta (eta = 0 is synchronous RL);
* ``plain_eta{1,2,4,8}``: plain PPO (``algo.decoupled=false``): clipping around
  the behaviour policy, no proximal recompute, no behaviour weight (at eta = 0
  the two objectives are the same);
* ``keepkv_eta4``: decoupled PPO, eta = 4, in-flight sequences keeping their KV
  cache across weight updates (``rollout.kv_on_update=keep``);
* trainer variants at eta = 2, next to ``eta2``: ``bf16_eta2`` (``model.dtype=bfloat16``:
  bf16 forward/backward over float32 master weights, bf16 rollout engine),
  ``lora8_eta2`` and ``lora8_lr1e-3_eta2`` (``trainer.lora.rank=8``, alpha 16:
  PEFT adapters only, at the full fine-tuning learning rate and at 10x it).

``--study`` runs the staleness study instead: the grid :data:`STUDY` of
objective (decoupled or plain PPO) x ``trainer.n_minibatches`` (1: the ratio
against the proximal policy is exactly 1, so decoupled PPO has no trust
region; 4: the clip binds) x behaviour-weight mode (``cap``: clamp at 5;
``mask``: drop tokens above 5; ``m2po``: no cap, M2PO's second-moment mask
at 0.04; ``approx``: clamp at 5 with the proximal logprobs interpolated,
``algo.prox_approx=true``, four minibatches only) x eta (0, 1, 2, 4, 8, 16),
each row over ``--seeds`` (a seed
changes the model's initialisation, its SFT warm start, the data order and
the sampling), with equal trained samples (same steps and batch) and the
same held-out problems for every row. Every finished run is written to
``--out`` at once and skipped when the command is run again, so the study
can be run in parts (``--rows``, ``--seeds``) and resumed after a stop. It
prints and stores per row the mean and standard error over seeds of the
final and the gained accuracy, samples/s and wall seconds, and plots the
accuracy gain against eta (``bench/staleness.png``)::

    python scripts/bench_quality.py --study --steps 250 --seeds 0,1,2

Each study row also reports the gain of the mean of the last three
evaluations and the mean training reward of the last fifth of the steps
(less noisy than one final evaluation) and every seed's gain; every run
keeps its per-step evidence (:data:`EVIDENCE`: the behaviour weights' second
moment and maximum, the fractions capped, masked and clipped, the KL to the
proximal policy, the gradient norm, the tokens' staleness, the reward), as
the mean over each tenth of its steps. ``--adopt
ROW@SEED=RUN_DIR`` takes in a run made by hand with ``python -m
hpcrl.submit`` once its saved ``config.yaml`` shows exactly the row's
overrides. Every run keeps the learning rate constant after warm-up
(:data:`BASE`) unless an override says otherwise.

Every run evaluates greedy held-out accuracy on ``--eval-size`` problems every
``--eval-every`` steps (and at the start). Writes ``bench/quality.json`` (every
curve plus a summary per run: start, final and best accuracy, the accuracy
reached by the wall time at which the fastest run finished, trained
samples/s, max staleness) and ``bench/quality.png``. Extra ``key=value``
arguments go to every run. One seed: differences of a few points are within
the noise of a single run (about 2 points of standard error on 500 problems).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from _bench import ROOT, pyplot, submit

sys.path.insert(0, str(ROOT))
from hpcrl.metrics.writer import read_evals  # noqa: E402

RUNS = {
    **{f"eta{e}": [f"admission.max_staleness={e}"] for e in (0, 1, 2, 4, 8)},
    **{f"plain_eta{e}": [f"admission.max_staleness={e}", "algo.decoupled=false"] for e in (1, 2, 4, 8)},
    "keepkv_eta4": ["admission.max_staleness=4", "rollout.kv_on_update=keep"],
    # trainer variants at the quickstart's eta = 2, next to eta2 (full fine-tuning in float32)
    "bf16_eta2": ["admission.max_staleness=2", "model.dtype=bfloat16"],
    "lora8_eta2": ["admission.max_staleness=2", "trainer.lora.rank=8", "trainer.lora.alpha=16"],
    "lora8_lr1e-3_eta2": ["admission.max_staleness=2", "trainer.lora.rank=8", "trainer.lora.alpha=16",
                          "trainer.lr=1e-3"],
}


def study_rows() -> dict[str, list[str]]:
    """The staleness study's grid: name -> overrides (eta = 0 is one objective: nothing is stale)."""
    rows = {}
    for mb in (1, 4):
        for eta in (0, 1, 2, 4, 8, 16):
            common = [f"admission.max_staleness={eta}", f"trainer.n_minibatches={mb}"]
            rows[f"decoupled_cap_mb{mb}_eta{eta}"] = [*common, "algo.behav_imp_weight_mode=cap"]
            if eta > 0:
                rows[f"decoupled_mask_mb{mb}_eta{eta}"] = [*common, "algo.behav_imp_weight_mode=mask"]
                rows[f"plain_mb{mb}_eta{eta}"] = [*common, "algo.decoupled=false"]
                rows[f"m2po_mb{mb}_eta{eta}"] = [*common, "algo.m2_threshold=0.04", "algo.behav_imp_weight_cap=null"]
                if mb > 1:  # at one update per step the first update's own logprobs are exact: nothing to approximate
                    rows[f"approx_mb{mb}_eta{eta}"] = [*common, "algo.behav_imp_weight_mode=cap", "algo.prox_approx=true"]
    return rows


STUDY = study_rows()


# Every run here keeps the learning rate constant after warm-up, as the quickstart did when the study began,
# so that its rows stay comparable when the quickstart's schedule changes; a decaying schedule is a command-line
# override (``trainer.lr_schedule=cosine``), which comes later and wins.
BASE = ["trainer.lr_schedule=constant"]


def settings(extra: list[str], args: argparse.Namespace) -> list[str]:
    """Every override a run of ``extra`` gets: the study's length and evaluation, the base, the row's, the
    command line's."""
    return [f"trainer.total_steps={args.steps}", f"eval.every_steps={args.eval_every}",
            f"eval.size={args.eval_size}", *BASE, *extra, *args.overrides]


def run(name: str, extra: list[str], args: argparse.Namespace, workdir: Path) -> dict:
    return read_run(submit(workdir / name, settings(extra, args), name), extra)


def read_run(run_dir: Path, extra: list[str]) -> dict:
    """One finished run's curves and summary, from its ``logs/metrics.jsonl``."""
    records = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [{"step": r.get("step", 0), "wall_s": r.get("time/elapsed_s", 0.0), "accuracy": r["eval/accuracy"]}
             for r in read_evals(run_dir / "logs")]  # the trainer's or the evaluation component's
    steps = [r for r in records if "reward/mean" in r]
    return {"overrides": extra, "evals": evals, "evidence": evidence(steps),
            "reward": [(r["step"], r["reward/mean"]) for r in steps],
            "samples_per_s": steps[-1].get("throughput/samples_per_s") if steps else None,
            "staleness_max": max((r.get("staleness/max", 0) for r in steps), default=None),
            "trainer_peak_mb": max((r["memory/peak_mb"] for r in steps if "memory/peak_mb" in r), default=None),
            "wall_s": evals[-1]["wall_s"] if evals else None}


# the per-step metrics that say why stale data trains worse (docs/algorithms.md): how far the behaviour policy is
# from the proximal one, how much of the batch each correction cuts, and how far and how hard each update moves
EVIDENCE = ("loss/imp_weight_m2", "loss/imp_weight_max", "loss/imp_weight_capped_fraction", "loss/m2_masked_fraction",
            "loss/clip_fraction", "loss/approx_kl", "grad/norm", "staleness/mean_token", "reward/mean")


def evidence(steps: list[dict]) -> dict:
    """Per evidence metric: its mean over each tenth of the run (the curve, short enough to keep for every run)."""
    out = {}
    n = len(steps)
    for key in EVIDENCE:
        tenths = []
        for i in range(10):
            vals = [r[key] for r in steps[i * n // 10:(i + 1) * n // 10] if key in r]
            tenths.append(sum(vals) / len(vals) if vals else None)
        if any(v is not None for v in tenths):
            out[key] = tenths
    return out


def accuracy_at(evals: list[dict], wall_s: float) -> float:
    """The last accuracy measured by ``wall_s`` (step-function interpolation)."""
    seen = [e["accuracy"] for e in evals if e["wall_s"] <= wall_s + 1e-9]
    return seen[-1] if seen else evals[0]["accuracy"]


def summarise(results: dict) -> None:
    first_done = min(r["wall_s"] for r in results.values())
    for r in results.values():
        acc = [e["accuracy"] for e in r["evals"]]
        r["summary"] = {"start": acc[0], "final": acc[-1], "best": max(acc), "gain": acc[-1] - acc[0],
                        "at_first_finish": accuracy_at(r["evals"], first_done), "first_finish_s": first_done}


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, r in results.items():
        style = "--" if name.startswith("plain") else (":" if name.startswith("keepkv") else "-")
        axes[0].plot([e["step"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], style, marker=".",
                     label=name)
        axes[1].plot([e["wall_s"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], style, marker=".",
                     label=name)
    axes[0].set_xlabel("trainer step")
    axes[1].set_xlabel("wall-clock seconds (trainer)")
    for ax in axes:
        ax.set_ylabel("held-out greedy accuracy")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def mean_se(values: list[float]) -> tuple[float, float | None]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    return mean, (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5


def late_accuracy(r: dict) -> float:
    """Mean held-out accuracy of the last three evaluations (steps 800-1000 of 1000): one evaluation at the
    last step swings by 5-10 points from one evaluation to the next, the mean of three much less."""
    return sum(e["accuracy"] for e in r["evals"][-3:]) / len(r["evals"][-3:])


def late_reward(r: dict) -> float:
    """Mean training reward over the last fifth of the steps (every sample of those steps, sampled at the
    rollout temperature by the policy that generated it)."""
    tail = r["reward"][-max(1, len(r["reward"]) // 5):]
    return sum(x[1] for x in tail) / len(tail)


def study_table(runs: dict) -> dict:
    """Per row: mean and standard error over its seeds (final accuracy, gain, late accuracy and its gain,
    late training reward, samples/s, wall seconds) and each seed's gain."""
    table = {}
    for row in STUDY:
        done = [r for key, r in sorted(runs.items()) if key.rsplit("@", 1)[0] == row]
        if not done:
            continue
        stats = {"seeds": [r["seed"] for r in done]}
        for metric, get in (("final", lambda r: r["evals"][-1]["accuracy"]),
                            ("gain", lambda r: r["evals"][-1]["accuracy"] - r["evals"][0]["accuracy"]),
                            ("late_gain", lambda r: late_accuracy(r) - r["evals"][0]["accuracy"]),
                            ("reward_late", late_reward),
                            ("samples_per_s", lambda r: r["samples_per_s"] or 0.0),
                            ("wall_s", lambda r: r["wall_s"] or 0.0)):
            stats[metric], stats[f"{metric}_se"] = mean_se([get(r) for r in done])
        stats["gain_by_seed"] = [r["evals"][-1]["accuracy"] - r["evals"][0]["accuracy"] for r in done]
        table[row] = stats
    return table


def print_table(table: dict) -> None:
    def pm(mean: float, se: float | None, scale: float = 100.0, digits: int = 1) -> str:
        return f"{scale * mean:.{digits}f}" + (f" ± {scale * se:.{digits}f}" if se is not None else "")

    print("| row | seeds | final accuracy % | gain (points) | gain of the last 3 evaluations | "
          "training reward, last fifth | gain per seed | samples/s | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row, t in table.items():
        per_seed = " / ".join(f"{100 * g:+.1f}" for g in t["gain_by_seed"])
        print(f"| {row} | {len(t['seeds'])} | {pm(t['final'], t['final_se'])} | {pm(t['gain'], t['gain_se'])} | "
              f"{pm(t['late_gain'], t['late_gain_se'])} | {pm(t['reward_late'], t['reward_late_se'], 1.0, 3)} | "
              f"{per_seed} | {pm(t['samples_per_s'], t['samples_per_s_se'], 1.0)} | "
              f"{pm(t['wall_s'], t['wall_s_se'], 1.0)} |")


def plot_study(table: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    families = sorted({row.rsplit("_eta", 1)[0] for row in table})
    for fam in families:
        points = sorted((int(row.rsplit("_eta", 1)[1]), t) for row, t in table.items()
                        if row.rsplit("_eta", 1)[0] == fam)
        ax.errorbar([e for e, _ in points], [100 * t["gain"] for _, t in points],
                    yerr=[100 * (t["gain_se"] or 0.0) for _, t in points], marker="o", capsize=3,
                    linestyle="--" if fam.startswith("plain") else "-", label=fam)
    ax.set_xlabel("max staleness eta")
    ax.set_ylabel("held-out accuracy gain, points (mean ± s.e. over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def adopt(spec: str, args: argparse.Namespace) -> tuple[str, Path]:
    """``ROW@SEED=RUN_DIR``: a finished run made by hand, taken in as that row and seed only if its saved
    configuration is exactly what the study would have run (the row's, the seed's and the command line's
    overrides change nothing in it)."""
    from hpcrl.config import load_config, load_saved

    key, _, path = spec.partition("=")
    row, _, seed = key.rpartition("@")
    run_dir = Path(path)
    if row not in STUDY or not seed.isdigit() or not path:
        raise SystemExit(f"--adopt {spec}: expected ROW@SEED=RUN_DIR with ROW one of {', '.join(STUDY)}")
    if not (run_dir / "DONE").exists():
        raise SystemExit(f"--adopt {spec}: {run_dir} is not a finished run (no DONE)")
    saved = load_saved(run_dir)
    if load_config(run_dir / "config.yaml", settings([*STUDY[row], f"seed={seed}"], args)) != saved:
        raise SystemExit(f"--adopt {spec}: {run_dir} was not run with the overrides of {row}, seed {seed} "
                         f"and {settings([], args)}")
    return key, run_dir


def study(args: argparse.Namespace) -> dict:
    """The staleness study, resumable: ``args.out`` holds every finished (row, seed) run."""
    rows = args.rows.split(",") if args.rows else list(STUDY)
    unknown = [r for r in rows if r not in STUDY]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; choose from {', '.join(STUDY)}")
    seeds = [int(x) for x in args.seeds.split(",")]
    saved = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs = saved.get("runs", {})
    meta = {"steps": args.steps, "eval_every": args.eval_every, "eval_size": args.eval_size,
            "overrides": args.overrides}
    if runs and saved.get("meta") != meta:
        raise SystemExit(f"{args.out} holds a study with other settings ({saved.get('meta')}); use another --out")
    for spec in args.adopt:
        key, run_dir = adopt(spec, args)
        runs[key] = read_run(run_dir, STUDY[key.rsplit("@", 1)[0]])
        runs[key]["seed"] = int(key.rsplit("@", 1)[1])
        print(f"adopted {run_dir} as {key}", flush=True)
    todo = [(row, seed) for seed in seeds for row in rows if f"{row}@{seed}" not in runs]
    print(f"staleness study: {len(todo)} runs to do, {len(runs)} done ({args.out})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for i, (row, seed) in enumerate(todo, 1):
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix="hpcrl-study-") as tmp:
            r = run(row, [*STUDY[row], f"seed={seed}"], args, Path(tmp))
        r["seed"] = seed
        runs[f"{row}@{seed}"] = r
        acc = [e["accuracy"] for e in r["evals"]]
        print(f"[{i}/{len(todo)}] {row} seed {seed}: {100 * acc[0]:.1f}% -> {100 * acc[-1]:.1f}%  "
              f"{time.time() - t0:.0f}s", flush=True)
        args.out.write_text(json.dumps({"meta": meta, "table": study_table(runs), "runs": runs}, indent=1))
    table = study_table(runs)
    args.out.write_text(json.dumps({"meta": meta, "table": table, "runs": runs}, indent=1))
    print_table(table)
    plot_study(table, args.out.with_suffix(".png"))
    return table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-size", type=int, default=500)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default bench/quality.json, with --study bench/staleness.json)")
    parser.add_argument("--study", action="store_true", help="run the staleness study grid (resumable)")
    parser.add_argument("--rows", default="", help=f"with --study: a comma-separated subset of {', '.join(STUDY)}")
    parser.add_argument("--seeds", default="0,1,2", help="with --study: comma-separated seeds")
    parser.add_argument("--adopt", action="append", default=[], metavar="ROW@SEED=RUN_DIR",
                        help="with --study: take in a finished run made with `python -m hpcrl.submit` and exactly "
                             "the row's overrides (checked against its config.yaml); repeatable")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.study:
        args.out = args.out or ROOT / "bench" / "staleness.json"
        return study(args)
    args.out = args.out or ROOT / "bench" / "quality.json"
    unknown = [n for n in args.runs.split(",") if n not in RUNS]
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)}")
    results, started = {}, time.time()
    with tempfile.TemporaryDirectory(prefix="hpcrl-quality-") as tmp:
        for name in args.runs.split(","):
            t0 = time.time()
            results[name] = r = run(name, RUNS[name], args, Path(tmp))
            acc = [e["accuracy"] for e in r["evals"]]
            print(f"{name:12s} accuracy {100 * acc[0]:5.1f}% -> {100 * acc[-1]:5.1f}% (best {100 * max(acc):5.1f}%)  "
                  f"{r['samples_per_s'] or 0:6.1f} samples/s  staleness max {r['staleness_max']}  "
                  f"trainer peak {r['trainer_peak_mb'] or 0:.0f} MiB  {time.time() - t0:.0f}s", flush=True)
    summarise(results)
    meta = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "steps": args.steps, "eval_every": args.eval_every, "eval_size": args.eval_size,
            "total_wall_s": time.time() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
    plot(results, args.out.with_suffix(".png"))
    return results


if __name__ == "__main__":
    main()
