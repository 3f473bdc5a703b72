"""Tools for trainer checkpoints and published weights: inspect, verify, to-hf, prune.

Run as ``python -m ckpt_tools <command> ...`` (see ``__main__``).
"""
