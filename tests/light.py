"""Running hpcrl's light commands so that a test sees what they imported.

``light_command("hpcrl", "status", run)`` is the argv of ``python -m hpcrl status run`` run through a
wrapper that, when the process exits (whatever the exit code), writes to stderr which heavy modules
(torch, transformers) it had imported; :func:`heavy_modules` reads that line back.
"""

from __future__ import annotations

import json
import sys

HEAVY = ("torch", "transformers")
_MARK = "hpcrl-test-heavy-modules: "
_WRAPPER = (
    "import atexit, json, runpy, sys\n"
    f"atexit.register(lambda: print({_MARK!r} + json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)),"
    " file=sys.stderr, flush=True))\n"
    "module = sys.argv[1]\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
)


def light_command(module: str, *args: str) -> list[str]:
    return [sys.executable, "-c", _WRAPPER, module, *args]


def heavy_modules(stderr: str) -> list[str]:
    """The heavy modules the wrapped process had imported when it exited."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith(_MARK)]
    assert lines, f"the wrapped process did not report its modules (killed?): {stderr[-2000:]}"
    return json.loads(lines[-1][len(_MARK):])
