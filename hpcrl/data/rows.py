"""Loading prompt/answer rows from JSONL, JSON-lines or Parquet files.

A dataset row becomes a ``Row`` (prompt, answer, index, extra). Bad rows are
never silently accepted: each is reported as ``path:line: why`` and either
skipped (``on_bad_row="skip"``, logged as a warning) or raised as
``BadRowError`` (``on_bad_row="error"``). ``index`` is the row's position
among the file's valid rows, so it is stable for a given file and policy and
can be used by the admission ledger to map tickets to rows.
Line numbers are 1-based (for Parquet and JSON arrays: the 1-based row number).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

log = logging.getLogger(__name__)


class BadRowError(ValueError):
    """A dataset row that cannot be used; the message is ``path:line: why``."""

    def __init__(self, path: str | Path, line: int, why: str) -> None:
        super().__init__(f"{path}:{line}: {why}")
        self.path = str(path)
        self.line = line
        self.why = why


@dataclass
class Row:
    prompt: str  # the text the policy continues
    answer: str  # the reference answer (numbers converted to str)
    index: int  # position among the file's valid rows
    extra: dict = field(default_factory=dict)  # every other column of the row

    def data(self) -> dict:
        """The row as user functions get it (an agent's ``data``, a demonstration's): prompt, answer, index and
        the other columns."""
        return {"prompt": self.prompt, "answer": self.answer, "index": self.index, **self.extra}


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as e:
                yield lineno, BadRowError(path, lineno, f"invalid JSON ({e.msg} at column {e.colno})")


def _iter_json(path: Path) -> Iterator[tuple[int, Any]]:
    """A .json file holding one array of rows (element k reported as line k), else JSON lines."""
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if not head.startswith("["):
        yield from _iter_jsonl(path)
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON array ({e.msg})") from e
    yield from enumerate(data, start=1)


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise ValueError(f"{path}: cannot read parquet file: {e}") from e
    for i, obj in enumerate(table.to_pylist(), start=1):
        yield i, obj


def _answer_str(value: Any) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return None


def _to_row(obj: Any, index: int, prompt_key: str, answer_key: str) -> Row | str:
    """The Row for ``obj``, or the reason it is bad."""
    if not isinstance(obj, dict):
        return f"row is not a JSON object (got {type(obj).__name__})"
    prompt = obj.get(prompt_key)
    if prompt is None:
        return f"missing {prompt_key!r}"
    if not isinstance(prompt, str):
        return f"{prompt_key!r} must be a string, got {type(prompt).__name__}"
    if not prompt.strip():
        return f"empty {prompt_key!r}"
    if obj.get(answer_key) is None:
        return f"missing {answer_key!r}"
    answer = _answer_str(obj[answer_key])
    if answer is None:
        return f"{answer_key!r} must be a string or number, got {type(obj[answer_key]).__name__}"
    extra = {k: v for k, v in obj.items() if k not in (prompt_key, answer_key)}
    return Row(prompt=prompt, answer=answer, index=index, extra=extra)


def load_rows(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    on_bad_row: Literal["skip", "error"] = "error",
    validate: Callable[[Row], str | None] | None = None,
) -> list[Row]:
    """Read the valid rows of ``path`` (.jsonl; .json as JSON lines or one array; .parquet)."""
    if on_bad_row not in ("skip", "error"):
        raise ValueError(f"on_bad_row: must be one of 'skip', 'error', got {on_bad_row!r}")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"dataset file does not exist: {p}")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        records = _iter_jsonl(p)
    elif suffix == ".json":
        records = _iter_json(p)
    elif suffix == ".parquet":
        records = _iter_parquet(p)
    else:
        raise ValueError(f"{p}: unsupported dataset format {suffix!r} (use .jsonl, .json or .parquet)")
    rows: list[Row] = []
    n_bad = 0
    for lineno, obj in records:
        row = obj if isinstance(obj, BadRowError) else _to_row(obj, len(rows), prompt_key, answer_key)
        if isinstance(row, Row) and validate is not None:
            reason = validate(row)
            row = row if reason is None else reason
        if isinstance(row, Row):
            rows.append(row)
            continue
        err = row if isinstance(row, BadRowError) else BadRowError(p, lineno, row)
        if on_bad_row == "error":
            raise err
        n_bad += 1
        log.warning("%s (row skipped)", err)
    if not rows:
        raise ValueError(f"{p}: no valid rows ({n_bad} bad rows skipped)")
    if n_bad:
        log.warning("%s: skipped %d bad rows, kept %d", p, n_bad, len(rows))
    return rows
