"""Run by tests/test_slurm_dist.py under srun / mpirun: bootstrap one trainer rank, all-reduce, report."""

import json

import torch
import torch.distributed as dist

from hpcrl.runtime.dist import discover, init_from_env

torch.set_num_threads(1)
source = discover().source if not dist.is_initialized() else "?"
ctx = init_from_env("gloo")
t = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(t)
print(json.dumps({"rank": ctx.rank, "world": ctx.world_size, "local_rank": ctx.local_rank, "sum": t.item(),
                  "backend": ctx.backend, "source": source}), flush=True)
dist.destroy_process_group()
