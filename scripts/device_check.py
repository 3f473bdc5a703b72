"""The device check: the GPU path end to end in one command, inside a short lease of one accelerator.

Run by ``scripts/device_check.sh`` (which installs the wheels that travel
with the tree first); each step is a child process with its own time limit,
and the whole check keeps to ``--budget-s``: a step that would start with
too little time left is skipped and says so. What it writes under ``--out``
(at most four files, as a lease's output folder allows):

- ``summary.json``: the device, the versions, and each step's result
  (return code, seconds, what it measured, or its error's last lines);
- ``report.txt``: the same as a short text report;
- ``check.log``: every step's output;
- ``pytest.xml``: the ``gpu`` tests' JUnit report.

Steps (``--cpu``: the same on the CPU with the tiny model and few steps, the
rehearsal that CI runs so that this script never rots):

1. ``pytest -m gpu`` (tests/test_gpu.py; on the CPU every test skips);
2. the quickstart for a fixed number of trainer steps with the trainer and the
   rollout on the accelerator (``rollout.device`` and ``trainer.backend`` on
   auto), then the same on the CPU (``rollout.device=cpu``, gloo, no visible
   GPU): trained samples/s of each and their ratio;
3. the throughput table of ``scripts/device_bench.py`` on a randomly initialised
   Qwen3-0.6B-shaped model: the FSDP2 trainer with and without activation
   checkpointing, the megatron engine at TP=1, the embedded engine's decoding at
   batch 1, 64 and 256, a weight publication over disk and the collective
   transport's packing.

    bash scripts/device_check.sh --out /tmp/check          # on a GPU machine
    bash scripts/device_check.sh --cpu --out /tmp/check    # the rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


class Check:
    """Runs the steps in order against one deadline; keeps each one's result and appends its output to the log."""

    def __init__(self, out: Path, work: Path, budget_s: float, only: set[str] = frozenset()) -> None:
        self.out, self.work, self.only = out, work, only
        self.deadline = time.monotonic() + budget_s
        self.log = (out / "check.log").open("a")
        self.steps: dict[str, dict] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, argv: list[str], timeout_s: float, *, min_s: float = 20.0,
            env: dict[str, str] | None = None) -> dict:
        """``argv`` in its own process group with at most ``timeout_s`` (and never past the deadline)."""
        limit = min(timeout_s, self.left() - 5)
        if self.only and name not in self.only:
            res = self.steps[name] = {"status": "not asked"}
            return res
        if limit < min_s:
            res = {"status": "skipped", "why": f"{self.left():.0f}s left of the check's budget"}
            self.steps[name] = res
            print(f"[device-check] {name}: skipped ({res['why']})", flush=True)
            return res
        print(f"[device-check] {name}: {' '.join(argv[1:])[:160]} (limit {limit:.0f}s)", flush=True)
        self.log.write(f"\n===== {name}: {' '.join(argv)}\n")
        self.log.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=limit)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            text, _ = proc.communicate()
            rc = None
        self.log.write(text)
        self.log.flush()
        res = {"status": "ok" if rc == 0 else ("timeout" if rc is None else "failed"), "rc": rc,
               "seconds": round(time.monotonic() - t0, 1)}
        if rc != 0:
            res["tail"] = text.strip().splitlines()[-15:]
        res["_text"] = text
        self.steps[name] = res
        print(f"[device-check] {name}: {res['status']} in {res['seconds']}s", flush=True)
        return res

    def last_json(self, name: str) -> dict | None:
        """The JSON object a step printed on its last line (device_bench.py's parts)."""
        res = self.steps[name]
        lines = res.get("_text", "").strip().splitlines()
        if res["status"] != "ok" or not lines:
            return None
        try:
            res["result"] = json.loads(lines[-1])
        except json.JSONDecodeError:
            res["status"], res["tail"] = "failed", lines[-15:]
            return None
        return res["result"]


def environment() -> dict:
    import torch

    env = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count()}
    for pkg in ("transformers", "megatron.core", "omegaconf", "submitit", "h5py"):
        try:
            mod = __import__(pkg, fromlist=["__version__"])
            env[pkg] = getattr(mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - a missing or broken package is a finding, not a crash
            env[pkg] = f"missing ({type(e).__name__})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0), device_memory_gib=round(props.total_memory / 2**30, 1),
                   device_count=torch.cuda.device_count())
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    else:
        env["device"] = "cpu"
    return env


def pytest_counts(xml: Path) -> dict:
    if not xml.exists():
        return {}
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    n["failed_ids"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                       if c.find("failure") is not None or c.find("error") is not None]
    return n


def quickstart(check: Check, name: str, steps: int, extra: list[str], env: dict[str, str] | None,
               timeout_s: float) -> dict | None:
    run_dir = check.work / name
    res = check.run(name, [PY, "-m", "hpcrl.submit", "--config", "configs/quickstart.yaml", f"run_dir={run_dir}",
                           f"name={name}", f"trainer.total_steps={steps}", "eval.every_steps=0", "eval.size=100",
                           *extra], timeout_s, min_s=60, env=env)
    metrics = run_dir / "logs" / "metrics.jsonl"
    if res["status"] != "ok" or not metrics.exists():
        return None
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    trained = [r for r in records if "reward/mean" in r]
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    devices = re.findall(r"engine on (\S+)", (run_dir / "logs" / "rollout-0.log").read_text()
                         if (run_dir / "logs" / "rollout-0.log").exists() else "")
    res["result"] = {"steps": len(trained), "samples_per_s": trained[-1].get("throughput/samples_per_s"),
                     "train_s": trained[-1].get("time/elapsed_s"), "reward_first": trained[0]["reward/mean"],
                     "reward_last": trained[-1]["reward/mean"], "eval_accuracy": evals,
                     "rollout_device": devices[0] if devices else None,
                     "trainer_peak_mb": max((r.get("memory/peak_mb", 0) for r in trained), default=None)}
    return res["result"]


def report(summary: dict) -> str:
    env, steps = summary["environment"], summary["steps"]
    lines = [f"hpcrl device check ({summary['mode']}), {summary['date']}",
             f"device: {env.get('device')} ({env.get('device_memory_gib', '-')} GiB, driver {env.get('driver', '-')}),"
             f" python {env['python']}, torch {env['torch']} (CUDA {env['cuda']}), transformers "
             f"{env.get('transformers')}, megatron-core {env.get('megatron.core')}", ""]
    for name, res in steps.items():
        lines.append(f"{name:16s} {res['status']:8s} {res.get('seconds', '-')}s")
        for t in res.get("tail", [])[-3:]:
            lines.append(f"    | {t[:150]}")
    t = steps.get("pytest", {}).get("result")
    if t:
        lines.append(f"\npytest -m gpu: {t['passed']} passed, {t['failures'] + t['errors']} failed, "
                     f"{t['skipped']} skipped {t['failed_ids'] or ''}")
    qa, qc = (steps.get(k, {}).get("result") for k in ("quickstart_accel", "quickstart_cpu"))
    for label, q in (("accelerator", qa), ("cpu", qc)):
        if q:
            lines.append(f"quickstart on the {label}: {q['steps']} steps, {q['samples_per_s']:.1f} trained "
                         f"samples/s, rollout engine on {q['rollout_device']}, held-out accuracy {q['eval_accuracy']}")
    if qa and qc and qc["samples_per_s"]:
        lines.append(f"  ratio accelerator / cpu: {qa['samples_per_s'] / qc['samples_per_s']:.2f}")
    rows = [(k, steps[k]["result"]) for k in ("fsdp", "fsdp_ac", "megatron") if steps.get(k, {}).get("result")]
    if rows:
        lines.append(f"\ntrainer, {rows[0][1]['seqs']} x {rows[0][1]['seq_len']} tokens per step, "
                     f"{rows[0][1]['dtype']}:")
        for k, r in rows:
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
            mem = f"{r['peak_memory_gib']:.1f} GiB" if r["peak_memory_gib"] else "-"
            lines.append(f"  {k:9s} {r['step_s']:7.3f} s/step {r['tokens_per_s']:10.0f} tokens/s "
                         f"{r['model_tflops_per_s']:7.1f} TFLOP/s  MFU {mfu}  peak {mem}")
    eng = steps.get("engine", {}).get("result")
    if eng:
        lines.append(f"\nembedded engine decoding ({eng['dtype']}, {eng['prompt']}-token prompts):")
        for r in eng["rows"]:
            hf = r.get("hf_generate_tokens_per_s")
            lines.append(f"  batch {r['batch']:4d}{', ragged' if r.get('ragged') else '        '}: "
                         f"{r['tokens_per_s']:10.0f} generated tokens/s"
                         + (f" (HF generate {hf:.0f}, ratio {r['tokens_per_s'] / hf:.2f})" if hf else ""))
    w = steps.get("weights", {}).get("result")
    if w:
        lines.append(f"\nweights ({w['bytes'] / 2**20:.0f} MiB, {w['dtype']}): disk publish {w['disk_publish_s']:.2f} s,"
                     f" load into the engine {w['disk_load_s']:.2f} s; collective packing {w['collective_pack_s']:.3f}"
                     f" s into {w['collective_buckets']} bucket(s); send: {w['collective_send']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for summary.json, report.txt, check.log")
    ap.add_argument("--cpu", action="store_true", help="the rehearsal: the CPU, the tiny model, few steps")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: <out>/../device-check-work)")
    ap.add_argument("--budget-s", type=float, default=None, help="the whole check's limit (default 530 s; --cpu 900)")
    ap.add_argument("--only", default="", help="comma list of the steps to run (default: all)")
    ap.add_argument("--quickstart-steps", type=int, default=None, help="trainer steps per quickstart run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out.parent / f"{args.out.name}-work"
    work.mkdir(parents=True, exist_ok=True)
    check = Check(args.out, work, args.budget_s or (900 if args.cpu else 530), set(filter(None, args.only.split(","))))
    cpu_only = {"CUDA_VISIBLE_DEVICES": ""}
    summary = {"mode": "cpu rehearsal" if args.cpu else "accelerator", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "environment": environment(), "steps": check.steps}
    if not args.cpu and not summary["environment"]["cuda_available"]:
        raise SystemExit("device_check: no CUDA device is visible; run with --cpu for the rehearsal")

    xml = args.out / "pytest.xml"
    check.run("pytest", [PY, "-m", "pytest", "tests/test_gpu.py", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                         "-o", "addopts=", f"--junitxml={xml}"], 180 if not args.cpu else 120)
    if xml.exists():
        check.steps["pytest"]["result"] = pytest_counts(xml)

    steps = args.quickstart_steps or (20 if args.cpu else 150)
    if not args.cpu:
        quickstart(check, "quickstart_accel", steps, [], None, 200)
    quickstart(check, "quickstart_cpu", steps, ["rollout.device=cpu", "trainer.backend=gloo"], cpu_only, 150)

    bench = [PY, "scripts/device_bench.py", "--work", str(work / "bench")]
    if args.cpu:
        bench += ["--size", "tiny", "--seqs", "8", "--seq-len", "128", "--micro-tokens", "512", "--steps", "2",
                  "--batches", "1", "8", "--hf-batches", "1", "8", "--new-tokens", "16"]
    for part, limit in (("model", 90), ("fsdp", 90), ("fsdp_ac", 90), ("engine", 90), ("weights", 60),
                        ("megatron", 90)):
        check.run(part, [*bench, "--part", part], limit)
        check.last_json(part)
        if part == "model" and check.steps[part]["status"] != "ok":
            break

    for res in check.steps.values():
        res.pop("_text", None)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = report(summary)
    (args.out / "report.txt").write_text(text)
    print(text, flush=True)
    failed = [k for k, v in check.steps.items() if v["status"] not in ("ok", "not asked")]
    if failed:
        raise SystemExit(f"device_check: not ok: {', '.join(failed)}")


if __name__ == "__main__":
    main()
