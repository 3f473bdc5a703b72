"""One rank of tests/test_megatron.py: build the GPTModel of an HF folder on TP x PP ranks over gloo, run a
forward pass and gather the weights back; rank results go to <out>/rank<r>.json.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python tests/mcore_probe.py HF_DIR TP PP OUT
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrl.trainer.mcore import model as M

torch.set_num_threads(1)
hf_dir, tp, pp, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
layout = M.init_parallel(tp, pp)
model = M.build(hf_dir, layout)
from transformers import AutoModelForCausalLM  # noqa: E402

hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True)
ids = torch.randint(0, hf.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
logits = M.forward_logits(model, ids, layout)
result = {"rank": dist.get_rank(), "stage": layout.stage, "tp_rank": layout.tp_rank}
if logits is not None:
    with torch.no_grad():
        result["max_abs_diff"] = (logits - hf(ids).logits).abs().max().item()
full = M.gather_hf(model, layout)
if dist.get_rank() == 0:
    ref = hf.state_dict()
    result["names_differ"] = sorted(set(full) ^ set(ref))
    result["unequal"] = sorted(k for k in ref if k in full and not torch.equal(full[k], ref[k]))
(out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
dist.barrier()
dist.destroy_process_group()
