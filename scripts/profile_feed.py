"""Where the trainer's time taking its batches goes: one ``bench_async.py`` mode under a sampling profiler.

    python scripts/profile_feed.py --mode async_eta1 --steps 150 --rate 400 --out bench/feed_profile_eta1.txt

Runs ``scripts/bench_async.py`` for one mode, attaches py-spy (the ``bench``
extra) to its trainer process as soon as it starts, samples every thread,
idle ones included (an fsync is time the loop waits), and sorts the samples
inside ``BatchFeed.next_batch`` (its waits for rollouts left out, as
``time/spool_s`` leaves them out) into what they were doing: setting stale
groups aside (the reason record, the ticket's reissue, the file's checks),
claiming (reads the read-ahead had not done, renames, ledger checks,
hand-overs), waking the read-ahead, listing ``ready/``. Prints the shares and
the benchmark's own row (spool + admission share, stale set-asides) and
writes both to ``--out``; ``--raw`` keeps py-spy's stacks, each frame with
its line, for a closer look at one category.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (label, a frame whose presence in a stack puts the sample there), first match wins
CATEGORIES = [
    ("set-aside: reason record (write, fsync, rename)", "Spool.drop"),
    ("set-aside: ticket reissued", "AdmissionLedger.reissue"),
    ("set-aside: file checked (read, verdict, holder)", "BatchFeed.regenerate"),
    ("claim: read the read-ahead had not done", "read_group"),
    ("claim: rename", "Spool.claim"),
    ("claim: ledger checks", "BatchFeed.verdict"),
    ("waking the read-ahead", "ReadAhead.kick"),
    ("listing ready/", "Spool.ready"),
    ("claim: hand-over and checks", "BatchFeed._take"),
]


def categorize(lines: list[str]) -> Counter:
    """Samples of py-spy's raw output (``frame;frame;... count`` per line) inside ``next_batch`` and outside its
    wait, by category (``other`` for the rest)."""
    out: Counter = Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        names = [f.split(" (")[0] for f in stack.split(";")]
        if not any(n.endswith("next_batch") for n in names) or any(n.endswith("batch_wait.<locals>.wait")
                                                                     for n in names):
            continue
        label = next((lb for lb, frame in CATEGORIES if any(n.endswith(frame) for n in names)), "other")
        out[label] += int(count)
    return out


def report(counts: Counter, row: dict) -> str:
    total = sum(counts.values())
    lines = [f"samples inside next_batch, waits left out: {total}"]
    lines += [f"{100 * n / max(total, 1):5.1f} %  {n:5d}  {label}" for label, n in counts.most_common()]
    lines.append("benchmark row: " + json.dumps(row, sort_keys=True))
    return "\n".join(lines)


def trainer_pid(bench: subprocess.Popen, deadline_s: float) -> int:
    """The trainer process that ``bench`` (bench_async.py) starts, found among its descendants."""
    deadline = time.time() + deadline_s
    while time.time() < deadline and bench.poll() is None:
        family, found = {bench.pid}, None
        for _ in range(4):  # bench_async -> hpcrl.submit -> the supervisor -> the trainer (as deep as it goes)
            kids = subprocess.run(["pgrep", "-P", ",".join(map(str, family))], capture_output=True, text=True)
            family |= {int(p) for p in kids.stdout.split()}
        for pid in sorted(family - {bench.pid}):
            try:
                if b"hpcrl.trainer" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found = pid
                    break
            except OSError:
                continue
        if found is not None:
            return found
        time.sleep(0.05)
    raise SystemExit("bench_async.py ended without a trainer process" if bench.poll() is not None
                     else f"no trainer process appeared within {deadline_s:.0f} s")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="async_eta1")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rate", type=int, default=400, help="samples a second")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--raw", type=Path, help="also keep py-spy's raw stacks here (frames with their lines)")
    args = parser.parse_args(argv)
    if args.mode.startswith("colocated"):
        parser.error("a colocated mode has no trainer process of its own: profile an async or disagg mode")
    if args.raw and not args.raw.parent.is_dir():  # found out before the benchmark runs, not after it
        parser.error(f"--raw: no folder {args.raw.parent}")
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("py-spy not found: pip install -e '.[bench]'")
    with tempfile.TemporaryDirectory() as tmp:
        result, raw = Path(tmp) / "row.json", Path(tmp) / "stacks.txt"
        print(f"bench_async.py --mode {args.mode}, {args.steps} steps, py-spy at {args.rate}/s on the trainer",
              flush=True)
        bench = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench_async.py"), "--steps", str(args.steps),
                                  "--rounds", "1",  # py-spy follows one trainer process: one run of the mode
                                  "--modes", args.mode, "--out", str(result)], cwd=ROOT, stdout=subprocess.DEVNULL)
        try:
            pid = trainer_pid(bench, 600)
            subprocess.run([spy, "record", "-p", str(pid), "-r", str(args.rate), "-f", "raw", "-o", str(raw),
                            "--nonblocking", "--idle"], capture_output=True, check=True)
            if bench.wait() != 0:
                raise SystemExit("bench_async.py failed")
        finally:
            if bench.poll() is None:
                bench.kill()
        r = json.loads(result.read_text())["runs"][args.mode]
        row = {k: r[k] for k in ("spool_admission_share", "spool_share", "spool_tail_share", "stale_set_asides",
                                 "read_ahead_hit_rate", "trainer_loop_s", "samples_per_s")}
        text = report(categorize(raw.read_text().splitlines()), {"mode": args.mode, "steps": args.steps, **row})
        if args.raw:
            shutil.copyfile(raw, args.raw)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
