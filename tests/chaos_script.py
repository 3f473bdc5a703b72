"""scripts/chaos.py as a module, for the tests that drive the chaos run or reuse its process monitor."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_chaos():
    spec = importlib.util.spec_from_file_location("chaos", ROOT / "scripts" / "chaos.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
