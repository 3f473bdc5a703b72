"""Chaos run: kill -9 components of a real run at random moments and check that nothing is lost.

    python scripts/chaos.py --kills 20 --steps 40 --out bench/chaos.json

Starts ``python -m hpcrl.submit`` (local scheduler by default, or
``launch.scheduler=slurm``; tiny model, no SFT), then kills a randomly chosen
component (trainer or a rollout replica: its whole process group, or
``scancel --signal=KILL --full`` of its Slurm job) at random moments. Some kills are aimed: the chaos
loop watches for a checkpoint being written (``ckpt/step_*.tmp``), a weight
version being published (``weights/v*.tmp.*``) or a spool file being written
(``spool/tmp/*``) and kills the writer right then. The watchdog must
resubmit each victim; the run must complete; then the audit (staleness bound,
every admitted group trained exactly once or dropped with a reason) must
pass. Prints and writes a JSON report with the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpcrl.audit import audit  # noqa: E402

FAST = ["model.tiny_hidden_size=32", "model.tiny_layers=2", "data.n_train=2000", "data.n_eval=40",
        "sft.enabled=false", "admission.batch_size=4", "rollout.group_size=4", "rollout.max_batch_size=8",
        "rollout.max_new_tokens=4", "eval.every_steps=0", "eval.size=20", "launch.progress_interval_s=2",
        "ckpt.every_steps=2", "watchdog.max_restarts=1000", "watchdog.backoff_s=0.2", "watchdog.backoff_max_s=1",
        "admission.max_staleness=2", "trainer.batch_timeout_s=300"]
TARGETS = {"checkpoint": ("trainer", "ckpt", "step_*.tmp"), "weights": ("trainer", "weights", "v*.tmp.*"),
           "spool": ("rollout", "spool/tmp", "*")}


def registry(run_dir: Path) -> dict[str, dict]:
    try:
        return json.loads((run_dir / "jobs" / "registry.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def kill(run_dir: Path, prefix: str) -> str | None:
    names = [n for n in registry(run_dir) if n.startswith(prefix)]
    if not names:
        return None
    name = random.choice(names)
    entry = registry(run_dir)[name]
    if entry.get("scheduler", "local") != "local":  # a Slurm job: SIGKILL to every process of it
        done = subprocess.run(["scancel", "--signal=KILL", "--full", str(entry["job_id"])], capture_output=True)
        return name if done.returncode == 0 else None
    try:
        os.killpg(int(entry["job_id"]), signal.SIGKILL)
    except (ProcessLookupError, PermissionError, ValueError):
        return None
    return name


def aimed_kill(run_dir: Path, what: str, window_s: float) -> str | None:
    """Wait up to ``window_s`` for the artifact of ``what`` to appear, then kill its writer."""
    prefix, sub, pattern = TARGETS[what]
    deadline = time.time() + window_s
    while time.time() < deadline:
        if list((run_dir / sub).glob(pattern)):
            return kill(run_dir, prefix)
        time.sleep(0.002)
    return None


def chaos(run_dir: Path, proc: subprocess.Popen, kills: int, seed: int, only: str | None = None) -> dict:
    rng = random.Random(seed)
    random.seed(seed)
    counts = {"random": 0, "checkpoint": 0, "weights": 0, "spool": 0}
    victims: dict[str, int] = {}
    time.sleep(8)  # let the components start once
    while sum(counts.values()) < kills and proc.poll() is None:
        time.sleep(rng.uniform(0.5, 2.5))
        kinds = ["random", "random", "checkpoint", "weights", "spool"]
        kind = rng.choice([k for k in kinds if only is None or k == "random" or TARGETS[k][0] == only])
        if kind == "random":
            victim = kill(run_dir, only or rng.choice(["trainer", "rollout"]))
        else:
            victim = aimed_kill(run_dir, kind, window_s=5)
        if victim:
            counts[kind] += 1
            victims[victim] = victims.get(victim, 0) + 1
    return {"kills": counts, "victims": victims}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/hpcrl").expanduser())
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", choices=["trainer", "rollout"], default=None, help="kill only this kind")
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = parser.parse_args(argv)
    run_dir = (args.run_dir or Path(f"runs/chaos-{int(time.time())}")).resolve()
    cmd = [sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
           f"run_dir={run_dir}", f"trainer.total_steps={args.steps}", f"rollout.replicas={args.replicas}",
           f"model.cache_dir={args.cache}/models", f"data.synthetic_dir={args.cache}/data", *FAST, *args.overrides]
    t0 = time.time()
    log = open(run_dir.parent / f"{run_dir.name}.submit.log", "w") if run_dir.parent.exists() else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    report = chaos(run_dir, proc, args.kills, args.seed, args.only)
    code = proc.wait(timeout=1800)
    rep = audit(run_dir)
    events = [json.loads(x) for x in (run_dir / "jobs" / "events.jsonl").read_text().splitlines()] \
        if (run_dir / "jobs" / "events.jsonl").exists() else []
    report.update({"exit_code": code, "wall_s": round(time.time() - t0, 1), "steps": rep.steps,
                   "admitted": rep.admitted, "trained_groups": rep.trained_groups, "dropped": rep.dropped,
                   "unfinished": rep.unfinished, "max_token_staleness": rep.max_token_staleness,
                   "quarantined": len(list((run_dir / "spool" / "quarantine").glob("*.h5"))),
                   "regenerated": len(list((run_dir / "admission" / "reissue").glob("*.taken-*"))),
                   "restarts": sum(1 for e in events if e.get("action") == "restart"),
                   "violations": rep.violations[:20], "run_dir": str(run_dir)})
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    r = main()
    sys.exit(0 if r["exit_code"] == 0 and not r["violations"] else 1)
