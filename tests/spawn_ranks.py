"""Start ``world`` spawned processes as the ranks of one gloo group and wait for them (test helper)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import traceback
from typing import Callable

from hpcrl.runtime.dist import free_port


def _rank_main(target: Callable[..., None], *args) -> None:
    """One rank: ``target``, then an exit that skips the interpreter's teardown. Every result is on disk by then,
    and in that teardown a background thread of torch has aborted finished ranks ("terminate called without an
    active exception", exit -6) in CI runs; an exception in ``target`` still exits 1 with its traceback."""
    try:
        target(*args)
    except BaseException:
        traceback.print_exc()
        code = 1
    else:
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn_ranks(target: Callable[..., None], world: int, *args, timeout: float = 300) -> None:
    """Run ``target(rank, world, port, *args)`` in ``world`` fresh processes; every one must exit 0."""
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_rank_main, args=(target, r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0, f"a rank of {target.__name__} exited with {p.exitcode}"
