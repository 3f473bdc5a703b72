"""Chaos run: kill -9 components of a real run at random moments, feed it bad files, and check that nothing is lost.

    python scripts/chaos.py --kills 20 --steps 40 --out bench/chaos.json
    python scripts/chaos.py --kills 30 --steps 400 --supervisor-kills 3 --paired-kills 5 --injections 4

Starts ``python -m hpcrl.submit`` (local scheduler by default, or
``launch.scheduler=slurm``; tiny model, no SFT) and plays a schedule of
events drawn from ``--seed`` (the same seed gives the same schedule, so two
versions of the code can be compared side by side):

* a kill of a randomly chosen component (trainer or a rollout replica: its
  whole process group, or, for a Slurm job, SIGKILL of the component's own
  processes: by pid on this host, else through ``srun --jobid --overlap
  pkill -KILL``; ``scancel --signal=KILL`` would let Slurm send SIGTERM
  first, and the trainer would checkpoint);
* an aimed kill: the loop watches for a checkpoint being written
  (``ckpt/step_*.tmp``), a weight version being published
  (``weights/v*.tmp.*``) or a spool file being written (``spool/tmp/*``) and
  kills the writer right then;
* a paired kill (``--paired-kills``): the trainer and a rollout within 0.5 s;
* a supervisor kill (``--supervisor-kills``): kill -9 of ``hpcrl.submit``
  alone (its components run on, orphaned), then ``--resume`` as the README
  says; a monitor samples /proc every 20 ms for the peak number of live
  trainer and per-replica rollout instances (a process and its own children
  are one; one owner: never more than 1);
* an injection round (``--injections``): four bad files dropped into
  ``spool/ready/`` from outside: a valid group at the current version under a
  ticket that was never admitted, garbage bytes named at a stale version (once under a made-up
  ticket, once under a real trained one), and a truncated copy of a trained
  group under another writer's name.

The watchdog must resubmit each victim and the run must complete. Then the
run is checked twice: by ``hpcrl.audit`` and by this script's own reading of
the run directory (ledger files and spool names): no ticket trained twice,
trained and dropped, or trained without admission; no injected file trained;
no made-up ticket reissued. It prints and writes a JSON report with the
counts, including ``regenerated_per_trained`` (reissued tickets taken by a
rollout over groups trained). ``--root`` runs another checkout of the code
(e.g. ``git worktree add /tmp/before <rev>``) under the same schedule.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpcrl.audit import audit  # noqa: E402
from hpcrl.spool.format import encode_group, file_name, parse_name, read_group  # noqa: E402

FAST = ["model.tiny_hidden_size=32", "model.tiny_layers=2", "data.n_train=2000", "data.n_eval=40",
        "sft.enabled=false", "admission.batch_size=4", "rollout.group_size=4", "rollout.max_batch_size=8",
        "rollout.max_new_tokens=4", "eval.every_steps=0", "eval.size=20", "launch.progress_interval_s=2",
        "ckpt.every_steps=2", "watchdog.max_restarts=1000", "watchdog.backoff_s=0.2", "watchdog.backoff_max_s=1",
        "admission.max_staleness=2", "trainer.batch_timeout_s=300"]
TARGETS = {"checkpoint": ("trainer", "ckpt", "step_*.tmp"), "weights": ("trainer", "weights", "v*.tmp.*"),
           "spool": ("rollout", "spool/tmp", "*")}
MADE_UP = 900_000_000  # injected made-up tickets start here: far beyond anything a run admits


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
    if entry.get("scheduler", "local") != "local":  # a Slurm job: SIGKILL the component's processes themselves
        return name if kill_in_job(run_dir, name, str(entry["job_id"])) else None
    try:
        os.killpg(int(entry["job_id"]), signal.SIGKILL)
    except (ProcessLookupError, PermissionError, ValueError):
        return None
    return name


def kill_in_job(run_dir: Path, name: str, job_id: str) -> bool:
    """SIGKILL the component processes of a Slurm job, so nothing of them can react (``scancel --signal=KILL``
    does not do that: Slurm sends the steps SIGTERM first, and the trainer checkpoints). On this host (the
    local cluster) by pid; elsewhere through a step that overlaps the job on each of its nodes."""
    role = "trainer" if name.startswith("trainer") else name
    pids = run_processes(run_dir).get(role, [])
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if pids:
        return True
    nodes = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%D"], capture_output=True, text=True).stdout.strip()
    if not nodes.isdigit():
        return False  # the job is not running
    module = "hpcrl.trainer" if role == "trainer" else "hpcrl.rollout"
    pattern = f"-m {module} --run-dir {run_dir}" + ("" if role == "trainer" else f" --replica {role.split('-')[1]}")
    done = subprocess.run(["srun", f"--jobid={job_id}", "--overlap", f"--nodes={nodes}", "--ntasks-per-node=1",
                           "pkill", "-KILL", "-f", "--", pattern], capture_output=True, timeout=60)
    return done.returncode == 0


def aimed_kill(run_dir: Path, what: str, window_s: float) -> str | None:
    """Wait up to ``window_s`` for the artifact of ``what`` to appear, then kill its writer."""
    prefix, sub, pattern = TARGETS[what]
    deadline = time.time() + window_s
    while time.time() < deadline:
        if list((run_dir / sub).glob(pattern)):
            return kill(run_dir, prefix)
        time.sleep(0.002)
    return None


def run_processes(run_dir: Path) -> dict[str, list[int]]:
    """Live component processes of ``run_dir`` by role (``trainer``, ``rollout-<replica>``); zombies do not count."""
    out: dict[str, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state == "Z" or str(run_dir) not in args:
            continue
        if "hpcrl.trainer" in args:
            out.setdefault("trainer", []).append(int(pid))
        elif "hpcrl.rollout" in args and "--replica" in args:
            out.setdefault(f"rollout-{args[args.index('--replica') + 1]}", []).append(int(pid))
    return out


class Monitor(threading.Thread):
    """Samples :func:`run_processes` every 20 ms; ``peak`` is the most live instances of a role seen at once (a
    process and its own children are one instance)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.peak, self.stopped = run_dir, Counter(), threading.Event()
        self.crowded: list[dict] = []  # the samples that saw two processes of one role: time, role, pids

    def run(self) -> None:
        while not self.stopped.wait(0.02):
            for role, pids in run_processes(self.run_dir).items():
                live = len(pids)
                if live > 1:
                    # a sweep of /proc takes time: a process read early may have exited before one read
                    # later was started. Those still running now were all running at once.
                    states = {p: _state(p) for p in pids}
                    who = {p: w for p in pids if states[p] not in ("Z", "gone") and (w := _who(p, states[p]))}
                    # a component's own child is part of it: a subprocess it starts shows its command line and
                    # environment until exec (its parent waits in state D meanwhile); one component = one instance
                    live = len({w.get("hpcrl_instance", p) for p, w in who.items() if w.get("ppid") not in who})
                    if live > 1 and len(self.crowded) < 20:
                        self.crowded.append({"time": round(time.time(), 3), "role": role, "processes": who})
                self.peak[role] = max(self.peak[role], live)


def _who(pid: int, state: str) -> dict | None:
    """What tells two processes of one role apart: state, parent, the owner epoch and instance they were started
    with, and the Slurm job they run in. The parent comes from ``stat`` on its own: a child between ``vfork`` and
    ``exec`` (its parent in state D) may refuse its ``environ`` and must still be seen as its parent's child.
    None when the process is gone by now (its ``stat`` can no longer be read: a short-lived child that exited
    since the sweep saw it was not running at the same time as the others)."""
    out: dict = {"state": state}
    try:
        out["ppid"] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    except (OSError, IndexError, ValueError):
        return out
    try:
        env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
    except OSError:
        return out
    return {**out, **{k.lower(): env[k.encode()].decode() for k in ("HPCRL_EPOCH", "HPCRL_INSTANCE", "SLURM_JOB_ID")
                      if k.encode() in env}}


def _state(pid: int) -> str:
    """The process state letter of ``pid`` ("gone" when it no longer exists)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _drop_in(run_dir: Path, name: str, data: bytes) -> str:
    """Place ``data`` in ``spool/ready/<name>`` the way a writer would (complete file, one rename)."""
    tmp = run_dir / "chaos-tmp"
    tmp.mkdir(exist_ok=True)
    with open(tmp / name, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp / name, run_dir / "spool" / "ready" / name)
    return name


def inject(run_dir: Path, k: int, rng: random.Random) -> list[str]:
    """One round of bad files (see the module docstring), copied from a trained group; their names."""
    steps = sorted((run_dir / "spool" / "trained").glob("step_*"))
    files = [p for d in reversed(steps[-3:]) for p in sorted(d.glob("g*.h5"))]
    if not files:
        return []
    src = rng.choice(files)
    group, info = read_group(src), parse_name(src.name)
    fresh = int(steps[-1].name.split("_")[1]) + 1  # the version being trained next: the file is not stale
    foreign = dataclasses.replace(group, ticket=MADE_UP + 2 * k, writer=f"intruder-{k}", samples=[
        dataclasses.replace(s, versions=np.full_like(s.versions, fresh)) for s in group.samples])
    junk = os.urandom(4096)
    data = src.read_bytes()
    return [_drop_in(run_dir, file_name(foreign), encode_group(foreign)),
            _drop_in(run_dir, f"g{MADE_UP + 2 * k + 1:09d}_v000000-000000_junk-{k}.h5", junk),
            _drop_in(run_dir, f"g{info.ticket:09d}_v000000-000000_junk-{k}.h5", junk),
            _drop_in(run_dir, f"g{info.ticket:09d}_v{info.min_version:06d}-{info.max_version:06d}_copycat-{k}.h5",
                     data[: len(data) // 2])]


def kill_kinds(only: str | None) -> list[str]:
    kinds = ["random", "random", "checkpoint", "weights", "spool"]
    return [k for k in kinds if only is None or k == "random" or TARGETS[k][0] == only]


def plan(kills: int, supervisor: int, paired: int, injections: int, only: str | None,
         rng: random.Random) -> list[str]:
    """The event schedule: ``kills`` kill events (of which ``supervisor`` and ``paired``) plus injections."""
    rest = [rng.choice(kill_kinds(only)) for _ in range(max(0, kills - supervisor - paired))]
    events = rest + ["paired"] * paired + ["inject"] * injections
    rng.shuffle(events)
    for i in range(supervisor):  # spread evenly, never first: the run must have started
        events.insert((i + 1) * len(events) // (supervisor + 1) + i, "supervisor")
    return events


def chaos(run_dir: Path, start, events: list[str], kills: int, rng: random.Random, only: str | None = None) -> dict:
    """Play ``events``; an aimed kill that found nothing to aim at lands no kill, so more kill events are drawn
    after the schedule until ``kills`` have landed (or the run ended). An injection before anything was trained
    (nothing to copy from yet) goes back to the end of the queue."""
    counts, victims, injected, queue = Counter(), Counter(), [], list(events)
    proc = start([])
    time.sleep(8)  # let the components start once
    while proc.poll() is None:
        if not queue:
            if sum(n for kind, n in counts.items() if kind != "inject") >= kills:
                break
            queue.append(rng.choice(kill_kinds(only)))
        event = queue.pop(0)
        time.sleep(rng.uniform(0.5, 2.5))
        if event == "inject":
            names = inject(run_dir, len(injected) // 4, rng)
            if not names:  # nothing trained yet to copy from (a slow start): try again later
                queue.append("inject")
                continue
            injected += names
            counts["inject"] += 1
            continue
        if event == "supervisor":
            proc.kill()
            proc.wait()
            time.sleep(rng.uniform(0.0, 3.0))  # its components run on, orphaned
            proc = start(["--resume", str(run_dir)])
            counts["supervisor"] += 1
            continue
        if event == "paired":
            first = kill(run_dir, "trainer")
            time.sleep(rng.uniform(0.0, 0.5))
            hit = [first, kill(run_dir, "rollout")]
        elif event == "random":
            hit = [kill(run_dir, only or rng.choice(["trainer", "rollout"]))]
        else:
            hit = [aimed_kill(run_dir, event, window_s=5)]
        hit = [v for v in hit if v]
        counts[event] += bool(hit)
        victims.update(hit)
    return {"proc": proc, "kills": dict(counts), "victims": dict(victims), "injected": injected}


def _tickets(paths) -> set[int]:
    return {int(p.name[1:10]) for p in paths if p.name[1:10].isdigit()}


def check(run_dir: Path, injected: list[str]) -> dict:
    """This script's own reading of the run directory (not ``hpcrl.audit``): counts and violations."""
    admission, spool = run_dir / "admission", run_dir / "spool"
    admitted = _tickets((admission / "tickets").iterdir())
    dropped = _tickets((admission / "dropped").iterdir())
    trained_files = [p for d in spool.glob("trained/step_*") for p in d.glob("g*.h5")]
    trained = Counter(int(p.name[1:10]) for p in trained_files)
    log = admission / "reissue.jsonl"  # reissues folded in by compaction; older runs have none
    folded = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    files = [p.name for p in (admission / "reissue").glob("t*")]
    reissued = [r.get("ticket", -1) for r in folded] + [int(n[1:10]) for n in files]
    where = {}
    for name in injected:
        hits = [p for p in spool.rglob(name)]
        where[name] = sorted({p.parent.relative_to(spool).parts[0] for p in hits}) or ["gone"]
    out = {"trained_twice": sum(1 for n in trained.values() if n > 1),
           "trained_and_dropped": len(set(trained) & dropped),
           "trained_never_admitted": len(set(trained) - admitted),
           "dropped_never_admitted": len(dropped - admitted),
           "injected_trained": sum("trained" in w for w in where.values()),
           "injected_placed": dict(Counter(",".join(w) for w in where.values())),
           "made_up_reissued": sum(t >= MADE_UP for t in reissued),
           "regenerated": len(folded) + sum(".taken-" in n for n in files)}
    out["regenerated_per_trained"] = round(out["regenerated"] / max(1, sum(trained.values())), 4)
    out["violations"] = [f"{k}={out[k]}" for k in ("trained_twice", "trained_and_dropped", "trained_never_admitted",
                                                   "dropped_never_admitted", "injected_trained", "made_up_reissued")
                         if out[k]]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="kill events in all (supervisor and paired included)")
    parser.add_argument("--supervisor-kills", type=int, default=0, help="kill -9 the supervisor, then --resume")
    parser.add_argument("--paired-kills", type=int, default=0, help="kill the trainer and a rollout within 0.5 s")
    parser.add_argument("--injections", type=int, default=0, help="rounds of bad files dropped into spool/ready")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/hpcrl").expanduser())
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout whose code runs (default: this one)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", choices=["trainer", "rollout"], default=None, help="kill only this kind")
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    run_dir = (args.run_dir or Path(f"runs/chaos-{int(time.time())}")).resolve()
    first = ["--config", str(root / "configs/quickstart.yaml"), f"run_dir={run_dir}",
             f"trainer.total_steps={args.steps}", f"rollout.replicas={args.replicas}",
             f"model.cache_dir={args.cache}/models", f"data.synthetic_dir={args.cache}/data", *FAST, *args.overrides]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.submit.log", "a")

    def start(resume: list[str]) -> subprocess.Popen:
        print(f"chaos: {'resuming' if resume else 'starting'} {run_dir}", file=sys.stderr, flush=True)
        return subprocess.Popen([sys.executable, "-m", "hpcrl.submit", *(resume or first)], cwd=root, stdout=log,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"})

    rng = random.Random(args.seed)
    random.seed(args.seed)
    events = plan(args.kills, args.supervisor_kills, args.paired_kills, args.injections, args.only, rng)
    t0, monitor = time.time(), Monitor(run_dir)
    monitor.start()
    report = chaos(run_dir, start, events, args.kills, rng, args.only)
    proc = report.pop("proc")
    code = proc.wait(timeout=1800)
    monitor.stopped.set()
    monitor.join()
    rep = audit(run_dir)
    events_log = [json.loads(x) for x in (run_dir / "jobs" / "events.jsonl").read_text().splitlines()] \
        if (run_dir / "jobs" / "events.jsonl").exists() else []
    own = check(run_dir, report["injected"])
    report.update({"exit_code": code, "wall_s": round(time.time() - t0, 1), "steps": rep.steps,
                   "admitted": rep.admitted, "trained_groups": rep.trained_groups, "dropped": rep.dropped,
                   "unfinished": rep.unfinished, "max_token_staleness": rep.max_token_staleness,
                   "quarantined": len(list((run_dir / "spool" / "quarantine").rglob("*.h5"))),
                   "restarts": sum(1 for e in events_log if e.get("action") == "restart"),
                   "peak_live": dict(monitor.peak), "crowded": monitor.crowded, **{k: v for k, v in own.items() if k != "violations"},
                   "violations": (rep.violations + own["violations"])[:20], "run_dir": str(run_dir)})
    report["injected"] = len(report["injected"])
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    r = main()
    one_owner = all(n <= 1 for n in r["peak_live"].values())
    sys.exit(0 if r["exit_code"] == 0 and not r["violations"] and one_owner else 1)
