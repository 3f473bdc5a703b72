"""A run on a size-capped filesystem that is filled at random moments: does hpcrl live through a full disk?

What it does: in a private mount namespace (``unshare``: no root needed where user namespaces are allowed) it
mounts a tmpfs of ``--size-mb``, starts ``python -m hpcrl.submit`` with its run directory there, and ``--faults``
times, at random steps of the run, fills the filesystem to the last byte (a filler file written until ENOSPC),
holds it full for ``--hold-s`` seconds and frees it. Whatever was writing then (a spool file, a weight
publication, a checkpoint, a ledger record, the supervisor's own records) meets ENOSPC for real.

It reports (stdout and ``--out`` JSON; the submit's output beside it as ``.log``, the components' logs as
``.logs/``): the submit's exit code, each fault (when, the step before and after, the
free bytes it left), the supervisor's storage lines, the restarts for storage and the other restarts from
``jobs/events.jsonl``, the audit (violations, admitted / trained / dropped tickets, duplicates) and the
temporaries left. Exit 0 when the run finished with exit 0, a clean audit and no temporary left.

    python scripts/faults/storage_faults.py --faults 10 --hold-s 40 --steps 2000 --out bench/faults/storage_full.json
    python scripts/faults/storage_faults.py --steps 60 --faults 3 --hold-s 8 -- model.tiny_layers=2 ...

Trailing ``key=value`` arguments are passed to the submit (after the script's own overrides).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSIDE = "HPCRL_STORAGE_FAULTS_INSIDE"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    p.add_argument("--size-mb", type=int, default=1000, help="the filesystem's size")
    p.add_argument("--steps", type=int, default=400, help="trainer.total_steps")
    p.add_argument("--faults", type=int, default=10, help="how many times the filesystem is filled")
    p.add_argument("--hold-s", type=float, default=40.0, help="how long it stays full each time")
    p.add_argument("--seed", type=int, default=0, help="chooses the steps at which it is filled")
    p.add_argument("--min-free-mb", type=float, default=20.0, help="launch.min_free_gb, in MB")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--out", type=Path, help="write the report here (JSON)")
    p.add_argument("overrides", nargs="*")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if os.environ.get(INSIDE) != "1":
        return reexec_in_namespace(argv if argv is not None else sys.argv[1:])
    return run_inside(args)


def reexec_in_namespace(argv: list[str]) -> int:
    """Run this script again in a new user and mount namespace, where it may mount a tmpfs."""
    cmd = ["unshare", "--user", "--map-root-user", "--mount", sys.executable, __file__, *argv]
    if os.geteuid() == 0:  # root: a mount namespace alone (a user namespace would hide the real uid's files)
        cmd = ["unshare", "--mount", sys.executable, __file__, *argv]
    return subprocess.call(cmd, env={**os.environ, INSIDE: "1"})


def run_inside(args: argparse.Namespace) -> int:
    mnt = Path(tempfile.mkdtemp(prefix="hpcrl-fullfs-"))
    subprocess.run(["mount", "--make-rprivate", "/"], check=False)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.size_mb}m", "tmpfs", str(mnt)], check=True)
    run_dir = mnt / "run"
    overrides = [f"run_dir={run_dir}", f"trainer.total_steps={args.steps}", f"launch.min_free_gb={args.min_free_mb / 1000}",
                 "launch.progress_interval_s=5", *args.overrides]
    log_path = (args.out.with_suffix(".log") if args.out else mnt.parent / f"{mnt.name}.log")
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hpcrl.submit", "--config", str(args.config), *overrides],
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
        filler = Filler(mnt, run_dir, args, proc)
        thread = threading.Thread(target=filler.run, daemon=True)
        thread.start()
        try:
            code = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        filler.stop = True
        thread.join(timeout=args.hold_s + 10)
    report = summarize(run_dir, code, time.time() - started, filler.faults, log_path.read_text())
    if args.out and (run_dir / "logs").is_dir():  # the tmpfs goes with this namespace: keep the components' logs
        shutil.copytree(run_dir / "logs", args.out.with_suffix(".logs"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("tensorboard"))
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    ok = code == 0 and report["audit"]["ok"] and not report["temporaries_left"]
    return 0 if ok else 1


def trainer_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue  # a line cut short by the full filesystem
    return -1


class Filler:
    """Fills the filesystem at the chosen steps, holds it full, frees it."""

    def __init__(self, mnt: Path, run_dir: Path, args: argparse.Namespace, proc: subprocess.Popen) -> None:
        self.mnt, self.run_dir, self.args, self.proc = mnt, run_dir, args, proc
        rng = random.Random(args.seed)
        lo, hi = 2, max(3, args.steps - 3)
        self.at = sorted(rng.sample(range(lo, hi), min(args.faults, hi - lo)))
        self.faults: list[dict] = []
        self.stop = False

    def run(self) -> None:
        for k, step in enumerate(self.at):
            while trainer_step(self.run_dir) < step:
                if self.stop or self.proc.poll() is not None:
                    return
                time.sleep(0.05 + random.random() * 0.2)  # not always right at a step's boundary
            self.faults.append(self.fill_and_free(k, step))

    def fill_and_free(self, k: int, step: int) -> dict:
        path = self.mnt / f"filler-{k}"
        t0, written = time.time(), 0
        try:
            f = open(path, "wb", buffering=0)
        except OSError:  # not even an inode left
            return {"fault": k, "at_step": step, "error": "could not create the filler"}
        try:
            for size in (1 << 20, 4096):  # megabytes, then the last partial blocks
                try:
                    while True:
                        written += f.write(b"\0" * size)
                except OSError:
                    pass
        finally:
            f.close()
        st = os.statvfs(self.mnt)
        free_at_full = st.f_bavail * st.f_frsize
        held = time.time()
        while time.time() - held < self.args.hold_s and not self.stop and self.proc.poll() is None:
            time.sleep(0.2)
        step_before_free = trainer_step(self.run_dir)
        path.unlink()
        return {"fault": k, "at_step": step, "step_when_freed": step_before_free, "filled_mb": written / 1e6,
                "free_bytes_while_full": free_at_full, "full_for_s": round(time.time() - t0, 1)}


def summarize(run_dir: Path, code: int, wall_s: float, faults: list[dict], log: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from hpcrl.audit import audit
    from hpcrl.launch.footprint import footprint
    from hpcrl.launch.leftovers import temporaries

    events = []
    try:
        lines = (run_dir / "jobs" / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:  # a line the full filesystem cut
            continue
    restarts = [e for e in events if e.get("action") == "restart"]
    rep = audit(run_dir) if (run_dir / "config.yaml").exists() else None
    return {
        "exit_code": code, "wall_s": round(wall_s, 1), "faults": faults,
        "storage_lines": [line for line in log.splitlines() if "storage" in line.lower()][:60],
        "tracebacks_in_submit_log": log.count("Traceback"),
        "restarts_for_storage": sum("storage fault" in e.get("reason", "") for e in restarts),
        "other_restarts": [e["reason"] for e in restarts if "storage fault" not in e.get("reason", "")],
        "audit": {"ok": rep.ok, "violations": rep.violations[:20], "admitted": rep.admitted,
                  "trained_groups": rep.trained_groups, "dropped": rep.dropped, "unfinished": rep.unfinished,
                  "steps": rep.steps} if rep else {"ok": False, "violations": ["no run directory"]},
        "temporaries_left": [str(p.relative_to(run_dir)) for p in temporaries(run_dir)] if run_dir.exists() else [],
        "footprint_mb": {k: round(v / 1e6, 1) for k, v in footprint(run_dir).items()} if run_dir.exists() else {},
    }


if __name__ == "__main__":
    sys.exit(main())
