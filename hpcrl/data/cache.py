"""A synthetic dataset's files, written once and reused: ``train.jsonl``, ``eval.jsonl``, then ``meta.json``.

``meta.json`` is the commit marker, written last: a call whose parameters
(``meta``) match a committed folder reuses its files, so many processes (or a
resubmitted job) can ask for the same dataset safely. Otherwise the folder is
uncommitted first, then every file is published atomically.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

from hpcrl.fs import atomic

log = logging.getLogger(__name__)


def cached_split(out_dir: Path, meta: dict, build: Callable[[], tuple[list[dict], list[dict]]]) -> tuple[Path, Path]:
    """``out_dir``'s (train, eval) JSONL paths, from ``build()`` unless a folder with this ``meta`` exists."""
    out = Path(out_dir).expanduser()
    train_path, eval_path, meta_path = out / "train.jsonl", out / "eval.jsonl", out / "meta.json"
    if train_path.exists() and eval_path.exists() and meta_path.exists():
        try:
            if atomic.read_json(meta_path) == meta:
                log.info("reusing %s dataset in %s", meta.get("kind"), out)
                return train_path, eval_path
            log.warning("%s: dataset parameters changed, regenerating", out)
        except json.JSONDecodeError:
            log.warning("%s: unreadable meta.json, regenerating", out)
    train, evals = build()
    out.mkdir(parents=True, exist_ok=True)
    meta_path.unlink(missing_ok=True)  # uncommit before replacing the data
    atomic.write_text(train_path, "".join(json.dumps(r) + "\n" for r in train))
    atomic.write_text(eval_path, "".join(json.dumps(r) + "\n" for r in evals))
    atomic.write_json(meta_path, meta)
    log.info("wrote %d train / %d eval %s problems to %s", len(train), len(evals), meta.get("kind"), out)
    return train_path, eval_path
