"""A weight-update group between a rollout process and its inference server's workers.

With ``rollout.server_update=group`` a rollout that holds a version's
tensors in memory (collective or colocated weights) broadcasts them straight
into its server instead of staging them to node-local storage for a reload.
The group is the server's own (SGLang ``/init_weights_update_group``): the
rollout process is rank 0, the server's tensor-parallel workers join as
ranks 1..world_size-1; NCCL where the rollout sees a CUDA device, gloo
otherwise. It is independent of any other process group of the rollout (the
collective transport's): it has its own TCP rendezvous and name.

Lifecycle: built by :func:`hpcrl.rollout.engines.build_engine` (nothing
connects yet); the backend calls :meth:`UpdateGroup.join` once, at the first
update, while it asks the server to join; :meth:`broadcast` sends one
version, tensor by tensor, in the order announced to the server;
:meth:`close` ends it with the engine.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from hpcrl.runtime.net import free_port

log = logging.getLogger(__name__)


class UpdateGroup:
    def __init__(self, address: str, world_size: int, *, name: str, timeout_s: float) -> None:
        if world_size < 2:
            raise ValueError(f"a weight-update group needs the rollout and >= 1 server worker, got {world_size}")
        self.address, self.world_size, self.name = address, world_size, name
        self.port = free_port(address)
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.timeout = timedelta(seconds=timeout_s)
        self._pg: dist.ProcessGroup | None = None

    @property
    def joined(self) -> bool:
        return self._pg is not None

    def join(self) -> None:
        """Rendezvous as rank 0 (blocks until every server worker joined, or the timeout)."""
        self._pg = custom_group(self.backend, f"tcp://{self.address}:{self.port}", self.world_size, 0, self.name,
                                self.timeout)
        log.info("weight-update group %s: %d ranks over %s at %s:%d", self.name, self.world_size, self.backend,
                 self.address, self.port)

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Send ``tensors`` from rank 0, one broadcast each, in order."""
        if self._pg is None:
            raise RuntimeError("UpdateGroup.broadcast before join")
        for t in tensors:
            self._pg.broadcast([t.to(self.device).contiguous()], dist.BroadcastOptions()).wait()

    def close(self) -> None:
        if self._pg is not None:
            try:
                dist.destroy_process_group(self._pg)
            except Exception as e:  # the server may be gone already: closing the rollout must still finish
                log.warning("closing weight-update group %s: %s", self.name, e)
            self._pg = None


def announce(state: Mapping[str, torch.Tensor]) -> dict[str, list]:
    """What the server is told before a broadcast: names, dtypes (``float32``...) and shapes, in sending order."""
    return {"names": list(state), "dtypes": [str(t.dtype).removeprefix("torch.") for t in state.values()],
            "shapes": [list(t.shape) for t in state.values()]}


def custom_group(backend: str, init_method: str, world_size: int, rank: int, name: str,
                 timeout: timedelta) -> dist.ProcessGroup:
    """A process group apart from the default one, built the way the inference servers build theirs (SGLang's
    ``init_custom_process_group``): a TCP rendezvous, a store prefixed by the group's name. It uses torch's
    private ``_new_process_group_helper``: there is no public call for a second group with its own rendezvous."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(name, store),
                                      group_name=name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
