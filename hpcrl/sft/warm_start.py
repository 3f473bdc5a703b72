"""Supervised warm start: fine-tune the base model until it is "a bit" right.

RL from a random tiny model gets no reward signal, so a run first trains on
the labelled answers (cross-entropy on the answer tokens + eos only, the
prompt masked) and stops as soon as greedy accuracy on the first
``eval_size`` eval rows reaches ``target_accuracy`` (checked every
``eval_every`` steps). Stopping at a target rather than after a fixed budget
gives reproducible starting accuracies: on the tiny addition model the jump
in accuracy happens at a seed-dependent step. The accuracy can also jump far
past the target between two checks; with ``max_accuracy`` below 1 a check
above it goes back to the check before (weights, optimizer, schedule and
batch order) and replays the same batches checking twice as often, so the
warm start ends in the band ``[target_accuracy, max_accuracy]`` unless the
accuracy crosses the whole band in one step (then the first step above the
target is kept, and the log says so).

Lifecycle:
1. The cache key hashes the base model (config + weight bytes), its
   tokenizer, the rows, the evaluation settings and every config field that
   changes the result (not ``cache_dir``/``threads``).
2. If ``<cache_dir>/<key>/result.json`` exists the folder is returned as is
   (``cached=True``); no training happens.
3. Otherwise train; the best-accuracy weights are kept (warning if the target
   was not reached), saved with ``save_model`` together with result.json and
   published by one atomic rename. Two processes racing on the same key both
   succeed; the second publication is discarded and the first one returned.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hpcrl.sft.config import SFTConfig  # noqa: F401 (re-exported)
from hpcrl.fs import atomic
from hpcrl.data.rows import Row
from hpcrl.eval.accuracy import greedy_accuracy
from hpcrl.model.hf_io import encode_prompt, load_model, load_tokenizer, save_model
from hpcrl.sft.demonstrations import Demonstrate, call_demonstrate, tokenize_demonstrations, turn_accuracy

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"
_KEY_VERSION = 1  # bump when the training recipe changes what a key produces




@dataclass
class SFTResult:
    path: Path  # folder of the warm-started model (the base model when disabled)
    accuracy: float  # greedy accuracy of the saved model (nan when disabled)
    steps: int  # optimizer steps of the saved model
    cached: bool  # true when found in the cache (no training in this call)
    seconds: float  # training time recorded when the model was made


def _hash_file(h: "hashlib._Hash", path: Path) -> None:
    h.update(path.name.encode() + b"\0")
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)


def cache_key(cfg: SFTConfig, base: Path, train_rows: list[Row], eval_rows: list[Row], extra: dict) -> str:
    """sha256 of everything that determines the warm-started weights."""
    h = hashlib.sha256(f"hpcrl-sft/{_KEY_VERSION}\0".encode())
    files = [base / "config.json", *sorted(base.glob("*.safetensors")), *sorted(base.glob("*.bin"))]
    for extra_file in ("tokenizer.json", "tokenizer_config.json"):
        if (base / extra_file).exists():
            files.append(base / extra_file)
    for path in files:
        _hash_file(h, path)
    fields = {k: v for k, v in asdict(cfg).items() if k not in ("cache_dir", "threads")}
    if fields["max_accuracy"] == 1.0:  # no band: the same weights as before the field existed, the same key
        del fields["max_accuracy"]
    h.update(json.dumps({"cfg": fields, **extra}, sort_keys=True).encode())
    for rows in (train_rows, eval_rows[: cfg.eval_size]):
        h.update(b"\0rows\0")
        for r in rows:
            h.update(json.dumps([r.prompt, r.answer], ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()


def _tokenize(tok: PreTrainedTokenizerBase, rows: list[Row], chat_template: bool) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each row: the prompt, then the answer and eos, trained on the answer and eos only."""
    out = []
    for r in rows:
        prompt = encode_prompt(tok, r.prompt, chat_template)
        answer = list(tok.encode(r.answer, add_special_tokens=False)) + [tok.eos_token_id]
        out.append((prompt + answer, [-100] * len(prompt) + answer))
    return out


def _collate(items: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch of (ids, labels); labels are -100 where nothing is trained."""
    width = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, (seq, lab) in enumerate(items):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        labels[i, : len(lab)] = torch.tensor(lab, dtype=torch.long)
        mask[i, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class _Batches:
    """Seeded epochs of shuffled indices, cut into batches."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size = n, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def next(self) -> list[int]:
        while len(self.order) < self.batch_size:
            self.order += torch.randperm(self.n, generator=self.gen).tolist()
        batch, self.order = self.order[: self.batch_size], self.order[self.batch_size:]
        return batch


class _Snapshot:
    """Everything the warm start's next steps depend on (weights, optimizer, schedule, batch order) at one step."""

    def __init__(self, step: int, model: PreTrainedModel, opt, sched, batches: _Batches) -> None:
        self.step = step
        self.model = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.opt, self.sched = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
        self.gen, self.order = batches.gen.get_state(), list(batches.order)
        self.rng = torch.get_rng_state()  # dropout, for base models that have it

    def restore(self, model: PreTrainedModel, opt, sched, batches: _Batches) -> int:
        """Put it all back; the step it was taken at."""
        model.load_state_dict(self.model)
        opt.load_state_dict(copy.deepcopy(self.opt))
        sched.load_state_dict(copy.deepcopy(self.sched))
        batches.gen.set_state(self.gen)
        batches.order = list(self.order)
        torch.set_rng_state(self.rng)
        return self.step


def _train(
    cfg: SFTConfig, model: PreTrainedModel, tok: PreTrainedTokenizerBase, data: list, evaluate: Callable[[], float]
) -> tuple[float, int]:
    """Train in place; leave the best-accuracy weights in ``model``; return (accuracy, step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    batches = _Batches(len(data), cfg.batch_size, cfg.seed)
    best_acc, best_step, best_state, losses = -1.0, 0, None, []
    band = cfg.max_accuracy < 1.0
    every, step, over = cfg.eval_every, 0, 0  # over: the step a check found above the band
    before = _Snapshot(0, model, opt, sched, batches) if band else None  # the last check below the band
    model.train()
    while step < cfg.max_steps:
        step += 1
        out = model(**_collate([data[i] for i in batches.next()], tok.pad_token_id))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(out.loss.item())
        if (step - (before.step if before else 0)) % every and step not in (cfg.max_steps, over):
            continue  # a replay checks the step that went over the band again, whatever the interval
        acc = evaluate()
        log.info("sft step %d loss %.4f accuracy %.3f", step, sum(losses) / len(losses), acc)
        losses.clear()
        if acc > best_acc:
            best_acc, best_step = acc, step
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if band and acc > cfg.max_accuracy and every > 1:
            every, over = max(1, every // 2), step
            log.info("sft: accuracy %.3f at step %d is above the band [%.3f, %.3f]: replaying from step %d, "
                     "checking every %d steps", acc, step, cfg.target_accuracy, cfg.max_accuracy, before.step, every)
            step = before.restore(model, opt, sched, batches)
            continue
        if acc >= cfg.target_accuracy:
            if band and acc > cfg.max_accuracy:
                log.warning("sft: the accuracy went from below %.3f to %.3f in one step, past the band's top %.3f; "
                            "keeping step %d", cfg.target_accuracy, acc, cfg.max_accuracy, step)
            return acc, step
        if band:
            before = _Snapshot(step, model, opt, sched, batches)
    log.warning(
        "sft: target accuracy %.3f not reached in %d steps; keeping step %d (accuracy %.3f)",
        cfg.target_accuracy, cfg.max_steps, best_step, best_acc,
    )
    if best_state is not None:
        model.load_state_dict(best_state)
    return best_acc, best_step


def _cached(final: Path) -> SFTResult | None:
    result = final / RESULT_FILE
    if not result.exists():
        return None
    info = atomic.read_json(result)
    return SFTResult(final, float(info["accuracy"]), int(info["steps"]), True, float(info["seconds"]))


def warm_start(
    cfg: SFTConfig,
    base_model: str | Path,
    train_rows: list[Row],
    eval_rows: list[Row],
    score: Callable[[str, str, Row], float],
    *,
    max_new_tokens: int = 8,
    chat_template: bool = False,
    demonstrate: Demonstrate | None = None,
) -> SFTResult:
    """Return a warm-started copy of ``base_model`` (trained now, or from the cache).

    With ``demonstrate`` (``sft.demonstrations``) each row's demonstrated conversation is trained instead of its
    answer, and the accuracy is that of the demonstrated turns (:mod:`hpcrl.sft.demonstrations`)."""
    base = Path(base_model).expanduser()
    if not cfg.enabled:
        return SFTResult(base, float("nan"), 0, False, 0.0)
    if not train_rows or not eval_rows:
        raise ValueError("sft: need at least one train row and one eval row")
    tok = load_tokenizer(base)  # validates the folder before hashing it
    extra = {"max_new_tokens": max_new_tokens, "chat_template": chat_template,
             "score": f"{getattr(score, '__module__', '')}.{getattr(score, '__qualname__', repr(score))}"}
    evals = eval_rows[: cfg.eval_size]
    if demonstrate is not None:  # the conversations are what the weights depend on (rendered by the hashed tokenizer)
        train_demos, eval_demos = call_demonstrate(train_rows, demonstrate), call_demonstrate(evals, demonstrate)
        h = hashlib.sha256()
        for d in (*train_demos, None, *eval_demos):
            h.update(json.dumps(d, sort_keys=True, default=str).encode() + b"\n")
        extra = {"demonstrations": h.hexdigest()}
    key = cache_key(cfg, base, train_rows, eval_rows, extra)
    final = Path(cfg.cache_dir).expanduser() / key
    if (hit := _cached(final)) is not None:
        log.info("sft: using cached warm start %s (accuracy %.3f)", final, hit.accuracy)
        return hit
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    t0 = time.monotonic()
    try:
        model = load_model(base)
        if demonstrate is not None:
            data = [(d.ids, d.labels()) for d in tokenize_demonstrations(tok, train_rows, train_demos)]
            eval_tokens = tokenize_demonstrations(tok, evals, eval_demos)

            def evaluate() -> float:
                return turn_accuracy(model, tok, eval_tokens)
        else:
            data = _tokenize(tok, train_rows, chat_template)

            def evaluate() -> float:
                return greedy_accuracy(model, tok, evals, score, max_new_tokens=max_new_tokens,
                                       chat_template=chat_template).accuracy

        accuracy, steps = _train(cfg, model, tok, data, evaluate)
    finally:
        torch.set_num_threads(prev_threads)
    seconds = time.monotonic() - t0
    info = {"accuracy": accuracy, "steps": steps, "seconds": seconds, "base_model": str(base)}
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        save_model(model, tok, final, extra_json={RESULT_FILE: info})
    except (OSError, ValueError):
        if (hit := _cached(final)) is None:
            raise
        log.info("sft: another process published %s first; using it", final)
        return hit
    log.info("sft: warm start %s accuracy %.3f after %d steps in %.1fs", final, accuracy, steps, seconds)
    return SFTResult(final, accuracy, steps, False, seconds)
