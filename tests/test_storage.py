"""Storage faults: the typed error, writes that leave nothing partial on a really full filesystem, the exit code
components stop with, the watchdog's free restart, the supervisor's retries and the sweep of dead writers'
temporaries."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from hpcrl.fs import atomic
from hpcrl.launch.leftovers import Sweeper, remove_all, temporaries
from hpcrl.launch.storage_wait import StorageWait
from hpcrl.fs.faults import EXIT_STORAGE, StorageError, filesystem, guarded, storage_fault
from hpcrl.watchdog.config import WatchdogConfig
from hpcrl.watchdog.policy import Watchdog

ROOT = Path(__file__).resolve().parents[1]


def full(path: str = "/x") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def test_a_storage_fault_names_the_operation_the_path_and_the_filesystem(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "file.json"  # not there yet: the filesystem is found from its parent
    with pytest.raises(StorageError) as info:
        with guarded("weight publish", target):
            raise full(str(target))
    err = info.value
    fs = filesystem(tmp_path)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and err.needs_space
    assert err.filesystem is not None and err.filesystem.mount == fs.mount
    text = str(err)
    assert "full" in text and "ENOSPC" in text and "weight publish" in text and str(target) in text
    assert f"filesystem {fs.mount}:" in text and "free of" in text and "inodes free" in text
    with pytest.raises(FileNotFoundError):  # not a storage fault: passes unchanged
        with guarded("read", target):
            raise FileNotFoundError(errno.ENOENT, "gone", str(target))
    wrapped = RuntimeError("h5py could not write")
    wrapped.__cause__ = OSError(errno.EIO, "Input/output error")
    assert storage_fault(wrapped).errno == errno.EIO and storage_fault(RuntimeError("bug")) is None
    from torch.distributed.checkpoint.api import CheckpointException  # a failed DCP save carries each rank's error

    dcp = CheckpointException("save", {0: (full(), None), 1: (ValueError("peer"), None)})
    assert storage_fault(dcp).errno == errno.ENOSPC
    rust = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")  # safetensors
    assert storage_fault(rust).errno == errno.ENOSPC and "RuntimeError" in storage_fault(rust).strerror
    assert storage_fault(RuntimeError("shape mismatch (os error 2)")) is None, "ENOENT is no storage fault"


def test_temporaries_carry_their_writers_instance(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HPCRL_INSTANCE", "e3n7")
    name = atomic.temporary_name(tmp_path / "v000004").name
    assert name == f"v000004.tmp.e3n7.{os.getpid()}" and atomic.temporary_writer(name) == "e3n7"
    monkeypatch.delenv("HPCRL_INSTANCE")
    assert atomic.temporary_writer(atomic.temporary_name(tmp_path / "a.json").name) is None
    assert atomic.temporary_writer("a.json") is None


SMALL_FS_WRITES = """
import errno, json, os, sys
from pathlib import Path
from hpcrl.fs import atomic
from hpcrl.fs.faults import StorageError
d = Path(sys.argv[1]); (d / "tmp").mkdir(); (d / "tickets").mkdir()
f = open(d / "filler", "wb", buffering=0)  # fill to the last byte
try:
    while True:
        f.write(b"x" * 4096)
except OSError:
    f.close()
out = {}


def _dir():
    with atomic.directory(d / "v1") as tmp:
        (tmp / "w").write_bytes(b"z" * 100000)


for what, call in (("write_json", lambda: atomic.write_json(d / "rec.json", {"k": "v" * 10000})),
                   ("create_exclusive", lambda: atomic.create_exclusive(d / "tickets" / "t0", b"y" * 10000, d / "tmp")),
                   ("directory", _dir)):
    try:
        call()
        out[what] = "written"
    except OSError as e:
        out[what] = {"errno": e.errno, "typed": isinstance(e, StorageError), "op": getattr(e, "op", None),
                     "text": str(e)}
out["left"] = sorted(p.name for p in d.rglob("*") if p.name != "filler" and p.is_file() or "tmp." in p.name)
(d / "filler").unlink()
out["after"] = [atomic.create_exclusive(d / "tickets" / "t0", b"y" * 10000, d / "tmp"),
                atomic.create_exclusive(d / "tickets" / "t0", b"other", d / "tmp")]
out["t0"] = len((d / "tickets" / "t0").read_bytes())
print(json.dumps(out))
"""


def run_on_small_fs(code: str, size: str = "2m") -> subprocess.CompletedProcess:
    """Run ``code`` with argv[1] a fresh tmpfs of ``size``, in a private mount namespace (a real full
    filesystem: the kernel says ENOSPC)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare for a private tmpfs")
    ns = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    script = textwrap.dedent(code)
    shell = f'd=$(mktemp -d) && mount -t tmpfs -o size={size} tmpfs "$d" && exec "$0" -c "$1" "$d"'
    proc = subprocess.run([*ns, "sh", "-c", shell, sys.executable, script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0 and "Operation not permitted" in proc.stderr and "unshare" in proc.stderr:
        pytest.skip(f"no private mount namespace here: {proc.stderr.strip()}")
    return proc


def test_on_a_full_filesystem_writes_fail_typed_and_leave_nothing_partial() -> None:
    import json

    proc = run_on_small_fs(SMALL_FS_WRITES)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for what, op in (("write_json", "write"), ("create_exclusive", "exclusive create")):
        got = out[what]
        assert got["errno"] == errno.ENOSPC and got["typed"] and got["op"] == op, out
        assert "full" in got["text"] and "free of" in got["text"], out
    assert out["directory"]["errno"] == errno.ENOSPC, out  # raised in the caller's block: an OSError, typed or not
    assert out["left"] == [], "no record, no temporary, no half-built directory left behind"
    assert out["after"] == [True, False] and out["t0"] == 10000, "once freed: one creator wins, whole"


def test_a_component_stops_with_exit_74_on_a_storage_fault_and_3_when_fenced(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import errno, logging, sys
        from hpcrl.runtime.exits import component_exit
        from hpcrl.runtime.owner import Fenced
        logging.basicConfig(level=logging.INFO)
        kind = sys.argv[1]
        with component_exit():
            if kind == "bug":
                raise ValueError("a bug")
            try:
                open(sys.argv[2] + "/x", "w").write("1")
                raise OSError(errno.ENOSPC, "No space left on device", sys.argv[2] + "/x")
            except OSError as e:
                if kind == "storage":
                    raise RuntimeError("h5py: can't write data") from e
                raise Fenced("owner epoch 2 took the run")  # fencing wins: the fault was this process's last act
    """)
    runs = {k: subprocess.run([sys.executable, "-c", code, k, str(tmp_path)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
            for k in ("storage", "fenced", "bug")}
    assert runs["storage"].returncode == EXIT_STORAGE, runs["storage"].stderr
    assert "storage fault (full, ENOSPC)" in runs["storage"].stderr and "free of" in runs["storage"].stderr
    assert "Traceback" not in runs["storage"].stderr
    assert runs["fenced"].returncode == 3
    assert runs["bug"].returncode == 1 and "ValueError: a bug" in runs["bug"].stderr


def test_the_watchdog_restarts_a_storage_stop_free_of_charge_with_a_growing_back_off() -> None:
    now = [0.0]
    dog = Watchdog(WatchdogConfig(max_restarts=0, backoff_s=1.0, backoff_max_s=8.0), clock=lambda: now[0])
    delays = []
    for _ in range(5):
        d = dog.assess("rollout-0", EXIT_STORAGE, None)
        assert d.action == "restart" and d.storage and "storage fault" in d.reason
        delays.append(d.delay_s)
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0]
    dog.started("rollout-0")
    now[0] += 8.0  # ran as long as the longest back-off: a later stop is a new fault
    assert dog.assess("rollout-0", EXIT_STORAGE, None).delay_s == 1.0
    crash = dog.assess("rollout-0", 1, None)
    assert crash.action == "fail" and not crash.storage, "the budget (0) was never charged by the storage stops"


def test_the_supervisors_retry_says_a_fault_once_keeps_its_heartbeat_and_stops_when_interrupted(
        tmp_path: Path, caplog) -> None:
    slept, beats, interrupted = [], [], [False]
    wait = StorageWait(tmp_path, min_free_bytes=0, keep_alive=lambda: beats.append(1),
                       interrupted=lambda: interrupted[0], sleep=slept.append, clock=lambda: sum(slept))
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) <= 3:
            raise full(str(tmp_path / "admission" / "reissue" / "t000000001"))
        return "done"

    with caplog.at_level(logging.INFO):
        assert wait.retry(flaky, "reissuing rollout-0's tickets") == "done"
    said = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 1 and "reissuing rollout-0's tickets" in said[0].getMessage()
    assert "free of" in said[0].getMessage() and "python -m hpcrl cancel" in said[0].getMessage()
    assert any("storage fault over after" in r.getMessage() for r in caplog.records)
    assert round(sum(slept)) == 1 + 2 + 4 and beats, "backed off 1, 2, 4 s, heartbeat kept meanwhile"
    interrupted[0] = True
    calls.clear()
    with pytest.raises(StorageError):
        wait.retry(flaky, "resubmitting rollout-0")
    assert len(calls) == 1
    assert wait.has_room() and not StorageWait(tmp_path, min_free_bytes=10 ** 18).has_room()


def _touch(path: Path, directory: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"w" * 100)
    else:
        path.write_bytes(b"t")
    return path


def test_the_sweep_removes_only_dead_writers_temporaries(tmp_path: Path) -> None:
    run = tmp_path / "run"
    dead_weights = _touch(run / "weights" / "v000005.tmp.e2n3.4242", directory=True)
    dead_ticket = _touch(run / "admission" / "tmp" / "t000000009.tmp.e2n3.4242")
    dead_reason = _touch(run / "spool" / "dropped" / "step_000001" / "x.h5.reason.tmp.e2n3.4242")
    old_epoch = _touch(run / "spool" / "tmp" / "g.h5.tmp.e1n9.77")
    live = _touch(run / "weights" / "v000006.tmp.e2n4.5151", directory=True)
    no_instance = _touch(run / "jobs" / "registry.json.tmp.99")
    ckpt = _touch(run / "ckpt" / "step_000010.tmp", directory=True)
    whole = _touch(run / "weights" / "v000004", directory=True)
    assert set(temporaries(run)) == {dead_weights, dead_ticket, dead_reason, old_epoch, live, no_instance, ckpt}
    now = [100.0]
    sweep = Sweeper(run, epoch=2, grace_s=30.0, clock=lambda: now[0])
    sweep.retired("e2n3")
    assert sweep.tick() == Counter() and dead_weights.exists(), "within the grace period nothing goes"
    now[0] += 31
    assert sweep.tick() == Counter({"weights": 1, "admission": 1, "spool": 2})
    assert not any(p.exists() for p in (dead_weights, dead_ticket, dead_reason, old_epoch))
    assert all(p.exists() for p in (live, no_instance, ckpt, whole)), "a live writer's, and what no instance names"
    assert remove_all(run) == Counter({"weights": 1, "jobs": 1, "ckpt": 1}) and whole.exists()
    assert temporaries(run) == []


def test_a_metrics_log_cut_mid_line_by_a_full_filesystem_loses_no_record_of_the_next_leg(tmp_path: Path) -> None:
    from hpcrl.metrics.writer import MetricsWriter, read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')  # ENOSPC mid-line
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write({"step": 2, "reward": 0.25})
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_status_gives_the_filesystem_and_the_runs_footprint_by_area(tmp_path: Path) -> None:
    from hpcrl.launch.footprint import format_storage, storage_status

    run = tmp_path / "run"
    (run / "spool" / "trained" / "step_000001").mkdir(parents=True)
    (run / "spool" / "trained" / "step_000001" / "g.h5").write_bytes(b"s" * 3000)
    _touch(run / "weights" / "v000002.tmp.e1n2.7", directory=True)  # 100 bytes, a temporary
    (run / "config.yaml").write_text("x" * 10)
    st = storage_status(run, min_free_gb=0.0)
    block = os.stat(run / "config.yaml").st_blocks * 512  # what one small file takes on this filesystem
    assert st["footprint"] == {"spool": os.stat(run / "spool/trained/step_000001/g.h5").st_blocks * 512,
                               "weights": block, "ckpt": 0, "logs": 0, "admission": 0, "eval": 0, "other": block}
    assert st["footprint"]["spool"] >= 3000 and block >= 10, "allocated blocks, what a quota counts"
    assert st["temporaries"] == 1 and st["filesystem"]["mount"] == filesystem(run).mount
    text = format_storage(st)
    assert "run footprint" in text and "spool" in text and "weights" in text and "; 1 temporaries" in text, text
    assert "BELOW" not in text
    assert "BELOW launch.min_free_gb" in format_storage(storage_status(run, min_free_gb=1e9))


def test_a_component_stop_is_said_as_a_fault_only_while_there_is_no_room(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO):
        StorageWait(tmp_path, min_free_bytes=0).stopped(["rollout-0"])
        assert [r.levelno for r in caplog.records] == [logging.WARNING], "over already: one warning, no fault"
        assert "has room now" in caplog.records[0].getMessage()
        caplog.clear()
        wait = StorageWait(tmp_path, min_free_bytes=10 ** 18)
        wait.stopped(["trainer-r0"])
        wait.stopped(["rollout-0"])
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said[0][0] == logging.ERROR and "trainer-r0 stopped on it (exit 74)" in said[0][1]
    assert "free of" in said[0][1] and said[1] == (logging.INFO, "storage fault: rollout-0 stopped on it (exit 74) too")


def test_a_component_stop_and_the_supervisors_own_write_on_one_filesystem_are_one_fault(tmp_path: Path,
                                                                                       caplog) -> None:
    wait = StorageWait(tmp_path, min_free_bytes=10 ** 18, sleep=lambda s: None)
    with caplog.at_level(logging.INFO):
        wait.stopped(["rollout-0"])
        wait.fault(full(str(tmp_path / "admission" / "reissue" / "t1")), "reissuing rollout-0's tickets")
        wait.fault(OSError(errno.EIO, "Input/output error", str(tmp_path / "x")), "recording the jobs")
    assert [r.levelno for r in caplog.records].count(logging.ERROR) == 1 and wait.faults == 1


def test_an_event_log_cut_mid_line_keeps_every_later_record(tmp_path: Path) -> None:
    log_path = tmp_path / "events.jsonl"
    log_path.write_text('{"action": "start"}\n{"action": "resta')  # a full filesystem cut this append
    atomic.append_line(log_path, '{"action": "restart"}')
    atomic.append_line(log_path, '{"action": "stop"}')
    assert log_path.read_text().splitlines()[1:] == ['{"action": "resta', '{"action": "restart"}', '{"action": "stop"}']


def test_below_the_floor_admission_pauses_and_a_periodic_checkpoint_is_held_off(tmp_path: Path, caplog) -> None:
    import torch

    from hpcrl.admission.config import AdmissionConfig
    from hpcrl.admission.ledger import AdmissionLedger
    from hpcrl.ckpt.config import CheckpointConfig
    from hpcrl.fs.space import SpaceFloor
    from hpcrl.runtime.dist import DistContext
    from hpcrl.trainer.checkpoint import Checkpointer

    now = [0.0]
    floor = SpaceFloor(tmp_path, 10 ** 18, "admission", every_s=2.0, clock=lambda: now[0])
    ledger = AdmissionLedger(tmp_path / "admission", AdmissionConfig(batch_size=2), num_rows=10, floor=floor)
    with caplog.at_level(logging.WARNING):
        assert ledger.try_admit(0, "r0") is None and ledger.num_created() == 0
        assert ledger.try_admit(0, "r0") is None
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["admission held off"], "said once"
    floor.min_free_bytes = 1  # space came back
    assert ledger.try_admit(0, "r0") is None, "the floor's answer holds for every_s"
    now[0] += 2.0
    assert ledger.try_admit(0, "r0").index == 0
    assert "admission resumed" in caplog.records[-1].getMessage()

    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    ckpt = Checkpointer(tmp_path / "ckpt", CheckpointConfig(every_steps=5), ctx, "h",
                        floor=SpaceFloor(tmp_path, 10 ** 18, "checkpointing"))
    assert not ckpt.due(5, last_step=10), "no room: the periodic one waits for the next due step"
    assert ckpt.due(10, last_step=10), "the run's last checkpoint is never held off"
    ckpt.floor = SpaceFloor(tmp_path, 0, "checkpointing")
    assert ckpt.due(5, last_step=10)


def test_a_batch_that_does_not_come_while_below_the_floor_is_a_storage_fault_not_a_dead_rollout(tmp_path) -> None:
    from hpcrl.admission.config import AdmissionConfig
    from hpcrl.admission.ledger import AdmissionLedger
    from hpcrl.fs.space import SpaceFloor
    from hpcrl.spool.store import Spool
    from hpcrl.trainer.feed import BatchFeed, BatchTimeout

    def feed(min_free: int) -> BatchFeed:
        ledger = AdmissionLedger(tmp_path / f"admission{min_free}", AdmissionConfig(batch_size=2), num_rows=10,
                                 floor=SpaceFloor(tmp_path, min_free, "space"))
        return BatchFeed(Spool(tmp_path / f"spool{min_free}"), ledger, 2, 1, timeout_s=0.1)

    with pytest.raises(StorageError) as info:
        feed(10 ** 18).next_batch(0)
    assert info.value.errno == errno.ENOSPC and "launch.min_free_gb" in str(info.value)
    with pytest.raises(BatchTimeout):
        feed(1).next_batch(0)


def test_a_network_timeout_is_no_storage_fault_but_a_filesystem_call_that_timed_out_is() -> None:
    assert storage_fault(TimeoutError(errno.ETIMEDOUT, "Connection timed out")) is None
    assert storage_fault(RuntimeError("connect failed: [Errno 110] Connection timed out")) is None
    assert storage_fault(OSError(errno.ETIMEDOUT, "Connection timed out", "/lustre/run/spool/x")) is not None


def test_where_hard_links_are_refused_an_exclusive_record_is_created_in_place(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tickets").mkdir()

    def refused(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted", src)

    monkeypatch.setattr(os, "link", refused)
    assert atomic.create_exclusive(tmp_path / "tickets" / "t0", b"first", tmp_path / "tmp")
    assert not atomic.create_exclusive(tmp_path / "tickets" / "t0", b"second", tmp_path / "tmp")
    assert (tmp_path / "tickets" / "t0").read_bytes() == b"first" and not list((tmp_path / "tmp").iterdir())
