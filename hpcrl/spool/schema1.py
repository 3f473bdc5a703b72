"""Reading spool files of schema version 1 (the layout before the compound datasets).

Schema 1 kept every header field in its own root attribute and every
per-token field in its own dataset, with ``offsets`` [G+1] delimiting the
samples (see the history of docs/spool-format.md). Nothing writes it any
more; the reader stays so that files published before an upgrade are still
trained (not quarantined) and old runs can still be audited.

``read`` returns the same pieces as the schema 2 reader in
:mod:`hpcrl.spool.format`, which then runs the same validation on them.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from hpcrl.spool.errors import SpoolFormatError
from hpcrl.spool.h5io import H5File

TOKEN_FIELDS = {  # dataset -> dtype of the flat per-token datasets
    "response_ids": np.int32,
    "behav_logprobs": np.float32,
    "versions": np.int32,
    "loss_mask": np.uint8,
}


def read(f: H5File) -> tuple[dict[str, Any], np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(header, prompt_ids, lengths, rewards, per-token arrays) of an open schema 1 file."""
    group_size = f.int_attr("group_size")
    offsets = f.dataset("offsets", np.int64)
    if group_size < 1:
        raise SpoolFormatError(f"group_size: must be >= 1, got {group_size}")
    if len(offsets) != group_size + 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise SpoolFormatError(f"offsets: expected {group_size + 1} non-decreasing values from 0")
    tokens = {name: f.dataset(name, dtype) for name, dtype in TOKEN_FIELDS.items()}
    rewards = f.dataset("rewards", np.float32)
    header = {
        "ticket": f.int_attr("ticket"), "writer": f.str_attr("writer"),
        "min_version": f.int_attr("min_version"), "max_version": f.int_attr("max_version"),
        "created": f.float_attr("created"),
        "finish_reasons": json.loads(f.str_attr("finish_reasons")), "meta": json.loads(f.str_attr("meta")),
    }
    return header, f.dataset("prompt_ids", np.int32), np.diff(offsets), rewards, tokens
