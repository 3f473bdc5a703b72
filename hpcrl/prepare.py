"""Run preparation, done once by the submitting process before any component starts.

Order: datasets (synthetic ones are generated into a cache and reused) ->
base model (a tiny model is built if asked and missing) -> dataset rows are
checked against the tokenizer -> SFT warm start (cached by content hash), or
the start from another run's checkpoint (``init.checkpoint``,
:mod:`hpcrl.init_from`) ->
``<run_dir>/prepared.json`` records the resolved paths every component reads
(:func:`load_prepared`). Everything here fails with a clear message before a
single component is launched.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from hpcrl import atomic
from hpcrl.config import RunConfig
from hpcrl.data.arithmetic import write_arithmetic_dataset
from hpcrl.data.longtail import write_reverse_dataset
from hpcrl.data.rows import Row, load_rows
from hpcrl.model.hf_io import encode_prompt, load_tokenizer, unknown_characters
from hpcrl.model.limits import ModelLimits
from hpcrl.model.tiny import TinyModelConfig, build_tiny_model
from hpcrl.reward.runner import RewardRunner, load_function
from hpcrl.sft.warm_start import warm_start

if TYPE_CHECKING:
    from hpcrl.eval.accuracy import EvalResult

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    init_model: str  # the policy at version 0 (SFT output or the base model)
    base_model: str
    train_path: str
    eval_path: str
    sft_accuracy: float | None = None  # greedy accuracy the warm start stopped at (its own eval subset)
    sft_steps: int = 0
    sft_cached: bool = False
    init_from: dict | None = None  # started from another run's checkpoint: which, what was restored (--from)


def load_prepared(run_dir: str | Path) -> Prepared:
    return Prepared(**atomic.read_json(Path(run_dir) / "prepared.json"))


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


def load_datasets(cfg: RunConfig, tokenizer, train_path: Path, eval_path: Path,
                  model_path: str | Path) -> tuple[list[Row], list[Row]]:
    """Rows of both splits; rows the tokenizer cannot represent, and prompts that leave the model's context no
    room for ``rollout.max_new_tokens``, count as bad rows (the same rows in every component)."""
    too_long = _context_check(cfg, tokenizer, ModelLimits.of_dir(model_path))

    def validate(row: Row) -> str | None:
        bad = unknown_characters(tokenizer, row.prompt + row.answer)
        if bad:
            return f"characters not in the tokenizer's vocabulary: {sorted(bad)}"
        return too_long(row.prompt)

    kw = dict(prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
              on_bad_row=cfg.data.on_bad_row, validate=validate)
    return load_rows(train_path, **kw), load_rows(eval_path, **kw)


def _context_check(cfg: RunConfig, tokenizer, limits: ModelLimits) -> Callable[[str], str | None]:
    """Why a prompt is too long for the context with ``rollout.max_new_tokens`` after it (None: it fits). Every
    prompt is tokenised as the rollout will (no bound on tokens per byte holds for every tokenizer: a
    SentencePiece prefix, Unicode normalisation)."""
    if limits.context is None:
        return lambda prompt: None
    room = limits.context - cfg.rollout.max_new_tokens

    def check(prompt: str) -> str | None:
        n = len(encode_prompt(tokenizer, prompt, cfg.data.chat_template))
        return None if n <= room else (f"the prompt is {n} tokens: with rollout.max_new_tokens="
                                       f"{cfg.rollout.max_new_tokens} it exceeds the model's context of "
                                       f"{limits.context}")
    return check


def scorer(runner: RewardRunner):
    """Adapt the reward runner to the ``score(prompt, response, row)`` the evaluators take."""
    def score(prompt: str, response: str, row: Row) -> float:
        return runner.score(prompt, response, {"answer": row.answer, **row.extra}).reward
    return score


Measure = Callable[..., "EvalResult"]  # (model, rows, after_batch=None) -> EvalResult


def held_out(cfg: RunConfig, tokenizer, runner: RewardRunner) -> Measure:
    """How the run measures held-out accuracy: one greedy completion per prompt scored by the reward
    function, or with ``eval.agent`` the agent function's episodes over greedy completions."""
    from hpcrl.eval.accuracy import greedy_accuracy

    if cfg.eval.agent:
        from hpcrl.agent.runner import load_agent_fn
        from hpcrl.eval.agent import agent_accuracy

        fn = load_agent_fn(cfg.agent.fn)
        return lambda model, rows, after_batch=None: agent_accuracy(
            model, tokenizer, rows, fn, max_new_tokens=cfg.rollout.max_new_tokens, timeout_s=cfg.agent.timeout_s,
            concurrency=cfg.agent.max_concurrent_episodes, batch_size=cfg.eval.batch_size, after_batch=after_batch,
            cfg=cfg.agent)
    score = scorer(runner)
    return lambda model, rows, after_batch=None: greedy_accuracy(
        model, tokenizer, rows, score, max_new_tokens=cfg.rollout.max_new_tokens, batch_size=cfg.eval.batch_size,
        chat_template=cfg.data.chat_template, after_batch=after_batch)


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
        runner = RewardRunner(cfg.reward)
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
