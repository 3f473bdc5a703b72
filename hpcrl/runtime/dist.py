"""Process-group bootstrap for trainer ranks.

A trainer rank learns its rank, world size, local rank and rendezvous
address (:func:`discover`) from, in this order of precedence:

1. ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``, as
   set by the local launcher or torchrun;
2. Slurm, inside an ``srun`` step (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
   ``SLURM_LOCALID``; the address is the first host of
   ``SLURM_STEP_NODELIST``, the port derived from the job and step ids so that
   every rank computes the same one without talking);
3. MPI (``mpirun``: ``OMPI_COMM_WORLD_RANK``/``PMIX_RANK``/``PMI_RANK``):
   mpi4py (imported lazily) gives rank and size, rank 0 picks the address
   and a free port and broadcasts them;
4. otherwise a single process.

It then picks its device and backend (CUDA -> NCCL, Ascend -> HCCL, else
gloo) and joins the group. No torchrun is needed.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpcrl.runtime.device import detect
from hpcrl.runtime.net import free_port  # noqa: F401 - where the rank bootstrap and tests take it from

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(backend: str, local_rank: int) -> tuple[torch.device, str]:
    """The device and backend for this rank; ``backend='auto'`` chooses by platform (:mod:`hpcrl.runtime.device`)."""
    acc = detect(backend, "trainer.backend")
    return acc.set_device(local_rank), acc.backend


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "env", "slurm", "mpi" or "single"


def discover(env: dict[str, str] | None = None) -> Rendezvous:
    """Rank, world size, local rank and rendezvous address of this process (see the module docstring)."""
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        if world > 1 and "MASTER_PORT" not in env:
            raise ValueError("MASTER_PORT must be set for a trainer with world_size > 1")
        return Rendezvous(rank, world, int(env.get("LOCAL_RANK", rank)), env.get("MASTER_ADDR", "127.0.0.1"),
                          int(env.get("MASTER_PORT") or free_port()), "env")
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        world = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
        addr = env.get("MASTER_ADDR") or resolve_node(first_host(env["SLURM_STEP_NODELIST"]))
        port = int(env.get("MASTER_PORT") or slurm_port(env["SLURM_JOB_ID"], env["SLURM_STEP_ID"]))
        return Rendezvous(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", "0")), addr, port, "slurm")
    if any(k in env for k in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")):
        return _discover_mpi(env)
    return Rendezvous(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT") or free_port()), "single")


def _discover_mpi(env: dict[str, str]) -> Rendezvous:
    from mpi4py import MPI  # lazily: only MPI launches need it

    comm = MPI.COMM_WORLD
    local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    addr_port = None
    if comm.Get_rank() == 0:
        addr_port = (env.get("MASTER_ADDR") or _own_address(), int(env.get("MASTER_PORT") or free_port()))
    addr, port = comm.bcast(addr_port, root=0)
    return Rendezvous(comm.Get_rank(), comm.Get_size(), local_rank, addr, port, "mpi")


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return "127.0.0.1"


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: ``gpu[003-004,007],cpu1`` -> ``gpu003``."""
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    if not m or not (m.group(1) or m.group(2)):
        raise ValueError(f"SLURM_STEP_NODELIST: cannot read hostlist {nodelist!r}")
    prefix, ranges, suffix = m.groups()
    first = ranges.split(",")[0].split("-")[0] if ranges else ""
    return f"{prefix}{first}{suffix}"


def resolve_node(node: str) -> str:
    """An address for Slurm node ``node``: DNS, else the NodeAddr Slurm knows (virtual nodes)."""
    try:
        return socket.gethostbyname(node)
    except OSError:
        pass
    out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"NodeAddr=(\S+)", out)
    if not m:
        raise ValueError(f"SLURM_STEP_NODELIST: node {node!r} has no address (DNS and scontrol both failed)")
    return m.group(1)


def slurm_port(job_id: str, step_id: str) -> int:
    """A port every rank of one srun step derives alike (distinct for concurrent steps of one job)."""
    return 20000 + (int(job_id) * 17 + int(step_id)) % 30000


def init_from_env(backend: str = "auto") -> DistContext:
    """Join the trainer's process group described by the environment (Slurm, MPI or torchrun-style)."""
    rdv = discover()
    rank, world, local_rank = rdv.rank, rdv.world_size, rdv.local_rank
    os.environ.update(MASTER_ADDR=rdv.master_addr, MASTER_PORT=str(rdv.master_port))
    device, backend = pick_device(backend, local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    log.info("rank %d/%d joined (%s on %s, rendezvous %s:%d from %s)", rank, world, backend, device,
             rdv.master_addr, rdv.master_port, rdv.source)
    return DistContext(rank, world, local_rank, device, backend)


