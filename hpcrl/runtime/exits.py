"""How a component process ends when something outside it failed: the exit codes the watchdog reads.

Every component's entry point runs inside :func:`component_exit`. Its job:

* a :class:`hpcrl.runtime.owner.Fenced` (a newer owner took the run) ends the process with
  :data:`hpcrl.runtime.owner.EXIT_FENCED` (3);
* a storage fault (:mod:`hpcrl.fs.faults`: full, over quota, I/O error, stale handle, read-only) anywhere in
  the exception's chain ends it with :data:`hpcrl.fs.faults.EXIT_STORAGE` (74), after one error line naming
  the operation, the path and the filesystem's free space; the watchdog restarts it free of charge once the
  filesystem has room (design.md §4.12). What it had not published is regenerated or retrained: every file
  it wrote is whole or absent (:mod:`hpcrl.fs.atomic`);
* anything else propagates: a crash, which costs a restart.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

from hpcrl.runtime.owner import exit_when_fenced, find_fenced
from hpcrl.fs.faults import EXIT_STORAGE, as_storage_error, storage_fault

log = logging.getLogger(__name__)


@contextmanager
def component_exit() -> Iterator[None]:
    """Turn a fencing into exit 3 and a storage fault into exit 74 (module docstring)."""
    with exit_when_fenced():
        try:
            yield
        except Exception as e:
            fault = storage_fault(e)
            if fault is None or find_fenced(e) is not None:
                raise
            log.error("%s; stopping (exit %d): the supervisor restarts this component once storage is back",
                      as_storage_error(fault), EXIT_STORAGE)
            raise SystemExit(EXIT_STORAGE) from None
