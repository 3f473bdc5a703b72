"""scripts/profile_feed.py sorts a profile's samples inside the trainer's batch-taking by what they did."""

from __future__ import annotations

from chaos_script import load_script

LOOP = "main (hpcrl/trainer/main.py:291);train_loop (hpcrl/trainer/main.py:92);take_batch (hpcrl/trainer/main.py:137)"
NEXT = LOOP + ";BatchFeed.next_batch (hpcrl/trainer/feed.py:175)"


def test_samples_are_sorted_by_what_they_did_and_the_waits_left_out() -> None:
    prof = load_script("profile_feed")
    lines = [
        f"{NEXT};BatchFeed._eligible (feed.py:266);BatchFeed.regenerate (feed.py:151);Spool.drop (store.py:380);"
        "write_bytes (hpcrl/fs/atomic.py:101) 7",
        f"{NEXT};BatchFeed._eligible (feed.py:266);BatchFeed.regenerate (feed.py:152);"
        "AdmissionLedger.reissue (ledger.py:195) 2",
        f"{NEXT};BatchFeed._take (feed.py:241);Spool.load (store.py:311);ReadAhead.read (readahead.py:165);"
        "read_group (format.py:252) 3",
        f"{NEXT};ReadAhead.kick (readahead.py:120);Condition.notify (threading.py:382) 1",
        f"{NEXT};batch_wait.<locals>.wait (hpcrl/trainer/main.py:174) 50",  # waiting for rollouts: not counted
        f"{LOOP};PolicyTrainer.train_step (policy.py:149) 90",  # training: not counted
        f"{NEXT};BatchFeed._take (feed.py:247) 1",
        "garbage without a count",
    ]
    counts = prof.categorize(lines)
    assert counts == {"set-aside: reason record (write, fsync, rename)": 7, "set-aside: ticket reissued": 2,
                      "claim: read the read-ahead had not done": 3, "waking the read-ahead": 1,
                      "claim: hand-over and checks": 1}
    text = prof.report(counts, {"mode": "async_eta1"})
    assert text.splitlines()[0].endswith(": 14") and "50.0 %      7  set-aside: reason record" in text


def test_a_raw_path_without_its_folder_is_refused_before_the_benchmark_runs(tmp_path, monkeypatch) -> None:
    import subprocess

    import pytest

    prof = load_script("profile_feed")
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("the benchmark was started"))
    with pytest.raises(SystemExit) as exit_info:
        prof.main(["--mode", "async_eta2_disk", "--raw", str(tmp_path / "missing" / "stacks.txt")])
    assert exit_info.value.code == 2
