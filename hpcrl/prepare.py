"""Run preparation, done once by the submitting process before any component starts.

Order: datasets (synthetic ones are generated into a cache and reused) ->
base model (a tiny model is built if asked and missing) -> dataset rows are
checked against the tokenizer -> SFT warm start (cached by content hash), or
the start from another run's checkpoint (``init.checkpoint``,
:mod:`hpcrl.init_from`) ->
``<run_dir>/prepared.json`` records the resolved paths every component reads
(:mod:`hpcrl.prepared`: what the components read of it, the datasets too). Everything here fails with a clear message before a
single component is launched.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path

from hpcrl.fs import atomic
from hpcrl.config import RunConfig
from hpcrl.data.arithmetic import write_arithmetic_dataset
from hpcrl.data.listops import write_listops_dataset
from hpcrl.data.longtail import write_reverse_dataset
from hpcrl.eval.measure import scorer
from hpcrl.model.hf_io import load_tokenizer
from hpcrl.model.tiny import TinyModelConfig, build_tiny_model
from hpcrl.prepared import Prepared, load_datasets
from hpcrl.reward.registry import build_scorer
from hpcrl.reward.runner import load_function
from hpcrl.sft.warm_start import warm_start

log = logging.getLogger(__name__)


def dataset_paths(cfg: RunConfig) -> tuple[Path, Path]:
    d = cfg.data
    if d.synthetic in ("addition", "multiplication"):
        out = (Path(d.synthetic_dir).expanduser()
               / f"{d.synthetic}-d{d.synthetic_digits}-n{d.n_train}-e{d.n_eval}-s{cfg.seed}")
        return write_arithmetic_dataset(out, n_train=d.n_train, n_eval=d.n_eval, seed=cfg.seed, digits=d.synthetic_digits,
                                      op="+" if d.synthetic == "addition" else "*")
    if d.synthetic == "reverse":
        out = (Path(d.synthetic_dir).expanduser()
               / f"reverse-l{d.synthetic_max_len}-a{d.synthetic_alpha}-n{d.n_train}-e{d.n_eval}-s{cfg.seed}")
        return write_reverse_dataset(out, n_train=d.n_train, n_eval=d.n_eval, seed=cfg.seed,
                                     max_len=d.synthetic_max_len, alpha=d.synthetic_alpha)
    if d.synthetic == "listops":
        out = Path(d.synthetic_dir).expanduser() / f"listops-n{d.n_train}-e{d.n_eval}-s{cfg.seed}"
        return write_listops_dataset(out, n_train=d.n_train, n_eval=d.n_eval, seed=cfg.seed)
    train = Path(d.train_path).expanduser()
    return train, Path(d.eval_path).expanduser() if d.eval_path else train


def base_model_path(cfg: RunConfig) -> Path:
    m = cfg.model
    if not m.tiny:
        path = Path(m.path).expanduser()
        if not (path / "config.json").exists():
            raise ValueError(f"model.path: {path} is not a HuggingFace model folder (no config.json)")
        return path
    tiny = TinyModelConfig(hidden_size=m.tiny_hidden_size, num_layers=m.tiny_layers, seed=cfg.seed)
    # the files' format is part of the key: a cache built before the tokenizer had a chat template is not reused
    key = hashlib.sha256(json.dumps({**asdict(tiny), "format": 2}, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(m.path).expanduser() if m.path else Path(m.cache_dir).expanduser() / f"tiny-qwen3-{key}"
    if not (path / "config.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        log.info("building a tiny Qwen3 model at %s", path)
        build_tiny_model(path, tiny)
    return path


def prepare(cfg: RunConfig, run_dir: Path) -> Prepared:
    train_path, eval_path = dataset_paths(cfg)
    base = base_model_path(cfg)
    tokenizer = load_tokenizer(base)
    train_rows, eval_rows = load_datasets(cfg, tokenizer, train_path, eval_path, base)
    log.info("data: %d train rows (%s), %d eval rows (%s)", len(train_rows), train_path, len(eval_rows), eval_path)
    prepared = Prepared(init_model=str(base), base_model=str(base), train_path=str(train_path), eval_path=str(eval_path))
    if cfg.init.checkpoint:
        from hpcrl.init_from import start_from

        init, prepared.init_from = start_from(cfg, run_dir, base, len(train_rows))
        prepared.init_model = str(init)
        if cfg.sft.enabled:
            log.info("SFT warm start skipped: the policy starts from %s", prepared.init_from["checkpoint"])
    elif cfg.sft.enabled:
        runner = build_scorer(cfg.reward)
        demonstrate = load_function(cfg.sft.demonstrations, "sft.demonstrations:") if cfg.sft.demonstrations else None
        try:
            res = warm_start(cfg.sft, base, train_rows, eval_rows, scorer(runner),
                             max_new_tokens=cfg.rollout.max_new_tokens, chat_template=cfg.data.chat_template,
                             demonstrate=demonstrate)
        finally:
            runner.close()
        prepared.init_model, prepared.sft_accuracy = str(res.path), res.accuracy
        prepared.sft_steps, prepared.sft_cached = res.steps, res.cached
        log.info("SFT warm start: accuracy %.3f after %d steps (%s)", res.accuracy, res.steps,
                 "cached" if res.cached else f"{res.seconds:.0f}s")
    atomic.write_json(run_dir / "prepared.json", asdict(prepared))
    return prepared
