"""Per-process runtime every component uses: the process group (``dist``), heartbeats, preemption
signals, logging set-up and the run-ownership fence (``owner``).

Imports run one way: components (trainer, rollout, checkpointing, watchdog) and orchestration
(``hpcrl.launch``: supervisor, schedulers) import ``hpcrl.runtime``; it imports neither.
"""
