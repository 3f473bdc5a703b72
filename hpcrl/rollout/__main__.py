"""``python -m hpcrl.rollout``: the stop signals are caught before the slow imports (hpcrl.runtime.preempt)."""

from hpcrl.runtime.preempt import catch_early

catch_early()

from hpcrl.rollout.main import main  # noqa: E402

main()
