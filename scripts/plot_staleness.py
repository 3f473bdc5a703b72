"""Plots of the staleness study (``scripts/bench_quality.py --study``) from its result file.

    python scripts/plot_staleness.py                         # bench/staleness_qs.json -> bench/staleness_qs_*.png
    python scripts/plot_staleness.py --study bench/staleness.json

* ``<name>_gain.png``: left, each objective's held-out gain against the
  staleness bound eta, mean ± standard error over its seeds (rows with one
  seed are drawn hollow); right, each seed's gain minus the same seed's
  eta = 0 run of the same family (paired: the seed's own difficulty cancels).
  One minibatch solid, four dashed.
* ``<name>_wallclock.png``: held-out accuracy against wall-clock seconds,
  the mean over seeds on a common time grid (each run's evaluations
  interpolated, up to the shortest run of the row): what a user with a fixed
  time budget gets from each row.

Needs the optional extra ``bench`` (matplotlib).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import bench_quality
from _bench import ROOT, pyplot


def split_row(row: str) -> tuple[str, int, int]:
    """``decoupled_cap_mb4_eta2`` -> (``decoupled_cap``, 4, 2)."""
    head, eta = row.rsplit("_eta", 1)
    family, mb = head.rsplit("_mb", 1)
    return family, int(mb), int(eta)


def gains(runs: dict) -> dict[str, dict[int, float]]:
    """Row -> seed -> held-out gain (last evaluation minus the first)."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for key, r in runs.items():
        row, seed = key.rsplit("@", 1)
        out[row][int(seed)] = r["evals"][-1]["accuracy"] - r["evals"][0]["accuracy"]
    return out


def paired(by_row: dict[str, dict[int, float]]) -> dict[str, list[float]]:
    """Row -> each seed's gain minus that seed's eta = 0 gain at the same minibatch count (eta = 0 has one
    objective: nothing is stale, so every family of that minibatch count is paired with ``decoupled_cap``)."""
    out = {}
    for row, seeds in by_row.items():
        family, mb, eta = split_row(row)
        base = by_row.get(f"decoupled_cap_mb{mb}_eta0", {})
        diffs = [g - base[s] for s, g in sorted(seeds.items()) if s in base]
        if eta > 0 and diffs:
            out[row] = diffs
    return out


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error over seeds (0 for one seed: drawn hollow, without an error bar)."""
    m, se = bench_quality.mean_se(xs)
    return m, se or 0.0


def curve(evals: list[dict], grid: list[float]) -> list[float]:
    """Accuracy at each time of ``grid`` by linear interpolation between a run's evaluations."""
    pts = [(e["wall_s"], e["accuracy"]) for e in evals]
    out = []
    for t in grid:
        for (t0, a0), (t1, a1) in zip(pts, pts[1:]):
            if t0 <= t <= t1:
                out.append(a0 + (a1 - a0) * (t - t0) / max(t1 - t0, 1e-9))
                break
        else:
            out.append(pts[-1][1] if t > pts[-1][0] else pts[0][1])
    return out


def style(family: str, mb: int, colors: dict) -> dict:
    color = colors.setdefault(family, f"C{len(colors)}")
    return {"color": color, "linestyle": "-" if mb == 1 else "--", "marker": "o" if mb == 1 else "s"}


def hollow(ax, eta: int, mean: float, kw: dict) -> None:
    """Mark a point of one seed only (no error bar to speak of)."""
    ax.plot([eta], [100 * mean], marker=kw["marker"], color="white", markeredgecolor=kw["color"], zorder=5)


def plot_gain(runs: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    by_row, colors = gains(runs), {}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    lines = defaultdict(list)  # (family, mb) -> [(eta, row)]
    for row in by_row:
        family, mb, eta = split_row(row)
        lines[(family, mb)].append((eta, row))
    diffs = paired(by_row)
    for (family, mb), points in sorted(lines.items()):
        points.sort()
        kw = style(family, mb, colors)
        stats = [mean_se(list(by_row[row].values())) for _, row in points]
        axes[0].errorbar([e for e, _ in points], [100 * m for m, _ in stats], yerr=[100 * s for _, s in stats],
                         capsize=3, label=f"{family}, {mb} minibatch{'es' if mb > 1 else ''}", **kw)
        for (eta, row), (m, _) in zip(points, stats):
            if len(by_row[row]) == 1:
                hollow(axes[0], eta, m, kw)
        with_diff = [(eta, row) for eta, row in points if row in diffs]
        if with_diff:
            d = [mean_se(diffs[row]) for _, row in with_diff]
            axes[1].errorbar([e for e, _ in with_diff], [100 * m for m, _ in d], yerr=[100 * s for _, s in d],
                             capsize=3, **kw)
            for (eta, row), (m, _) in zip(with_diff, d):
                if len(diffs[row]) == 1:
                    hollow(axes[1], eta, m, kw)
    for ax in axes:
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xticks([0, 1, 2, 4, 8, 16], ["0", "1", "2", "4", "8", "16"])
        ax.set_xlim(-0.3, 20)
    axes[0].set_xlabel("max staleness eta")
    axes[0].set_ylabel("held-out accuracy gain, points (mean ± s.e. over seeds)")
    axes[0].legend(fontsize=7)
    axes[1].axhline(0, color="grey", linewidth=0.8)
    axes[1].axhspan(-2, 2, color="grey", alpha=0.12)
    axes[1].set_xlabel("max staleness eta")
    axes[1].set_ylabel("gain minus the same seed's eta = 0 gain, points (band: ±2)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def plot_wallclock(runs: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows: dict[str, list[dict]] = defaultdict(list)
    for key, r in sorted(runs.items()):
        rows[key.rsplit("@", 1)[0]].append(r)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6), sharey=True)
    colors: dict = {}
    for row, done in sorted(rows.items(), key=lambda kv: split_row(kv[0])[::-1]):
        family, mb, eta = split_row(row)
        if len(done) < 2:
            continue  # one seed: no mean to speak of
        end = min(r["evals"][-1]["wall_s"] for r in done)
        grid = [end * i / 50 for i in range(51)]
        mean = [sum(c) / len(c) for c in zip(*(curve(r["evals"], grid) for r in done))]
        kw = style(f"{family} eta {eta}", mb, colors)
        kw.pop("marker")
        axes[0 if mb == 1 else 1].plot(grid, [100 * a for a in mean], label=f"{family}, eta {eta}", **kw)
    for ax, mb in zip(axes, (1, 4)):
        ax.set_title(f"{mb} minibatch{'es' if mb > 1 else ''} per step")
        ax.set_xlabel("wall-clock seconds (mean over seeds)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("held-out accuracy %")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", type=Path, default=ROOT / "bench" / "staleness_qs.json")
    args = parser.parse_args(argv)
    runs = json.loads(args.study.read_text())["runs"]
    stem = args.study.with_suffix("")
    plot_gain(runs, stem.with_name(stem.name + "_gain.png"))
    plot_wallclock(runs, stem.with_name(stem.name + "_wallclock.png"))


if __name__ == "__main__":
    main()
