"""Code rewards: a model-written Python program, run in the sandbox against hidden tests.

``reward.scorer: code`` (:mod:`hpcrl.reward.registry`). A row of a code task
carries, besides its prompt:

* ``tests``: a JSON list of ``[args, expected]`` pairs, ``args`` the
  positional arguments of one call and ``expected`` its JSON result;
* ``entry`` (optional, default ``f``): the function the program must define;
* ``form`` (optional, default ``program``): ``program`` = the response is a
  program that defines ``entry``; ``expression`` = the response is one
  Python expression in ``x``, the body of ``lambda x: ...``.

The response's code is its last fenced block (```` ```python ... ``` ````), or
the whole response. A trusted harness in the sandbox
(:mod:`hpcrl.reward.sandbox`) loads it, calls it on each test's arguments and
prints the results as JSON; the expected values never enter the sandbox, and
the comparison runs here, on plain JSON values. So a program cannot pass by
printing "all tests passed", by exiting early (``sys.exit(0)``,
``os._exit``), by returning an object that equals everything, or by reading
the answers: it passes only by returning the right values. The reward is 1.0
when every test passes, else 0.0 (``detail`` says how many passed, or why
the program failed).

A program that fails in any way (an exception, a limit, the timeout, too
much output) scores 0 with status ``ok`` (it was scored: it failed) except
for the wall-clock timeout (status ``timeout``); the reasons are counted in
:attr:`CodeScorer.counts` as ``program_<why>``. A sample whose sandbox could
not run at all scores status ``infra_error``: that says nothing of the
program, and the rollout does not train it as a 0.

Lifecycle: built once per process from the ``reward`` config (the sandbox is
probed then, and a machine that cannot contain programs refuses at once);
``score``/``score_many`` from one thread (``score_many`` runs up to
``reward.max_workers`` sandboxes at a time); ``close()`` stops the pool.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hpcrl.reward.config import RewardConfig
from hpcrl.reward.sandbox import Sandbox, SandboxResult
from hpcrl.reward.scorer import Item, RewardResult

__all__ = ["CodeScorer", "extract_code", "judge"]

MARK = "#hpcrl-results#"  # the harness's line of results (what precedes it on stdout is the program's)
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Runs inside the sandbox. Loads the candidate, calls it on each test's arguments, prints one results line.
HARNESS = r'''
import json, sys
inputs = json.load(open("/task/inputs.json"))
spec = json.load(open("/task/spec.json"))
src = open("/task/candidate.py").read()
sys.setrecursionlimit(10000)
def plain(v, depth=0):
    if depth > 50:
        raise ValueError("nested too deeply")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [plain(x, depth + 1) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (set, frozenset)):
        return sorted(plain(x, depth + 1) for x in v)
    return "<" + type(v).__name__ + ">"
try:
    ns = {"__name__": "candidate"}
    if spec["form"] == "expression":
        fn = eval(compile("lambda x: (" + src + "\n)", "candidate", "eval"), ns)
    else:
        exec(compile(src, "candidate", "exec"), ns)
        fn = ns[spec["entry"]]
except BaseException as e:
    print(MARK + json.dumps({"load_error": type(e).__name__ + ": " + str(e)[:200]}), flush=True)
    raise SystemExit(0)
results = []
for args in inputs:
    try:
        value = plain(fn(*args))
        json.dumps(value)
        results.append(["ok", value])
    except BaseException as e:
        results.append(["raised", type(e).__name__])
print(MARK + json.dumps({"results": results}), flush=True)
'''.replace("MARK", repr(MARK))


def extract_code(response: str) -> str:
    """The last fenced code block of ``response``, or the whole of it."""
    blocks = _FENCE.findall(response)
    return (blocks[-1] if blocks else response).strip()


def judge(run: SandboxResult, expected: list[Any]) -> tuple[float, str]:
    """(reward, detail) of a finished run against the expected values: 1.0 only when every result is right. The
    results line may be the program's own (printed before it exits): anything but well-formed results scores 0."""
    lines = [line for line in run.stdout.decode(errors="replace").splitlines() if line.startswith(MARK)]
    if not lines:
        return 0.0, f"no results ({run.status}{': ' + run.detail if run.detail else ''})"
    try:
        got = json.loads(lines[-1][len(MARK):])
        if isinstance(got, dict) and "load_error" in got:
            return 0.0, f"does not load: {str(got['load_error'])[:200]}"
        results = got.get("results") if isinstance(got, dict) else None
        if not isinstance(results, list) or len(results) != len(expected):
            return 0.0, "malformed results"
        passed = sum(1 for r, want in zip(results, expected)
                     if isinstance(r, list) and len(r) == 2 and r[0] == "ok" and _same(r[1], want))
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return 0.0, "unreadable results"
    return (1.0 if passed == len(expected) else 0.0), f"{passed}/{len(expected)} tests passed"


def _same(got: Any, want: Any) -> bool:
    """Equal as JSON values, with bool and int told apart (True is not 1) and floats to 1e-9."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, float) or isinstance(got, float):
        return isinstance(got, (int, float)) and isinstance(want, (int, float)) and abs(got - want) <= 1e-9 * max(
            1.0, abs(want))
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


class CodeScorer:
    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.sandbox = Sandbox(cfg.sandbox)
        self._counts: Counter = Counter()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix="code-reward")

    def score(self, prompt: str, response: str, row: dict) -> RewardResult:
        try:
            tests = _tests(row)
        except ValueError as e:
            return self._record(RewardResult(0.0, "invalid", f"the row's tests: {e}"), "bad_row")
        spec = {"entry": str(row.get("entry") or "f"), "form": str(row.get("form") or "program")}
        files = {"harness.py": HARNESS, "candidate.py": extract_code(response), "spec.json": json.dumps(spec),
                 "inputs.json": json.dumps([args for args, _ in tests])}
        run = self.sandbox.run(files, ["python", "-I", "/task/harness.py"])
        if run.infra_error:
            return self._record(RewardResult(0.0, "infra_error", run.detail), "sandbox_failed")
        reward, detail = judge(run, [want for _, want in tests])
        if run.status == "timeout":
            return self._record(RewardResult(0.0, "timeout", detail), "program_timeout")
        why = "passed" if reward else ("failed" if run.status == "ok" else run.status)
        if run.status != "ok" and run.detail not in detail:
            detail = f"{detail}; {run.detail}"
        return self._record(RewardResult(reward, "ok", detail), f"program_{why}")

    def score_many(self, items: list[Item]) -> list[RewardResult]:
        return list(self._pool.map(lambda item: self.score(*item), items))

    @property
    def counts(self) -> dict[str, int]:
        """Results by status, and by what the program did (``program_passed``, ``program_failed``,
        ``program_exit``, ``program_signal``, ``program_timeout``, ``program_output_limit``; ``sandbox_failed``: an
        infra_error; ``bad_row``: a row without usable tests)."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _record(self, result: RewardResult, why: str) -> RewardResult:
        with self._lock:
            self._counts[result.status] += 1
            self._counts[why] += 1
        return result


def _tests(row: dict) -> list[tuple[list, Any]]:
    raw = row.get("tests")
    tests = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(tests, list) or not tests:
        raise ValueError("expected a non-empty JSON list of [args, expected]")
    out = []
    for t in tests:
        if not (isinstance(t, list) and len(t) == 2 and isinstance(t[0], list)):
            raise ValueError(f"each test is [args, expected] with args a list, got {t!r:.80}")
        out.append((t[0], t[1]))
    return out
