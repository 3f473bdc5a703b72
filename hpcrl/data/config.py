"""Configuration of the prompt datasets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class DataConfig:
    # build a synthetic task instead of reading train_path/eval_path (reverse: long-tailed lengths,
    # hpcrl/data/longtail.py; listops: write a Python expression, scored by reward.scorer=code, hpcrl/data/listops.py)
    synthetic: Literal["none", "addition", "multiplication", "reverse", "listops"] = "none"
    synthetic_dir: str = "~/.cache/hpcrl/data"  # where synthetic datasets are written (reused when present)
    synthetic_digits: int = 2  # operand digits of the synthetic arithmetic task
    synthetic_max_len: int = 24  # reverse task: longest digit string (lengths 3..max_len, P ~ (L-2)^-alpha)
    synthetic_alpha: float = 1.5  # reverse task: power-law exponent of the length distribution (smaller = longer tail)
    n_train: int = 20000  # synthetic training problems
    n_eval: int = 500  # synthetic held-out problems
    train_path: str = ""  # JSONL or parquet with prompt/answer rows
    eval_path: str = ""  # held-out JSONL or parquet
    prompt_key: str = "prompt"  # column holding the prompt text
    answer_key: str = "answer"  # column holding the reference answer
    on_bad_row: Literal["skip", "error"] = "error"  # a malformed row is reported (file:line) and skipped, or stops the run
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template

    def __post_init__(self) -> None:
        if self.synthetic == "none" and not self.train_path:
            raise ValueError("train_path: required when synthetic is 'none' (or set data.synthetic=addition)")
        if self.synthetic_digits < 1:
            raise ValueError(f"synthetic_digits: must be >= 1, got {self.synthetic_digits}")
        if self.synthetic_max_len < 3:
            raise ValueError(f"synthetic_max_len: must be >= 3, got {self.synthetic_max_len}")
        if self.synthetic_alpha <= 0:
            raise ValueError(f"synthetic_alpha: must be > 0, got {self.synthetic_alpha}")
        if self.n_train < 1 or self.n_eval < 1:
            raise ValueError(f"n_train: n_train and n_eval must be >= 1, got {self.n_train}, {self.n_eval}")
