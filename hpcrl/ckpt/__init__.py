"""Trainer checkpoints: sharded (DCP), committed atomically, verified on load."""
