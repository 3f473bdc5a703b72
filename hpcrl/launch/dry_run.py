"""``python -m hpcrl.submit --config X.yaml [key=value ...] --dry-run``: check a run before it waits in a queue.

Creates nothing (no run directory, no dataset, no model, no job), and imports
neither torch nor transformers. In order:

1. the config was loaded and validated by the caller (a bad key exits 2);
2. the model: a local HuggingFace folder must exist with its ``config.json``
   and a tokenizer that parses and names an eos token (a tiny model to be
   built is reported as such);
3. the data: ``data.train_path`` / ``data.eval_path`` must exist and parse
   into rows (synthetic tasks are generated at the start, reported as such);
   a start from another run's checkpoint (``init.checkpoint``): it verifies
   and holds the configured architecture;
4. the components: for each, the request the scheduler would get is printed
   (its spec's ``describe``, :mod:`hpcrl.launch.registry`: the local command line; the ``srun`` command inside an allocation; the
   sbatch script submitit would write), and under ``launch.scheduler=slurm``
   each script is checked with ``sbatch --test-only``, which reports where
   and when Slurm would start it, or why it refuses (partition, account,
   QOS, resources).

:func:`dry_run` prints one line per check and returns True when all passed.
"""

from __future__ import annotations

import logging
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

from hpcrl.config import RunConfig
from hpcrl.launch.registry import scheduler_spec
from hpcrl.launch.scheduler import ComponentSpec
from hpcrl.launch.specs import component_specs

log = logging.getLogger(__name__)


def check_model(cfg: RunConfig) -> tuple[bool, str]:
    path = Path(cfg.model.path).expanduser() if cfg.model.path else None
    if cfg.model.tiny and (path is None or not (path / "config.json").exists()):
        return True, f"a tiny Qwen3 model is built at the start ({path or cfg.model.cache_dir})"
    if path is None or not path.is_dir():
        return False, f"model.path: {path} is not a directory"
    if not (path / "config.json").exists():
        return False, f"model.path: {path} has no config.json (not a HuggingFace model folder)"
    return tokenizer_check(path)


def tokenizer_check(path: Path) -> tuple[bool, str]:
    """The folder's tokenizer, read without transformers (the dry-run stays a light command): a
    ``tokenizer.json`` must parse with the ``tokenizers`` library, and an eos token must be named (generation
    needs one); a tokenizer in other files (``tokenizer.model``, ``vocab.json``) is found, and loads at the
    start."""
    import json

    files = [f for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
             if (path / f).exists()]
    if not files:
        return False, f"model.path: no tokenizer files (tokenizer.json, tokenizer.model, vocab.json) in {path}"
    special = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            loaded = json.loads((path / name).read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            return False, f"model.path: {path / name} does not parse: {e}"
        if not isinstance(loaded, dict):
            return False, f"model.path: {path / name} is not a JSON object"
        special = {**loaded, **special}
    if not special.get("eos_token"):
        return False, f"model.path: the tokenizer in {path} names no eos token (needed to end generations)"
    if "tokenizer.json" not in files:
        return True, f"model {path} (tokenizer files: {', '.join(files)}; loaded at the start)"
    from tokenizers import Tokenizer  # the Rust library transformers wraps; no torch

    try:
        size = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # whatever the file holds, the user must hear it before queueing
        return False, f"model.path: the tokenizer in {path} does not load: {type(e).__name__}: {e}"
    return True, f"model {path} (tokenizer: {size} tokens)"


def check_start(cfg: RunConfig) -> tuple[bool, str]:
    """``init.checkpoint`` (--from): the checkpoint verifies and its model has the configured architecture."""
    from hpcrl.init_from import ARCHITECTURE_KEYS, architecture, resolve_source, source_init_model

    try:
        src = resolve_source(cfg.init.checkpoint)
        theirs = architecture(source_init_model(src))
    except (ValueError, OSError) as e:
        return False, str(e)
    path = Path(cfg.model.path).expanduser() if cfg.model.path else None
    if path is not None and (path / "config.json").exists():
        ours = architecture(path)
        diff = {k: (ours[k], theirs[k]) for k in ARCHITECTURE_KEYS if ours[k] != theirs[k]}
        if diff:
            return False, f"init.checkpoint: {src} holds another architecture than {path}: {diff}"
    return True, f"starts from {src} (restoring weights{''.join(', ' + r for r in cfg.init.restore)})"


def check_data(cfg: RunConfig) -> tuple[bool, str]:
    d = cfg.data
    if d.synthetic != "none":
        return True, f"synthetic {d.synthetic} task ({d.n_train} train, {d.n_eval} eval rows) generated at the start"
    from hpcrl.data.rows import load_rows

    counts = []
    for key, value in (("train_path", d.train_path), ("eval_path", d.eval_path or d.train_path)):
        path = Path(value).expanduser()
        if not path.exists():
            return False, f"data.{key}: {path} does not exist"
        try:
            rows = load_rows(path, prompt_key=d.prompt_key, answer_key=d.answer_key, on_bad_row=d.on_bad_row)
        except (ValueError, KeyError, OSError) as e:
            return False, f"data.{key}: {path}: {e}"
        counts.append(f"{key} {path} ({len(rows)} rows)")
    return True, "; ".join(counts)


def describe_srun(cfg: RunConfig, spec: ComponentSpec, run_dir: Path, scratch: Path) -> tuple[bool, str]:
    """``launch.scheduler: srun``: the ``srun`` command of the component's step."""
    from hpcrl.launch.slurm import SrunScheduler

    return True, " ".join(SrunScheduler().command(spec).argv)


def describe_sbatch(cfg: RunConfig, spec: ComponentSpec, run_dir: Path, scratch: Path) -> tuple[bool, str]:
    """``launch.scheduler: slurm``: the sbatch script submitit would write, and whether ``sbatch --test-only``
    takes it (the script to test is written to ``scratch``)."""
    from hpcrl.launch.scheduler import SubmitRejected
    from hpcrl.launch.slurm import render_sbatch

    try:
        script = render_sbatch(spec, run_dir / "logs" / "slurm")
    except SubmitRejected as e:
        return False, str(e)
    path = scratch / f"{spec.name}.sbatch"
    path.write_text(script)
    proc = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, timeout=60)
    said = " ".join((proc.stderr + proc.stdout).split())
    return proc.returncode == 0, f"sbatch --test-only: {said}\n{script}"


def dry_run(cfg: RunConfig) -> bool:
    run_dir = Path(cfg.run_dir or f"runs/{cfg.name}-<time>").expanduser().resolve()
    print(f"dry run of {cfg.name}: nothing is created or submitted; the run directory would be {run_dir}")
    ok = True
    checks = [("model", check_model(cfg)), ("data", check_data(cfg))]
    if cfg.init.checkpoint:
        checks.append(("start", check_start(cfg)))
    for what, (passed, text) in checks:
        print(f"[{'ok' if passed else 'FAIL'}] {what}: {text}")
        ok &= passed
    scheduler = scheduler_spec(cfg.launch.scheduler)
    with tempfile.TemporaryDirectory(prefix="hpcrl-dry-run-") as tmp:
        for spec in component_specs(replace(cfg, run_dir=str(run_dir)), run_dir):
            try:
                passed, text = scheduler.describe_request(cfg, spec, run_dir, Path(tmp))
            except (OSError, subprocess.SubprocessError) as e:
                passed, text = False, f"{type(e).__name__}: {e}"
            print(f"[{'ok' if passed else 'FAIL'}] {spec.name} ({cfg.launch.scheduler}): {text}")
            ok &= passed
    print("dry run passed" if ok else "dry run FAILED: fix the lines marked FAIL")
    return ok
