"""The long-tailed reversal task: answers, the length tail, held-out separation, reuse, config choice."""

from __future__ import annotations

import json

import pytest

from hpcrl.data.config import DataConfig
from hpcrl.data.longtail import MIN_LEN, reverse_split, write_reverse_dataset


def test_answers_reverse_the_prompt_and_lengths_have_a_long_tail() -> None:
    train, evals = reverse_split(5000, 200, seed=0, max_len=24, alpha=1.5)
    for r in train[:200]:
        digits = r["prompt"][len("rev:"):-1]
        assert r["answer"] == digits[::-1] and r["answer"][0] != "0"
    lengths = sorted(len(r["answer"]) for r in train)
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert lengths[0] == MIN_LEN and median <= 5 and p99 >= 4 * median  # most short, a few many times longer
    assert not {r["prompt"] for r in evals} & {r["prompt"] for r in train}


def test_write_is_deterministic_and_reused(tmp_path) -> None:
    a = write_reverse_dataset(tmp_path / "d", n_train=300, n_eval=50, seed=1)
    text = a[0].read_text()
    assert len(text.splitlines()) == 300 and json.loads(text.splitlines()[0])["prompt"].startswith("rev:")
    mtime = a[0].stat().st_mtime_ns
    assert write_reverse_dataset(tmp_path / "d", n_train=300, n_eval=50, seed=1) == a
    assert a[0].stat().st_mtime_ns == mtime  # reused, not rewritten


def test_config_choice_and_errors() -> None:
    assert DataConfig(synthetic="reverse").synthetic_max_len == 24
    with pytest.raises(ValueError, match="^synthetic_max_len"):
        DataConfig(synthetic="reverse", synthetic_max_len=2)
