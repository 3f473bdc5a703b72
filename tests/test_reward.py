"""Tests for hpcrl.reward: answer extraction/verification and the runner that
contains raising, hanging, garbage-returning and crashing reward functions."""

from __future__ import annotations

import logging
import os
import time
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from hpcrl.reward import (
    RewardConfig,
    RewardRunner,
    answers_match,
    extract_answer,
    load_function,
    math_reward,
    parse_number,
)
from hpcrl.reward.runner import _WarningLimiter

if __package__:
    from . import reward_fixtures as fx
else:
    import reward_fixtures as fx

torch.set_num_threads(1)
FX = fx.__name__


# --- math_verify ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"First \boxed{3}, finally \boxed{\frac{1}{\sqrt{2}}} done", r"\frac{1}{\sqrt{2}}"),
        (r"\boxed{ {a}+{b} }", "{a}+{b}"),
        ("So 3 + 4 = 7. The answer is 42. Let me double check 9", "42"),
        ("the ANSWER IS: -3", "-3"),
        ("The answer is 1. Then the answer is 2", "2"),
        ("Answer: 3.50", "3.50"),
        ("reasoning 12\n#### 1,234", "1,234"),
        (r"answer: 5 but \boxed{6}", "6"),
        ("I think 10-3=7 so", "7"),
        ("x = -5", "-5"),
        ("it is 3/4 of it", "3/4"),
        ("the total is 1,234 apples", "1,234"),
        (r"we get \frac{3}{4} overall", r"\frac{3}{4}"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("59", Fraction(59)),
        ("-3", Fraction(-3)),
        ("1,234", Fraction(1234)),
        ("1,234,567.5", Fraction(2469135, 2)),
        ("3.50", Fraction(7, 2)),
        ("3/4", Fraction(3, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"\dfrac{3}{4}", Fraction(3, 4)),
        (r"-\frac{1}{2}", Fraction(-1, 2)),
        ("$5$", Fraction(5)),
        ("5.", Fraction(5)),
        ("\u22122", Fraction(-2)),
        ("1,2", None),
        ("3/0", None),
        ("nan", None),
        ("inf", None),
        ("x+1", None),
        ("", None),
    ],
)
def test_parse_number(text: str, expected: Fraction | None) -> None:
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    "predicted, reference, expected",
    [
        ("0.75", r"\frac{3}{4}", True),
        ("1,000", "1000", True),
        ("$18", "18", True),
        ("18 dollars", "18", True),
        ("5 or 6", "5", False),
        ("-5", "5", False),
        (r"\sqrt{2}", r"$\sqrt{2}$", True),
        ("(1, 2)", "(1,2)", True),
        ("x", "y", False),
        (None, "5", False),
        ("", "", False),
    ],
)
def test_answers_match(predicted: str | None, reference: str, expected: bool) -> None:
    assert answers_match(predicted, reference) is expected


def test_math_reward() -> None:
    assert math_reward("2+2?", r"so \boxed{4}", answer="4") == 1.0
    assert math_reward("2+2?", r"so \boxed{5}", answer="4") == 0.0
    assert math_reward("q", "The answer is 72.", answer="He earns 6*12 = 72\n#### 72", split="train") == 1.0
    assert math_reward("q", "no idea", answer="4") == 0.0


# --- config and loading ----------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"fn": "no_colon"}, "fn"),
        ({"fn": ":f"}, "fn"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"isolation": "fork"}, "isolation"),
        ({"max_workers": 0}, "max_workers"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        RewardConfig(**kwargs)


@pytest.mark.parametrize(
    "path, problem",
    [
        ("no_colon_here", "bad format"),
        ("a:b:c", "bad format"),
        ("hpcrl_no_such_module_xyz:f", "not found"),
        (f"{FX}:missing_fn", "no attribute"),
        (f"{FX}:NOT_CALLABLE", "not callable"),
    ],
)
def test_load_function_errors_name_the_path(path: str, problem: str) -> None:
    with pytest.raises(ValueError) as info:
        load_function(path)
    assert path in str(info.value) and problem in str(info.value)


def test_load_function_default_and_dotted() -> None:
    assert load_function(RewardConfig().fn) is math_reward
    assert load_function("fractions:Fraction.from_float")(0.5) == Fraction(1, 2)


def test_runner_rejects_bad_path_before_running() -> None:
    with pytest.raises(ValueError, match="hpcrl_no_such_module_xyz"):
        RewardRunner(RewardConfig(fn="hpcrl_no_such_module_xyz:f"))


def test_warning_limiter_suppresses_identical_warnings(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limiter = _WarningLimiter(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="hpcrl.reward.runner"):
        assert limiter.warn("m:f", "error", "boom")
        assert not limiter.warn("m:f", "error", "boom")
        assert limiter.warn("m:f", "error", "other")
        now[0] = 11.0
        assert limiter.warn("m:f", "error", "boom")
    assert "and 1 more like it" in caplog.records[-1].getMessage()


# --- runner, both isolation modes -------------------------------------------------


def _runner(fn: str, isolation: str, timeout_s: float = 5.0, max_workers: int = 2) -> RewardRunner:
    return RewardRunner(RewardConfig(fn=f"{FX}:{fn}", timeout_s=timeout_s, isolation=isolation, max_workers=max_workers))


def test_thread_values_and_errors(caplog: pytest.LogCaptureFixture) -> None:
    with _runner("exact", "thread") as runner:
        assert runner.score("p", "7", {"answer": "7"}).reward == 1.0
        assert runner.score("p", "8", {"answer": "7"}).status == "ok"
    expectations = {
        "returns_nan": (0.0, "invalid"),
        "returns_inf": (0.0, "invalid"),
        "returns_none": (0.0, "invalid"),
        "returns_str": (0.0, "invalid"),
        "returns_int": (2.0, "ok"),
    }
    for fn, (reward, status) in expectations.items():
        with _runner(fn, "thread") as runner:
            result = runner.score("p", "r", {"answer": "1"})
            assert (result.reward, result.status) == (reward, status), fn
    with _runner("returns_bool", "thread") as runner:
        assert runner.score("p", "yes", {}).reward == 1.0
        assert runner.score("p", "no", {}).reward == 0.0
    with caplog.at_level(logging.WARNING, logger="hpcrl.reward.runner"), _runner("raises", "thread") as runner:
        for _ in range(3):
            result = runner.score("p", "r", {"answer": "9"})
            assert (result.reward, result.status) == (0.0, "error")
        assert "ValueError" in result.detail and "bad row 9" in result.detail
        assert runner.counts == {"ok": 0, "error": 3, "timeout": 0, "invalid": 0}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and ":raises" in r.getMessage()]
    assert len(warnings) == 1  # identical warnings are rate-limited
    assert f"{FX}:raises" in warnings[0] and "bad row 9" in warnings[0]


def test_thread_timeout_abandons_call_and_keeps_working() -> None:
    with _runner("hangs_if_asked", "thread", timeout_s=0.5, max_workers=4) as runner:
        start = time.monotonic()
        result = runner.score("p", "hang", {})
        assert (result.reward, result.status) == (0.0, "timeout")
        assert time.monotonic() - start < 2.0
        assert runner.score("p", "fine", {}).status == "ok"
        start = time.monotonic()
        results = runner.score_many([("p", r, {}) for r in ["a", "hang", "b", "hang", "c"]])
        assert time.monotonic() - start < 2.5  # the two hangs time out concurrently
        assert [r.status for r in results] == ["ok", "timeout", "ok", "timeout", "ok"]
        assert runner.counts == {"ok": 4, "error": 0, "timeout": 3, "invalid": 0}


def test_to_reward_accepts_numpy_and_torch_scalars() -> None:
    import numpy as np

    from hpcrl.reward.runner import to_reward

    assert to_reward(np.float32(0.5))[:2] == (0.5, "ok")
    assert to_reward(np.bool_(True))[:2] == (1.0, "ok")
    assert to_reward(torch.tensor(0.25))[:2] == (0.25, "ok")
    assert to_reward(torch.tensor([1.0, 2.0]))[1] == "invalid"
    assert to_reward(np.float64("nan"))[1] == "invalid"
    assert to_reward(1 + 0j)[1] == "invalid"


def test_thread_score_many_preserves_order() -> None:
    with _runner("exact", "thread", max_workers=4) as runner:
        items = [("p", str(i % 3), {"answer": "1"}) for i in range(20)]
        rewards = [r.reward for r in runner.score_many(items)]
    assert rewards == [1.0 if i % 3 == 1 else 0.0 for i in range(20)]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may linger in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_process_timeout_kills_worker_and_restarts() -> None:
    with _runner("hangs_if_asked", "process", timeout_s=0.5, max_workers=1) as runner:
        old_pid = int(runner.score("p", "warm", {}).reward)  # worker started
        start = time.monotonic()
        result = runner.score("p", "hang", {})
        assert (result.reward, result.status) == (0.0, "timeout")
        assert time.monotonic() - start < 2.0
        assert not _running(old_pid)
        new = runner.score("p", "fine", {})
        assert new.status == "ok" and int(new.reward) not in (old_pid, os.getpid())
        assert runner.counts == {"ok": 2, "error": 0, "timeout": 1, "invalid": 0}


def test_process_timeout_kills_grandchildren(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    with _runner("hangs_with_child", "process", timeout_s=0.5, max_workers=1) as runner:
        assert runner.score("p", "r", {"pid_file": str(pid_file)}).status == "timeout"
    child_pid = int(pid_file.read_text())
    deadline = time.monotonic() + 2.0
    while _running(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child_pid)


def test_process_worker_death_is_an_error_and_worker_restarts() -> None:
    with _runner("exits", "process", max_workers=1) as runner:
        result = runner.score("p", "die", {})
        assert (result.reward, result.status) == (0.0, "error")
        assert "exit code 3" in result.detail
        assert runner.score("p", "ok", {}).reward == 0.5
    with _runner("segfaults", "process", max_workers=1) as runner:
        result = runner.score("p", "die", {})
        assert result.status == "error" and "exit code -11" in result.detail
        assert runner.score("p", "ok", {}).reward == 0.5


def test_process_runs_in_other_process_and_classifies() -> None:
    with _runner("worker_pid", "process", max_workers=2) as runner:
        pids = {r.reward for r in runner.score_many([("p", "r", {})] * 6)}
        assert float(os.getpid()) not in pids and 1 <= len(pids) <= 2
    with _runner("raises", "process", max_workers=1) as runner:
        result = runner.score("p", "r", {"answer": 4})
        assert result.status == "error" and "bad row 4" in result.detail
    with _runner("returns_nan", "process", max_workers=1) as runner:
        assert runner.score("p", "r", {}).status == "invalid"
        assert runner.counts["invalid"] == 1


def test_process_unpicklable_row_is_an_error() -> None:
    with _runner("exact", "process", max_workers=1) as runner:
        result = runner.score("p", "1", {"answer": "1", "bad": lambda: 0})
        assert result.status == "error" and "cannot send" in result.detail
        assert runner.score("p", "1", {"answer": "1"}).reward == 1.0


def test_call_threads_time_a_call_from_its_start_and_survive_a_hung_one() -> None:
    import threading
    import time

    from hpcrl.reward.threads import CallThreads

    pool = CallThreads(1)
    release = threading.Event()
    queued = [pool.submit(lambda: time.sleep(0.2) or "slow") for _ in range(3)]
    # one thread: the third call waits ~0.4 s in the queue, but only its own 0.2 s counts against 0.5 s
    assert all(pool.wait(c, 0.5) for c in queued) and [c.result for c in queued] == ["slow"] * 3
    hung = pool.submit(release.wait)
    assert pool.wait(hung, 0.1) is False and pool.abandoned == 1
    after = pool.submit(lambda: 7)
    assert pool.wait(after, 1.0) and after.result == 7  # a fresh thread took the hung one's place
    boom = pool.submit(lambda: (_ for _ in ()).throw(SystemExit(3)))
    assert pool.wait(boom, 1.0) and boom.result is None and "SystemExit" in boom.error
    assert pool.wait(pool.submit(lambda: 8), 1.0)  # a BaseException does not kill the thread
    release.set()
    pool.close()


def test_thread_isolation_reuses_its_threads() -> None:
    import threading

    from hpcrl.reward.runner import RewardConfig, RewardRunner

    with RewardRunner(RewardConfig(fn="hpcrl.reward.math_verify:math_reward", max_workers=4)) as runner:
        before = threading.active_count()
        for _ in range(20):
            results = runner.score_many([("1+1=", "2", {"answer": "2"})] * 8)
            assert [r.reward for r in results] == [1.0] * 8
        assert threading.active_count() <= before  # no thread per call, no pool per group


@pytest.mark.parametrize("reference, final, right", [
    (r"\sqrt{8}", r"2\sqrt{2}", True), ("(1,2]", "(1,2)", False), (r"\{1,2\}", r"\{2,1\}", True),
    ("3", "x=3", True), ("0.5", r"\frac{1}{2}", True), ("12", "13", False)])
def test_the_symbolic_verifier_runs_on_the_runners_threads(reference: str, final: str, right: bool) -> None:
    """math-verify behind reward.fn, called on the runner's worker threads (its own SIGALRM timeouts are off)."""
    pytest.importorskip("math_verify")
    with RewardRunner(RewardConfig(fn="hpcrl.reward.symbolic:symbolic_math_reward", timeout_s=30)) as runner:
        result = runner.score("p", f"So the answer is $\\boxed{{{final}}}$.", {"answer": reference})
    assert result.status == "ok" and result.reward == float(right), result
