"""hpcrl.runtime.cputime: CPU seconds per thread, named by the Python thread that owns each native id."""

from __future__ import annotations

import os
import threading
import time

import pytest

from hpcrl.runtime.cputime import _TICK, since, thread_cpu_s


def _fake_task(root, tid: int, comm: str, utime: int, stime: int) -> None:
    d = root / str(tid)
    d.mkdir()
    rest = ["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 30  # fields 3..: state, ..., utime (14), stime
    (d / "stat").write_text(f"{tid} ({comm}) " + " ".join(rest) + "\n")


def test_threads_are_named_by_python_and_the_rest_summed_as_native(tmp_path) -> None:
    """A comm with spaces and parentheses does not shift the fields; the caller's own thread is named; two threads
    Python did not start are summed; a task whose stat went away is skipped."""
    me = threading.get_native_id()
    _fake_task(tmp_path, me, "py (main) x", 3 * _TICK, _TICK)
    _fake_task(tmp_path, me + 100_001, "omp", _TICK, 0)
    _fake_task(tmp_path, me + 100_002, "gloo", 2 * _TICK, _TICK)
    (tmp_path / str(me + 100_003)).mkdir()  # ended while listed: no stat
    got = thread_cpu_s(tmp_path)
    assert got == {threading.current_thread().name: 4.0, "native": 4.0}


def test_no_proc_gives_nothing_and_an_odd_entry_is_skipped(tmp_path) -> None:
    assert thread_cpu_s(tmp_path / "missing") == {}
    (tmp_path / "not-a-tid").mkdir()
    (tmp_path / "not-a-tid" / "stat").write_text("1 (x) S" + " 0" * 40)
    assert thread_cpu_s(tmp_path) == {}


def test_since_counts_what_each_thread_burned_between_two_readings() -> None:
    """Start-up before the first reading is left out; a name first seen in the second reading counts whole; a
    reading that went down (a thread replaced by another of its name) counts 0, never less."""
    assert since({"MainThread": 12.5, "spool-publisher": 2.0, "native": 1.0}, {"MainThread": 9.0, "native": 3.0}) \
        == {"MainThread": 3.5, "spool-publisher": 2.0, "native": 0.0}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_a_busy_thread_shows_its_cpu_under_its_name() -> None:
    """For real: a thread that spins for 0.3 s of CPU is counted under its name, next to the main thread."""
    def spin() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.3:
            pass
        done.wait()

    done = threading.Event()
    t = threading.Thread(target=spin, name="spinner")
    t.start()
    try:
        deadline = time.monotonic() + 30
        while thread_cpu_s().get("spinner", 0.0) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        got = thread_cpu_s()
    finally:
        done.set()
        t.join()
    assert got["spinner"] >= 0.25 and "MainThread" in got
