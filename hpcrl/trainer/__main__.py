"""``python -m hpcrl.trainer``: the stop signals are caught before the slow imports (hpcrl.runtime.preempt)."""

from hpcrl.runtime.preempt import catch_early

catch_early()

from hpcrl.trainer.main import main  # noqa: E402

main()
