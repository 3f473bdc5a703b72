"""Measure this machine's cost model for the pipeline simulator, then check the simulator against bench_async.

    python scripts/sim_calibrate.py --out bench/sim_costs.json                            # measure, ~20 minutes
    python scripts/sim_calibrate.py --costs bench/sim_costs.json --check bench/results.json
    python scripts/sim_calibrate.py --costs bench/sim_costs.json --check run1.json run2.json --check-out c.json
    python scripts/sim_calibrate.py --costs bench/sim_costs.json --shared-only --out bench/sim_costs_b.json

Measuring runs the pieces of ``scripts/bench_async.py``'s task (the reverse
task's lengths, the tiny model, B = 16 groups of G = 8, 64 engine rows), each
in a process of its own, with 1 and with 2 torch threads, fresh, ``--repeats``
times (3) in alternation with the shared-core runs below; each thread
count's costs are fitted to its median run, each slowdown is the median of
its runs, and every run's typical steps and ratios are kept (``repeats``)
to show the spread:

* the embedded engine (``TorchEngine``), alone (``--companion``: beside a
  thread that publishes the task's groups into a spool at the rate the
  colocated loop's spool writer does while it generates, :class:`Companion`,
  ``COMPANION_GROUPS_PER_S``, as ``bench/sim_costs_s25.json`` (at 100 a
  second) and ``bench/sim_costs_s25b.json`` were measured; the simulator now
  charges the writer's CPU itself, ``side_cpu_per_group_s`` below): every
  decode step's time against its
  rows and their context tokens over a grid of batch sizes (least squares for
  ``decode_s``, ``decode_per_row_s``, ``decode_per_context_token_s``); the
  prefill of admitted groups against tokens, into an empty engine and into
  a running batch whose cache is merged with theirs (``prefill_*``,
  ``merge_per_token_s``); the cache rebuilt after new weights
  (``rebuild_prefill_*``); loading a state dict (``weights_load_s``). Every
  context counts as the left-padded cache holds it, rows times the longest
  (``padded_cache``; cost files from before 2026-11-28 summed the tokens
  and priced admissions and rebuilds on one ``prefill_*`` line);
* the FSDP2 trainer on one gloo rank: ``train_step`` on batches of the
  task's lengths scaled x1 and x2 (``train_step_s``, ``train_per_token_s``)
  and handing its weights to an engine in the same process
  (``colocated_publish_s``);
* the spool and the ledger: the trainer's claim + read + commit per group
  without read-ahead (``spool_per_group_s``) and a ticket (``admit_s``);
* ``shared_slowdown``: decode steps while another process trains, and train
  steps while another process decodes, against the same steps with that
  process stopped (SIGSTOP) in the windows between, paired in time
  (:func:`paired_slowdown`; the mean of the two; a cost model measured so
  says ``"shared": "paired"``). ``--shared-only`` measures only these,
  into a copy of a cost model (``--costs``) whose pieces it keeps.

What crosses processes is taken from the run being checked (``--check``):
the trainer's publish time per step (``time/publish_s``: collective or disk)
and the rollout's weight receive + load per version; and from the baseline
run (``colocated_t1``) alone, what the pieces leave out: the share of
groups GRPO leaves out of the loss (its count, or what its training time
implies), scoring per sample, the worker's admission time per admitted group
(every ask, refused ones included), the colocated feed's look at the
spool between engine steps, and the CPU the process's other threads (the
spool writer, the read-ahead) burned per group
(``side_cpu_per_group_s``: free where a core is idle for it, as in the
baseline, charged to the generating steps where none is: ``colocated_t2``'s
two torch threads on two cores, a rollout while the trainer shares its
cores; ``--no-side-cpu`` leaves it out, the model before 2026-11-29). Where the results file has the baseline's time
split (``bench_async.py`` of 2026-11-27 and later), the levels of decode,
admission prefill and the train step are then fitted to it
(:func:`hpcrl.sim.fit.fit_phases`: each piece keeps the shape it had alone,
its level is scaled so that the simulated baseline spends the measured
seconds in that phase; ``--no-fit`` skips this), and every mode is
simulated with the same factors (the check's code: scripts/_sim_check.py; the task
both see: scripts/_sim_task.py). ``--check`` then plays every mode of the results
file it knows (not the vLLM ones) in the simulator and prints the predicted
ratio to ``colocated_t1`` next to the measured one (target: within 10 %).
With several results files (repeated runs of the same code), each is played
with its own baseline and crossing costs, and the check is also made on the
mean ratios, mode by mode: one run's ratios carry its baseline's noise
(10-30 % here), which a mean of runs shrinks; each mean is printed with its
standard error, from the ratios of all its rounds (each against its own
round's baseline): what the machine's noise leaves uncertain in it. Each
mode's line also gives the engine's decode steps and their mean batch
(rows), simulated / measured: with the decode time per step, they tell a
gap in the cost of a step from one in the number of steps. Where the run
recorded the engine's decode steps by rows (``decode_by_rows``, since
2026-11-29), a second line gives each bin's measured time a step against
what the played cost model (its fitted level, no shared-core slowdown)
prices a step of that bin's mean rows and context: the loop's cost of a
step against its batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from _bench import ROOT

from _sim_check import check
from _sim_task import B, G, MAX_LEN, MAX_NEW, ROWS, task_lengths

sys.path.insert(0, str(ROOT))
from hpcrl.data.longtail import MIN_LEN  # noqa: E402

# the colocated loop's spool writer while it generates: the baseline (colocated_t1) of bench/results_s22.json,
# _s23, _s23b and _s24 published its 960 groups in 18.1, 19.0, 16.0 and 13.6 s of generating (rollout_busy x
# trainer_loop_s): 53, 50.6, 60 and 70.5 a second, 58.5 on average (the default mode's rollout, generating all the
# time: 36-48)
COMPANION_GROUPS_PER_S = 60.0
LATE_AFTER = 4  # the calibration admits one group into each running batch after this decode step


def fit(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least squares, coefficients clamped at 0 (a negative cost is noise)."""
    coef, *_ = np.linalg.lstsq(np.array(rows, float), np.array(times, float), rcond=None)
    return [max(0.0, float(c)) for c in coef]


# -- measurements, each in a fresh process -----------------------------------------------------------------
def _model(tmp: Path) -> Path:
    from hpcrl.model.tiny import build_tiny_model

    return build_tiny_model(tmp / "model")


def _engine(model_path: Path):
    from hpcrl.model.hf_io import load_model
    from hpcrl.rollout.engine import SamplingParams
    from hpcrl.rollout.torch_engine import TorchEngine

    return TorchEngine(load_model(model_path), eos_token_id=1, pad_token_id=0, max_batch_size=ROWS,
                       sampling=SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))


def measure_engine(model_path: Path, seconds: float = 0.0, companion: bool = False) -> dict:
    """Decode steps over a grid of batch sizes; prefill against tokens, into an empty engine and into a running
    batch (whose cache is merged with the new rows'); the rebuild after new weights; a state dict load. Every
    context is counted as the engine's left-padded cache holds it: rows times the longest (``padded``). With
    ``companion``, a spool writer runs beside it as in the loop (:class:`Companion`)."""
    engine, rng = _engine(model_path), random.Random(0)
    records: dict[str, list] = {"decode": [], "load": [], "prefill": [], "merge": [], "rebuild": []}
    deadline = time.monotonic() + seconds
    with (Companion(COMPANION_GROUPS_PER_S) if companion else contextlib.nullcontext()) as writer:
        t0 = time.monotonic()
        while True:
            for rows in (1, 8, 16, 32, 48, 64):
                _measure_batch(engine, rng, rows, records)
            if time.monotonic() >= deadline:
                break
        rate = writer.published / max(time.monotonic() - t0, 1e-9) if writer is not None else None
    return {**records, "padded": True, "companion_groups_per_s": rate}  # the rate it kept up (None: alone)


class Companion:
    """What runs beside the engine in the generating process (the colocated loop's, a rollout's): its spool
    writer's thread, publishing one of the task's groups every ``1 / groups_per_s`` seconds (encode, write, fsync,
    rename into ``ready/``, as ``hpcrl.rollout.publisher`` does; each file removed after). Its Python holds the GIL
    and its work takes a core from a torch thread: what a piece measured alone leaves out. Lifecycle: a context
    manager; the thread starts on entry and is stopped and joined on exit, which raises if the thread failed."""

    def __init__(self, groups_per_s: float) -> None:
        self.interval, self.published, self.error = 1.0 / groups_per_s, 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spool-publisher", daemon=True)

    def __enter__(self) -> "Companion":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise RuntimeError("the spool writer beside the measured engine failed") from self.error

    def _run(self) -> None:
        try:
            self._publish()
        except BaseException as e:  # the measurement must not go on without it unnoticed: raised on exit
            self.error = e

    def _publish(self) -> None:
        from hpcrl.spool.store import Spool

        rng = random.Random(2)
        with tempfile.TemporaryDirectory() as tmp:
            spool, groups = Spool(Path(tmp) / "spool"), []
            next_at = time.monotonic()
            while not self._stop.wait(max(0.0, next_at - time.monotonic())):
                next_at += self.interval
                groups = groups or _groups(rng, 1)
                group = groups.pop()
                group.ticket = self.published
                spool.publish(group).unlink()
                self.published += 1


def _measure_batch(engine, rng: random.Random, rows: int, records: dict[str, list]) -> None:
    """One grid point of :func:`measure_engine`: ``rows`` rows admitted into an empty engine, decoded to the end,
    one more group admitted into the running batch after LATE_AFTER steps and new weights loaded after 10."""
    from hpcrl.rollout.engine import Request

    padded = lambda: engine.num_running() * max((len(s.tokens()) for s in engine._running), default=0)  # noqa: E731
    groups = max(1, rows // G)
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randint(8, 29))] for _ in range(groups)]
    for g, prompt in enumerate(prompts):
        for i in range(min(G, rows)):
            engine.submit(Request((g, i), prompt, max_new_tokens=MAX_NEW))
    before = engine.stats["admit_prefill_s"]
    engine.poll()  # admission (one prefill call over each prompt) + a decode step
    # each prompt as long as the longest, counted whole (its pending token too), as the simulator counts it
    records["prefill"].append((groups * max(map(len, prompts)), engine.stats["admit_prefill_s"] - before))
    for step in range(MAX_NEW - 1):
        n, ctx, before = engine.num_running(), padded(), engine.stats["admit_prefill_s"]
        t0 = time.perf_counter()
        engine.poll()
        polled, admit = time.perf_counter() - t0, engine.stats["admit_prefill_s"] - before
        if admit > 0:  # a group admitted into the running batch (below): its prefill and the merge
            records["merge"].append((len(late), (n + G) * max(ctx // n, len(late)), admit))
        else:
            records["decode"].append((n, ctx, polled))
        if step == LATE_AFTER and n + G <= ROWS:  # one more group, entering at the next poll
            late = [rng.randrange(3, 60) for _ in range(rng.randint(8, 29))]
            for i in range(G):  # its tokens: one a poll from step LATE_AFTER + 1 to the last, MAX_NEW - 2
                engine.submit(Request(("late", i), late, max_new_tokens=MAX_NEW - LATE_AFTER - 2))
        if step == 10:  # new weights mid-generation: the cache is rebuilt over every running row
            state = {k: v.clone() for k, v in engine.model.state_dict().items()}
            before, tokens = engine.stats["rebuild_prefill_s"], padded()
            t0 = time.perf_counter()
            engine.load_state_dict(state, engine.version + 1)
            total = time.perf_counter() - t0
            prefilled = engine.stats["rebuild_prefill_s"] - before
            records["rebuild"].append((tokens, prefilled))
            records["load"].append(total - prefilled)
    if engine.num_running():
        raise RuntimeError("the calibration's batch did not finish with its grid point")


def _groups(rng: random.Random, scale: int):
    from hpcrl.spool.format import Sample, TrajectoryGroup

    lengths, _ = task_lengths(B * G, seed=rng.randrange(1 << 30))
    groups = []
    for t in range(B):
        n = rng.choice(range(MIN_LEN, MAX_LEN + 1))
        prompt = np.array([rng.randrange(3, 60) for _ in range(n + 5)], np.int32)
        samples = []
        for i in range(G):
            k = min(MAX_NEW * scale, lengths[t * G + i] * scale)
            samples.append(Sample(np.array([rng.randrange(3, 60) for _ in range(k)], np.int32),
                                  np.full(k, -1.0, np.float32), np.zeros(k, np.int32), np.ones(k, np.uint8),
                                  float(i % 2), "stop"))
        groups.append(TrajectoryGroup(ticket=t, writer="w", prompt_ids=prompt, samples=samples,
                                      meta={"epoch": 0, "row": t}))
    return groups


def _trainer(model_path: Path):
    """The FSDP2 train engine on one gloo rank of this process."""
    from hpcrl.algo.config import AlgoConfig
    from hpcrl.runtime.dist import free_port, init_from_env
    from hpcrl.trainer.config import TrainerConfig
    from hpcrl.trainer.engine import build_train_engine

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return build_train_engine("fsdp", model_path, TrainerConfig(world_size=1, total_steps=1_000_000),
                              AlgoConfig(), init_from_env("gloo"), pad_id=0, dtype="float32")


def measure_trainer(model_path: Path, seconds: float = 0.0) -> dict:
    """train_step against tokens; the in-process weight hand-over; the spool per group; a ledger ticket."""
    from hpcrl.algo.config import AlgoConfig
    from hpcrl.trainer import batch as tb

    engine = _trainer(model_path)
    rng, steps = random.Random(1), []
    target = _engine(model_path)
    engine.train_step(tb.to_sequences(_groups(rng, 1), AlgoConfig())[0])  # warm-up
    deadline = time.monotonic() + seconds
    while True:
        for scale in (1, 2, 1, 2, 1, 2):
            groups = _groups(rng, scale)
            seqs, _ = tb.to_sequences(groups, AlgoConfig())
            tokens = sum(len(s.tokens) for s in seqs)
            t0 = time.perf_counter()
            engine.train_step(seqs)
            steps.append((tokens, time.perf_counter() - t0))
        if time.monotonic() >= deadline:
            break
    t0 = time.perf_counter()
    for _ in range(5):
        target.load_state_dict(engine.full_state_dict(), 1)  # colocated: publish = load into the engine
    handover = (time.perf_counter() - t0) / 5
    return {"train": steps, "handover": handover, **measure_spool(rng)}


def measure_spool(rng: random.Random) -> dict:
    from hpcrl.admission.config import AdmissionConfig
    from hpcrl.admission.ledger import AdmissionLedger
    from hpcrl.spool.store import Spool
    from hpcrl.trainer.feed import BatchFeed

    with tempfile.TemporaryDirectory() as tmp:
        ledger = AdmissionLedger(Path(tmp) / "admission", AdmissionConfig(batch_size=B, max_staleness=100), 100_000)
        spool = Spool(Path(tmp) / "spool")
        t0 = time.perf_counter()
        tickets = [ledger.try_admit(0, "w") for _ in range(4 * B)]
        admit = (time.perf_counter() - t0) / len(tickets)
        for i, t in enumerate(tickets):
            g = _groups(rng, 1)[i % B]
            g.ticket, g.meta = t.index, {"epoch": t.epoch, "row": t.row}
            spool.publish(g)
        feed = BatchFeed(spool, ledger, B, 100, timeout_s=10)
        t0 = time.perf_counter()
        for v in range(4):
            feed.next_batch(v)
            feed.commit(v)
        return {"admit_s": admit, "spool_per_group_s": (time.perf_counter() - t0) / (4 * B)}


def _child(kind: str, threads: int, model_path: Path, seconds: float, out: Path | None,
           companion: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--_child", kind, "--_threads", str(threads), "--_model", str(model_path),
           "--_seconds", str(seconds)] + (["--_out", str(out)] if out else []) + (["--_companion"] if companion else [])
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)})


def run_child(kind: str, threads: int, model_path: Path, seconds: float = 0.0, companion: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        if _child(kind, threads, model_path, seconds, out, companion).wait() != 0:
            raise SystemExit(f"the {kind} measurement failed")
        return json.loads(out.read_text())


def steps_loop(kind: str, model_path: Path, seconds: float) -> dict:
    """The same operation over and over for ``seconds``, each one's start and end on the system's monotonic clock
    (which every process shares): ``engine``, a decode step of a batch of 32 rows (4 groups, decoded to the end,
    then admitted again, untimed: every window of a second or more holds the same mix of contexts); ``trainer``, a
    train step on one batch of the task."""
    if kind == "engine":
        from hpcrl.rollout.engine import Request

        engine, rng = _engine(model_path), random.Random(0)

        def refill() -> None:
            if not engine.num_running():
                for g in range(4):
                    prompt = [rng.randrange(3, 60) for _ in range(20)]
                    for i in range(G):
                        engine.submit(Request((g, i), prompt, max_new_tokens=MAX_NEW))
                engine.poll()  # the admission's prefill

        return {"ops": _timed(engine.poll, seconds, before=refill)}
    from hpcrl.algo.config import AlgoConfig
    from hpcrl.trainer import batch as tb

    trainer = _trainer(model_path)
    seqs, _ = tb.to_sequences(_groups(random.Random(1), 1), AlgoConfig())
    trainer.train_step(seqs)  # warm-up
    return {"ops": _timed(lambda: trainer.train_step(seqs), seconds)}


def _timed(step: Callable[[], object], seconds: float,
           before: Callable[[], None] | None = None) -> list[tuple[float, float]]:
    """``step`` repeated for ``seconds``, each call's (start, end); ``before`` runs untimed before each one."""
    ops, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        if before is not None:
            before()
        t0 = time.monotonic()
        step()
        ops.append((t0, time.monotonic()))
    return ops


def paired_slowdown(kind: str, other: str, model_path: Path, cycles: int = 10, window_s: float = 2.0) -> dict:
    """How much ``kind``'s steps (one thread) slow while a process runs ``other`` (one thread) on the same cores,
    paired in time: the other process is stopped and continued (SIGSTOP, SIGCONT) every ``window_s`` for
    ``cycles`` cycles while ``kind`` repeats one operation (:func:`steps_loop`), and each cycle's mean step with
    the other running is divided by the same cycle's mean step with it stopped (:func:`cycle_ratios`); the
    slowdown is the median over the cycles. Both processes are ended on the way out, whatever ended the
    measurement (SIGTERM included: the other one is never left stopped); one that dies midway fails it."""
    import signal

    def interrupted(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, interrupted)
    load = _child(other, 1, model_path, 3600.0, None)
    child = None
    try:
        time.sleep(8.0)  # the other one past its start-up
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.json"
            child = subprocess.Popen([sys.executable, __file__, "--_child", f"{kind}_steps", "--_threads", "1",
                                      "--_model", str(model_path), "--_seconds", str(8.0 + 2 * cycles * window_s),
                                      "--_out", str(out)], env={**os.environ, "OMP_NUM_THREADS": "1"})
            time.sleep(6.0)  # its start-up and warm-up, the other one running
            switches = []  # (time, the other one running after it)
            for _ in range(cycles):
                for running in (False, True):
                    if load.poll() is not None:
                        raise SystemExit(f"the {other} process ended during the paired {kind} measurement")
                    load.send_signal(signal.SIGCONT if running else signal.SIGSTOP)
                    switches.append((time.monotonic(), running))
                    time.sleep(window_s)
            end = time.monotonic()  # the last window's end: what runs after it is left out
            if child.wait() != 0:
                raise SystemExit(f"the paired {kind} measurement failed")
            ops = json.loads(out.read_text())["ops"]
    finally:
        for proc in (child, load):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        signal.signal(signal.SIGTERM, previous)
    ratios = cycle_ratios(ops, switches, end)
    return {"slowdown": float(np.median(ratios)), "cycle_ratios": ratios, "window_s": window_s}


def cycle_ratios(ops: list[tuple[float, float]], switches: list[tuple[float, bool]], end: float) -> list[float]:
    """Each cycle's (a stopped window, then a running one) mean step running over its mean step stopped, in time
    order; a step counts in the window it lies wholly in (the last window ends at ``end``); a cycle without a
    whole step in both windows is left out."""
    if any(running != (k % 2 == 1) for k, (_, running) in enumerate(switches)) or len(switches) % 2:
        raise ValueError("switches: a stopped window, then a running one, in turn, whole cycles")
    bounds = [t for t, _ in switches] + [end]
    windows: list[list[float]] = [[] for _ in switches]
    for a, b in ops:
        for k in range(len(switches)):
            if bounds[k] <= a and b <= bounds[k + 1]:
                windows[k].append(b - a)
                break
    ratios = [float(np.mean(windows[k + 1]) / np.mean(windows[k]))
              for k in range(0, len(switches), 2) if windows[k] and windows[k + 1]]
    if not ratios:
        raise ValueError("no cycle held a whole step in both of its windows: longer windows")
    return ratios


def costs_from(engine: dict, trainer: dict) -> dict:
    """The cost model of one run of each piece. An engine run of before 2026-11-28 has neither merges nor rebuilds
    of their own, nor padded contexts: its prefill line prices both, over summed tokens."""
    d0, d1, d2 = fit([[1, n, c] for n, c, _ in engine["decode"]], [t for *_, t in engine["decode"]])
    admissions = [(n, 0, t) for n, t in engine["prefill"]] + [tuple(m) for m in engine.get("merge", [])]
    p0, p1, m = fit([[1, n, k] for n, k, _ in admissions], [t for *_, t in admissions])
    t0, t1 = fit([[1, n] for n, _ in trainer["train"]], [t for _, t in trainer["train"]])
    out = {"decode_s": d0, "decode_per_row_s": d1, "decode_per_context_token_s": d2, "prefill_s": p0,
           "prefill_per_token_s": p1, "weights_load_s": float(np.median(engine["load"])), "train_step_s": t0,
           "train_per_token_s": t1, "colocated_publish_s": trainer["handover"], "admit_s": trainer["admit_s"],
           "spool_per_group_s": trainer["spool_per_group_s"]}
    if engine.get("padded"):
        r0, r1 = fit([[1, n] for n, _ in engine["rebuild"]], [t for _, t in engine["rebuild"]])
        out.update(padded_cache=True, merge_per_token_s=m, rebuild_prefill_s=r0, rebuild_prefill_per_token_s=r1)
    return out


def typical_decode_s(engine: dict) -> float:
    """One decode step at 32 rows of 20 context tokens, from the fit."""
    d0, d1, d2 = fit([[1, n, c] for n, c, _ in engine["decode"]], [t for *_, t in engine["decode"]])
    return d0 + 32 * d1 + 32 * 20 * d2


def typical_train_s(trainer: dict) -> float:
    """One train step of 1,500 tokens, from the fit."""
    t0, t1 = fit([[1, n] for n, _ in trainer["train"]], [t for _, t in trainer["train"]])
    return t0 + 1500 * t1


def median_run(runs: list[dict], typical) -> dict:
    """The run whose typical step (``typical``) is the median of the runs': one consistent set of samples (with an
    even count, the slower of the two middle runs)."""
    return sorted(runs, key=typical)[len(runs) // 2]


def measure_shared(model_path: Path, ratios: dict) -> str:
    """Each side's steps beside the other, paired in time (:func:`paired_slowdown`); appends to ``ratios``."""
    ratios["decode"].append(paired_slowdown("engine", "trainer", model_path)["slowdown"])
    ratios["train"].append(paired_slowdown("trainer", "engine", model_path)["slowdown"])
    return f"beside the other: decode {ratios['decode'][-1]:.2f}x, train {ratios['train'][-1]:.2f}x"


def measure_repeat(model_path: Path, seconds: float, runs: dict, ratios: dict, companion: bool = False) -> str:
    """One repeat of :func:`measure`: the engine (beside a spool writer with ``companion``) and the trainer with 1
    and 2 threads, then each beside the other (:func:`measure_shared`); appends to ``runs`` and ``ratios``, returns
    a progress line."""
    for threads in (1, 2):
        runs[threads]["engine"].append(run_child("engine", threads, model_path, seconds, companion=companion))
        kept = runs[threads]["engine"][-1].get("companion_groups_per_s")
        if kept is not None and kept < 0.9 * COMPANION_GROUPS_PER_S:
            print(f"warning: the spool writer beside the engine kept {kept:.0f} groups/s, "
                  f"not {COMPANION_GROUPS_PER_S:.0f}", flush=True)
        runs[threads]["trainer"].append(run_child("trainer", threads, model_path, seconds))
    shared = measure_shared(model_path, ratios)
    decode = ", ".join(f"{t} thread(s) {1e3 * typical_decode_s(runs[t]['engine'][-1]):.2f} ms" for t in (1, 2))
    train = ", ".join(f"{t}: {1e3 * typical_train_s(runs[t]['trainer'][-1]):.0f} ms" for t in (1, 2))
    return f"typical decode step {decode}; train step {train}; {shared}"


def measure(out: Path, repeats: int = 3, seconds: float = 8.0, companion: bool = False) -> None:
    """The pieces with 1 and 2 threads and the shared-core slowdowns, ``repeats`` times in alternation (1, 2,
    paired, 1, 2, paired ...). Each thread count's cost model is fitted to its median run (by the typical decode
    step; the trainer by the typical train step), and each slowdown is the median of its repeats' paired
    measurements (:func:`measure_shared`). Each run measures for ``seconds`` at least (whole passes over its
    grid): one short run is not enough on these shared cores (docs/performance.md, the simulator's calibration).
    ``companion``: the engine beside a spool writer (:class:`Companion`) instead of alone."""
    with tempfile.TemporaryDirectory() as tmp:
        model_path = _model(Path(tmp))
        runs: dict[int, dict[str, list]] = {1: {"engine": [], "trainer": []}, 2: {"engine": [], "trainer": []}}
        ratios: dict[str, list[float]] = {"decode": [], "train": []}
        for k in range(repeats):
            print(f"run {k + 1} of {repeats}: " + measure_repeat(model_path, seconds, runs, ratios, companion),
                  flush=True)
        result: dict = {"repeats": {**{f"threads{t}": {"decode_ms": [1e3 * typical_decode_s(e) for e in r["engine"]],
                                                       "train_ms": [1e3 * typical_train_s(x) for x in r["trainer"]],
                                                       # the rate the writer beside the engine kept, each run
                                                       "writer_groups_per_s": [e.get("companion_groups_per_s")
                                                                               for e in r["engine"]]}
                                       for t, r in runs.items()}, "shared_slowdown": ratios}}
        for threads, r in runs.items():
            engine, trainer = median_run(r["engine"], typical_decode_s), median_run(r["trainer"], typical_train_s)
            fitted = result[f"threads{threads}"] = costs_from(engine, trainer)
            print(f"{threads} thread(s), median run: " + ", ".join(f"{k} {v:.3g}" for k, v in fitted.items()),
                  flush=True)
        result.update(shared_slowdown=shared_medians(ratios), shared="paired",
                      companion_groups_per_s=COMPANION_GROUPS_PER_S if companion else None)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


def shared_medians(ratios: dict[str, list[float]]) -> dict[str, float]:
    slow = {kind: float(np.median(v)) for kind, v in ratios.items()}
    print(f"shared cores (medians): decode {slow['decode']:.2f}x, train {slow['train']:.2f}x", flush=True)
    return {**slow, "mean": (slow["decode"] + slow["train"]) / 2}


def measure_shared_only(costs: Path, out: Path, repeats: int) -> None:
    """``costs``'s pieces as they are, with the shared-core slowdowns measured again, paired in time (``repeats``
    times, the medians): ``out`` records where the pieces came from (``pieces_from``)."""
    result = json.loads(costs.read_text())
    ratios: dict[str, list[float]] = {"decode": [], "train": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = _model(Path(tmp))
        for k in range(repeats):
            print(f"run {k + 1} of {repeats}: " + measure_shared(model_path, ratios), flush=True)
    result.setdefault("repeats", {})["shared_slowdown"] = ratios
    result.update(shared_slowdown=shared_medians(ratios), pieces_from=str(costs), shared="paired")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


# -- the check against a bench_async results file ----------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="measure, and write the cost model here")
    ap.add_argument("--repeats", type=int, default=3, help="with --out: runs of the pieces per thread count, "
                    "alternating; each cost model is fitted to the median run (an odd count keeps it the middle one)")
    ap.add_argument("--seconds", type=float, default=8.0, help="with --out: each run measures for this long at "
                    "least (whole passes; 0: one pass)")
    ap.add_argument("--companion", action="store_true", help="with --out: measure the engine beside a spool writer "
                    f"at {COMPANION_GROUPS_PER_S:.0f} groups/s (the cost files of 2026-11-29's first session; the "
                    "simulator charges the writer's CPU itself: Costs.side_cpu_per_group_s)")
    ap.add_argument("--costs", type=Path, help="a cost model written by --out")
    ap.add_argument("--shared-only", action="store_true", help="with --out and --costs: keep that cost model's "
                    "pieces and measure the shared-core slowdowns again, paired in time (~3 minutes a repeat)")
    ap.add_argument("--check", type=Path, nargs="+", help="bench_async results files to compare the simulator "
                    "with (several: also with their mean ratios, mode by mode)")
    ap.add_argument("--check-out", type=Path, help="write the comparison here")
    ap.add_argument("--no-fit", action="store_true",
                    help="with --check: the pieces' costs as measured, not fitted to the baseline's split")
    ap.add_argument("--task-lengths", action="store_true", help="with --check: each sample draws its own response "
                    "length from the task and every prompt is the mean one, even where the run recorded its groups' "
                    "shapes (the workload before 2026-11-28)")
    ap.add_argument("--summed-context", action="store_true", help="with --check: the engine model before "
                    "2026-11-28 with this cost model's coefficients: contexts summed, no merge, the rebuild on the "
                    "admissions' prefill line")
    ap.add_argument("--no-side-cpu", action="store_true", help="with --check: the other threads' CPU (the spool "
                    "writer's, ...) left out where no core is idle for it (the model before 2026-11-29)")
    ap.add_argument("--_child")
    ap.add_argument("--_threads", type=int, default=1)
    ap.add_argument("--_model", type=Path)
    ap.add_argument("--_seconds", type=float, default=0.0)
    ap.add_argument("--_out", type=Path)
    ap.add_argument("--_companion", action="store_true")
    args = ap.parse_args()
    if args._child:
        import torch

        torch.set_num_threads(args._threads)
        if args._child.endswith("_steps"):
            result = steps_loop(args._child.removesuffix("_steps"), args._model, args._seconds)
        else:
            result = (measure_engine(args._model, args._seconds, args._companion) if args._child == "engine"
                      else measure_trainer(args._model, args._seconds))
        if args._out:
            args._out.write_text(json.dumps(result))
        return
    if args.shared_only and not args.out:
        ap.error("--shared-only needs --out: where the cost model with the slowdowns measured again goes")
    if args.out:
        if args.repeats < 1 or args.seconds < 0:
            ap.error("--repeats must be at least 1 and --seconds at least 0")
        if args.shared_only:
            if not args.costs:
                ap.error("--shared-only needs --costs: the cost model whose pieces it keeps")
            measure_shared_only(args.costs, args.out, args.repeats)
        else:
            measure(args.out, args.repeats, args.seconds, args.companion)
    if args.check:
        if not (args.costs or args.out):
            ap.error("--check needs a cost model: --costs FILE (or --out to measure one first)")
        check(args.out or args.costs, args.check, args.check_out, fit=not args.no_fit,
              task_only=args.task_lengths, summed=args.summed_context, side_cpu=not args.no_side_cpu)
    if not (args.out or args.check):
        ap.error("nothing to do: --out to measure, --check to compare")


if __name__ == "__main__":
    main()
