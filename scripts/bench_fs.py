"""The filesystem protocol under many writers: the spool and the admission ledger as a cluster uses them.

    python scripts/bench_fs.py --writers 1,8,32,64 --seconds 20 --out bench/fs.json        # concurrency
    python scripts/bench_fs.py --length 100000 --out bench/fs_length.json                   # run length
    python scripts/bench_fs.py --ops --out bench/fs_ops.json                                # operation counts

Every process is real protocol code on a real directory (``--dir``, default a temporary directory: point it at
the shared filesystem to measure that): rollout stand-ins (one process each) admit tickets through
:class:`~hpcrl.admission.ledger.AdmissionLedger`, build groups of ``--group-size`` responses whose lengths are
drawn log-uniformly from ``--tokens`` (real file sizes: ids, behaviour log-probabilities, versions and the loss
mask of every token) and publish them with :meth:`~hpcrl.spool.store.Spool.publish` at ``--rate`` groups/s each
(the generation time they stand in for); one trainer stand-in takes batches of ``--batch`` groups with the
trainer's own :class:`~hpcrl.trainer.feed.BatchFeed` (claim, load, ledger checks, commit to ``trained/``,
``--drop-share`` of the groups dropped as uniform and recorded in the ledger), advances the policy version
after each batch and runs the checkpoint-time retention every ``--ckpt-every`` steps. Nothing trains: the
trainer's loop is the protocol alone, so what it costs is measured without the model in the way.

Concurrency (``--writers``): for each number of writers, groups/s through the trainer, claim latency
(publish to claim) percentiles, admission latency percentiles, contention (``O_EXCL`` ticket creations lost
to another writer) and refusals at the staleness bound, and the trainer's protocol seconds per step.
Run length (``--length N``): the same loop with small files until N groups were trained; the per-step cost
of the trainer's protocol and of the writers' admit + publish in windows of the run, and of retention at
each checkpoint, so that growth with the number of files already in the spool's directories shows.
Operation counts (``--ops``): a short run under ``strace -f``; each process's system calls after its start
marker are classed as metadata operations (creates, renames, fsyncs, directory listings, lookups, unlinks,
opens) and divided by the groups it handled: the numbers a metadata server sees per group, which
docs/performance.md turns into the largest fleet a Lustre or GPFS metadata server sustains.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcrl.admission import ledger as ledger_mod  # noqa: E402
from hpcrl.admission.config import AdmissionConfig  # noqa: E402
from hpcrl.admission.ledger import AdmissionLedger  # noqa: E402
from hpcrl.fs.atomic import write_json  # noqa: E402
from hpcrl.spool.format import Sample, TrajectoryGroup  # noqa: E402
from hpcrl.spool.store import Spool  # noqa: E402
from hpcrl.trainer.feed import BatchFeed  # noqa: E402

NUM_ROWS = 100_000
MARK = "/__hpcrl_bench_fs_start__"  # a failed stat of this path marks where a process's counted calls begin


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


class GroupMaker:
    """Groups of real size from a pool of random arrays (the content does not matter, the bytes do)."""

    def __init__(self, seed: int, group_size: int, tokens: tuple[int, int]) -> None:
        self.rng = np.random.default_rng(seed)
        self.group_size, self.lo, self.hi = group_size, tokens[0], tokens[1]
        self.ids = self.rng.integers(0, 150_000, self.hi).astype(np.int32)
        self.logp = -self.rng.random(self.hi).astype(np.float32)
        self.mask = np.ones(self.hi, np.uint8)

    def make(self, ticket: int, row: int, epoch: int, version: int, writer: str) -> TrajectoryGroup:
        samples = []
        for _ in range(self.group_size):
            n = int(np.exp(self.rng.uniform(np.log(self.lo), np.log(self.hi + 1)))) if self.hi > self.lo else self.lo
            n = min(max(n, self.lo), self.hi)
            samples.append(Sample(response_ids=self.ids[:n], behav_logprobs=self.logp[:n],
                                  versions=np.full(n, version, np.int32), loss_mask=self.mask[:n],
                                  reward=float(self.rng.integers(0, 2)), finish_reason="stop"))
        meta = {"version": version, "row": row, "epoch": epoch, "reward_status": ["ok"] * self.group_size}
        return TrajectoryGroup(ticket=ticket, writer=writer, prompt_ids=self.ids[:64], samples=samples, meta=meta)


def read_version(root: Path) -> int:
    try:
        return int((root / "version").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def writer_main(root: Path, idx: int, args: dict, go, out: Path) -> None:
    """One rollout stand-in: admit, 'generate' (pace to the rate), publish; for the run's seconds (counted from
    the moment every process is ready) or its share of the tickets."""
    lost = [0]
    real_create = ledger_mod.create_exclusive

    def counted_create(path, record):  # a lost O_EXCL race: another writer created this ticket first
        won = real_create(path, record)
        lost[0] += not won and path.parent.name == "tickets"
        return won

    ledger_mod.create_exclusive = counted_create
    cfg = AdmissionConfig(batch_size=args["batch"], max_staleness=args["eta"], recheck_s=args["recheck"])
    ledger = AdmissionLedger(root / "admission", cfg, NUM_ROWS, seed=0)
    spool, writer = Spool(root / "spool"), f"r{idx}-e1n{idx + 1}"
    maker = GroupMaker(idx, args["group_size"], tuple(args["tokens"]))
    admit_s, publish_s, tickets, refused = [], [], [], 0
    period = 1.0 / args["rate"] if args["rate"] > 0 else 0.0
    version, seen = 0, 0.0
    stop_at = started(go, args["seconds"])
    os.path.exists(MARK)  # the start marker: strace counts this process's calls from here
    next_at = time.monotonic()
    while time.time() < stop_at and (args["limit"] <= 0 or len(tickets) < args["limit"]):
        if time.monotonic() - seen > 0.5:  # a rollout learns of new weights by polling, not per ticket
            version, seen = read_version(root), time.monotonic()
        t0 = time.perf_counter()
        ticket = ledger.try_admit(version, writer)
        t1 = time.perf_counter()
        if ticket is None:
            refused += 1
            time.sleep(0.01)
            version, seen = read_version(root), time.monotonic()
            continue
        admit_s.append(t1 - t0)
        group = maker.make(ticket.index, ticket.row, ticket.epoch, version, writer)
        next_at += period
        time.sleep(max(0.0, next_at - time.monotonic()))
        next_at = max(next_at, time.monotonic() - period)  # a writer that fell behind does not burst
        group.created = time.time()  # finished now: claim latencies count from here
        t2 = time.perf_counter()
        spool.publish(group)
        publish_s.append(time.perf_counter() - t2)
        tickets.append(ticket.index)
    write_json(out, {"pid": os.getpid(), "admit_s": admit_s, "publish_s": publish_s, "tickets": tickets,
                     "refused": refused, "lost_races": lost[0]})


def started(go, seconds: float) -> float:
    """Say this process is ready, wait for all the others; the time to stop at."""
    ready, start = go
    ready.release()
    start.wait()
    return time.time() + seconds


def trainer_main(root: Path, args: dict, go, out: Path) -> None:
    """The trainer stand-in: BatchFeed batches, commit, version + 1, retention every ckpt_every steps."""
    ledger = AdmissionLedger(root / "admission", AdmissionConfig(args["batch"], args["eta"]), NUM_ROWS, seed=0)
    spool = Spool(root / "spool")
    share = args["drop_share"]
    keep = (lambda g: (g.ticket * 2654435761 % 1000) >= share * 1000) if share > 0 else None
    # no read-ahead thread (--ops traces this one; the trainer's adds a ready/ listing per step and a stat per file)
    feed = BatchFeed(spool, ledger, args["batch"], args["eta"], timeout_s=max(60.0, args["seconds"]),
                     poll_s=0.002, keep=keep, read_ahead=False)
    ledger.sync_drop_count()  # as the trainer does at its start
    steps, latency, ready_to_claim, retention, slept, polls = [], [], [], [], [0.0], [0]

    def wait() -> None:  # the feed found too few groups: sleep one poll interval (the trainer's: 10 ms)
        t = time.perf_counter()
        time.sleep(0.01)
        slept[0] += time.perf_counter() - t
        polls[0] += 1

    stop_at = started(go, args["seconds"] + 1.0)  # the writers' last groups are taken too
    os.path.exists(MARK)  # the start marker
    version = 0
    taken = lambda: len(feed.trained) + sum(feed.dropped.values())  # noqa: E731
    while time.time() < stop_at and (args["limit"] <= 0 or taken() < args["limit"]):
        slept[0], polls[0] = 0.0, 0
        feed.timeout_s = 30.0 if args["limit"] > 0 else max(1.0, stop_at - time.time())
        t0 = time.perf_counter()
        try:
            groups = feed.next_batch(version, wait=wait)
        except Exception as e:  # noqa: BLE001 - the writers stopped: the run is over
            if time.time() < stop_at - 2.0 and args["limit"] <= 0:
                print(f"trainer: {type(e).__name__}: {e}", file=sys.stderr)
            break
        claimed = time.time()
        feed.commit(version)
        version += 1
        cost = time.perf_counter() - t0 - slept[0]
        time.sleep(args["step_s"])  # the training step the protocol stands beside
        _write_version(root, version)
        latency += [claimed - g.created for g in groups]
        ready_to_claim.append(claimed - max(g.created for g in groups))
        steps.append({"step": version, "protocol_s": cost, "polls": polls[0], "trained": len(feed.trained),
                      "dropped": sum(feed.dropped.values()), "time": time.time()})
        if args["ckpt_every"] and version % args["ckpt_every"] == 0:
            t = time.perf_counter()
            feed.sync()  # as before a checkpoint: the moves since the last one made durable
            feed.retain(keep_dropped_files=100)
            retention.append({"step": version, "seconds": time.perf_counter() - t, "trained": len(feed.trained)})
    write_json(out, {"pid": os.getpid(), "steps": steps, "claim_latency_s": latency,
                     "ready_to_claim_s": ready_to_claim, "retention": retention,
                     "dropped": feed.dropped})


def _write_version(root: Path, version: int) -> None:
    tmp = root / f"version.tmp.{os.getpid()}"
    tmp.write_text(str(version))
    os.replace(tmp, root / "version")


def run_once(root: Path, writers: int, args: dict, seconds: float) -> dict:
    """One run: the trainer and ``writers`` writer processes for ``seconds`` (or until ``limit`` groups)."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    go = (ctx.Semaphore(0), ctx.Event())  # every process ready (imports done), then the clock starts
    args = {**args, "seconds": seconds}
    procs = [ctx.Process(target=trainer_main, args=(root, args, go, root / "trainer.json"))]
    w_args = {**args, "limit": -(-args["limit"] // writers) if args["limit"] > 0 else 0}
    procs += [ctx.Process(target=writer_main, args=(root, i, w_args, go, root / f"writer{i}.json"))
              for i in range(writers)]
    for p in procs:
        p.start()
    for _ in procs:
        while not go[0].acquire(timeout=5.0):
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a bench process died before it was ready (exit {dead[0].exitcode})")
    go[1].set()
    for p in procs:
        p.join()
    t = json.loads((root / "trainer.json").read_text())
    ws = [json.loads((root / f"writer{i}.json").read_text()) for i in range(writers)]
    steps = t["steps"][1:] or t["steps"]  # the first step waits for the writers' first groups
    span = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else 0.0
    taken = (steps[-1]["trained"] + steps[-1]["dropped"] - steps[0]["trained"] - steps[0]["dropped"]) if steps else 0
    admit = [x for w in ws for x in w["admit_s"]]
    publish = [x for w in ws for x in w["publish_s"]]
    proto = [s["protocol_s"] for s in steps]
    return {
        "writers": writers, "groups_trained": t["steps"][-1]["trained"] if t["steps"] else 0,
        "offered_groups_per_s": writers * args["rate"] if args["rate"] > 0 else None,
        "groups_per_s": taken / span if span else None,
        # publish -> claimed, for every group (includes waiting for the batch to fill) and for the group that
        # completed its batch (the protocol's own delay: poll interval, listing, claim, load, checks)
        "claim_latency_ms": {f"p{q}": 1e3 * pct(t["claim_latency_s"], q) for q in (50, 90, 99)}
        if t["claim_latency_s"] else None,
        "batch_complete_to_claimed_ms": {f"p{q}": 1e3 * pct(t["ready_to_claim_s"], q) for q in (50, 90, 99)}
        if t["ready_to_claim_s"] else None,
        "admit_ms": {f"p{q}": 1e3 * pct(admit, q) for q in (50, 90, 99)} if admit else None,
        "publish_ms": {f"p{q}": 1e3 * pct(publish, q) for q in (50, 90, 99)} if publish else None,
        "tickets": sum(len(w["tickets"]) for w in ws),
        "lost_races": sum(w["lost_races"] for w in ws), "refused_at_bound": sum(w["refused"] for w in ws),
        # the trainer's time in the feed apart from its sleeps (its polls of ready/ included), per step
        "trainer_protocol_ms_per_step": {"mean": 1e3 * float(np.mean(proto)), "p99": 1e3 * pct(proto, 99)}
        if proto else None,
        "trainer_polls_per_step": float(np.mean([s["polls"] for s in steps])) if steps else None,
        "_trainer": t, "_writers": ws,
    }


def concurrency(base: Path, args: dict) -> dict:
    rows = []
    for w in args["writer_counts"]:
        r = run_once(base / f"w{w}", w, {**args, "limit": 0}, args["seconds"])
        done, proto = r["batch_complete_to_claimed_ms"] or {}, r["trainer_protocol_ms_per_step"] or {}
        print(f"{w:3d} writers: {r['groups_per_s'] or 0:.1f} groups/s (offered {r['offered_groups_per_s']}), "
              f"batch complete -> claimed p50/p99 {done.get('p50', 0):.1f}/{done.get('p99', 0):.1f} ms, admit p99 "
              f"{(r['admit_ms'] or {}).get('p99', 0):.2f} ms, lost races {r['lost_races']}, trainer protocol "
              f"{proto.get('mean', 0):.2f} ms/step", flush=True)
        rows.append({k: v for k, v in r.items() if not k.startswith("_")})
        shutil.rmtree(base / f"w{w}", ignore_errors=True)
    return {"concurrency": rows}


def windows(values: list[tuple[int, float]], n: int, width: int) -> list[dict]:
    """Mean of (position, seconds) pairs per window of ``width`` positions."""
    out = []
    for lo in range(0, n, width):
        xs = [v for p, v in values if lo <= p < lo + width]
        if xs:
            out.append({"from": lo, "to": lo + width, "ms": 1e3 * float(np.mean(xs)), "n": len(xs)})
    return out


def growth(windows_: list[dict]) -> tuple[float, float]:
    """Median of the first and of the last quarter of the full windows (a window with under half the steps of
    the fullest is the run's ragged end): how the cost moved over the run, robust to one loaded moment."""
    full = [w["ms"] for w in windows_ if w["n"] >= max(x["n"] for x in windows_) / 2]
    k = max(1, len(full) // 4)
    return float(np.median(full[:k])), float(np.median(full[-k:]))


def ratio(pair: tuple[float, float]) -> float:
    return pair[1] / pair[0]


def run_length(base: Path, args: dict) -> dict:
    n, w = args["length"], args["length_writers"]
    small = {**args, "tokens": [16, 64], "rate": 0.0, "limit": n}
    t0 = time.time()
    r = run_once(base / "length", w, small, seconds=24 * 3600)
    t, ws = r["_trainer"], r["_writers"]
    width = max(1000, n // 20)
    per_step = windows([(s["trained"], s["protocol_s"]) for s in t["steps"]], n, width)
    per_group = windows([(tk, a + p) for x in ws for tk, a, p in zip(x["tickets"], x["admit_s"], x["publish_s"])],
                        n, width)
    admit = windows([(tk, a) for x in ws for tk, a in zip(x["tickets"], x["admit_s"])], n, width)
    first, last = growth(per_step)
    out = {"groups": n, "writers": w, "wall_s": time.time() - t0, "drop_share": args["drop_share"],
           "trainer_ms_per_step": per_step, "writer_admit_publish_ms_per_group": per_group,
           "writer_admit_ms_per_group": admit, "writer_growth": ratio(growth(per_group)),
           "writer_admit_growth": ratio(growth(admit)), "retention": t["retention"],
           "retention_growth": ratio(growth([{"ms": 1e3 * r["seconds"], "n": 1} for r in t["retention"]])),
           "trainer_step_growth": last / first}
    print(f"{n} groups, median of the first and last quarter of the run: trainer protocol {first:.2f} -> "
          f"{last:.2f} ms/step; writer admit+publish x{out['writer_growth']:.2f}, admit alone "
          f"x{out['writer_admit_growth']:.2f}; retention x{out['retention_growth']:.2f}", flush=True)
    shutil.rmtree(base / "length", ignore_errors=True)
    return {"length": out}


CLASSES = [  # (class, test on the strace line)
    ("rename", lambda c, rest: c in ("rename", "renameat", "renameat2")),
    ("fsync", lambda c, rest: c in ("fsync", "fdatasync")),
    ("unlink", lambda c, rest: c in ("unlink", "unlinkat", "rmdir")),
    ("mkdir", lambda c, rest: c in ("mkdir", "mkdirat")),
    ("listdir", lambda c, rest: c in ("open", "openat") and "O_DIRECTORY" in rest),
    ("create", lambda c, rest: c in ("open", "openat", "creat") and "O_CREAT" in rest),
    ("open", lambda c, rest: c in ("open", "openat")),
    ("lookup", lambda c, rest: c in ("stat", "lstat", "newfstatat", "statx", "access", "faccessat",
                                     "faccessat2", "readlink", "readlinkat")),
]
_LINE = re.compile(r"^(?:\d+\s+)?([a-z0-9_]+)\((.*)$")


def classify(trace: Path) -> Counter:
    """Metadata operations in one process's strace output, counted after its start marker."""
    counts: Counter = Counter()
    started = False
    for line in trace.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        call, rest = m.groups()
        if not started:
            started = MARK in rest
            continue
        if any(x in rest for x in ("/dev/", "/proc/", ".py", "site-packages", "AT_EMPTY_PATH")) or \
                re.search(r'/(version|writer\d+\.json|trainer\.json)(\.tmp[.\d]*)?"', rest):
            continue  # not the protocol's files (fstat of an open descriptor, the bench's own files)
        for name, test in CLASSES:
            if test(call, rest):
                counts[name] += 1
                if name == "listdir":  # which directory: the trainer's polls list ready/
                    counts[f"listdir {rest.split(chr(34))[1].rstrip('/').rsplit('/', 1)[-1]}/"] += 1
                break
    return counts


def ops(base: Path, args: dict) -> dict:
    if shutil.which("strace") is None:
        raise SystemExit("--ops needs strace (apt-get install strace)")
    root = base / "ops"
    cmd = [shutil.which("strace"), "-f", "-qq", "-ff", "-o", str(base / "trace"), "-e",
           "trace=%file,fsync,fdatasync,getdents64", sys.executable, __file__, "--_ops-child", str(root),
           "--writers", str(args["ops_writers"]), "--seconds", str(args["seconds"]), "--rate", str(args["rate"]),
           "--batch", str(args["batch"]), "--eta", str(args["eta"]), "--drop-share", str(args["drop_share"]),
           "--tokens", f"{args['tokens'][0]},{args['tokens'][1]}", "--ckpt-every", str(args["ckpt_every"]),
           "--step-s", str(args["step_s"]), "--recheck", str(args["recheck"])]
    subprocess.run(cmd, check=True)
    t = json.loads((root / "trainer.json").read_text())
    ws = [json.loads(p.read_text()) for p in sorted(root.glob("writer*.json"))]
    groups_w = sum(len(w["tickets"]) for w in ws)
    groups_t = t["steps"][-1]["trained"] + t["steps"][-1]["dropped"] if t["steps"] else 0
    per_w: Counter = Counter()
    for w in ws:
        per_w += classify(Path(f"{base / 'trace'}.{w['pid']}"))
    per_t = classify(Path(f"{base / 'trace'}.{t['pid']}"))
    polls = sum(x["polls"] for x in t["steps"])
    seconds = t["steps"][-1]["time"] - t["steps"][0]["time"] if len(t["steps"]) > 1 else 0.0
    out = {"writers": len(ws), "groups_published": groups_w, "groups_taken": groups_t, "trainer_polls": polls,
           "trainer_polls_per_s": polls / seconds if seconds else None, "seconds": seconds,
           "writer_refusals_per_s": sum(w["refused"] for w in ws) / len(ws) / seconds if seconds else None,
           "per_writer_per_s": {k: v / len(ws) / seconds for k, v in sorted(per_w.items())} if seconds else None,
           "per_group_writer": {k: v / max(1, groups_w) for k, v in sorted(per_w.items())},
           "per_group_trainer": {k: v / max(1, groups_t) for k, v in sorted(per_t.items())},
           "steps": len(t["steps"]), "checkpoints": len(t["retention"])}
    for side in ("writer", "trainer"):
        row = out[f"per_group_{side}"]
        print(f"{side} per group: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    if out["per_writer_per_s"]:
        print(f"each writer, per second ({out['writer_refusals_per_s']:.0f} refusals/s): " +
              ", ".join(f"{k} {v:.1f}" for k, v in out["per_writer_per_s"].items()), flush=True)
    return {"ops": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writers", default="1,8,32,64", help="writer counts to run side by side (comma-separated)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each concurrency run")
    ap.add_argument("--rate", type=float, default=2.0, help="groups/s each writer publishes (0: as fast as it can)")
    ap.add_argument("--tokens", default="1024,16384", help="response lengths, log-uniform between the two")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="groups per trainer step (admission.batch_size)")
    ap.add_argument("--eta", type=int, default=4, help="admission.max_staleness")
    ap.add_argument("--drop-share", type=float, default=0.25, help="share of groups dropped as uniform")
    ap.add_argument("--ckpt-every", type=int, default=50, help="steps between retention passes")
    ap.add_argument("--step-s", type=float, default=0.0, help="the trainer's training time per step (a sleep)")
    ap.add_argument("--recheck", type=float, default=0.0, help="admission.recheck_s of the writers")
    ap.add_argument("--length", type=int, default=0, help="run length: groups to train (small files)")
    ap.add_argument("--length-writers", type=int, default=4)
    ap.add_argument("--ops", action="store_true", help="count metadata operations per group under strace")
    ap.add_argument("--ops-writers", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where to run (default: a temporary directory)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--_ops-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    args = {"writer_counts": [int(x) for x in a.writers.split(",")], "seconds": a.seconds, "rate": a.rate,
            "tokens": [int(x) for x in a.tokens.split(",")], "group_size": a.group_size, "batch": a.batch,
            "eta": a.eta, "drop_share": a.drop_share, "ckpt_every": a.ckpt_every, "length": a.length,
            "length_writers": a.length_writers, "ops_writers": a.ops_writers, "limit": 0, "step_s": a.step_s,
            "recheck": a.recheck}
    if a._ops_child:  # the run strace follows
        run_once(Path(a._ops_child), args["writer_counts"][0], args, a.seconds)
        return
    base = Path(a.dir or tempfile.mkdtemp(prefix="hpcrl-bench-fs-"))
    base.mkdir(parents=True, exist_ok=True)
    git = lambda *cmd: subprocess.run(["git", *cmd], capture_output=True, text=True,  # noqa: E731
                                      cwd=Path(__file__).parent).stdout.strip()
    result: dict = {"meta": {"args": args, "dir": str(base), "host": os.uname().nodename, "time": time.time(),
                             "commit": git("rev-parse", "--short", "HEAD"),
                             "dirty": bool(git("status", "--porcelain", "hpcrl"))}}
    try:
        if a.ops:
            result.update(ops(base, args))
        elif a.length:
            result.update(run_length(base, args))
        else:
            result.update(concurrency(base, args))
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
