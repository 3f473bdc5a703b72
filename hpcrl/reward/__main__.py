"""``python -m hpcrl.reward --run-dir DIR``: the reward service component (hpcrl/reward/service.py)."""

from hpcrl.runtime.preempt import catch_early

catch_early()  # before the slow imports: a stop signal while starting stops it cleanly

from hpcrl.reward.service import main  # noqa: E402

if __name__ == "__main__":
    main()
