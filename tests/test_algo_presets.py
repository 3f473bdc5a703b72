"""Slow: every preset in configs/algos/ trains on the quickstart without NaN and improves held-out accuracy.

The default run checks the presets with their own machinery (``ppo``'s critic,
``dapo``'s dynamic sampling); the others differ only in their loss, which the
float64 references of tests/test_algo.py check, and run with ``-m long``.

Each preset runs ``python -m hpcrl.submit`` for a fixed number of steps from
the cached SFT warm start (built under ~/.cache/hpcrl on first use), through
scripts/run_presets.py, the same code that produced the table in
docs/algorithms.md. The longer measurement is ``pytest -m bench``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from run_presets import PRESETS, run_preset  # noqa: E402

STEPS = 120  # fewer steps leave the gain within the +-2 point noise of one 500-problem evaluation


DEFAULT = ("ppo", "dapo")  # the critic and dynamic sampling; the other presets only change the loss: opt-in, -m long


@pytest.mark.slow
@pytest.mark.parametrize("preset", [p if p in DEFAULT else pytest.param(p, marks=pytest.mark.long) for p in PRESETS])
def test_preset_trains_without_nan_and_improves(preset, tmp_path) -> None:
    r = run_preset(preset, preset, ["eval.size=500"], STEPS, tmp_path)
    assert r["steps"] == STEPS
    assert r["non_finite"] == 0
    assert r["acc_end"] > r["acc_start"], r
    if preset == "dapo":
        assert r["dropped"].get("uniform", 0) > 0  # dynamic sampling did replace uniform groups


@pytest.mark.bench
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_long(preset, tmp_path) -> None:
    r = run_preset(preset, preset, ["eval.size=500"], 200, tmp_path)
    assert r["non_finite"] == 0 and r["acc_end"] > r["acc_start"] + 0.05, r
