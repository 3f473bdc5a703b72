"""hpcrl: asynchronous reinforcement learning for LLMs on Slurm/HPC clusters.

Every component (trainer, rollout, reward, watchdog) is its own process or
Slurm job; they meet on the shared filesystem in a run directory (see
docs/architecture.md and docs/design.md, the contract).
"""

__version__ = "0.1.0"
