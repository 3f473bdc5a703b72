"""Plots of the filesystem-protocol benchmark (``scripts/bench_fs.py``) from its result files.

    python scripts/plot_fs.py                  # bench/fs_length.png and bench/fs_concurrency.png

* ``bench/fs_length.png`` (from ``--length`` results, ``bench/fs_length.json``):
  the trainer's protocol cost per step, a writer's admission and admission +
  publish per group, and retention per checkpoint, against the groups already
  in the run; flat lines are what "flat in run length" means.
* ``bench/fs_concurrency.png`` (from ``--writers`` results, ``bench/fs_concurrency.json``
  and, beside it where present, ``bench/fs_concurrency_recheck.json``): groups/s
  trained against offered, and the time from a batch's last publish to its
  claim (p50, p99), against the number of writers.

Needs the optional extra ``bench`` (matplotlib).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _bench import ROOT, pyplot


def plot_length(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    length = result["length"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for key, label in (("trainer_ms_per_step", "trainer: protocol per step"),
                       ("writer_admit_publish_ms_per_group", "writer: admission + publish per group"),
                       ("writer_admit_ms_per_group", "writer: admission per ticket")):
        windows = length[key]
        mids = [(w["from"] + w["to"]) / 2 for w in windows]
        axes[0].plot(mids, [w["ms"] for w in windows], marker=".", label=label)
    axes[0].set_xlabel("groups already in the run (window midpoint)")
    axes[0].set_ylabel("ms (mean over the window)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    retention = length["retention"]
    axes[1].plot([r["trained"] for r in retention], [1000 * r["seconds"] for r in retention], ".", ms=3)
    axes[1].set_xlabel("groups trained")
    axes[1].set_ylabel("retention at a checkpoint (ms)")
    fig.suptitle(f"{length['groups']:,} groups, {length['writers']} writers, {100 * length['drop_share']:.0f}% "
                 f"dropped: last/first quarter trainer {length['trainer_step_growth']:.2f}x, admission "
                 f"{length['writer_admit_growth']:.2f}x, retention {length['retention_growth']:.2f}x", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def plot_concurrency(runs: dict[str, list[dict]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, (label, rows) in enumerate(runs.items()):
        rated = [r for r in rows if r["groups_per_s"] is not None]  # one writer may train too few to rate
        axes[0].plot([r["writers"] for r in rated], [r["groups_per_s"] for r in rated], marker="o", color=f"C{i}",
                     label=f"trained, {label}")
        for q, style in (("p50", "-"), ("p99", "--")):
            axes[1].plot([r["writers"] for r in rows], [r["batch_complete_to_claimed_ms"][q] for r in rows], style,
                         marker="o", color=f"C{i}", label=f"{q}, {label}")
    first = next(iter(runs.values()))
    axes[0].plot([r["writers"] for r in first], [r["offered_groups_per_s"] for r in first], "k:", label="offered")
    axes[0].set_ylabel("groups/s")
    axes[1].set_ylabel("batch's last publish to its claim (ms)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("writer processes")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", type=Path, default=ROOT / "bench", help="where the result files are")
    args = ap.parse_args()
    length = args.bench / "fs_length.json"
    if length.exists():
        plot_length(json.loads(length.read_text()), length.with_suffix(".png"))
    runs = {label: json.loads(f.read_text())["concurrency"]
            for label, f in (("recheck_s=0", args.bench / "fs_concurrency.json"),
                             ("recheck_s=0.25", args.bench / "fs_concurrency_recheck.json")) if f.exists()}
    if runs:
        plot_concurrency(runs, args.bench / "fs_concurrency.png")


if __name__ == "__main__":
    main()
