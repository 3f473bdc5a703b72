"""Slurm schedulers: each component its own job (submitit), or an srun step of one allocation.

:class:`SlurmScheduler` (``launch.scheduler=slurm``, from a login node)
submits each component through submitit as its own batch job, with the
resources of ``launch.trainer`` / ``launch.rollout``. Inside the job,
:class:`RunCommand` runs the component's command line once per task (the
trainer's ranks are the job's tasks and bootstrap from ``SLURM_PROCID``),
appending to the component's log in ``<run_dir>/logs/`` and forwarding
SIGTERM/SIGINT/SIGUSR2 to it; its exit code is the job's result. Submitit's
own files (sbatch script, stdout/stderr, pickles) are in
``<run_dir>/logs/slurm/<job id>/``.

Lifecycle of a job as the supervisor sees it: ``submit`` (an sbatch
rejection raises :class:`SubmitRejected` naming the component and Slurm's
message) -> ``poll`` returns None while it pends or runs; the states of all
jobs are read with one ``sacct`` call at most every
``launch.slurm_state_interval_s`` -> a COMPLETED job's exit code is its
result, and a component that failed inside its job wrote its code there
(:mod:`hpcrl.launch.slurm_job`); a job that ends otherwise (FAILED,
CANCELLED, TIMEOUT, OUT_OF_MEMORY, NODE_FAIL, ...) is decided only once
``squeue`` no longer lists it (Slurm sets CANCELLED at once, then signals
the processes: a component that checkpoints and exits 75 in time is a
restart, not a failure, whenever the state was read), and without a code of
its own returns 1; so does a job that pends for a reason that never
resolves (bad constraint, partition limits). Either way a line stating the
Slurm state is appended to the component's log (so the supervisor's error
shows it) -> ``cancel`` is ``scancel``.

:class:`SrunScheduler` (``launch.scheduler=srun``) is for the whole run in one
heterogeneous allocation (``sbatch/run_async_ppo.sh``): each component is a
local ``srun --het-group=G`` process (trainer: group 0, rollouts and the evaluation component: group 1).

Preemption (a rollout on a preemptible partition or QOS): a job that ends
PREEMPTED is a restart free of charge (exit 75), as is one whose component
stopped in time; a job Slurm requeued is not finished: its result file is
set aside (``squeue`` lists it pending again, or running again since a later
start) and the same job is polled on. :meth:`SlurmScheduler.queued` tells
the supervisor that a job waits in the queue, so it is never called hung.

Elastic rollout: ``python -m hpcrl scale D N`` (:mod:`hpcrl.launch.fleet`)
sets the supervised count; ``python -m hpcrl.launch.slurm add-rollout --run-dir D
--replica K`` submits one more rollout job to a running run outside the supervisor (admission is
global in the run directory, so it simply starts taking tickets); it is
recorded in ``<run_dir>/jobs/rollout-K.json`` and exits by itself when the
trainer writes ``DONE``. Stopping a replica is ``scancel``: its unfinished
tickets are reclaimed like any dead rollout's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import re
import subprocess
import tempfile
import time
from pathlib import Path

import submitit

from hpcrl.fs import atomic
from hpcrl.launch.config import ResourcesConfig
from hpcrl.launch.scheduler import ComponentSpec, LocalScheduler, SubmitRejected, python_module
from hpcrl.launch.slurm_job import RESULTS, RunCommand, append_note, step_codes
from hpcrl.launch.slurm_state import ENDED_BADLY, QUEUED, after_run, hopeless, read_states, still_listed
from hpcrl.runtime.owner import ENV_INSTANCE
from hpcrl.runtime.preempt import EXIT_REQUEUE

log = logging.getLogger(__name__)

def sbatch_options(res: ResourcesConfig, tasks: int) -> dict:
    """submitit SlurmExecutor parameters for one component's job (``tasks`` processes in all)."""
    per_node = res.tasks_per_node or max(1, tasks // res.nodes)
    if per_node * res.nodes != tasks:
        raise ValueError(f"tasks_per_node: {res.nodes} node(s) x {per_node} task(s) != the {tasks} process(es) "
                         "this component needs (trainer.world_size for the trainer)")
    params: dict = {"nodes": res.nodes, "ntasks_per_node": per_node, "cpus_per_task": res.cpus_per_task,
                    "time": res.time_min, "signal_delay_s": res.signal_s, "stderr_to_stdout": True}
    optional = {"gpus_per_node": res.gpus_per_node or None, "mem": res.mem, "partition": res.partition,
                "account": res.account, "qos": res.qos, "constraint": res.constraint, "gres": res.gres,
                "exclusive": True if res.exclusive else None}
    params.update({k: v for k, v in optional.items() if v})
    extra = {}
    for line in res.extra_sbatch:
        opt = line.removeprefix("#SBATCH").strip().removeprefix("--")
        key, _, value = opt.partition("=")
        extra[key] = value if value else True
    if extra:
        params["additional_parameters"] = extra
    if res.setup:
        params["setup"] = list(res.setup)
    srun = container_args(res)
    if srun:
        params["srun_args"] = srun
    return params


def container_args(res: ResourcesConfig) -> list[str]:
    if not res.container_image:
        return []
    args = [f"--container-image={res.container_image}"]
    return args + ([f"--container-mounts={res.container_mounts}"] if res.container_mounts else [])


class SlurmScheduler:
    """Each component its own Slurm job, through submitit."""

    def __init__(self, folder: Path, state_interval_s: float = 2.0) -> None:
        self.folder, self.state_interval = Path(folder), state_interval_s
        self._jobs: dict[str, tuple[submitit.Job, ComponentSpec]] = {}
        self._states: dict[str, tuple[str, str]] = {}  # job id -> (state, reason)
        self._read_at = 0.0
        self._codes: dict[str, int] = {}
        self._set_aside: dict[str, float] = {}  # job id -> time of a result file written before a requeue

    def executor(self, spec: ComponentSpec) -> submitit.SlurmExecutor:
        """The submitit executor for ``spec``'s job (its sbatch script: :func:`render_sbatch`)."""
        executor = submitit.SlurmExecutor(folder=self.folder / "%j")
        try:
            options = sbatch_options(spec.resources or ResourcesConfig(), spec.tasks)
        except ValueError as e:
            raise SubmitRejected(spec.name, f"launch.{spec.name.split('-')[0]}.{e}") from None
        if spec.comment:
            options["comment"] = spec.comment
        executor.update_parameters(job_name=f"hpcrl-{spec.name}", **options)
        return executor

    def submit(self, spec: ComponentSpec) -> str:
        executor = self.executor(spec)
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            job = executor.submit(RunCommand(spec.argv, spec.env, str(spec.log_path), str(self.folder / "%j")))
        except submitit.core.utils.FailedJobError as e:
            raise SubmitRejected(spec.name, _slurm_message(str(e))) from None
        self._jobs[job.job_id] = (job, spec)
        log.info("submitted %s as Slurm job %s (%d task(s))", spec.name, job.job_id, spec.tasks)
        return job.job_id

    def submit_array(self, specs: list[ComponentSpec]) -> list[str]:
        """One ``sbatch --array`` for components of one kind (the rollout replicas: the same resources, one task
        each), task k running ``specs[k]``; each task is then a job of its own (``<array id>_<k>``): polled,
        signalled, cancelled and resubmitted alone. Fewer than two, or specs that differ, go one by one."""
        if len(specs) < 2 or any(s.tasks != 1 or s.resources != specs[0].resources for s in specs):
            return [self.submit(spec) for spec in specs]
        executor = self.executor(specs[0])
        executor.update_parameters(job_name=f"hpcrl-{specs[0].name.rsplit('-', 1)[0]}")
        executor.parameters.pop("comment", None)  # set per task below
        for spec in specs:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            jobs = executor.submit_array([RunCommand(s.argv, s.env, str(s.log_path), str(self.folder / "%j"))
                                          for s in specs])
        except submitit.core.utils.FailedJobError as e:
            raise SubmitRejected(specs[0].name, _slurm_message(str(e))) from None
        for job, spec in zip(jobs, specs):
            self._jobs[job.job_id] = (job, spec)
            if spec.comment:  # each task its own comment (run, component, epoch, instance)
                subprocess.run(["scontrol", "update", f"JobId={job.job_id}", f"Comment={spec.comment}"],
                               capture_output=True, timeout=60)
        log.info("submitted %s as the Slurm job array %s", ", ".join(s.name for s in specs),
                 jobs[0].job_id.split("_")[0])
        return [job.job_id for job in jobs]

    def poll(self, job_id: str) -> int | None:
        if job_id in self._codes:
            return self._codes[job_id]
        job, spec = self._jobs[job_id]
        if spec.tasks == 1 and self._finished_run(job, spec):
            state, reason = "COMPLETED", ""
        else:
            state, reason = self._state(job_id)
        code = self._code(job, spec, state, reason)
        if code is not None:
            self._codes[job_id] = code
        return code

    def _finished_run(self, job: submitit.Job, spec: ComponentSpec) -> bool:
        """Whether the job's result file is the end of the job: only once ``squeue`` no longer lists it. Not when
        Slurm requeued the job after that run (preemption with ``PreemptMode=REQUEUE``, ``scontrol requeue``:
        the component handed its work back and exited 75, and the same job runs again once it starts): that
        result is then set aside and the job polled on."""
        path = job.paths.result_pickle
        try:
            written = path.stat().st_mtime
        except FileNotFoundError:
            return False
        if written <= self._set_aside.get(job.job_id, 0.0):
            return False
        what, how = after_run(job.job_id, written)
        if what == "requeued":
            self._set_aside[job.job_id] = written
            append_note(spec.log_path, f"Slurm requeued job {job.job_id} ({how}): its component stopped and the "
                                       "same job runs again when it starts")
            log.warning("%s: Slurm requeued job %s (%s)", spec.name, job.job_id, how)
        return what == "ended"

    def queued(self, job_id: str) -> bool:
        """Whether the job waits in Slurm's queue (submitted, or requeued after a preemption): its component
        is not running, so its heartbeat is not expected."""
        return job_id not in self._codes and self._state(job_id)[0] in QUEUED

    def has_room(self, spec: ComponentSpec, within_s: float) -> bool:
        """Whether ``sbatch --test-only`` says a job for ``spec`` would start within ``within_s`` seconds."""
        try:
            script = render_sbatch(spec, self.folder)
        except SubmitRejected:
            return False
        with tempfile.NamedTemporaryFile("w", suffix=".sbatch", prefix="hpcrl-room-") as f:
            f.write(script)
            f.flush()
            try:
                proc = subprocess.run(["sbatch", "--test-only", f.name], capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.SubprocessError):
                return False
        m = re.search(r"to start at (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", proc.stderr + proc.stdout)
        if proc.returncode != 0 or m is None:
            return False
        return time.mktime(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) <= time.time() + within_s

    def _code(self, job: submitit.Job, spec: ComponentSpec, state: str, reason: str) -> int | None:
        failed = sorted(job.paths.folder.glob("exit.*.json")) if state not in ("PENDING", "RUNNING") else []
        if failed and state in ("PREEMPTED", "REQUEUED"):  # e.g. SIGTERM before the component's handler was set
            what, _ = after_run(job.job_id, failed[0].stat().st_mtime)
            if what != "ended":
                return None  # requeued (its next run removes the file) or still ending
            append_note(spec.log_path, f"Slurm job {job.job_id} was preempted and its component died of it "
                                       f"({json.loads(failed[0].read_text())['code']}); starting it again is not a "
                                       "failure")
            return EXIT_REQUEUE
        if failed:  # a task whose component failed wrote its code, then ended the same way (slurm_job)
            code = int(json.loads(failed[0].read_text())["code"])
            append_note(spec.log_path, f"Slurm job {job.job_id} ({state}): the component "
                                       f"{'was killed by signal %d' % -code if code < 0 else 'exited %d' % code}")
            return code
        if state == "PENDING" and hopeless(reason):
            append_note(spec.log_path, f"Slurm job {job.job_id} can never start (pending, reason {reason}); "
                                       "cancelling it")
            self.cancel(job.job_id, signal.SIGKILL)
            return 1
        if state == "COMPLETED" or (state == "FAILED" and job.paths.result_pickle.exists()):
            try:
                codes = [c for c in job.results() if c is not None]
            except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as e:
                append_note(spec.log_path, f"Slurm job {job.job_id} ({state}): {str(e)[-2000:]}")
                return 1
            return next((c for c in codes if c != 0), 0)
        if state in ENDED_BADLY:
            if still_listed(job.job_id):
                # cancelled or preempted, but its processes are still stopping (Slurm sets the state at once, then
                # signals them): the component may yet checkpoint and exit 75, so wait for the end to decide
                return None
            if job.paths.result_pickle.exists():  # it stopped by itself in time: its own code decides
                return self._code(job, spec, "COMPLETED", reason)
            if state == "PREEMPTED":  # PreemptMode=CANCEL, and the component did not stop within the grace time
                append_note(spec.log_path, f"Slurm job {job.job_id} was preempted (cancelled for a job of higher "
                                           "priority); starting it again is not a failure")
                return EXIT_REQUEUE
            append_note(spec.log_path, f"Slurm job {job.job_id} ended in state {state}"
                                       f"{' (' + reason + ')' if reason and reason != 'None' else ''}; "
                                       f"submitit log: {job.paths.stdout}")
            return 1
        return None

    def _state(self, job_id: str) -> tuple[str, str]:
        if time.time() - self._read_at >= self.state_interval or job_id not in self._states:
            self._states.update(read_states(list(self._jobs)))
            self._read_at = time.time()
        return self._states.get(job_id, ("UNKNOWN", ""))

    def cancel(self, job_id: str, sig: int = signal.SIGTERM) -> None:
        if job_id in self._codes:
            return
        signal_job(job_id, sig)

    def wait(self, job_id: str, timeout: float) -> int | None:
        deadline = time.time() + timeout
        while (code := self.poll(job_id)) is None and time.time() < deadline:
            time.sleep(0.5)
        return code


def signal_job(job_id: str, sig: int = signal.SIGTERM) -> None:
    """Signal a component's job (SIGKILL: cancel it). A component that sees SIGTERM may ask for its own
    requeue (preemption handling): a job being stopped must not come back, so it is made non-requeueable first."""
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "Requeue=0"], capture_output=True, timeout=60)
    if sig == signal.SIGKILL:
        cmd = ["scancel", job_id]
    else:
        cmd = ["scancel", f"--signal={signal.Signals(sig).name.removeprefix('SIG')}", job_id]
    subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def render_sbatch(spec: ComponentSpec, folder: Path) -> str:
    """The sbatch script submitit writes for ``spec`` (the job's command shown as in the real file)."""
    executor = SlurmScheduler(folder).executor(spec)
    return executor._make_submission_file_text(executor._submitit_command_str, "render")


def _slurm_message(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if "error" in ln.lower()]
    return " | ".join(lines) if lines else text.strip()[-1000:]


def build_slurm(cfg, run_dir: Path) -> SlurmScheduler:
    """``launch.scheduler: slurm`` (:mod:`hpcrl.launch.registry`): each component its own job."""
    return SlurmScheduler(run_dir / "logs" / "slurm", cfg.launch.slurm_state_interval_s)


def build_srun(cfg, run_dir: Path) -> SrunScheduler:
    """``launch.scheduler: srun`` (:mod:`hpcrl.launch.registry`): each component a step of this allocation."""
    return SrunScheduler()


class SrunScheduler(LocalScheduler):
    """Inside one (heterogeneous) allocation: each component an ``srun`` step of its het group."""

    def __init__(self, het_groups: dict[str, int] | None = None) -> None:
        super().__init__()
        self.het_groups = het_groups or {"trainer": 0, "rollout": 1, "eval": 1}
        self._codes: dict[str, Path] = {}  # srun pid -> the folder its tasks write their codes to
        self._said: dict[str, tuple[Path, int]] = {}  # srun pid -> srun's own log, and its size before this step

    def submit(self, spec: ComponentSpec) -> str:
        command = self.command(spec)
        before = command.log_path.stat().st_size if command.log_path.exists() else 0
        job_id = super().submit(command)
        self._codes[job_id] = self.codes_folder(spec)
        self._said[job_id] = (command.log_path, before)
        return job_id

    def queued(self, job_id: str) -> bool:
        """Whether srun still waits for room in the allocation to create the step ("step creation temporarily
        disabled, retrying", e.g. a replica scaled beyond what the het group holds): its component has not
        started, so its heartbeat is not expected."""
        path, before = self._said.get(job_id, (None, 0))
        if path is None:
            return False
        try:
            with open(path, "rb") as f:
                f.seek(before)
                said = f.read().decode(errors="replace")
        except FileNotFoundError:
            return False
        waiting = said.rfind("step creation temporarily disabled")
        return waiting >= 0 and "Step created" not in said[waiting:]

    def poll(self, job_id: str) -> int | None:
        """The component's code: a step that ended COMPLETED may have been stopped to be restarted (75)."""
        code = super().poll(job_id)
        if code is None:
            return None
        codes = step_codes(self._codes[job_id]).values()  # none when srun itself failed, or a task was killed
        failed = next((c for c in codes if c not in RESULTS), None)  # the component's own code, not srun's
        if failed is not None:
            return failed
        return 75 if code == 0 and 75 in codes else code

    def wait(self, job_id: str, timeout: float) -> int | None:
        return None if super().wait(job_id, timeout) is None else self.poll(job_id)

    @staticmethod
    def codes_folder(spec: ComponentSpec) -> Path:
        return spec.log_path.parent / "steps" / f"{spec.name}.{spec.env.get(ENV_INSTANCE, 'x')}"

    def command(self, spec: ComponentSpec) -> ComponentSpec:
        """``spec`` as the local ``srun`` process that runs it as a step of this allocation: each task runs
        the component under :func:`hpcrl.launch.slurm_job.run_step`, which ends a step that stopped to be
        restarted (exit 75) COMPLETED in ``sacct`` and hands the code to :meth:`poll`."""
        res = spec.resources or ResourcesConfig()
        kind = spec.name.split("-")[0]
        srun = ["srun", f"--job-name=hpcrl-{spec.name}", *([f"--comment={spec.comment}"] if spec.comment else []),
                f"--ntasks={spec.tasks}", "--exact",
                f"--cpus-per-task={res.cpus_per_task}", "--kill-on-bad-exit=1", "--unbuffered",
                f"--output={str(spec.log_path).replace('{rank}', '%t')}", "--open-mode=append"]
        if kind in self.het_groups and os.environ.get("SLURM_HET_SIZE"):
            srun.insert(1, f"--het-group={self.het_groups[kind]}")
        if res.gpus_per_node:
            srun.append(f"--gpus-per-node={res.gpus_per_node}")
        step = python_module("hpcrl.launch.slurm_job", "--codes", str(self.codes_folder(spec)), "--")
        return ComponentSpec(spec.name, [*srun, *container_args(res), *step, *spec.argv],
                             spec.log_path.with_name(f"{spec.name}.srun.log"), spec.env)


def add_rollout(run_dir: Path, replica: int) -> str:
    """Submit rollout replica ``replica`` to the running run in ``run_dir``; returns its job id."""
    from hpcrl.config import load_saved  # the root config only at this entry point

    run_dir = Path(run_dir).resolve()
    cfg = load_saved(run_dir)
    name = f"rollout-{replica}"
    spec = ComponentSpec(name, python_module("hpcrl.rollout", "--run-dir", str(run_dir), "--replica", str(replica)),
                         run_dir / "logs" / f"{name}.log", resources=cfg.launch.rollout)
    job_id = SlurmScheduler(run_dir / "logs" / "slurm").submit(spec)
    atomic.write_json(run_dir / "jobs" / f"{name}.json", {"job_id": job_id, "scheduler": "slurm", "argv": spec.argv})
    return job_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.launch.slurm")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add-rollout", help="submit one more rollout replica to a running run")
    add.add_argument("--run-dir", type=Path, required=True)
    add.add_argument("--replica", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        log.info("rollout-%d is Slurm job %s", args.replica, add_rollout(args.run_dir, args.replica))
    except SubmitRejected as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
