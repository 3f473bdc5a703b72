"""What the benchmark scripts share: running one configuration and getting matplotlib."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def submit(run_dir: Path, overrides: list[str], name: str, config: str = "configs/quickstart.yaml") -> Path:
    """Run ``python -m hpcrl.submit`` on ``config`` (the quickstart's) with ``overrides``; exit on failure."""
    cmd = [sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / config), f"run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return run_dir


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a message) when the extra is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return None
    return plt
