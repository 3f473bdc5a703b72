"""Start ``world`` spawned processes as the ranks of one gloo group and wait for them (test helper)."""

from __future__ import annotations

import multiprocessing as mp
from typing import Callable

from hpcrl.runtime.dist import free_port


def spawn_ranks(target: Callable[..., None], world: int, *args, timeout: float = 300) -> None:
    """Run ``target(rank, world, port, *args)`` in ``world`` fresh processes; every one must exit 0."""
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0, f"a rank of {target.__name__} exited with {p.exitcode}"
