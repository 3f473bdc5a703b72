"""Golden files of the sbatch scripts generated for each component's Slurm job, and resource checks.

No cluster needed: the scripts are rendered exactly as ``SlurmScheduler``
submits them (through submitit). Regenerate after an intended change with
``HPCRL_UPDATE_GOLDEN=1 pytest tests/test_slurm_scripts.py``.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("submitit")

from hpcrl.launch.config import ResourcesConfig  # noqa: E402
from hpcrl.launch.scheduler import ComponentSpec, SubmitRejected  # noqa: E402
from hpcrl.launch.slurm import SlurmScheduler, render_sbatch  # noqa: E402

pytestmark = pytest.mark.slurm
GOLDEN = Path(__file__).parent / "golden"
RUN = Path("/RUN")


def site_resources() -> ResourcesConfig:
    return ResourcesConfig(nodes=2, tasks_per_node=4, gpus_per_node=4, cpus_per_task=8, mem="200G", time_min=240, signal_s=300,
                           partition="gpu", account="proj123", qos="normal", constraint="a100", gres="gpu:4",
                           exclusive=True, extra_sbatch=["--reservation=rl", "#SBATCH --requeue"],
                           setup=["module load cuda/12.4", "source /opt/venv/bin/activate"],
                           container_image="nvcr.io/nvidia/pytorch:24.05-py3", container_mounts="/scratch:/scratch")


def specs() -> dict[str, ComponentSpec]:
    argv = ["python", "-m", "hpcrl.trainer", "--run-dir", str(RUN)]
    return {
        "trainer_site": ComponentSpec("trainer", argv, RUN / "logs/trainer-r{rank}.log", resources=site_resources(),
                                      tasks=8),
        "rollout_default": ComponentSpec("rollout-0", argv, RUN / "logs/rollout-0.log", resources=ResourcesConfig()),
    }


@pytest.mark.parametrize("name", ["trainer_site", "rollout_default"])
def test_generated_sbatch_script_matches_golden(name: str) -> None:
    text = render_sbatch(specs()[name], RUN / "logs/slurm").replace(sys.executable, "PYTHON")
    path = GOLDEN / f"slurm_{name}.sbatch"
    if os.environ.get("HPCRL_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


def test_task_layout_that_does_not_match_the_trainer_ranks_is_rejected_naming_the_key() -> None:
    spec = ComponentSpec("trainer", ["python"], RUN / "t.log", resources=ResourcesConfig(nodes=2, tasks_per_node=2),
                         tasks=2)
    with pytest.raises(SubmitRejected, match=r"trainer: .*launch\.trainer\.tasks_per_node: 2 node\(s\) x 2"):
        SlurmScheduler(RUN).executor(spec)


@pytest.mark.parametrize("override, message", [
    ("launch.rollout.extra_sbatch=[reservation=x]", "launch.rollout.extra_sbatch: expected options like"),
    ("launch.trainer.mem=4X", "launch.trainer.mem: expected a size"),
    ("launch.rollout.signal_s=3600", "launch.rollout.signal_s: must be between 1 and time_min*60-1 = 3599"),
    ("launch.preempt_grace_s=0", "launch.preempt_grace_s: must be > 0"),
    ("launch.trainer.container_mounts=/a:/a", "launch.trainer.container_mounts: set container_image"),
    # (a prefix: schedulers registered by other tests in this process follow the built-in ones)
    ("launch.scheduler=pbs", "launch.scheduler: must be one of ['local', 'slurm', 'srun'"),
])
def test_bad_resources_config_names_the_key(override: str, message: str) -> None:
    from hpcrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


class FakeJob:
    """What ``SlurmScheduler._code`` reads of a submitit job: its id and its files."""

    def __init__(self, folder: Path) -> None:
        self.job_id = "77"
        self.paths = type("Paths", (), {"folder": folder, "result_pickle": folder / "77_0_result.pkl",
                                        "stdout": folder / "77_0_log.out"})()

    def results(self) -> list[int]:
        import pickle

        return [pickle.loads(self.paths.result_pickle.read_bytes())[1]]


def test_a_cancelled_job_is_classified_by_what_its_component_did_not_by_when_the_state_was_read(
        tmp_path, monkeypatch) -> None:
    """Slurm sets CANCELLED at once and signals the processes afterwards: read then, the job used to count as a
    failure (exit 1) although its trainer went on to checkpoint and exit 75 (a free restart)."""
    import pickle

    from hpcrl.launch import slurm

    job, spec = FakeJob(tmp_path), specs()["rollout_default"]
    spec.log_path = tmp_path / "rollout-0.log"
    scheduler = SlurmScheduler(tmp_path)
    listed = {"77": True}
    monkeypatch.setattr(slurm, "still_listed", lambda job_id: listed[job_id])
    assert scheduler._code(job, spec, "CANCELLED", "") is None  # still stopping: undecided
    job.paths.result_pickle.write_bytes(pickle.dumps(("success", 75)))  # it checkpointed and exited 75
    listed["77"] = False
    assert scheduler._code(job, spec, "CANCELLED", "") == 75
    job.paths.result_pickle.unlink()  # killed before it could: a failure
    assert scheduler._code(job, spec, "CANCELLED", "") == 1
    assert "ended in state CANCELLED" in spec.log_path.read_text()
    (tmp_path / "exit.0.json").write_text('{"code": -9}')  # killed inside the job: the wrapper wrote the signal
    assert scheduler._code(job, spec, "FAILED", "") == -9


def test_a_preempted_job_is_a_free_restart_or_left_to_slurms_requeue_whatever_its_component_died_of(
        tmp_path, monkeypatch) -> None:
    """SIGTERM from a preemption before the component set its handler kills it (the wrapper writes -15): not a
    failure. Cancelled (PREEMPTED, gone): a free restart (75); requeued: the job comes back, nothing to decide;
    PREEMPTED without a code of the component's own: a free restart too."""
    from hpcrl.launch import slurm

    job, spec = FakeJob(tmp_path), specs()["rollout_default"]
    spec.log_path = tmp_path / "rollout-0.log"
    scheduler = SlurmScheduler(tmp_path)
    after = {"77": ("requeued", "PENDING")}
    monkeypatch.setattr(slurm, "after_run", lambda job_id, t: after[job_id])
    monkeypatch.setattr(slurm, "still_listed", lambda job_id: False)
    (tmp_path / "exit.0.json").write_text('{"code": -15}')
    assert scheduler._code(job, spec, "REQUEUED", "") is None
    assert scheduler._code(job, spec, "PREEMPTED", "") is None  # the same job runs again
    after["77"] = ("ended", "")
    assert scheduler._code(job, spec, "PREEMPTED", "") == 75
    assert "was preempted and its component died of it (-15)" in spec.log_path.read_text()
    (tmp_path / "exit.0.json").unlink()
    assert scheduler._code(job, spec, "PREEMPTED", "") == 75  # killed after the grace time, no code of its own


def test_a_job_pending_for_a_node_that_is_busy_or_reserved_waits_and_one_that_can_never_start_is_given_up(
        tmp_path, monkeypatch) -> None:
    """A rollout resubmitted to the node it was just preempted from waits with ``ReqNodeNotAvail`` (the node is
    reserved for the preemptor): it used to be cancelled as hopeless, a charged failure that ended the run."""
    from hpcrl.launch import slurm

    job, spec = FakeJob(tmp_path), specs()["rollout_default"]
    spec.log_path = tmp_path / "rollout-0.log"
    scheduler = SlurmScheduler(tmp_path)
    cancelled: list[str] = []
    monkeypatch.setattr(scheduler, "cancel", lambda job_id, sig=None: cancelled.append(job_id))
    for reason in ("ReqNodeNotAvail, UnavailableNodes:", "ReqNodeNotAvail, UnavailableNodes:node1",
                   "ReqNodeNotAvail", "Resources", "Priority", "BeginTime", "Dependency", "AssocGrpGRES",
                   "QOSGrpCpuLimit", "QOSMaxJobsPerUserLimit", "AssocMaxJobsLimit", "QOSMaxCpuPerUserLimit"):
        assert scheduler._code(job, spec, "PENDING", reason) is None, reason
    assert not cancelled
    for i, reason in enumerate(("PartitionTimeLimit", "DependencyNeverSatisfied", "QOSMaxGRESPerJob",
                                "AssocMaxCpuPerJobLimit", "QOSMaxMemoryPerNode", "QOSMinCpuNotSatisfied"), 1):
        assert scheduler._code(job, spec, "PENDING", reason) == 1, reason
        assert len(cancelled) == i
    assert set(cancelled) == {"77"} and "can never start" in spec.log_path.read_text()


def test_an_srun_step_stopped_to_be_restarted_ends_completed_and_hands_its_code_to_the_supervisor(tmp_path) -> None:
    """A component that exits 75 (walltime, preemption) inside an ``srun`` step used to leave the step FAILED
    75:0 in sacct. Each task now runs under ``slurm_job --codes``: 0 and 75 end the task 0 (COMPLETED), a
    failure or a kill ends it the same way; the supervisor gets the component's code either way."""
    import subprocess

    from hpcrl.launch.scheduler import LocalScheduler
    from hpcrl.launch.slurm import SrunScheduler
    from hpcrl.runtime.owner import ENV_INSTANCE

    ends = {"done": "pass", "stopped": "raise SystemExit(75)", "failed": "raise SystemExit(3)",
            "killed": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"}
    scheduler = SrunScheduler()
    for name, code in ends.items():
        spec = ComponentSpec(name, [sys.executable, "-c", code], tmp_path / f"{name}.log",
                             env={ENV_INSTANCE: "e1n1"})
        srun_argv = scheduler.command(spec).argv
        step = srun_argv[srun_argv.index(sys.executable):]  # what each task runs, without srun in front
        assert step[:3] == [sys.executable, "-m", "hpcrl.launch.slurm_job"] and step[-3:] == spec.argv
        task = subprocess.run(step, env={**os.environ, "SLURM_PROCID": "0"}, timeout=60)
        assert task.returncode == {"done": 0, "stopped": 0, "failed": 3, "killed": -9}[name]
        job_id = LocalScheduler.submit(scheduler, ComponentSpec(name, ["true"], tmp_path / f"{name}.srun.log"))
        scheduler._codes[job_id] = scheduler.codes_folder(spec)  # as submit() records it beside the srun
        assert scheduler.wait(job_id, 30) == {"done": 0, "stopped": 75, "failed": 3, "killed": -9}[name]


def test_an_srun_step_that_waits_for_room_in_the_allocation_is_queued_not_hung(tmp_path, monkeypatch) -> None:
    """A replica scaled beyond what the het group holds: srun waits to create its step ("step creation
    temporarily disabled, retrying"), which the watchdog must not take for a component that never sent a
    heartbeat. Only what this srun said counts, not an earlier srun's lines in the same log."""
    import time

    from hpcrl.launch.slurm import SrunScheduler

    go = tmp_path / "go"
    script = ("import sys, time, pathlib\n"
              "print('srun: Job 905 step creation temporarily disabled, retrying (Requested nodes are busy)', "
              "file=sys.stderr, flush=True)\n"
              f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.05)\n"
              "print('srun: Step created for job 905', file=sys.stderr, flush=True)\n"
              "time.sleep(30)\n")
    srun_log = tmp_path / "rollout-2.srun.log"
    # an earlier srun of the same component that never got its step (it was killed while it waited)
    srun_log.write_text("srun: Job 904 step creation temporarily disabled, retrying (Requested nodes are busy)\n")
    scheduler = SrunScheduler()
    monkeypatch.setattr(scheduler, "command", lambda spec: ComponentSpec(
        spec.name, [sys.executable, "-c", "import time; time.sleep(30)"], srun_log, spec.env))
    at_once = scheduler.submit(ComponentSpec("rollout-2", ["true"], tmp_path / "rollout-2.log"))
    try:
        assert not scheduler.queued(at_once)  # what the earlier srun said is not this one's
    finally:
        scheduler.cancel(at_once)
    monkeypatch.setattr(scheduler, "command", lambda spec: ComponentSpec(spec.name, [sys.executable, "-c", script],
                                                                          srun_log, spec.env))
    job_id = scheduler.submit(ComponentSpec("rollout-2", ["true"], tmp_path / "rollout-2.log"))
    try:
        deadline = time.time() + 30
        while not scheduler.queued(job_id):
            assert time.time() < deadline, srun_log.read_text()
            time.sleep(0.05)
        go.touch()
        while scheduler.queued(job_id):
            assert time.time() < deadline, srun_log.read_text()
            time.sleep(0.05)
        assert scheduler.poll(job_id) is None  # created: the step runs
    finally:
        scheduler.cancel(job_id)
    assert not SrunScheduler().queued("nosuchjob")


def test_a_running_job_that_sacct_still_shows_pending_is_read_running_from_the_controller(tmp_path,
                                                                                          monkeypatch) -> None:
    """slurmdbd lags the controller (seconds here, more under load): a trainer running for a while read PENDING in
    sacct, the supervisor took it for queued and restarted its heartbeat clock, then failed it as silent. squeue's
    word wins for every job it lists (a requeued job sacct still shows PREEMPTED reads PENDING); a finished job
    keeps sacct's word, and so does every job while the controller does not answer."""
    from hpcrl.launch.slurm_state import read_states

    fake = {"sacct": "echo '5|PENDING|None'; echo '6|COMPLETED|None'; echo '8|CANCELLED by 0|None'; "
                     "echo '9|PREEMPTED|None'",
            "squeue": "echo '5|RUNNING|None'; echo '7|PENDING|Resources'; echo '9|PENDING|BeginTime'"}
    for name, body in fake.items():
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    want = {"5": ("RUNNING", "None"), "6": ("COMPLETED", "None"), "7": ("PENDING", "Resources"),
            "8": ("CANCELLED", "None"), "9": ("PENDING", "BeginTime")}
    assert read_states(["5", "6", "7", "8", "9"]) == want
    (tmp_path / "squeue").write_text("#!/bin/sh\nexit 1\n")  # the controller does not answer
    assert read_states(["5", "6", "7", "8", "9"]) == {"5": ("PENDING", "None"), "6": ("COMPLETED", "None"),
                                                      "8": ("CANCELLED", "None"), "9": ("PREEMPTED", "None")}
