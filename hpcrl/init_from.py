"""Start a new run from another run's checkpoint.

``python -m hpcrl.submit --config X.yaml --from <run_dir>/ckpt/step_N
[--restore optimizer,scheduler,data]`` (the keys ``init.checkpoint`` and
``init.restore``). The new run is a run of its own (its own directory,
ledger, versions from 0); what it takes from the source:

* **weights, always**: the policy (and the critic, when both runs have one);
  from a checkpoint of another trainer engine (FSDP2's into the megatron
  engine, or the reverse) the policy is its exported HF weights, a critic
  starts afresh from them, and the optimizer state is refused; the megatron engine reshards its own
  checkpoints of other TP/PP sizes as it loads them, optimizer included;
* ``optimizer``: the optimizer state (Adam moments and step counts);
* ``scheduler``: the learning-rate schedule's position (its step count; the
  base rate, warm-up and length are this run's config);
* ``data``: the data position: this run's ticket 0 is the dataset position
  after the highest ticket the source trained before step N, so the data
  order continues instead of starting over (the source's dataset size and
  seed must be this run's).

Lifecycle: :func:`start_from` is called once by :func:`hpcrl.prepare.prepare`,
before any component starts:

1. The source is a checkpoint directory, or a run directory (its newest valid
   checkpoint); it must verify fully (a damaged one is refused). Its run's
   ``prepared.json`` names its initial policy: the architecture and
   tokenizer. The model this run's config names must have the same
   architecture (``config.json``), else the start is refused naming both.
2. The weights are exported to ``<run_dir>/init/model`` (a HuggingFace
   folder), this run's version-0 policy; no SFT warm start runs.
3. The checkpoint becomes ``<run_dir>/ckpt/step_000000``: its files hard-linked
   (copied across filesystems), with its own ``trainer.json``: step 0, which
   parts to load (``load``), the scheduler state only when asked, no RNG
   states or counters, and where it came from (``from``). The trainer
   resumes from it as from any checkpoint
   (:meth:`hpcrl.trainer.checkpoint.Checkpointer.restore`).
4. With ``data``, ``admission/meta.json`` gets the ``offset``
   (:class:`hpcrl.admission.ledger.AdmissionLedger`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from hpcrl.fs import atomic
from hpcrl.ckpt import store
from hpcrl.config import RunConfig, config_hash
from hpcrl.spool.format import parse_name
from hpcrl.trainer.registry import train_engine_spec

log = logging.getLogger(__name__)


def _export():
    """:mod:`hpcrl.trainer.export`, imported where a checkpoint's tensors are read (torch), so that the light
    commands that check a source (``--dry-run --from``) stay light."""
    from hpcrl.trainer import export

    return export
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings")
INIT_DIR = "init"


def resolve_source(path: str) -> Path:
    """The checkpoint directory ``init.checkpoint`` names; raises ValueError naming the key."""
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise ValueError(f"init.checkpoint: {p} does not exist")
    if not (p / store.COMMITTED).exists():
        found = store.latest_valid(p / "ckpt")
        if found is None:
            raise ValueError(f"init.checkpoint: {p} is neither a committed checkpoint nor a run directory with one")
        p = found[1]
    problems = store.verify(p)
    if problems:
        raise ValueError(f"init.checkpoint: {p} does not verify: {'; '.join(problems[:3])}")
    return p


def architecture(model_dir: Path) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return {k: cfg.get(k) for k in ARCHITECTURE_KEYS}


def source_init_model(ckpt: Path) -> Path:
    prepared = ckpt.parent.parent / "prepared.json"
    if not prepared.exists():
        raise ValueError(f"init.checkpoint: {prepared} not found; the checkpoint must be inside its run directory "
                         "(<run_dir>/ckpt/step_N)")
    return Path(atomic.read_json(prepared)["init_model"])


def link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def has_critic(ckpt: Path) -> bool:
    return any(k.startswith("critic.") for k in _export().saved_keys(ckpt))


def check_adapters(cfg: RunConfig, src: Path) -> None:
    """A checkpoint's policy state loads only into a trainer with the same LoRA adapters (or none)."""
    theirs = _export().lora_settings_of(src) if _export().has_adapters(src) else None
    ours = cfg.trainer.lora if cfg.trainer.lora.rank else None

    def same(s) -> tuple | None:
        return None if s is None else (s.rank, float(s.alpha), sorted(s.target_modules))

    if same(theirs) != same(ours):
        def say(s) -> str:
            return "full fine-tuning" if s is None else f"LoRA rank {s.rank}, alpha {s.alpha}, {s.target_modules}"

        raise ValueError(f"init.checkpoint: {src} was trained with {say(theirs)}, this run's trainer.lora asks for "
                         f"{say(ours)}; its trainer state does not load into that. Export its merged weights "
                         f"(python -m ckpt_tools to-hf) and start from them with model.path instead")


def write_step0(cfg: RunConfig, src: Path, run_dir: Path) -> Path:
    """``<run_dir>/ckpt/step_000000``: the source's shards with a trainer.json saying what to load."""
    meta = atomic.read_json(src / "trainer.json")
    restore = cfg.init.restore
    load = ["model"] + (["critic"] if has_critic(src) else [])
    theirs, ours = weight_layout(_export().saved_keys(src)), trainer_layout(cfg)
    if theirs.split()[0] != ours.split()[0]:  # another engine's state does not load: the policy is the weights
        # exported to init/model (the megatron engine reshards its own onto other TP/PP sizes as it loads)
        if "optimizer" in restore:
            raise ValueError(f"init.restore: optimizer: {src} holds optimizer state of a {theirs} trainer, this run's "
                             f"is {ours}; it does not load into that (start from the weights alone)")
        if "critic" in load:
            log.warning("init.checkpoint: %s holds the critic of a %s trainer, this run's is %s: the critic starts "
                        "from the initial policy's weights", src, theirs, ours)
        load = [k for k in load if k not in ("model", "critic")]
    if "optimizer" in restore:
        load += ["optim"] + (["critic_optim"] if "critic" in load else [])
    root = run_dir / "ckpt"
    root.mkdir(parents=True, exist_ok=True)
    tmp, final = root / "step_000000.tmp", store.step_dir(root, 0)
    shutil.rmtree(tmp, ignore_errors=True)
    skip = {store.MANIFEST, store.COMMITTED, "trainer.json"}
    shutil.copytree(src, tmp, copy_function=link_or_copy,
                    ignore=lambda d, names: [n for n in names if n in skip or n.startswith("rng-r")])
    atomic.write_json(tmp / "trainer.json", {
        "step": 0, "engine_version": 0, "world_size": meta["world_size"], "config_hash": config_hash(cfg),
        "scheduler": meta["scheduler"] if "scheduler" in restore else None,
        "critic_scheduler": meta.get("critic_scheduler") if "scheduler" in restore else None,
        "load": load, "time": time.time(),
        "from": {"checkpoint": str(src), "step": meta["step"], "restore": list(restore)}})
    store.commit(tmp, final)
    return final


def weight_layout(keys: list[str]) -> str:
    """How a checkpoint's weights are laid out (``fsdp``, ``megatron TP=t PP=p``): the layout of the train
    engine that wrote it (:func:`hpcrl.trainer.export.checkpoint_owner`)."""
    return _export().checkpoint_owner(keys)[1]


def trainer_layout(cfg: RunConfig) -> str:
    """:func:`weight_layout` of the checkpoints this run's trainer writes."""
    return train_engine_spec(cfg.trainer.engine).layout_of(cfg.trainer)


def data_offset(src: Path, num_rows: int, seed: int) -> int:
    """This run's ticket 0 = the source's position after the highest ticket trained before its checkpoint."""
    src_run = src.parent.parent
    step = int(atomic.read_json(src / "trainer.json")["step"])
    meta_path = src_run / "admission" / "meta.json"
    if not meta_path.exists():
        raise ValueError(f"init.restore: data: {meta_path} not found; the source run has no data position")
    meta = atomic.read_json(meta_path)
    if (meta["num_rows"], meta["seed"]) != (num_rows, seed):
        raise ValueError(f"init.restore: data: the source trained on {meta['num_rows']} rows with seed {meta['seed']}, "
                         f"this run has {num_rows} rows and seed {seed}; the data position would mean other prompts")
    trained = src_run / "spool" / "trained"
    names = [parse_name(f.name) for d in trained.glob("step_*") if d.name[5:].isdigit() and int(d.name[5:]) < step
             for f in d.iterdir()]
    tickets = [n.ticket for n in names if n is not None]
    return int(meta.get("offset", 0)) + (max(tickets) + 1 if tickets else 0)


def start_from(cfg: RunConfig, run_dir: Path, base_model: Path, num_rows: int) -> tuple[Path, dict]:
    """Steps 1-4 of the module docstring: (this run's initial model, what was taken, for prepared.json)."""
    src = resolve_source(cfg.init.checkpoint)
    src_model = source_init_model(src)
    ours, theirs = architecture(base_model), architecture(src_model)
    if ours != theirs:
        diff = {k: (ours[k], theirs[k]) for k in ARCHITECTURE_KEYS if ours[k] != theirs[k]}
        raise ValueError(f"init.checkpoint: {src} holds a model of another architecture than model.* names "
                         f"({base_model}); differing (this config, checkpoint): {diff}")
    check_adapters(cfg, src)
    t0 = time.time()
    taken = {"checkpoint": str(src), "restore": list(cfg.init.restore), "data_offset": 0}
    if "data" in cfg.init.restore:
        taken["data_offset"] = data_offset(src, num_rows, cfg.seed)
    init = _export().to_hf(src, src_model, run_dir / INIT_DIR / "model")
    step0 = write_step0(cfg, src, run_dir)
    if "data" in cfg.init.restore:
        admission = run_dir / "admission"
        admission.mkdir(parents=True, exist_ok=True)
        atomic.write_json(admission / "meta.json", {"num_rows": num_rows, "seed": cfg.seed,
                                                    "offset": taken["data_offset"]})
    log.info("starting from %s (step %s): weights -> %s, %s; restored %s; data position %d (%.1fs)", src,
             atomic.read_json(src / "trainer.json")["step"], init, step0, ", ".join(cfg.init.restore) or "nothing else",
             taken["data_offset"], time.time() - t0)
    return init, taken
