"""Per-file cost of the trajectory spool and of admission, on realistic small groups.

    OMP_NUM_THREADS=1 python scripts/bench_spool.py [--reps 5] [--files 64] [--json OUT]
    OMP_NUM_THREADS=1 python scripts/bench_spool.py --profile read      # cProfile one operation

Builds groups like the long-tailed benchmark task produces them (8 samples,
a prompt of ~8 tokens, response lengths 3..25 with a median of ~5, float32
logprobs, per-token versions, a worker-like ``meta``) in a temporary
directory and times, per file, with ``time.perf_counter``:

* rollout side: ``write_group`` alone, ``Spool.publish`` (write + fsync +
  rename + directory fsync) and the admission ledger's ``try_admit`` (a
  granted ticket, and a refused call at the bound, which the rollout makes
  on every loop iteration);
* trainer side: ``Spool.claim`` (rename, per file of a B-file claim),
  ``read_group``, ``Spool.load`` (read + name check) and
  ``Spool.mark_trained`` (per file of a B-file commit);
* one trainer step for B groups: claim + load every file + mark_trained,
  the spool's share of a trainer step; and the rollout's publish + admit
  for the same B groups.

Each figure is the median over ``--reps`` repetitions of the mean over
``--files`` files (per-step figures: median over all steps of all reps).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcrl.admission.config import AdmissionConfig  # noqa: E402
from hpcrl.admission.ledger import AdmissionLedger  # noqa: E402
from hpcrl.spool.format import Sample, TrajectoryGroup, read_group, write_group  # noqa: E402
from hpcrl.spool.store import Spool  # noqa: E402


def make_groups(n: int, seed: int = 0, group_size: int = 8, first_ticket: int = 0) -> list[TrajectoryGroup]:
    """``n`` groups shaped like the reversal task's (short responses, a few spanning two versions)."""
    rng = np.random.default_rng(seed)
    groups = []
    for t in range(n):
        version = 3 + t // 16
        samples, texts = [], []
        for _ in range(group_size):
            length = int(min(25, 3 + rng.geometric(0.35) - 1))
            versions = np.full(length, version, np.int32)
            if rng.random() < 0.1:  # interrupted by a weight update: the tail is one version newer
                versions[length // 2:] += 1
            samples.append(Sample(response_ids=rng.integers(0, 32_000, length).astype(np.int32),
                                  behav_logprobs=-rng.random(length).astype(np.float32) * 3,
                                  versions=versions, loss_mask=np.ones(length, np.uint8),
                                  reward=float(rng.integers(0, 2)), finish_reason="stop"))
            texts.append("".join(str(d) for d in rng.integers(0, 10, length)))
        prompt = "".join(str(d) for d in rng.integers(0, 10, 6))
        meta = {"version": version, "prompt": f"Reverse: {prompt}", "answer": prompt[::-1], "row": t,
                "epoch": 0, "responses": texts, "reward_status": ["ok"] * group_size}
        groups.append(TrajectoryGroup(ticket=first_ticket + t, writer="bench-0", prompt_ids=rng.integers(
            0, 32_000, int(rng.integers(6, 11))).astype(np.int32), samples=samples, meta=meta))
    return groups


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_rep(root: Path, groups: list[TrajectoryGroup], batch: int) -> dict[str, list[float]]:
    """Seconds per operation (per file, or per step) for one pass over ``groups``."""
    out: dict[str, list[float]] = {k: [] for k in (
        "write_group", "publish", "admit", "admit_refused", "claim", "read_group", "load",
        "mark_trained", "step_trainer", "step_rollout")}
    plain = root / "plain"
    plain.mkdir()
    paths = [plain / f"{g.ticket}.h5" for g in groups]
    for p, g in zip(paths, groups):
        out["write_group"].append(_timed(lambda: write_group(p, g)))
    for p in paths:  # read after all are written, as the trainer reads files written a while ago
        out["read_group"].append(_timed(lambda: read_group(p)))
    ledger = AdmissionLedger(root / "admission", AdmissionConfig(batch_size=batch, max_staleness=0), 1000)
    spool = Spool(root / "spool")
    for i in range(0, len(groups), batch):
        chunk = groups[i:i + batch]
        version = i // batch
        t_admit = [_timed(lambda: ledger.try_admit(version, "bench-0")) for _ in chunk]
        refused = _timed(lambda: ledger.try_admit(version, "bench-0"))
        t_pub = [_timed(lambda: spool.publish(g)) for g in chunk]
        out["admit"] += t_admit
        out["admit_refused"].append(refused)
        out["publish"] += t_pub
        out["step_rollout"].append(sum(t_admit) + refused + sum(t_pub))
        t0 = time.perf_counter()
        entries = spool.claim(spool.ready())
        t1 = time.perf_counter()
        t_load = [_timed(lambda: spool.load(e)) for e in entries]
        t2 = time.perf_counter()
        spool.mark_trained(entries, version)
        t3 = time.perf_counter()
        assert len(entries) == len(chunk), "bench files must all be valid"
        out["claim"] += [(t1 - t0) / len(entries)] * len(entries)
        out["load"] += t_load
        out["mark_trained"] += [(t3 - t2) / len(entries)] * len(entries)
        out["step_trainer"].append(t3 - t0)
    return out


ROWS = [  # key, label, unit
    ("write_group", "write_group (plain file)", "per file"),
    ("publish", "Spool.publish (write+fsync+rename)", "per file"),
    ("admit", "ledger.try_admit, granted", "per ticket"),
    ("admit_refused", "ledger.try_admit, refused at bound", "per call"),
    ("claim", "Spool.claim (rename, B at once)", "per file"),
    ("read_group", "read_group", "per file"),
    ("load", "Spool.load (read+validate+name check)", "per file"),
    ("mark_trained", "Spool.mark_trained (B at once)", "per file"),
    ("step_trainer", "trainer step: claim+load+mark_trained", "per step"),
    ("step_rollout", "rollout: B x (admit+publish)", "per step"),
]


def run(reps: int, files: int, batch: int, base: str | None) -> dict[str, dict[str, float]]:
    groups = make_groups(files)
    per_rep: dict[str, list[float]] = {k: [] for k, _, _ in ROWS}
    per_step: dict[str, list[float]] = {"step_trainer": [], "step_rollout": []}
    for _ in range(reps):
        with tempfile.TemporaryDirectory(dir=base) as d:
            times = one_rep(Path(d), groups, batch)
        for k, v in times.items():
            if k in per_step:
                per_step[k] += v
            else:
                per_rep[k].append(statistics.fmean(v))
    result = {}
    for k, _, _ in ROWS:
        values = per_step[k] if k in per_step else per_rep[k]
        result[k] = {"median_us": statistics.median(values) * 1e6, "min_us": min(values) * 1e6}
    return result


def profile(op: str, files: int, base: str | None) -> None:
    groups = make_groups(files)
    with tempfile.TemporaryDirectory(dir=base) as d:
        spool = Spool(Path(d) / "spool")
        paths = [spool.publish(g) for g in groups]
        prof = cProfile.Profile()
        if op == "read":
            prof.runcall(lambda: [read_group(p) for p in paths * 5])
        elif op == "write":
            prof.runcall(lambda: [write_group(Path(d) / f"w{i}.h5", g) for i, g in enumerate(groups * 5)])
        else:
            more = make_groups(files * 5, seed=1, first_ticket=files)
            prof.runcall(lambda: [spool.publish(g) for g in more])
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--files", type=int, default=64, help="groups per repetition (a multiple of --batch)")
    ap.add_argument("--batch", type=int, default=16, help="B: groups per trainer step")
    ap.add_argument("--dir", default=None, help="where to create the temporary spool (default: $TMPDIR)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--profile", choices=["read", "write", "publish"], default=None,
                    help="instead of the table, cProfile one operation over --files files")
    args = ap.parse_args()
    if args.files % args.batch:
        ap.error("--files must be a multiple of --batch")
    if args.profile:
        profile(args.profile, args.files, args.dir)
        return
    res = run(args.reps, args.files, args.batch, args.dir)
    print(f"spool + admission costs, {args.files} groups x {args.reps} reps, B={args.batch}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}")
    print(f"{'operation':<42}{'unit':>11}{'median us':>11}{'min us':>9}")
    for k, label, unit in ROWS:
        print(f"{label:<42}{unit:>11}{res[k]['median_us']:>11.1f}{res[k]['min_us']:>9.1f}")
    step_ms = res["step_trainer"]["median_us"] / 1e3
    print(f"trainer-side spool share of a 350-450 ms step: {step_ms / 450:.2%} - {step_ms / 350:.2%}")
    # what reading and committing a batch costs when nothing is read ahead (bench_async's spool_read_share +
    # commit_share; its spool_admission_share is the trainer's own time/spool_s + time/commit_s)
    async_ms = args.batch * (res["mark_trained"]["median_us"] + res["read_group"]["median_us"]) / 1e3
    print(f"reading + committing a batch (B x (mark_trained + read_group)) = {async_ms:.2f} ms per step: "
          f"{async_ms / 450:.2%} - {async_ms / 350:.2%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
