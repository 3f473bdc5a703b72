"""Save and restore the trainer's whole state with torch.distributed.checkpoint.

What a checkpoint at step ``N`` holds (the state *after* N training steps,
i.e. policy version N): the sharded model and optimizer state, and the
critic with its optimizer when PPO uses one (DCP, so it
reloads onto a different number of ranks), the LR-scheduler state, the RNG
states of every rank (torch, numpy, python), the trainer's counters, and the
config hash. The admission counters and spool position need no copy: they
are the files in ``admission/`` and ``spool/trained/step_<v>/`` for v < N,
which :func:`hpcrl.trainer.reconcile.reconcile` brings back in line on resume.

Every rank calls :meth:`Checkpointer.save` and :meth:`Checkpointer.restore`
(both are collective). Rank 0 checks the ownership fence right before the
commit: a trainer of a replaced owner writes its files but never commits
them (the temporary directory is removed).
"""

from __future__ import annotations

import base64
import logging
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hpcrl.fs import atomic
from hpcrl.ckpt import store
from hpcrl.ckpt.config import CheckpointConfig
from hpcrl.fs.faults import human_bytes
from hpcrl.fs.space import SpaceFloor
from hpcrl.runtime.dist import DistContext
from hpcrl.runtime.owner import Fence, NoFence

if TYPE_CHECKING:
    from hpcrl.trainer.engine import TrainEngine

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def layout_mismatch(path: Path, state: dict[str, Any]) -> str | None:
    """Why ``state`` (this trainer's :meth:`~hpcrl.trainer.engine.TrainEngine.checkpoint_state`) does not load
    in place from the checkpoint at ``path``, or None when it does: the checkpoint lacks some of its weights,
    because another engine wrote it, or the megatron engine with other tensor/pipeline-parallel sizes."""
    if not isinstance(state.get("model"), dict):
        return None
    saved = {k for k in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata if k.startswith("model.")}
    wanted = {f"model.{k}" for k in state["model"]}
    missing = sorted(wanted - saved)
    if not missing:
        return None
    return (f"checkpoint {path} does not hold {len(missing)} of this trainer's {len(wanted)} weights (e.g. "
            f"{missing[0]!r}; it holds e.g. {min(saved, default='nothing')!r}): it was written by another trainer "
            "engine, and loads only into that one (python -m ckpt_tools to-hf exports its weights, and a run can "
            "start from them with --from)")


def set_rng_state(state: dict[str, Any]) -> None:
    raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


class Checkpointer:
    def __init__(self, root: Path, cfg: CheckpointConfig, ctx: DistContext, config_hash: str,
                 fence: Fence | NoFence | None = None, floor: SpaceFloor | None = None) -> None:
        self.root, self.cfg, self.ctx, self.config_hash = root, cfg, ctx, config_hash
        self.fence = fence or NoFence()
        self.floor = floor  # rank 0's: a periodic checkpoint without room for it is held off
        self.root.mkdir(parents=True, exist_ok=True)
        self._last_save = time.monotonic()
        self._swept = False  # the first save removes what earlier trainers left under construction
        self._sized = (-1, 0)  # (step, bytes) of the newest committed checkpoint

    def has(self, step: int) -> bool:
        """Whether a committed checkpoint of ``step`` exists already."""
        return any(s == step for s, _ in store.committed(self.root))

    def due(self, step: int, last_step: int) -> bool:
        """Whether to save after ``step`` (the same answer on every rank)."""
        c = self.cfg
        want = (c.at_end and step == last_step) or (c.every_steps > 0 and step % c.every_steps == 0)
        want = want or (c.every_seconds > 0 and time.monotonic() - self._last_save >= c.every_seconds)
        final = c.at_end and step == last_step  # never held off: the run's end needs it (a failed write restarts)
        maybe = want or c.every_seconds > 0  # another rank's clock may want one when this rank's does not
        held = maybe and not final and self.ctx.is_main and self.floor is not None and \
            not self.floor.ok(self._newest_size())
        if self.ctx.world_size > 1:
            flag = torch.tensor([int(want), int(held)], device=self.ctx.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            want, held = bool(flag[0].item()), bool(flag[1].item())
        if want and held:
            self._last_save = time.monotonic()  # a time-based one is tried again after every_seconds, not every step
            if self.ctx.is_main:
                log.warning("checkpoint at step %d held off for lack of room (the newest took %s); the next due "
                            "step tries again", step, human_bytes(self._newest_size()))
        return want and not held

    def _newest_size(self) -> int:
        """Bytes of the newest committed checkpoint: what the next one will take, about."""
        newest = store.committed(self.root)
        if not newest:
            return 0
        if self._sized[0] != newest[-1][0]:
            self._sized = (newest[-1][0], sum(p.stat().st_size for p in newest[-1][1].rglob("*") if p.is_file()))
        return self._sized[1]

    def save(self, engine: TrainEngine, step: int, extra: dict[str, Any]) -> Path:
        t0 = time.time()
        tmp, final = self.root / f"step_{step:06d}.tmp", store.step_dir(self.root, step)
        if self.ctx.is_main:
            for old in [tmp] + ([] if self._swept else list(self.root.glob("step_*.tmp"))):
                shutil.rmtree(old, ignore_errors=True)  # this trainer group is the run's only one
            self._swept = True
            tmp.mkdir(parents=True)
        self._barrier()
        try:
            dcp.save(engine.checkpoint_state(), checkpoint_id=str(tmp))
            atomic.write_json(tmp / f"rng-r{self.ctx.rank}.json", rng_state())
        except BaseException:  # e.g. a full filesystem: never leave the half-written checkpoint's space taken
            if self.ctx.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._barrier()
        if self.ctx.is_main:
            atomic.write_json(tmp / "trainer.json", {
                "step": step, "world_size": self.ctx.world_size, "config_hash": self.config_hash,
                **engine.schedule_state(), "engine_version": engine.version,
                "time": time.time(), "owner_epoch": self.fence.epoch, **extra})
            if self.fence.superseded():  # the step boundary that follows stops every rank
                shutil.rmtree(tmp, ignore_errors=True)
                log.error("checkpoint step %d not committed: owner epoch %d was replaced", step, self.fence.epoch)
            else:
                store.commit(tmp, final)
                store.prune(self.root, self.cfg.keep_last, self.cfg.keep_every)
                log.info("checkpoint step %d committed in %.2fs: %s", step, time.time() - t0, final)
        self._barrier()
        self._last_save = time.monotonic()
        return final

    def restore(self, engine: TrainEngine) -> dict[str, Any] | None:
        """Load the newest valid checkpoint into ``engine``; its trainer.json, or None if there is none.

        A pending rewind (:func:`hpcrl.ckpt.store.apply_rewind`) is carried out first, by rank 0."""
        if self.ctx.is_main:
            self.fence.check("rewind")
            rewound = store.apply_rewind(self.root)
            if rewound:
                log.warning("rewound to step %d: %d newer checkpoint(s) set aside in %s; the groups trained after "
                            "step %d return to the queue", rewound[0], len(rewound[1]),
                            rewound[1][0].parent if rewound[1] else "-", rewound[0])
        found = store.latest_valid(self.root) if self.ctx.is_main else None
        box = [str(found[1]) if found else None]
        if self.ctx.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return None
        path = Path(box[0])
        meta = atomic.read_json(path / "trainer.json")
        state = engine.checkpoint_state()
        if meta.get("load") is not None:  # another run's checkpoint (--from): only the parts it names
            state = {k: v for k, v in state.items() if k in meta["load"]}
        if state:  # --from a checkpoint of another engine loads nothing: the weights are the exported init model
            problem = layout_mismatch(path, state)
            if problem is None:
                dcp.load(state, checkpoint_id=str(path))
            else:  # the same engine with another parallel layout converts what it loads; any other, refused
                state = engine.convert_checkpoint(path, set(state))
                if state is None:
                    raise ValueError(problem)
            engine.load_checkpoint_state(state)
        engine.version = meta.get("engine_version", meta["step"])
        if meta.get("from"):  # this run's schedule, at the saved position when the scheduler was restored
            engine.load_schedule_state(meta, position_only=True)
            log.info("starting from %s (step %d of its run): loaded %s%s", meta["from"]["checkpoint"],
                     meta["from"]["step"], ", ".join(state), ", the schedule's position" if meta.get("scheduler")
                     else "")
            return meta
        engine.load_schedule_state(meta)
        rng_file = path / f"rng-r{self.ctx.rank}.json"
        if meta["world_size"] == self.ctx.world_size and rng_file.exists():
            set_rng_state(atomic.read_json(rng_file))
        else:
            log.warning("checkpoint written by %d ranks, resuming on %d: RNG states not restored",
                        meta["world_size"], self.ctx.world_size)
        if meta.get("config_hash") != self.config_hash:
            log.warning("config changed since checkpoint %s was written", path)
        log.info("resumed from %s (version %d)", path, meta["step"])
        return meta

    def _barrier(self) -> None:
        if self.ctx.world_size > 1:
            dist.barrier()
