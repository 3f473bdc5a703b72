"""The spool file format: one HDF5 file per finished prompt group.

A rollout writes each group of ``group_size`` samples of one prompt as one
file; the trainer reads it. The layout (schema 2, see docs/spool-format.md)
holds only numeric datasets and JSON strings: nothing is pickled, so a file
from an untrusted or broken writer can at worst fail validation. It is kept
to a few HDF5 objects because the fixed cost per object dominates for files
this small: a ``schema_version`` attribute, a JSON ``header`` attribute, and
three datasets, ``prompt_ids``, ``samples`` (one compound row per sample:
length, reward) and ``tokens`` (one compound row per response token, the
samples' tokens one after the other).

Ordering rules: ``encode_group``/``write_group`` produce a plain file and are
not atomic; publication (write to a temporary name, fsync, rename) is the
store's job (``hpcrl.spool.store.Spool.publish``). ``read_group`` reads
schema 2 and schema 1 files, validates everything and raises
``SpoolFormatError`` with the reason; it never returns a group that would
crash the trainer.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hpcrl.spool import schema1
from hpcrl.spool.errors import SpoolFormatError
from hpcrl.spool.h5io import H5File, encode

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, SCHEMA_VERSION)
SUFFIX = ".h5"
WRITER_RE = re.compile(r"^[A-Za-z0-9-]+$")
_NAME_RE = re.compile(r"^g(\d{9,})_v(\d{6,})-(\d{6,})_([A-Za-z0-9-]+)\.h5$")
# Sample field -> (column of the ``tokens`` dataset, dtype). Packed little-endian compound types.
_TOKEN_COLUMNS = {
    "response_ids": ("response_id", np.dtype("<i4")),
    "behav_logprobs": ("behav_logprob", np.dtype("<f4")),
    "versions": ("version", np.dtype("<i4")),
    "loss_mask": ("loss_mask", np.dtype("u1")),
}
TOKEN_DTYPE = np.dtype([(col, dt) for col, dt in _TOKEN_COLUMNS.values()])
PROMPT_DTYPE = np.dtype("<i4")
SAMPLE_DTYPE = np.dtype([("length", "<i8"), ("reward", "<f4")])
_HEADER_TYPES: dict[str, tuple[type, ...]] = {  # header key -> accepted JSON types
    "ticket": (int,), "writer": (str,), "min_version": (int,), "max_version": (int,),
    "created": (int, float), "finish_reasons": (list,), "meta": (dict,),
}
_EMPTY_VERSION_KEY = "version"  # meta key giving the version of a group without tokens

__all__ = ["PROMPT_DTYPE", "READABLE_SCHEMAS", "SAMPLE_DTYPE", "SCHEMA_VERSION", "TOKEN_DTYPE", "NameInfo", "Sample",
           "SpoolFormatError", "TrajectoryGroup", "encode_group", "encode_group_read", "file_name", "parse_name",
           "read_group", "validate_group", "write_group"]


@dataclass
class Sample:
    """One response of a prompt group; all arrays have the response length L."""

    response_ids: np.ndarray  # int32 [L]  (L may be 0)
    behav_logprobs: np.ndarray  # float32 [L], finite, <= 0
    versions: np.ndarray  # int32 [L], policy version that generated each token, >= 0
    loss_mask: np.ndarray  # uint8 [L], 0/1
    reward: float  # stored as float32
    finish_reason: str  # "stop" | "length" | "abort" | ...


@dataclass
class TrajectoryGroup:
    """All samples of one admitted prompt (one admission ticket)."""

    ticket: int  # admission ticket id (>= 0)
    writer: str  # rollout writer id, [A-Za-z0-9-]+
    prompt_ids: np.ndarray  # int32 [P], shared by all samples of the group
    samples: list[Sample]
    created: float = field(default_factory=time.time)  # unix time the group was finished
    meta: dict = field(default_factory=dict)  # JSON-serialisable extras (prompt text, answer, ...)

    def version_range(self) -> tuple[int, int]:
        """(oldest, newest) policy version of any response token; meta["version"] (or 0) twice if no token."""
        vs = [s.versions for s in self.samples if len(s.versions)]
        if vs:
            flat = np.concatenate(vs) if len(vs) > 1 else np.asarray(vs[0])
            return int(flat.min()), int(flat.max())
        # No generated token at all: the producer states the version in meta.
        v = int(self.meta.get(_EMPTY_VERSION_KEY, 0))
        return v, v

    @property
    def min_version(self) -> int:
        """Oldest policy version of any response token (meta["version"] or 0 if no token)."""
        return self.version_range()[0]

    @property
    def max_version(self) -> int:
        """Newest policy version of any response token (meta["version"] or 0 if no token)."""
        return self.version_range()[1]


class NameInfo(NamedTuple):
    """What a spool file name says about its content."""

    ticket: int
    min_version: int
    max_version: int
    writer: str


def file_name(group: TrajectoryGroup) -> str:
    """Canonical file name ``g{ticket:09d}_v{min:06d}-{max:06d}_{writer}.h5``."""
    lo, hi = group.version_range()
    return f"g{group.ticket:09d}_v{lo:06d}-{hi:06d}_{group.writer}{SUFFIX}"


def parse_name(name: str) -> NameInfo | None:
    """Parse a canonical spool file name; ``None`` for anything else (temp files, reasons)."""
    m = _NAME_RE.match(name)
    if m is None:
        return None
    info = NameInfo(int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4))
    if info.min_version > info.max_version:
        return None
    return info


# -- writing --------------------------------------------------------------------
def _as_1d(value: Any, dtype: np.dtype | type, what: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise SpoolFormatError(f"{what}: must be 1-D, got shape {arr.shape}")
    return arr.astype(dtype, copy=False)


def _check_writable(group: TrajectoryGroup) -> tuple[int, int]:
    """Checks without which the file or its name would be incoherent; returns the version range."""
    if not isinstance(group.ticket, (int, np.integer)) or group.ticket < 0:
        raise SpoolFormatError(f"ticket: must be an int >= 0, got {group.ticket!r}")
    if not isinstance(group.writer, str) or not WRITER_RE.match(group.writer):
        raise SpoolFormatError(f"writer: must match [A-Za-z0-9-]+, got {group.writer!r}")
    if not group.samples:
        raise SpoolFormatError("samples: a group needs at least one sample")
    for i, s in enumerate(group.samples):
        lengths = {k: len(getattr(s, k)) for k in _TOKEN_COLUMNS}
        if len(set(lengths.values())) != 1:
            raise SpoolFormatError(f"samples[{i}]: per-token arrays differ in length: {lengths}")
    lo, hi = group.version_range()
    if lo < 0:
        where = "versions" if any(len(s.versions) for s in group.samples) else f"meta.{_EMPTY_VERSION_KEY}"
        raise SpoolFormatError(f"{where}: must be >= 0, got {lo}")
    return lo, hi


def encode_group(group: TrajectoryGroup) -> bytes:
    """The bytes of ``group``'s spool file (schema 2), built in memory.

    Structure is checked here (lengths, ticket, writer, versions >= 0); value
    checks (finite non-positive logprobs, 0/1 mask) run in ``read_group`` so a
    bad group still reaches the spool and is quarantined with a reason. Call
    ``validate_group`` first to fail early instead.
    """
    return encode(*_encoded_parts(group))


def encode_group_read(group: TrajectoryGroup) -> tuple[bytes, TrajectoryGroup | None]:
    """The bytes of ``group``'s spool file and the group ``read_group`` returns from them, built from the very
    arrays that were encoded and validated as ``read_group`` validates (without parsing the bytes); ``None`` in
    its place when ``read_group`` would refuse the file. For a reader in the writing process (colocated mode)."""
    attrs, datasets = _encoded_parts(group)
    samples, tokens = datasets["samples"], datasets["tokens"]
    try:  # copies, as a read makes them: the trainer's group shares no memory with the writer's
        view = _assemble(json.loads(attrs["header"]), np.array(datasets["prompt_ids"]),
                         np.ascontiguousarray(samples["length"]), np.ascontiguousarray(samples["reward"]),
                         {name: np.ascontiguousarray(tokens[col]) for name, (col, _) in _TOKEN_COLUMNS.items()})
    except Exception:  # noqa: BLE001 - whatever read_group would refuse (it turns any of these into a refusal)
        view = None
    return encode(attrs, datasets), view


def _encoded_parts(group: TrajectoryGroup) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``encode``'s attributes and datasets for ``group``."""
    lo, hi = _check_writable(group)
    samples = np.empty(len(group.samples), SAMPLE_DTYPE)
    samples["length"] = [len(s.response_ids) for s in group.samples]
    samples["reward"] = [s.reward for s in group.samples]
    tokens = np.empty(int(samples["length"].sum()), TOKEN_DTYPE)
    for name, (col, dtype) in _TOKEN_COLUMNS.items():
        parts = [_as_1d(getattr(s, name), dtype, name) for s in group.samples]
        tokens[col] = np.concatenate(parts)
    header = {"ticket": int(group.ticket), "writer": group.writer, "min_version": lo, "max_version": hi,
              "created": float(group.created), "finish_reasons": [s.finish_reason for s in group.samples],
              "meta": group.meta}
    return ({"schema_version": SCHEMA_VERSION, "header": json.dumps(header, ensure_ascii=False)},
            {"prompt_ids": _as_1d(group.prompt_ids, PROMPT_DTYPE, "prompt_ids"), "samples": samples, "tokens": tokens})


def write_group(path: Path, group: TrajectoryGroup) -> None:
    """Write ``group`` to ``path`` (plain, non-atomic; see ``Spool.publish`` and ``encode_group``)."""
    data = encode_group(group)
    with open(path, "wb") as f:
        f.write(data)


def validate_group(group: TrajectoryGroup) -> None:
    """Raise ``SpoolFormatError`` unless ``group`` would pass ``read_group``."""
    _check_writable(group)
    for i, s in enumerate(group.samples):
        _check_values(
            f"samples[{i}].",
            np.asarray(s.behav_logprobs, np.float32),
            np.asarray(s.versions),
            np.asarray(s.loss_mask),
        )
        if not math.isfinite(float(s.reward)):
            raise SpoolFormatError(f"samples[{i}].reward: must be finite, got {s.reward}")


def _check_values(where: str, logp: np.ndarray, versions: np.ndarray, mask: np.ndarray) -> None:
    """Vectorised value checks of one sample's or one file's flat per-token arrays."""
    if not np.isfinite(logp).all():
        raise SpoolFormatError(f"{where}behav_logprobs: contains NaN or inf")
    if (logp > 0).any():
        raise SpoolFormatError(f"{where}behav_logprobs: contains positive values (max {logp.max()})")
    if (versions < 0).any():
        raise SpoolFormatError(f"{where}versions: contains negative values")
    # uint8 (as read): 0/1 means <= 1, one reduction; other dtypes (validate_group) need both bounds
    bad = (mask > 1).any() if mask.dtype == np.uint8 else ((mask != 0) & (mask != 1)).any()
    if bad:
        raise SpoolFormatError(f"{where}loss_mask: values must be 0 or 1")


# -- reading --------------------------------------------------------------------
def read_group(path: Path) -> TrajectoryGroup:
    """Read and fully validate one spool file (schema 2, or schema 1 written before it).

    Raises ``SpoolFormatError`` for a truncated/unreadable file, an unknown
    schema version, a missing or mistyped attribute or dataset, inconsistent
    shapes, NaN/inf/positive logprobs, negative versions, a mask not 0/1,
    non-finite rewards, invalid JSON or a header that contradicts the data.
    A missing file raises ``FileNotFoundError``.
    """
    try:
        with H5File(path) as f:
            schema = f.int_attr("schema_version")
            if schema == SCHEMA_VERSION:
                parts = _read_schema2(f)
            elif schema == 1:
                parts = schema1.read(f)
            else:
                raise SpoolFormatError(f"schema_version: expected {SCHEMA_VERSION} (or 1, still readable), "
                                       f"got {schema}")
        return _assemble(*parts)
    except (SpoolFormatError, FileNotFoundError):
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
        raise SpoolFormatError(f"unreadable content ({type(e).__name__}: {e})") from e


def _read_schema2(f: H5File) -> tuple[dict[str, Any], np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    header = json.loads(f.str_attr("header"))
    prompt_ids = f.dataset("prompt_ids", PROMPT_DTYPE)
    samples = f.dataset("samples", SAMPLE_DTYPE)
    rows = f.dataset("tokens", TOKEN_DTYPE)
    tokens = {name: np.ascontiguousarray(rows[col]) for name, (col, _) in _TOKEN_COLUMNS.items()}
    return header, prompt_ids, np.ascontiguousarray(samples["length"]), np.ascontiguousarray(samples["reward"]), tokens


def _assemble(header: Any, prompt_ids: np.ndarray, lengths: np.ndarray, rewards: np.ndarray,
              tokens: dict[str, np.ndarray]) -> TrajectoryGroup:
    """Validate what a reader found and build the group from it."""
    _check_header(header)
    n_samples = len(lengths)
    if n_samples < 1:
        raise SpoolFormatError("samples: a group needs at least one sample, the file has none")
    if len(rewards) != n_samples:
        raise SpoolFormatError(f"rewards: expected {n_samples} entries, got {len(rewards)}")
    if (lengths < 0).any():
        raise SpoolFormatError(f"sample lengths (offsets) must be >= 0, got {lengths.tolist()}")
    total = int(lengths.sum())
    counts = {k: len(v) for k, v in tokens.items()}
    if any(c != total for c in counts.values()):
        raise SpoolFormatError(f"per-token data must have {total} entries (the sum of the sample lengths, "
                               f"offsets[-1]), got {counts}")
    reasons = header["finish_reasons"]
    if len(reasons) != n_samples or not all(isinstance(r, str) for r in reasons):
        raise SpoolFormatError(f"finish_reasons: expected a JSON list of {n_samples} strings")
    versions = tokens["versions"]
    if total:
        _check_values("", tokens["behav_logprobs"], versions, tokens["loss_mask"])
    if not np.isfinite(rewards).all():
        raise SpoolFormatError("rewards: contains NaN or inf")
    ends = np.cumsum(lengths).tolist()
    ids, logp, mask = tokens["response_ids"], tokens["behav_logprobs"], tokens["loss_mask"]
    samples = [Sample(ids[a:b], logp[a:b], versions[a:b], mask[a:b], reward, reason)
               for a, b, reward, reason in zip([0, *ends[:-1]], ends, rewards.tolist(), reasons)]
    group = TrajectoryGroup(ticket=header["ticket"], writer=header["writer"], prompt_ids=prompt_ids,
                            samples=samples, created=float(header["created"]), meta=header["meta"])
    actual = (int(versions.min()), int(versions.max())) if total else group.version_range()
    stored = (header["min_version"], header["max_version"])
    if stored != actual:
        raise SpoolFormatError(f"min/max_version in the header {stored} contradict the token versions {actual}")
    return group


def _check_header(header: Any) -> None:
    if not isinstance(header, dict):
        raise SpoolFormatError("header: expected a JSON object")
    for key, types in _HEADER_TYPES.items():
        if key not in header:
            raise SpoolFormatError(f"header: missing {key!r}")
        value = header[key]
        if not isinstance(value, types) or isinstance(value, bool):
            raise SpoolFormatError(f"header {key!r}: expected {' or '.join(t.__name__ for t in types)}, "
                                   f"got {type(value).__name__}")
    if header["ticket"] < 0:
        raise SpoolFormatError(f"ticket: must be >= 0, got {header['ticket']}")
    if not WRITER_RE.match(header["writer"]):
        raise SpoolFormatError(f"writer: must match [A-Za-z0-9-]+, got {header['writer']!r}")
    if not math.isfinite(header["created"]):
        raise SpoolFormatError(f"created: must be finite, got {header['created']}")
