"""The rollout fleet: fixed sizes against autoscaling, and rollouts preempted by Slurm.

    python scripts/bench_fleet.py compare --steps 600 --out bench/fleet_compare.json
    python scripts/bench_fleet.py preempt --preemptions 10 --out bench/fleet_preempt.json

``compare`` runs the quickstart three times, one after the other on the same
machine: a fixed 1 rollout replica, a fixed 3, and autoscaling between 1 and 3
(``launch.autoscale``, with a 20 s window and cooldown so a short run sees it
act). Reported for each: the trainer's wait share (``time/wait_s`` over
``time/step_s`` of every step), trained samples/s, wall time, the held-out
accuracy at the end, and for the autoscaled run every decision with its
reason (``logs/fleet.jsonl``). ``--scheduler slurm`` runs them on the local
Slurm cluster (each component its own job) instead of local processes.

``preempt`` runs the quickstart on the local Slurm cluster
(scripts/slurm_cluster.sh) with the rollouts on the preemptible ``scavenger``
partition of node1 (``PreemptMode=REQUEUE``) and the trainer on node2, the
autoscaler moving the fleet between 1 and 3 replicas, while a preemptor
submits jobs to the ``high`` partition on node1 (2 to 4 of its 4 CPUs, held
15-30 s, one every ``--period`` seconds) until Slurm has preempted a rollout
``--preemptions`` times. Reported: the preemptions (each rollout stop on
SIGTERM), the autoscaler's decisions, the restarts
the watchdog charged (none expected), the audit (nothing lost or trained
twice) and the held-out accuracy before and after RL, to set beside the
undisturbed quickstart's seeds (bench/quickstart_seeds.json).

Extra ``key=value`` arguments go to every run.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _bench import ROOT

sys.path.insert(0, str(ROOT))
from hpcrl.audit import audit  # noqa: E402
from hpcrl.metrics.writer import read_evals, read_metrics  # noqa: E402

FLEETS = {
    "fixed_1": ["rollout.replicas=1"],
    "fixed_3": ["rollout.replicas=3"],
    "autoscale_1_3": ["rollout.replicas=1", "launch.autoscale.enabled=true", "launch.autoscale.min_replicas=1",
                      "launch.autoscale.max_replicas=3", "launch.autoscale.window_s=20",
                      "launch.autoscale.cooldown_s=20"],
}
ON_SLURM = ["launch.scheduler=slurm", "launch.slurm_state_interval_s=1"]


def run(run_dir: Path, overrides: list[str], name: str) -> float:
    """One quickstart run; its wall seconds (exits on failure with the supervisor's last lines)."""
    cmd = [sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
           f"run_dir={run_dir}", *overrides]
    t0 = time.time()
    print(f"[{name}] {' '.join(overrides)}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return time.time() - t0


def report(run_dir: Path, wall_s: float) -> dict:
    steps = [r for r in read_metrics(run_dir / "logs" / "metrics.jsonl") if "time/wait_s" in r]
    evals = [(int(r["step"]), float(r["eval/accuracy"])) for r in read_evals(run_dir / "logs")]
    fleet = [json.loads(x) for x in _lines(run_dir / "logs" / "fleet.jsonl")]
    events = [json.loads(x) for x in _lines(run_dir / "jobs" / "events.jsonl")]
    rep = audit(run_dir)
    return {
        "wait_share": sum(r["time/wait_s"] for r in steps) / max(1e-9, sum(r["time/step_s"] for r in steps)),
        "samples_per_s": steps[-1]["throughput/samples_per_s"], "wall_s": wall_s, "steps": len(steps),
        "eval_start": evals[0][1] if evals else None, "eval_final": evals[-1][1] if evals else None,
        "decisions": [{"t": round(r["time"] - fleet[0]["time"], 1), "from": r["wanted"], "to": r["decision"],
                       "reason": r["reason"]} for r in fleet if "decision" in r],
        "max_replicas_seen": max([r["wanted"] for r in fleet] or [None], key=lambda x: x or 0),
        "charged_restarts": [e for e in events if e["action"] == "restart" and "preemption" not in e["reason"]],
        "audit_ok": rep.ok, "audit_violations": rep.violations[:5], "unfinished": rep.unfinished,
    }


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def compare(args, tmp: Path) -> dict:
    out = {}
    for name, fleet in FLEETS.items():
        over = [f"trainer.total_steps={args.steps}", *fleet, *(ON_SLURM if args.scheduler == "slurm" else []),
                *args.overrides]
        wall = run(tmp / name, over, name)
        out[name] = report(tmp / name, wall)
        r = out[name]
        print(f"[{name}] wait share {r['wait_share']:.1%}, {r['samples_per_s']:.1f} samples/s, {wall:.0f}s, "
              f"held-out {r['eval_final']}, decisions {[(d['from'], d['to']) for d in r['decisions']]}", flush=True)
    return out


class Preemptor(threading.Thread):
    """Submits high-priority jobs on node1 until Slurm has preempted a rollout ``target`` times."""

    def __init__(self, run_dir: Path, target: int, period_s: float, log_dir: Path, seed: int = 0) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.target, self.period, self.log_dir = run_dir, target, period_s, log_dir
        self.rng, self.jobs, self.stop = random.Random(seed), [], threading.Event()

    def preemptions(self) -> int:
        return sum(p.read_text(errors="replace").count("received SIGTERM")
                   for p in (self.run_dir / "logs").glob("rollout-*.log"))

    def run(self) -> None:
        while not self.stop.wait(self.period) and self.preemptions() < self.target:
            if not any(self.run_dir.glob("logs/rollout-*.log")):
                continue
            cpus, hold = self.rng.randint(2, 4), self.rng.randint(15, 30)
            proc = subprocess.run(["sbatch", "--parsable", "-p", "high", "-w", "node1", "-c", str(cpus), "-J",
                                   "bench-high", "-o", str(self.log_dir / "high-%j.out"), "--wrap", f"sleep {hold}"],
                                  capture_output=True, text=True, timeout=60)
            if proc.returncode == 0:
                self.jobs.append(proc.stdout.strip())
                print(f"[preemptor] high job {self.jobs[-1]}: {cpus} CPUs of node1 for {hold}s "
                      f"({self.preemptions()} preemptions so far)", flush=True)


def preempt(args, tmp: Path) -> dict:
    run_dir = tmp / "preempt"
    over = [*ON_SLURM, *FLEETS["autoscale_1_3"], "launch.rollout.partition=scavenger",
            "launch.rollout.extra_sbatch=[--nodelist=node1]", "launch.trainer.extra_sbatch=[--nodelist=node2]",
            "watchdog.max_restarts=3", f"trainer.total_steps={args.steps}", *args.overrides]
    preemptor = Preemptor(run_dir, args.preemptions, args.period, tmp)
    preemptor.start()
    try:
        wall = run(run_dir, over, "preempt")
    finally:
        preemptor.stop.set()
        subprocess.run(["scancel", *preemptor.jobs], capture_output=True)
    out = report(run_dir, wall)
    out["preemptions"] = preemptor.preemptions()
    out["high_jobs"] = len(preemptor.jobs)
    # (Slurm's log does not count them: a rollout that stops within the grace time ends its job before Slurm
    # requeues it; the first runs wrote a field slurm_preempt_records, always 0 for that reason)
    print(f"[preempt] {out['preemptions']} preemptions by {out['high_jobs']} high jobs, wait share "
          f"{out['wait_share']:.1%}, held-out {out['eval_start']} -> {out['eval_final']}, audit ok {out['audit_ok']}, "
          f"charged restarts {len(out['charged_restarts'])}, decisions "
          f"{[(d['from'], d['to']) for d in out['decisions']]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["compare", "preempt"])
    parser.add_argument("--steps", type=int, default=None, help="trainer steps (compare: 600; preempt: 2000)")
    parser.add_argument("--scheduler", choices=["local", "slurm"], default="local", help="compare only")
    parser.add_argument("--preemptions", type=int, default=10, help="preempt: rollout preemptions to cause")
    parser.add_argument("--period", type=float, default=25.0, help="preempt: seconds between high-priority jobs")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    args.steps = args.steps or (600 if args.mode == "compare" else 2000)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="hpcrl-fleet-") as tmp:
        result = (compare if args.mode == "compare" else preempt)(args, Path(tmp))
    meta = {"command": " ".join(["bench_fleet.py", *sys.argv[1:]]), "steps": args.steps,
            "total_wall_s": time.time() - t0, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = args.out or ROOT / "bench" / f"fleet_{args.mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs" if args.mode == "compare" else "run": result, "meta": meta}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
