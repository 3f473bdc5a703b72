"""The spool file format: one HDF5 file per finished prompt group.

A rollout writes each group of ``group_size`` samples of one prompt as one
file; the trainer reads it. The layout (see docs/spool-format.md) holds only
numeric datasets and JSON strings: nothing is pickled, so a file from an
untrusted or broken writer can at worst fail validation.

Ragged per-sample arrays are stored flat: sample ``i`` owns the slice
``offsets[i]:offsets[i+1]`` of ``response_ids``, ``behav_logprobs``,
``versions`` and ``loss_mask``.

Ordering rules: ``write_group`` writes a plain file and is not atomic;
publication (write to a temporary name, fsync, rename) is the store's job
(``hpcrl.spool.store.Spool.publish``). ``read_group`` validates everything and
raises ``SpoolFormatError`` with the reason; it never returns a group that
would crash the trainer.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import h5py
import numpy as np

SCHEMA_VERSION = 1
SUFFIX = ".h5"
WRITER_RE = re.compile(r"^[A-Za-z0-9-]+$")
_NAME_RE = re.compile(r"^g(\d{9,})_v(\d{6,})-(\d{6,})_([A-Za-z0-9-]+)\.h5$")
_TOKEN_FIELDS = {  # name -> dtype of the flat per-token datasets
    "response_ids": np.int32,
    "behav_logprobs": np.float32,
    "versions": np.int32,
    "loss_mask": np.uint8,
}
_EMPTY_VERSION_KEY = "version"  # meta key giving the version of a group without tokens


class SpoolFormatError(ValueError):
    """A spool file (or a group about to be written) is invalid; the message says why."""


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

    def _version_range(self) -> tuple[int, int]:
        vs = [np.asarray(s.versions) for s in self.samples if len(s.versions)]
        lows, highs = [int(v.min()) for v in vs], [int(v.max()) for v in vs]
        if lows:
            return min(lows), max(highs)
        # No generated token at all: the producer states the version in meta.
        v = int(self.meta.get(_EMPTY_VERSION_KEY, 0))
        return v, v

    @property
    def min_version(self) -> int:
        """Oldest policy version of any response token (meta["version"] or 0 if no token)."""
        return self._version_range()[0]

    @property
    def max_version(self) -> int:
        """Newest policy version of any response token (meta["version"] or 0 if no token)."""
        return self._version_range()[1]


class NameInfo(NamedTuple):
    """What a spool file name says about its content."""

    ticket: int
    min_version: int
    max_version: int
    writer: str


def file_name(group: TrajectoryGroup) -> str:
    """Canonical file name ``g{ticket:09d}_v{min:06d}-{max:06d}_{writer}.h5``."""
    return f"g{group.ticket:09d}_v{group.min_version:06d}-{group.max_version:06d}_{group.writer}{SUFFIX}"


def parse_name(name: str) -> NameInfo | None:
    """Parse a canonical spool file name; ``None`` for anything else (temp files, reasons)."""
    m = _NAME_RE.match(name)
    if m is None:
        return None
    info = NameInfo(int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4))
    if info.min_version > info.max_version:
        return None
    return info


def _as_1d(value: Any, dtype: type, what: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise SpoolFormatError(f"{what}: must be 1-D, got shape {arr.shape}")
    return arr.astype(dtype, copy=False)


def _check_writable(group: TrajectoryGroup) -> None:
    """Checks without which the file or its name would be incoherent."""
    if not isinstance(group.ticket, (int, np.integer)) or group.ticket < 0:
        raise SpoolFormatError(f"ticket: must be an int >= 0, got {group.ticket!r}")
    if not isinstance(group.writer, str) or not WRITER_RE.match(group.writer):
        raise SpoolFormatError(f"writer: must match [A-Za-z0-9-]+, got {group.writer!r}")
    if not group.samples:
        raise SpoolFormatError("samples: a group needs at least one sample")
    for i, s in enumerate(group.samples):
        lengths = {k: len(getattr(s, k)) for k in _TOKEN_FIELDS}
        if len(set(lengths.values())) != 1:
            raise SpoolFormatError(f"samples[{i}]: per-token arrays differ in length: {lengths}")
        if len(s.versions) and int(np.min(s.versions)) < 0:
            raise SpoolFormatError(f"samples[{i}].versions: must be >= 0")
    if group.min_version < 0:
        raise SpoolFormatError(f"meta.{_EMPTY_VERSION_KEY}: must be >= 0, got {group.min_version}")


def write_group(path: Path, group: TrajectoryGroup) -> None:
    """Write ``group`` to ``path`` (plain, non-atomic; see ``Spool.publish``).

    Structure is checked here (lengths, ticket, writer, versions >= 0); value
    checks (finite non-positive logprobs, 0/1 mask) run in ``read_group`` so a
    bad group still reaches the spool and is quarantined with a reason. Call
    ``validate_group`` first to fail early instead.
    """
    _check_writable(group)
    lengths = [len(s.response_ids) for s in group.samples]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    with h5py.File(path, "w", locking=False) as f:
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["ticket"] = int(group.ticket)
        f.attrs["writer"] = group.writer
        f.attrs["min_version"] = group.min_version
        f.attrs["max_version"] = group.max_version
        f.attrs["created"] = float(group.created)
        f.attrs["group_size"] = len(group.samples)
        f.attrs["meta"] = json.dumps(group.meta, ensure_ascii=False)
        f.attrs["finish_reasons"] = json.dumps([s.finish_reason for s in group.samples])
        f.create_dataset("prompt_ids", data=_as_1d(group.prompt_ids, np.int32, "prompt_ids"))
        f.create_dataset("offsets", data=offsets)
        for name, dtype in _TOKEN_FIELDS.items():
            parts = [_as_1d(getattr(s, name), dtype, name) for s in group.samples]
            f.create_dataset(name, data=np.concatenate(parts) if parts else np.zeros(0, dtype))
        f.create_dataset("rewards", data=np.array([s.reward for s in group.samples], np.float32))


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
    if not np.all(np.isfinite(logp)):
        raise SpoolFormatError(f"{where}behav_logprobs: contains NaN or inf")
    if np.any(logp > 0):
        raise SpoolFormatError(f"{where}behav_logprobs: contains positive values (max {logp.max()})")
    if np.any(versions < 0):
        raise SpoolFormatError(f"{where}versions: contains negative values")
    if np.any((mask != 0) & (mask != 1)):
        raise SpoolFormatError(f"{where}loss_mask: values must be 0 or 1")


def read_group(path: Path) -> TrajectoryGroup:
    """Read and fully validate one spool file.

    Raises ``SpoolFormatError`` for a truncated/unreadable file, a wrong
    schema version, a missing or mistyped dataset, inconsistent shapes,
    NaN/inf/positive logprobs, negative versions, a mask not 0/1 or attributes
    that contradict the data. A missing file raises ``FileNotFoundError``.
    """
    path = Path(path)
    try:
        f = h5py.File(path, "r", locking=False)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SpoolFormatError(f"unreadable HDF5 file ({e})") from e
    try:
        with f:
            return _read_open(f)
    except SpoolFormatError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
        raise SpoolFormatError(f"unreadable content ({type(e).__name__}: {e})") from e


def _attr(f: h5py.File, name: str) -> Any:
    if name not in f.attrs:
        raise SpoolFormatError(f"missing attribute {name!r}")
    return f.attrs[name]


def _int_attr(f: h5py.File, name: str) -> int:
    value = _attr(f, name)
    if not isinstance(value, (int, np.integer)):
        raise SpoolFormatError(f"attribute {name!r}: expected an integer, got {value!r}")
    return int(value)


def _str_attr(f: h5py.File, name: str) -> str:
    value = _attr(f, name)
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    if not isinstance(value, str):
        raise SpoolFormatError(f"attribute {name!r}: expected a string, got {type(value).__name__}")
    return value


def _dataset(f: h5py.File, name: str, dtype: type) -> np.ndarray:
    obj = f.get(name)
    if not isinstance(obj, h5py.Dataset):
        raise SpoolFormatError(f"missing dataset {name!r}")
    if obj.dtype != np.dtype(dtype) or obj.ndim != 1:
        raise SpoolFormatError(
            f"dataset {name!r}: expected 1-D {np.dtype(dtype)}, got {obj.ndim}-D {obj.dtype}"
        )
    return obj[()]


def _read_open(f: h5py.File) -> TrajectoryGroup:
    schema = _int_attr(f, "schema_version")
    if schema != SCHEMA_VERSION:
        raise SpoolFormatError(f"schema_version: expected {SCHEMA_VERSION}, got {schema}")
    group_size = _int_attr(f, "group_size")
    offsets = _dataset(f, "offsets", np.int64)
    arrays = {name: _dataset(f, name, dtype) for name, dtype in _TOKEN_FIELDS.items()}
    rewards = _dataset(f, "rewards", np.float32)
    reasons = json.loads(_str_attr(f, "finish_reasons"))
    meta = json.loads(_str_attr(f, "meta"))
    _check_shapes(group_size, offsets, arrays, rewards, reasons, meta)
    _check_values("", arrays["behav_logprobs"], arrays["versions"], arrays["loss_mask"])
    if not np.all(np.isfinite(rewards)):
        raise SpoolFormatError("rewards: contains NaN or inf")
    samples = []
    for i in range(group_size):
        sl = slice(int(offsets[i]), int(offsets[i + 1]))
        samples.append(Sample(**{k: v[sl] for k, v in arrays.items()},
                              reward=float(rewards[i]), finish_reason=reasons[i]))
    group = TrajectoryGroup(
        ticket=_int_attr(f, "ticket"), writer=_str_attr(f, "writer"),
        prompt_ids=_dataset(f, "prompt_ids", np.int32), samples=samples,
        created=float(_attr(f, "created")), meta=meta,
    )
    _check_header(f, group)
    return group


def _check_shapes(group_size: int, offsets: np.ndarray, arrays: dict[str, np.ndarray],
                  rewards: np.ndarray, reasons: Any, meta: Any) -> None:
    if group_size < 1:
        raise SpoolFormatError(f"group_size: must be >= 1, got {group_size}")
    if len(offsets) != group_size + 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise SpoolFormatError(f"offsets: expected {group_size + 1} non-decreasing values from 0")
    n = int(offsets[-1])
    lengths = {k: len(v) for k, v in arrays.items()}
    if any(length != n for length in lengths.values()):
        raise SpoolFormatError(f"per-token datasets must all have offsets[-1]={n} entries, got {lengths}")
    if len(rewards) != group_size:
        raise SpoolFormatError(f"rewards: expected {group_size} entries, got {len(rewards)}")
    if not isinstance(reasons, list) or len(reasons) != group_size or not all(
        isinstance(r, str) for r in reasons
    ):
        raise SpoolFormatError(f"finish_reasons: expected a JSON list of {group_size} strings")
    if not isinstance(meta, dict):
        raise SpoolFormatError("meta: expected a JSON object")


def _check_header(f: h5py.File, group: TrajectoryGroup) -> None:
    if group.ticket < 0:
        raise SpoolFormatError(f"ticket: must be >= 0, got {group.ticket}")
    if not WRITER_RE.match(group.writer):
        raise SpoolFormatError(f"writer: must match [A-Za-z0-9-]+, got {group.writer!r}")
    stored = (_int_attr(f, "min_version"), _int_attr(f, "max_version"))
    actual = (group.min_version, group.max_version)
    if stored != actual:
        raise SpoolFormatError(f"min/max_version attributes {stored} contradict the token versions {actual}")
    if not math.isfinite(group.created):
        raise SpoolFormatError(f"created: must be finite, got {group.created}")
