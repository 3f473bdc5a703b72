"""The sandbox for model-written programs, against hostile programs (each one contained, scored 0 with its reason
counted, and the scorer goes on), and the code scorer's judgement.

Real bubblewrap (Debian's ``bubblewrap``, installed by the test command); nothing is mocked. Each program runs
under small limits so that the whole file takes seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hpcrl.config import ConfigError, load_config
from hpcrl.reward.code import CodeScorer, extract_code, judge
from hpcrl.reward.config import RewardConfig, SandboxConfig
from hpcrl.reward.registry import build_scorer
from hpcrl.reward.sandbox import Sandbox, SandboxResult, SandboxUnavailable

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

ROOT = Path(__file__).resolve().parents[1]
LIMITS = SandboxConfig(wall_s=4.0, cpu_s=1, memory_mb=256, processes=32, output_bytes=4096)
REVERSE = json.dumps([[[[1, 2, 3]], [3, 2, 1]], [[[]], []], [[["a", "b"]], ["b", "a"]]])
GOOD = "def f(xs):\n    return xs[::-1]\n"


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS)


@pytest.fixture(scope="module")
def scorer():
    s = CodeScorer(RewardConfig(scorer="code", sandbox=LIMITS, max_workers=2))
    yield s
    s.close()


def run(sandbox: Sandbox, program: str, *args: str) -> SandboxResult:
    return sandbox.run({"main.py": program}, ["python", "/task/main.py", *args])


def alive(marker: str) -> list[str]:
    """Processes on this machine whose command line holds ``marker``."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def test_a_plain_program_runs_and_sees_only_its_own_world(sandbox: Sandbox) -> None:
    r = run(sandbox, "import os, sys\nprint(sys.version_info[0], os.getcwd(), sorted(os.environ), os.listdir('/'))")
    assert r.status == "ok" and r.returncode == 0, r
    major, cwd, rest = r.stdout.decode().split(" ", 2)
    assert major == "3" and cwd == "/tmp"
    env, top = rest.rsplit("] [", 1)
    assert set(eval(env + "]")) <= {"PATH", "HOME", "LANG", "PYTHONDONTWRITEBYTECODE", "PWD", "SHLVL"}  # none of ours
    assert not {"work", "root", "home"} & set(eval("[" + top))  # nothing of the run directory or $HOME


def test_a_failure_before_the_program_starts_is_the_sandboxs_and_a_program_cannot_fake_either(sandbox) -> None:
    """Only a trusted shell, after the namespaces, mounts and limits, says "started" (on a descriptor the program
    never holds): a sandbox that fails before it is an infra error, a program that fails is the program's."""
    broken = Sandbox.__new__(Sandbox)
    broken.cfg, broken._tools = SandboxConfig(open_files=10**9), sandbox._tools  # prlimit cannot set this
    r = broken.run({"main.py": "print(1)"}, ["python", "/task/main.py"])
    assert r.status == "infra_error" and "NOFILE" in r.detail, r
    r = run(sandbox, "import sys\nsys.stderr.write('bwrap: Creating new namespace failed')\nsys.exit(1)\n")
    assert r.status == "exit" and r.returncode == 1  # the program's own exit, whatever it prints
    r = run(sandbox, "import os\nfor fd in range(3, 256):\n    try:\n        os.write(fd, b'x')\n"
                     "        print(fd)\n    except OSError:\n        pass\n")
    assert r.status == "ok" and r.stdout == b"", r.stdout  # no descriptor of the host's reaches it


def test_standard_input_is_given_and_cannot_block_the_caller(sandbox: Sandbox) -> None:
    r = sandbox.run({"main.py": "import sys\nprint(sys.stdin.read()[::-1])"}, ["python", "/task/main.py"],
                    stdin=b"abc")
    assert r.status == "ok" and r.stdout == b"cba\n", r
    r = sandbox.run({"main.py": "print('ignored')"}, ["python", "/task/main.py"], stdin=b"x" * 4 * 2**20)
    assert r.status == "ok" and r.stdout == b"ignored\n", r
    with pytest.raises(ValueError, match="plain file name"):
        sandbox.run({"../escape.py": "x"}, ["python", "/task/main.py"])


def test_an_infinite_loop_is_stopped_by_the_cpu_limit(sandbox: Sandbox) -> None:
    r = run(sandbox, "while True:\n    pass\n")
    assert r.status == "signal" and "CPU-time limit" in r.detail, r


def test_a_sleeping_program_is_stopped_by_the_wall_clock(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    r = run(sandbox, "import time\ntime.sleep(60)\n")
    assert r.status == "timeout" and time.monotonic() - t0 < LIMITS.wall_s + 2, r


def test_a_fork_bomb_hits_the_process_limit_and_leaves_nothing_behind(sandbox: Sandbox) -> None:
    marker = "forkbomb-4711"
    r = run(sandbox, "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                     "        time.sleep(0.01)\n", marker)
    assert r.status in ("signal", "timeout"), r  # it keeps trying until a limit ends it
    time.sleep(0.2)
    assert not alive(marker), alive(marker)
    plain = run(sandbox, "import os\nwhile True:\n    os.fork()\n")  # fork() fails at the limit: it raises
    assert plain.status in ("exit", "output_limit") and b"BlockingIOError" in plain.stderr, plain


def test_a_memory_bomb_fails_inside_its_limit(sandbox: Sandbox) -> None:
    r = run(sandbox, "x = bytearray(2 * 1024**3)\n")
    assert r.status == "exit" and b"MemoryError" in r.stderr, r


def test_gigabytes_of_output_are_cut_off_at_once(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    r = run(sandbox, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n")
    assert r.status == "output_limit" and len(r.stdout) <= LIMITS.output_bytes, r.status
    assert time.monotonic() - t0 < 2.0
    r = run(sandbox, "import sys\nwhile True:\n    sys.stderr.write('y' * 65536)\n")
    assert r.status == "output_limit" and len(r.stderr) <= LIMITS.output_bytes


def test_writes_outside_the_working_directory_reach_nothing(sandbox: Sandbox, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "spool").mkdir(parents=True)
    os.chmod(tmp_path, 0o777)  # even a directory anyone may write to stays out of reach
    os.chmod(run_dir, 0o777)
    outside = [run_dir / "spool" / "evil.h5", run_dir / "DONE", Path.home() / "evil", ROOT / "evil.py",
               Path("/usr/evil")]
    targets = outside + [Path("/tmp/hpcrl-evil")]  # /tmp: the sandbox's own tmpfs, not the host's
    program = ("import sys\nfor path in sys.argv[1:]:\n    try:\n        open(path, 'w').write('x')\n"
               "        print('wrote', path)\n    except OSError as e:\n"
               "        print('refused', path, type(e).__name__)\n")
    r = run(sandbox, program, *map(str, targets))
    assert r.status == "ok" and r.stdout.count(b"refused") == len(outside), r.stdout
    assert not any(p.exists() for p in targets)
    big = run(sandbox, "open('/tmp/big', 'wb').write(b'x' * 64 * 1024**2)\n")  # over file_mb
    assert big.status == "exit" and b"File too large" in big.stderr, big


def test_the_runs_files_and_the_jobs_environment_are_not_readable(sandbox: Sandbox, tmp_path: Path,
                                                                  monkeypatch) -> None:
    secret = "hpcrl-secret-0451"
    monkeypatch.setenv("HPCRL_TEST_SECRET", secret)
    (tmp_path / "admin_key").write_text(secret)
    os.chmod(tmp_path, 0o755)
    program = ("import glob, os, sys\nout = [repr(dict(os.environ))]\n"
               "for p in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline') + sys.argv[1:]:\n"
               "    try:\n        out.append(open(p, 'rb').read().decode(errors='replace'))\n"
               "    except OSError as e:\n        out.append(type(e).__name__)\nprint('\\n'.join(out))\n")
    r = run(sandbox, program, str(tmp_path / "admin_key"), f"/proc/{os.getpid()}/environ")
    assert r.status == "ok", r
    assert secret not in r.stdout.decode() and "FileNotFoundError" in r.stdout.decode()


def test_no_socket_reaches_the_jobs_ports(sandbox: Sandbox) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port, accepted = server.getsockname()[1], []

    def accept() -> None:
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    program = ("import socket, sys\nfor host in ('127.0.0.1', 'localhost', '8.8.8.8'):\n    try:\n"
               "        socket.create_connection((host, int(sys.argv[1])), timeout=1)\n"
               "        print('connected', host)\n"
               "    except OSError as e:\n        print('refused', host, type(e).__name__)\n")
    r = run(sandbox, program, str(port))
    t.join()
    server.close()
    assert r.status == "ok" and b"connected" not in r.stdout and not accepted, (r.stdout, accepted)


def test_killing_its_parent_or_process_group_kills_only_itself(sandbox: Sandbox) -> None:
    program = ("import os, signal, sys\nfor pid in (int(sys.argv[1]), os.getppid(), 1, -1):\n    try:\n"
               "        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(pid, type(e).__name__)\n"
               "os.killpg(0, signal.SIGKILL)\n")
    r = run(sandbox, program, str(os.getpid()))
    assert r.status == "signal" and "SIGKILL" in r.detail, r
    assert run(sandbox, "print('still here')").stdout == b"still here\n"  # and this process lives on


def test_a_daemonised_child_dies_with_its_sandbox(sandbox: Sandbox) -> None:
    marker = "daemon-0815"
    program = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               "        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[1]])\n"
               "    os._exit(0)\nprint('parent gone')\n")
    r = run(sandbox, program, marker)
    assert r.status == "ok", r
    time.sleep(0.3)
    assert not alive(marker), alive(marker)
    r = run(sandbox, program.replace("print('parent gone')", "time.sleep(60)"), marker)  # parent outlives the clock
    assert r.status == "timeout"
    time.sleep(0.3)
    assert not alive(marker), alive(marker)


@pytest.mark.parametrize("response, why", [
    ("import sys\nprint('3/3 tests passed')\nsys.exit(0)\n", "does not load: SystemExit"),
    ("import os\nprint('#hpcrl-results#' + '{\"results\": [[\"ok\", 1], [\"ok\", 1], [\"ok\", 1]]}', flush=True)\n"
     "os._exit(0)\n",
     "0/3 tests passed"),
    ("class Any:\n    def __eq__(self, other):\n        return True\ndef f(xs):\n    return Any()\n",
     "0/3 tests passed"),
    ("def f(xs):\n    import sys\n    sys.exit(0)\n", "0/3 tests passed"),
    ("def f(xs):\n    return [str(x) for x in xs[::-1]]\n", "2/3 tests passed"),
])
def test_tricks_score_nothing(scorer: CodeScorer, response: str, why: str) -> None:
    r = scorer.score("reverse the list", response, {"answer": "", "tests": REVERSE})
    assert r.reward == 0.0 and r.status == "ok" and why in r.detail, r


def test_hostile_programs_are_scored_zero_with_their_reasons_and_the_scorer_goes_on(scorer: CodeScorer) -> None:
    hostile = ["def f(xs):\n    while True:\n        pass\n",
               "import os\nwhile True:\n    os.fork()\n",
               "def f(xs):\n    return bytearray(2 * 1024**3)\n",
               "print('x' * 10**7)\n",
               "import os\nos.killpg(0, 9)\n"]
    before = scorer.counts
    results = scorer.score_many([("p", h, {"answer": "", "tests": REVERSE}) for h in hostile] +
                                [("p", f"```python\n{GOOD}```", {"answer": "", "tests": REVERSE})])
    assert [r.reward for r in results] == [0.0] * len(hostile) + [1.0], results
    assert all(r.status == "ok" for r in results)
    after = scorer.counts
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    assert grew["program_passed"] == 1 and grew["ok"] == 6
    assert grew.get("program_signal", 0) >= 2 and grew.get("program_output_limit") == 1, grew


def test_the_expression_form_and_the_judge() -> None:
    assert extract_code("Here:\n```python\nx = 1\n```\nand\n```\ndef f(x):\n    return x\n```") == \
        "def f(x):\n    return x"
    assert extract_code("  x[::-1] ") == "x[::-1]"
    ok = SandboxResult("ok", 0, b'noise\n#hpcrl-results#{"results": [["ok", 1.0], ["ok", [true, 2]]]}\n', b"", 0.0)
    assert judge(ok, [1, [True, 2]]) == (1.0, "2/2 tests passed")
    assert judge(ok, [1, [1, 2]])[0] == 0.0  # True is not 1
    for forged in ("5", "null", '"load_error"', "[" * 100000, '{"results": 3}', '{"load_error": 1}',
                   '{"results": [["ok", ' + "[" * 5000 + "]" * 5000 + "]]}"):  # what a program may print itself
        line = SandboxResult("ok", 0, f"#hpcrl-results#{forged}\n".encode(), b"", 0.0)
        assert judge(line, [1])[0] == 0.0


def test_the_code_scorer_is_a_choice_of_the_config_and_counts_infra_errors(tmp_path: Path) -> None:
    cfg = load_config(str(ROOT / "configs/quickstart.yaml"), ["reward.scorer=code", "reward.sandbox.wall_s=2"])
    scorer = build_scorer(cfg.reward)
    try:
        row = {"answer": "", "tests": REVERSE, "form": "expression"}
        assert scorer.score("p", "x[::-1]", row).reward == 1.0
        assert scorer.score("p", "x", {"answer": ""}).status == "invalid"  # a row without tests
        scorer.sandbox._tools["bwrap"] = "/nonexistent/bwrap"  # the sandbox cannot start: the program never ran
        r = scorer.score("p", "x[::-1]", row)
        assert r.status == "infra_error" and scorer.counts["infra_error"] == 1, r
        scorer.sandbox.cfg = SandboxConfig(scratch_dir=str(tmp_path / "gone"))  # nor can it be staged
        assert scorer.score("p", "x[::-1]", row).status == "infra_error"
    finally:
        scorer.close()
    with pytest.raises(ConfigError, match="reward.sandbox.launcher: mechanism=launcher runs programs"):
        load_config(str(ROOT / "configs/quickstart.yaml"), ["reward.sandbox.mechanism=launcher"])


def test_a_machine_that_cannot_contain_programs_is_told_so(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap, no prlimit
    with pytest.raises(SandboxUnavailable, match="prlimit"):
        Sandbox(SandboxConfig())
    (tmp_path / "prlimit").symlink_to(shutil.which("prlimit", path="/usr/bin:/bin"))
    with pytest.raises(SandboxUnavailable, match="apt install bubblewrap"):
        Sandbox(SandboxConfig())


def test_the_listops_code_task_is_disjoint_deterministic_and_its_references_pass(tmp_path, scorer) -> None:
    from hpcrl.data.listops import listops_split, write_listops_dataset

    train, evals = listops_split(3000, 100, seed=3)
    assert (train, evals) == listops_split(3000, 100, seed=3)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals} and len(evals) == 100
    assert max(len(r["answer"]) for r in train + evals) <= 48  # configs/code_listops.yaml: max_new_tokens 48
    rows = evals[:24]
    results = scorer.score_many([(r["prompt"], r["answer"], r) for r in rows])
    assert [r.reward for r in results] == [1.0] * len(rows), [(r.detail, x["answer"]) for r, x in zip(results, rows)]
    wrong = scorer.score_many([(r["prompt"], "x", r) for r in rows])  # the identity is right for none of them
    assert sum(r.reward for r in wrong) < len(rows) / 4
    paths = write_listops_dataset(tmp_path / "d", n_train=50, n_eval=10, seed=1)
    assert write_listops_dataset(tmp_path / "d", n_train=50, n_eval=10, seed=1) == paths  # reused
    assert len(paths[0].read_text().splitlines()) == 50


@pytest.mark.slow
def test_a_code_task_run_scores_every_program_in_the_sandbox_and_passes_the_audit(tmp_path: Path) -> None:
    """``configs/code_listops.yaml`` end to end on a small random model: the rollout job scores every sample's
    program in its sandbox (as root it drops to nobody first), the trainer trains them, the audit is clean and
    counts every trained sample's reward as scored, none as an infra error."""
    import sys

    from hpcrl.audit import audit

    run, cache = tmp_path / "run", tmp_path / "cache"
    out = subprocess.run([sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/code_listops.yaml"),
                          f"run_dir={run}", f"model.cache_dir={cache}/models", f"data.synthetic_dir={cache}/data",
                          "model.tiny_hidden_size=32", "model.tiny_layers=2", "data.n_train=300", "data.n_eval=20",
                          "sft.enabled=false", "admission.batch_size=4", "rollout.group_size=4",
                          "rollout.max_batch_size=8", "rollout.max_new_tokens=16", "trainer.total_steps=3",
                          "eval.every_steps=3", "eval.size=20"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    rep = audit(run)
    assert rep.ok and rep.steps == 3, rep.violations
    assert rep.reward_status.get("ok", 0) >= 3 * 4 * 4 and "infra_error" not in rep.reward_status, rep.reward_status
    stats = json.loads((run / "logs" / "rollout-0.stats.json").read_text())
    programs = sum(v for k, v in stats["reward"].items() if k.startswith("program_"))
    assert programs >= 3 * 4 * 4 and stats["samples_infra_error"] == 0, stats["reward"]


HOSTILE = ["def f(xs):\n    while True:\n        pass\n",  # infinite loop
           "import os\nwhile True:\n    os.fork()\n",  # fork bomb
           "def f(xs):\n    return bytearray(2 * 1024**3)\n",  # memory bomb
           "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",  # endless output
           "import os\nos.killpg(0, 9)\n",  # its process group
           "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",  # its parent
           "open('/tmp/hpcrl-evil', 'w').write('x')\nimport os\nos._exit(0)\n",  # writes, then exits early
           "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n",  # daemonises
           GOOD]


def test_hostile_programs_in_a_real_rollout_loop_score_zero_and_the_loop_goes_on(tmp_path: Path) -> None:
    """The rollout loop (a real worker, engine, ledger and spool: ``tests/test_episodes.py``) whose samples are
    hostile programs, scored by the code scorer in the sandbox: every group is published, the hostile ones with
    reward 0 and the good one with 1, and the loop keeps generating after each."""
    from test_episodes import make_worker, run_to_idle

    from hpcrl.rollout.episodes import SingleTurn

    class Hostile(SingleTurn):
        """Single-turn episodes whose text is replaced by the next hostile program (the model's tokens stay)."""

        def __init__(self, engine, tokenizer) -> None:
            super().__init__(engine, tokenizer, CodeScorer(RewardConfig(scorer="code", sandbox=LIMITS)))
            self.n = 0

        offset = 0

        def collect(self, completion) -> None:
            super().collect(completion)
            key, episode = self._done[-1]
            episode.text, self.n = HOSTILE[(self.offset + self.n) % len(HOSTILE)], self.n + 1

        def score(self, row, episodes):
            return self.reward.score_many([(row.prompt, e.text, {"answer": "", "tests": REVERSE}) for e in episodes])

        def close(self) -> None:
            self.reward.close()

    from hpcrl.spool.format import read_group

    by_text: dict[str, set[float]] = {}
    for offset in (0, 6):  # two loops of 2 groups x 3 samples: every program of HOSTILE runs
        Hostile.offset = offset
        worker, spool = make_worker(tmp_path / str(offset), Hostile)
        run_to_idle(worker, timeout_s=300)
        groups = [read_group(e.path) for e in spool.ready()]
        assert sorted(g.ticket for g in groups) == [0, 1] and worker.episodes.n == 6  # it went on after each
        for g in groups:
            for text, sample in zip(g.meta["responses"], g.samples):
                by_text.setdefault(text, set()).add(float(sample.reward))
    assert set(by_text) == set(HOSTILE)
    assert all(by_text[h] == {0.0} for h in HOSTILE[:-1]) and by_text[GOOD] == {1.0}, by_text
    assert not Path("/tmp/hpcrl-evil").exists()
