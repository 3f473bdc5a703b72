"""Dataset rows (bad-row reporting, formats) and the addition dataset."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpcrl.data.arithmetic import addition_problems, main, write_arithmetic_dataset
from hpcrl.data.rows import BadRowError, Row, load_rows

LINES = [
    '{"prompt": "1+1=", "answer": "2"}',  # 1 good
    '{"prompt": "2+2=", "answer": 4',  # 2 invalid JSON
    '{"answer": "3"}',  # 3 missing prompt
    '{"prompt": "  ", "answer": "3"}',  # 4 empty prompt
    '{"prompt": "3+4=", "answer": 7, "level": 2}',  # 5 good, numeric answer
    "",  # 6 blank: ignored
    '[1, 2]',  # 7 not an object
    '{"prompt": "5+5="}',  # 8 missing answer
    '{"prompt": 12, "answer": "1"}',  # 9 non-string prompt
    '{"prompt": "9+9=", "answer": "18"}',  # 10 good
]


@pytest.fixture
def messy(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(LINES) + "\n")
    return path


def test_skip_mode_keeps_good_rows_and_reports_lines(messy, caplog):
    with caplog.at_level(logging.WARNING, logger="hpcrl.data.rows"):
        rows = load_rows(messy, on_bad_row="skip")
    assert [(r.prompt, r.answer, r.index) for r in rows] == [("1+1=", "2", 0), ("3+4=", "7", 1), ("9+9=", "18", 2)]
    assert rows[1].extra == {"level": 2}
    text = caplog.text
    for line, why in [(2, "invalid JSON"), (3, "missing 'prompt'"), (4, "empty 'prompt'"),
                      (7, "row is not a JSON object"), (8, "missing 'answer'"), (9, "'prompt' must be a string")]:
        assert f"{messy}:{line}: {why}" in text
    assert f"{messy}:6:" not in text and f"{messy}:1:" not in text


def test_error_mode_raises_with_file_and_line(messy):
    with pytest.raises(BadRowError, match=rf"^{messy}:2: invalid JSON") as info:
        load_rows(messy)
    assert info.value.line == 2 and isinstance(info.value, ValueError)


def test_validate_hook_and_custom_keys(tmp_path):
    path = tmp_path / "q.json"
    path.write_text('{"question": "a?", "solution": "x"}\n{"question": "bb?", "solution": "y"}\n')
    rows = load_rows(path, prompt_key="question", answer_key="solution", on_bad_row="skip",
                     validate=lambda r: "too long" if len(r.prompt) > 2 else None)
    assert [r.prompt for r in rows] == ["a?"]
    with pytest.raises(BadRowError, match=r"q.json:2: too long"):
        load_rows(path, prompt_key="question", answer_key="solution",
                  validate=lambda r: "too long" if len(r.prompt) > 2 else None)


def test_json_array_file(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"prompt": "p", "answer": 1.0}, {"prompt": "q"}]))
    rows = load_rows(path, on_bad_row="skip")
    assert [(r.prompt, r.answer) for r in rows] == [("p", "1")]
    with pytest.raises(BadRowError, match=r"a.json:2: missing 'answer'"):
        load_rows(path)


def test_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    table = pa.table({"prompt": ["1+2=", "", "4+4="], "answer": [3, 0, 8], "src": ["a", "b", "c"]})
    pq.write_table(table, path)
    rows = load_rows(path, on_bad_row="skip")
    assert rows == [Row("1+2=", "3", 0, {"src": "a"}), Row("4+4=", "8", 1, {"src": "c"})]
    with pytest.raises(BadRowError, match=r"d.parquet:2: empty 'prompt'"):
        load_rows(path)


def test_missing_file_empty_file_and_bad_format(tmp_path):
    with pytest.raises(ValueError, match="nope.jsonl"):
        load_rows(tmp_path / "nope.jsonl")
    empty = tmp_path / "e.jsonl"
    empty.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match="no valid rows"):
        load_rows(empty, on_bad_row="skip")
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported"):
        load_rows(csv)
    with pytest.raises(ValueError, match="^on_bad_row"):
        load_rows(empty, on_bad_row="ignore")


def test_addition_problems_deterministic_and_in_range():
    a = addition_problems(200, seed=1, digits=2)
    assert a == addition_problems(200, seed=1, digits=2)
    assert a != addition_problems(200, seed=2, digits=2)
    for p in a:
        x, y = p["prompt"].rstrip("=").split("+")
        assert 10 <= int(x) <= 99 and 10 <= int(y) <= 99
        assert p["answer"] == str(int(x) + int(y)) and p["prompt"].endswith("=")
    three = addition_problems(50, seed=0, digits=3)
    assert all(100 <= int(p["prompt"].split("+")[0]) <= 999 for p in three)


def test_addition_dataset_disjoint_deterministic_idempotent(tmp_path):
    train, evals = write_arithmetic_dataset(tmp_path / "a", n_train=3000, n_eval=300, seed=5)
    t_rows, e_rows = load_rows(train), load_rows(evals)
    assert len(t_rows) == 3000 and len(e_rows) == 300
    eval_prompts = {r.prompt for r in e_rows}
    assert len(eval_prompts) == 300
    assert not eval_prompts & {r.prompt for r in t_rows}
    train2, evals2 = write_arithmetic_dataset(tmp_path / "b", n_train=3000, n_eval=300, seed=5)
    assert train.read_bytes() == train2.read_bytes() and evals.read_bytes() == evals2.read_bytes()
    # idempotent: a matching meta.json means the files are reused, not rewritten
    mtime = train.stat().st_mtime_ns
    assert write_arithmetic_dataset(tmp_path / "a", n_train=3000, n_eval=300, seed=5) == (train, evals)
    assert train.stat().st_mtime_ns == mtime
    # changed parameters regenerate
    write_arithmetic_dataset(tmp_path / "a", n_train=100, n_eval=300, seed=5)
    assert len(load_rows(train)) == 100
    assert not [p for p in (tmp_path / "a").iterdir() if ".tmp." in p.name]


def test_addition_dataset_rejects_impossible_eval(tmp_path):
    with pytest.raises(ValueError, match="^n_eval"):
        write_arithmetic_dataset(tmp_path, n_train=10, n_eval=81, digits=1)


def test_arithmetic_cli(tmp_path, capsys):
    main(["--out", str(tmp_path), "--n-train", "50", "--n-eval", "10", "--seed", "3"])
    assert str(tmp_path / "train.jsonl") in capsys.readouterr().out
    assert len(load_rows(tmp_path / "eval.jsonl")) == 10


def test_multiplication_dataset(tmp_path):
    train, evals = write_arithmetic_dataset(tmp_path / "m", n_train=500, n_eval=50, seed=5, op="*")
    rows = load_rows(train) + load_rows(evals)
    for r in rows:
        x, y = r.prompt.rstrip("=").split("*")
        assert 10 <= int(x) <= 99 and 10 <= int(y) <= 99 and r.answer == str(int(x) * int(y))
    assert not {r.prompt for r in load_rows(evals)} & {r.prompt for r in load_rows(train)}
    # the same folder asked for additions is regenerated, not reused
    write_arithmetic_dataset(tmp_path / "m", n_train=500, n_eval=50, seed=5)
    assert "+" in load_rows(train)[0].prompt
    with pytest.raises(ValueError, match="^op"):
        write_arithmetic_dataset(tmp_path / "x", n_train=10, n_eval=5, op="-")


def test_a_run_counts_a_prompt_too_long_for_the_models_context_as_a_bad_row(tmp_path) -> None:
    """The rollout's single-turn episodes and the evaluation take prompts from the dataset: one that leaves the
    context no room for rollout.max_new_tokens is reported before either sees it (exact token counts)."""
    from hpcrl.config import load_config
    from hpcrl.model.hf_io import load_tokenizer
    from hpcrl.model.tiny import TinyModelConfig, build_tiny_model
    from hpcrl.prepared import load_datasets

    model = build_tiny_model(tmp_path / "model", TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2,
                                                                 num_kv_heads=2, head_dim=8, intermediate_size=32,
                                                                 max_position_embeddings=64))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": p, "answer": "2"}) for p in ("1+1=", "1" * 56, "1" * 57)) + "\n")
    tok = load_tokenizer(model)
    cfg = load_config("configs/quickstart.yaml", ["rollout.max_new_tokens=8"])
    with pytest.raises(BadRowError, match=r"rows.jsonl:3: prompt: 57 prompt tokens \+ 8 to generate exceed the "
                                          r"model's context of 64 tokens"):
        load_datasets(cfg, tok, rows, rows, model)
    cfg = load_config("configs/quickstart.yaml", ["rollout.max_new_tokens=8", "data.on_bad_row=skip"])
    train, _ = load_datasets(cfg, tok, rows, rows, model)
    assert [len(r.prompt) for r in train] == [4, 56]  # 56 + 8 fills the context exactly
