"""Logging set-up, done once at each process entry point."""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def setup_logging(component: str, log_file: str | Path | None = None, level: int = logging.INFO) -> None:
    """Prefix every record with the component (and rank) and send it to stderr and ``log_file``."""
    fmt = logging.Formatter(f"%(asctime)s [{component}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(level)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    for noisy in ("httpx", "urllib3", "h5py", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
