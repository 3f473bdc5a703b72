"""Greedy evaluator and the SFT warm start (cache, determinism, best-model keeping)."""

import json
import logging
import os
import sys
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

from hpcrl.data.arithmetic import addition_problems  # noqa: E402
from hpcrl.data.rows import Row  # noqa: E402
from hpcrl.eval.accuracy import greedy_accuracy  # noqa: E402
from hpcrl.model.hf_io import encode_prompt, load_model, load_tokenizer  # noqa: E402
from hpcrl.model.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from hpcrl.sft.warm_start import SFTConfig, warm_start  # noqa: E402

ws = sys.modules["hpcrl.sft.warm_start"]  # the package re-exports the function under the module's name

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16,
                        intermediate_size=64, seed=1)


def exact(prompt: str, response: str, row: Row) -> float:
    return float(response.strip() == row.answer)


def rows(n: int, seed: int) -> list[Row]:
    return [Row(p["prompt"], p["answer"], i, {}) for i, p in enumerate(addition_problems(n, seed))]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("base") / "tiny", SMALL)


def manual_greedy(model, tok, prompt: str, max_new: int) -> str:
    ids = encode_prompt(tok, prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == tok.eos_token_id:
                break
    return tok.decode(out, skip_special_tokens=True)


def test_greedy_accuracy_matches_manual_loop(base):
    model, tok = load_model(base), load_tokenizer(base)
    model.train()
    batch = [Row("1+2=", "3", 0, {}), Row("12+47=", "59", 1, {}), Row("What is 7+8? ", "15", 2, {})]
    seen = {}

    def record(prompt, response, row):
        seen[prompt] = response
        return 1.0

    res = greedy_accuracy(model, tok, batch, record, max_new_tokens=6, batch_size=2)
    assert res.accuracy == 1.0 and res.n == 3 and len(res.examples) == 3
    assert model.training  # train mode restored
    model.eval()
    for r in batch:
        assert seen[r.prompt] == manual_greedy(model, tok, r.prompt, 6)
        assert len(seen[r.prompt]) >= 1
    half = greedy_accuracy(model, tok, batch, lambda p, resp, row: float(row.index % 2 == 0))
    assert half.accuracy == pytest.approx(2 / 3)


def test_greedy_accuracy_rejects_empty(base):
    with pytest.raises(ValueError, match="^rows"):
        greedy_accuracy(load_model(base), load_tokenizer(base), [], exact)


def test_collate_masks_prompt_and_pads():
    # (ids, labels): a prompt of 3 tokens then an answer of 2, a prompt of 1 then an answer of 3
    batch = ws._collate([([5, 6, 7, 8, 1], [-100, -100, -100, 8, 1]), ([5, 9, 9, 1], [-100, 9, 9, 1])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 1], [5, 9, 9, 1, 0]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 8, 1], [-100, 9, 9, 1, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]


def test_train_keeps_best_accuracy_weights(base, caplog):
    model, tok = load_model(base), load_tokenizer(base)
    data = ws._tokenize(tok, rows(64, 0), False)
    scripted, states = iter([0.1, 0.5, 0.2]), []

    def evaluate():
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        return next(scripted)

    cfg = SFTConfig(batch_size=8, max_steps=6, eval_every=2, target_accuracy=0.9, threads=1)
    with caplog.at_level(logging.WARNING, logger="hpcrl.sft.warm_start"):
        acc, step = ws._train(cfg, model, tok, data, evaluate)
    assert (acc, step) == (0.5, 4) and "not reached" in caplog.text
    final = model.state_dict()
    assert all(torch.equal(final[k], states[1][k]) for k in final)
    assert not all(torch.equal(final[k], states[2][k]) for k in final)


def test_a_check_above_the_band_replays_the_same_batches_checking_twice_as_often(base, caplog):
    """sft.max_accuracy: the accuracy jumps past the band between two checks (step 8); the warm start goes back
    to step 4 and replays: the checks at 6 and 8 see the same weights the first pass had at 8 (deterministic),
    and the first check in the band ends it."""
    model, tok = load_model(base), load_tokenizer(base)
    data = ws._tokenize(tok, rows(64, 0), False)
    scripted, states = iter([0.1, 0.9, 0.15, 0.35]), []

    def evaluate():
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        return next(scripted)

    cfg = SFTConfig(batch_size=8, max_steps=40, eval_every=4, target_accuracy=0.3, max_accuracy=0.4, threads=1)
    with caplog.at_level(logging.INFO, logger="hpcrl.sft.warm_start"):
        acc, step = ws._train(cfg, model, tok, data, evaluate)
    assert (acc, step) == (0.35, 8) and "replaying from step 4, checking every 2 steps" in caplog.text
    first_at_8, replayed_at_8, at_4 = states[1], states[3], states[0]
    assert all(torch.equal(first_at_8[k], replayed_at_8[k]) for k in first_at_8)
    assert not all(torch.equal(at_4[k], replayed_at_8[k]) for k in at_4)
    # an odd interval: the replay (every 2 from step 5) checks 7, 9 and again 10, the step that went over
    scripted, states = iter([0.1, 0.9, 0.1, 0.1, 0.35]), []
    cfg = SFTConfig(batch_size=8, max_steps=40, eval_every=5, target_accuracy=0.3, max_accuracy=0.4, threads=1)
    assert ws._train(cfg, load_model(base), tok, data, evaluate) == (0.35, 10)
    assert all(torch.equal(states[1][k], states[4][k]) for k in states[1])  # the same weights at step 10
    # checks every step already and still past the band: the first step above the target is kept
    scripted = iter([0.1, 0.9, 0.1, 0.9])
    cfg = SFTConfig(batch_size=8, max_steps=40, eval_every=2, target_accuracy=0.3, max_accuracy=0.4, threads=1)
    with caplog.at_level(logging.WARNING, logger="hpcrl.sft.warm_start"):
        assert ws._train(cfg, load_model(base), tok, data, evaluate) == (0.9, 4)  # checks at 2, 4, then 3, 4
    assert "in one step, past the band's top" in caplog.text
    with pytest.raises(ValueError, match="max_accuracy"):
        SFTConfig(target_accuracy=0.5, max_accuracy=0.4)
    with pytest.raises(ValueError, match="max_accuracy"):
        SFTConfig(max_accuracy=float("nan"))


def test_warm_start_trains_caches_and_is_deterministic(base, tmp_path):
    train, evals = rows(400, 0), rows(20, 99)
    cfg = SFTConfig(batch_size=16, max_steps=30, eval_every=10, eval_size=20, target_accuracy=1.01,
                    threads=1, cache_dir=str(tmp_path / "cache"))
    first = warm_start(cfg, base, train, evals, exact, max_new_tokens=4)
    assert not first.cached and first.steps in (10, 20, 30) and 0.0 <= first.accuracy <= 1.0
    assert first.path.parent == tmp_path / "cache"
    info = json.loads((first.path / "result.json").read_text())
    assert info["steps"] == first.steps and info["accuracy"] == first.accuracy
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp." in p.name]

    t0 = time.monotonic()
    second = warm_start(cfg, base, train, evals, exact, max_new_tokens=4)
    assert second.cached and second.path == first.path and time.monotonic() - t0 < 5
    assert (second.accuracy, second.steps) == (first.accuracy, first.steps)

    # same inputs in a fresh cache: identical weights (deterministic with the seed)
    cfg2 = SFTConfig(**{**cfg.__dict__, "cache_dir": str(tmp_path / "cache2")})
    third = warm_start(cfg2, base, train, evals, exact, max_new_tokens=4)
    assert not third.cached and third.path.name == first.path.name
    m1, m3, m0 = load_model(first.path), load_model(third.path), load_model(base)
    s1, s3, s0 = m1.state_dict(), m3.state_dict(), m0.state_dict()
    assert all(torch.equal(s1[k], s3[k]) for k in s1)
    assert not all(torch.equal(s1[k], s0[k]) for k in s1)  # it did train

    # a changed field or changed rows give a different key
    other = warm_start(SFTConfig(**{**cfg.__dict__, "max_steps": 10}), base, train, evals, exact,
                       max_new_tokens=4)
    assert other.path != first.path and other.steps == 10


def test_warm_start_stops_at_target_and_disabled(base, tmp_path):
    train, evals = rows(100, 0), rows(10, 7)
    cfg = SFTConfig(batch_size=8, max_steps=50, eval_every=5, eval_size=10, target_accuracy=0.0,
                    threads=1, cache_dir=str(tmp_path))
    res = warm_start(cfg, base, train, evals, exact)
    assert res.steps == 5
    off = warm_start(SFTConfig(enabled=False, cache_dir=str(tmp_path)), base, train, evals, exact)
    assert off.path == base and off.steps == 0 and not off.cached


def test_config_validation():
    with pytest.raises(ValueError, match="^lr"):
        SFTConfig(lr=0)
    with pytest.raises(ValueError, match="^eval_every"):
        SFTConfig(eval_every=0)
