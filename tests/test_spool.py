"""Tests of the HDF5 trajectory spool: format round trip, names, atomic publish,
claim/drop/trained/release moves and quarantine of invalid files."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import hpcrl.spool.store as store
from hpcrl.spool import (
    SCHEMA_VERSION,
    NameInfo,
    Sample,
    Spool,
    SpoolFormatError,
    TrajectoryGroup,
    encode_group,
    encode_group_read,
    file_name,
    parse_name,
    read_group,
    validate_group,
    write_group,
)

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"


def make_sample(rng: np.random.Generator, length: int, v0: int = 3, v1: int = 3) -> Sample:
    return Sample(
        response_ids=rng.integers(0, 50_000, length).astype(np.int32),
        behav_logprobs=-rng.random(length).astype(np.float32) * 5,
        versions=np.sort(rng.integers(v0, v1 + 1, length)).astype(np.int32),
        loss_mask=rng.integers(0, 2, length).astype(np.uint8),
        reward=float(rng.integers(0, 2)) - 0.25,
        finish_reason="length" if length > 10 else "stop",
    )


def make_group(ticket: int = 7, writer: str = "r0-a", lengths=(5, 0, 12, 3), seed: int = 0,
               v0: int = 3, v1: int = 5) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    return TrajectoryGroup(
        ticket=ticket, writer=writer,
        prompt_ids=rng.integers(0, 50_000, 9).astype(np.int32),
        samples=[make_sample(rng, n, v0, v1) for n in lengths],
        created=1_700_000_000.123456789,
        meta={"prompt": "Combien font 2+2 ? 答え ∑ 🙂", "index": 3, "answers": ["4", "四"]},
    )


def assert_same_group(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    assert (a.ticket, a.writer, a.created, a.meta) == (b.ticket, b.writer, b.created, b.meta)
    assert a.prompt_ids.dtype == b.prompt_ids.dtype and a.prompt_ids.tobytes() == b.prompt_ids.tobytes()
    assert len(a.samples) == len(b.samples)
    for sa, sb in zip(a.samples, b.samples):
        for k in ("response_ids", "behav_logprobs", "versions", "loss_mask"):
            x, y = getattr(sa, k), getattr(sb, k)
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k
        assert (sa.reward, sa.finish_reason) == (sb.reward, sb.finish_reason)


# -- format ---------------------------------------------------------------------
def test_round_trip_bit_equal(tmp_path: Path) -> None:
    g = make_group()
    write_group(tmp_path / "x.h5", g)
    back = read_group(tmp_path / "x.h5")
    assert_same_group(g, back)
    assert len(back.samples[1].response_ids) == 0
    assert (back.min_version, back.max_version) == (g.min_version, g.max_version)


def test_encode_group_read_gives_the_group_read_group_returns_and_refuses_what_it_refuses(tmp_path: Path) -> None:
    g = make_group()
    g.samples[0].behav_logprobs = [float(x) for x in g.samples[0].behav_logprobs]  # as a writer holds them
    g.samples[0].response_ids = [int(x) for x in g.samples[0].response_ids]
    g.samples[2].reward = 1 / 3  # not a float32
    g.meta["pair"] = (1, 2)  # JSON makes it a list
    data, view = encode_group_read(g)
    assert data == encode_group(g)
    (tmp_path / "x.h5").write_bytes(data)
    assert_same_group(view, read_group(tmp_path / "x.h5"))
    assert view.samples[2].reward != 1 / 3 and view.meta["pair"] == [1, 2]
    assert not np.shares_memory(view.prompt_ids, g.prompt_ids)
    bad = make_group()
    bad.samples[0].behav_logprobs[1] = np.nan
    data, view = encode_group_read(bad)
    (tmp_path / "bad.h5").write_bytes(data)
    assert view is None
    with pytest.raises(SpoolFormatError, match="NaN"):
        read_group(tmp_path / "bad.h5")


def test_schema_layout_is_as_documented(tmp_path: Path) -> None:
    write_group(tmp_path / "x.h5", make_group(lengths=(4, 6)))
    with h5py.File(tmp_path / "x.h5", "r", locking=False) as f:
        assert set(f.attrs) == {"schema_version", "header"}
        assert f.attrs["schema_version"] == SCHEMA_VERSION == 2
        header = json.loads(f.attrs["header"])
        layout = {k: (f[k].dtype, f[k].shape) for k in f}
    assert set(header) == {"ticket", "writer", "min_version", "max_version", "created", "finish_reasons", "meta"}
    assert header["finish_reasons"] == ["stop", "stop"] and header["meta"]["answers"] == ["4", "四"]
    assert layout == {
        "prompt_ids": (np.dtype("<i4"), (9,)),
        "samples": (np.dtype([("length", "<i8"), ("reward", "<f4")]), (2,)),
        "tokens": (np.dtype([("response_id", "<i4"), ("behav_logprob", "<f4"), ("version", "<i4"),
                             ("loss_mask", "u1")]), (10,)),
    }


@pytest.mark.parametrize("schema", [1, 2])
def test_golden_files_of_every_readable_schema_read_bit_equal(tmp_path: Path, schema: int) -> None:
    """Files written by earlier code (tests/golden/spool_schema<N>.h5, from make_group()) stay readable."""
    golden = GOLDEN / f"spool_schema{schema}.h5"
    with h5py.File(golden, "r", locking=False) as f:
        assert f.attrs["schema_version"] == schema
    assert_same_group(make_group(), read_group(golden))
    sp = Spool(tmp_path)  # and through the store, under the file's canonical name
    shutil.copy(golden, sp.ready_dir / file_name(make_group()))
    [entry] = sp.claim(sp.ready())
    assert_same_group(make_group(), sp.load(entry))


def test_header_rewritten_as_variable_length_string_still_reads(tmp_path: Path) -> None:
    """h5py writes str attributes as variable-length strings; the reader takes both kinds."""
    write_group(tmp_path / "x.h5", make_group())
    with h5py.File(tmp_path / "x.h5", "r+", locking=False) as f:
        f.attrs["header"] = f.attrs["header"].decode()
        assert h5py.check_string_dtype(f.attrs.get_id("header").dtype).length is None
    assert_same_group(make_group(), read_group(tmp_path / "x.h5"))


def test_large_header_round_trips(tmp_path: Path) -> None:
    """A JSON header far over HDF5's 64 KiB limit for compact attributes (long response texts in meta)."""
    g = make_group()
    g.meta["responses"] = ["令" * 40_000] * 4
    write_group(tmp_path / "x.h5", g)
    assert_same_group(g, read_group(tmp_path / "x.h5"))


def test_group_without_tokens_takes_version_from_meta(tmp_path: Path) -> None:
    g = make_group(lengths=(0, 0))
    assert (g.min_version, g.max_version) == (0, 0)
    g.meta["version"] = 12
    assert file_name(g).startswith("g000000007_v000012-000012_")
    write_group(tmp_path / "x.h5", g)
    assert read_group(tmp_path / "x.h5").max_version == 12


def test_names() -> None:
    g = make_group(ticket=42, writer="node3-7", v0=2, v1=9)
    lo, hi = g.min_version, g.max_version
    name = file_name(g)
    assert name == f"g000000042_v{lo:06d}-{hi:06d}_node3-7.h5"
    assert parse_name(name) == NameInfo(42, lo, hi, "node3-7")
    big = make_group(ticket=12_345_678_901)
    assert parse_name(file_name(big)).ticket == 12_345_678_901
    for other in (name + ".tmp.123", name + ".reason.json", "g42_v1-2_w.h5",
                  "g000000001_v000005-000004_w.h5", "g000000001_v000001-000002_w_x.h5", "README"):
        assert parse_name(other) is None, other


def test_write_rejects_incoherent_groups(tmp_path: Path) -> None:
    bad_len = make_group()
    bad_len.samples[0].loss_mask = bad_len.samples[0].loss_mask[:-1]
    bad_writer = make_group(writer="a_b")
    bad_ticket = make_group(ticket=-1)
    for g, field in ((bad_len, "samples[0]"), (bad_writer, "writer"), (bad_ticket, "ticket")):
        with pytest.raises(SpoolFormatError, match=field.replace("[", r"\[")):
            write_group(tmp_path / "x.h5", g)
    nan = make_group()
    nan.samples[2].behav_logprobs[1] = np.nan
    with pytest.raises(SpoolFormatError, match="NaN"):
        validate_group(nan)
    validate_group(make_group())


# -- store ----------------------------------------------------------------------
def test_publish_lists_sorted_and_ignores_junk(tmp_path: Path) -> None:
    sp = Spool(tmp_path / "spool")
    sp.publish(make_group(ticket=5, v0=4, v1=4))
    sp.publish(make_group(ticket=9, v0=1, v1=6))
    sp.publish(make_group(ticket=2, v0=4, v1=5))
    (sp.ready_dir / "g000000001_v000000-000000_w.h5.tmp.999").write_bytes(b"partial")
    (sp.ready_dir / "notes.txt").write_text("x")
    assert [e.ticket for e in sp.ready()] == [9, 2, 5]
    assert os.listdir(sp.tmp_dir) == []
    with pytest.raises(FileExistsError):
        sp.publish(make_group(ticket=5, v0=4, v1=4))
    assert os.listdir(sp.tmp_dir) == [], "failed publish must not leave a temp file"
    with pytest.raises(SpoolFormatError, match="writer"):
        sp.publish(make_group(ticket=6, writer="a_b"))
    assert os.listdir(sp.tmp_dir) == [] and len(sp.ready()) == 3


def test_listing_ready_again_reuses_known_entries_and_follows_arrivals_and_departures(tmp_path: Path) -> None:
    """The trainer lists ready/ on every look: an entry is built from a name once, and the listing stays exact."""
    sp = Spool(tmp_path / "spool")
    for t in (3, 1):
        sp.publish(make_group(ticket=t))
    first = sp.ready()
    sp.claim([first[0]])  # ticket 1 leaves ready/
    sp.publish(make_group(ticket=2))
    (sp.ready_dir / "junk.h5").write_bytes(b"x")
    again = sp.ready()
    assert [e.ticket for e in again] == [2, 3]
    assert again[1] is first[1], "ticket 3's entry is the one built before"
    assert again[0].path == sp.ready_dir / again[0].name and again[0].ticket == 2
    assert [e.ticket for e in Spool(tmp_path / "spool").ready()] == [2, 3], "another Spool's first listing"
    rebuilt = []
    sp._entries = lambda *args: rebuilt.append(args[1]) or Spool._entries(*args)
    unchanged = sp.ready()
    assert unchanged == again and unchanged is not again and rebuilt == [], "the same names: the same sorted entries"
    unchanged.pop()  # the caller's copy
    assert [e.ticket for e in sp.ready()] == [2, 3] and rebuilt == []
    sp.publish(make_group(ticket=0))
    assert [e.ticket for e in sp.ready()] == [0, 2, 3] and len(rebuilt) == 1, "an arrival: listed entries again"


def test_publish_writes_the_encoded_file_and_it_is_durable_before_the_rename(tmp_path: Path, monkeypatch) -> None:
    """The bytes in ready/ are encode_group's, and the file was fsynced (by fd) before it got its final name."""
    sp = Spool(tmp_path)
    g = make_group(ticket=3)
    events: list[str] = []
    real_fsync, real_rename = os.fsync, store.rename_noreplace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(f"fsync:{os.readlink(f'/proc/self/fd/{fd}')}"),
                                                   real_fsync(fd))[1])
    monkeypatch.setattr(store, "rename_noreplace",
                        lambda a, b: (events.append(f"rename:{a}"), real_rename(a, b))[1])
    path = sp.publish(g)
    tmp = next(e.split(":", 1)[1] for e in events if e.startswith("rename:"))
    assert events.index(f"fsync:{tmp}") < events.index(f"rename:{tmp}")
    assert events[-1] == f"fsync:{sp.ready_dir}", "the directory entry is made durable last"
    assert path.read_bytes() == encode_group(g)
    assert_same_group(g, read_group(path))


WRITER = textwrap.dedent("""
    import sys, numpy as np
    from pathlib import Path
    from hpcrl.spool import Sample, Spool, TrajectoryGroup
    sp = Spool(Path(sys.argv[1]))
    rng = np.random.default_rng(1)
    for t in range(int(sys.argv[2])):
        n = int(rng.integers(1, 400))
        s = [Sample(np.arange(n, dtype=np.int32), np.full(n, -0.5, np.float32),
                    np.full(n, t % 5, np.int32), np.ones(n, np.uint8), 1.0, "stop") for _ in range(8)]
        sp.publish(TrajectoryGroup(t, "sub", np.arange(30, dtype=np.int32), s, meta={"t": t}))
""")


def test_publish_is_atomic_for_a_concurrent_reader(tmp_path: Path) -> None:
    root, total = tmp_path / "spool", 200
    sp = Spool(root)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(total)], env=env)
    seen: set[str] = set()
    read_while_writing = 0
    deadline = time.monotonic() + 60
    while len(seen) < total and time.monotonic() < deadline:
        alive = proc.poll() is None
        for name in os.listdir(sp.ready_dir):
            assert parse_name(name) is not None, f"reader saw a non-final name {name}"
        for e in sp.ready():
            if e.name not in seen:
                g = read_group(e.path)  # raises if the file were partial
                assert g.ticket == e.ticket and len(g.samples) == 8
                seen.add(e.name)
                read_while_writing += alive
        if proc.poll() is not None and proc.returncode != 0:
            break
    assert proc.wait(timeout=30) == 0
    assert len(seen) == total
    assert read_while_writing > 0, "the reader never overlapped the writer; test proves nothing"
    assert os.listdir(sp.tmp_dir) == []


def truncate(path: Path, keep: float) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep) if keep < 1 else size - 1)


@pytest.mark.parametrize("keep", [0.05, 0.5, 0.95, 1.0])
def test_truncated_file_is_quarantined(tmp_path: Path, keep: float) -> None:
    sp = Spool(tmp_path)
    sp.publish(make_group(ticket=1))
    good = sp.publish(make_group(ticket=2))
    truncate(sp.ready()[0].path, keep)
    entries = sp.claim(sp.ready())
    assert sp.load(entries[0]) is None
    assert sp.load(entries[1]) is not None and entries[1].path.name == good.name
    assert sp.counts() == {"ready": 0, "claimed": 1, "trained": 0, "dropped": 0, "quarantined": 1}
    [q] = sp.quarantined()
    rec = sp.reason(q)
    assert q.ticket == 1 and rec["from"] == "claimed" and "SpoolFormatError" in rec["reason"]


def _edit(path: Path, fn) -> None:
    with h5py.File(path, "r+", locking=False) as f:
        fn(f)


def _set(name: str, index: int, value):
    def fn(f):
        f[name][index] = value
    return fn


def _set_field(name: str, column: str, index: int, value):
    """Change one column of one row of a compound dataset (schema 2 ``tokens``/``samples``)."""
    def fn(f):
        rows = f[name][()]
        rows[column][index] = value
        f[name][...] = rows
    return fn


def _replace(name: str, data):
    def fn(f):
        del f[name]
        f.create_dataset(name, data=data)
    return fn


def _attr(name: str, value):
    def fn(f):
        f.attrs[name] = value
    return fn


def _header(**changes):
    def fn(f):
        f.attrs["header"] = json.dumps({**json.loads(f.attrs["header"]), **changes})
    return fn


def _retype(name: str, **dtypes):
    """Rewrite compound dataset ``name`` with some columns stored in another dtype."""
    def fn(f):
        rows = f[name][()]
        new = np.empty(rows.shape, [(c, dtypes.get(c, rows.dtype[c])) for c in rows.dtype.names])
        for c in rows.dtype.names:
            new[c] = rows[c]
        _replace(name, new)(f)
    return fn


CORRUPTIONS = {  # schema 2: case -> (edit, expected words in the quarantine reason)
    "nan_logprob": (_set_field("tokens", "behav_logprob", 3, np.nan), "NaN"),
    "inf_logprob": (_set_field("tokens", "behav_logprob", 0, -np.inf), "NaN or inf"),
    "positive_logprob": (_set_field("tokens", "behav_logprob", 2, 0.5), "positive"),
    "negative_version": (_set_field("tokens", "version", 1, -1), "negative"),
    "mask_not_binary": (_set_field("tokens", "loss_mask", 0, 2), "0 or 1"),
    "nan_reward": (_set_field("samples", "reward", 1, np.nan), "rewards"),
    "negative_length": (_set_field("samples", "length", 0, -5), ">= 0"),
    "lengths_exceed_tokens": (_set_field("samples", "length", 1, 4), "sum of the sample lengths"),
    "short_tokens": (lambda f: _replace("tokens", f["tokens"][:3])(f), "sum of the sample lengths"),
    "no_samples": (lambda f: _replace("samples", f["samples"][:0])(f), "at least one sample"),
    "wrong_schema": (_attr("schema_version", 99), "schema_version: expected 2"),
    "schema_not_int": (_attr("schema_version", "2"), "expected an integer"),
    "wrong_token_dtype": (_retype("tokens", response_id="<i8"), "dataset 'tokens'"),
    "big_endian_tokens": (_retype("tokens", version=">i4"), "dataset 'tokens'"),
    "wrong_sample_dtype": (_retype("samples", reward="<f8"), "dataset 'samples'"),
    "prompt_2d": (_replace("prompt_ids", np.zeros((3, 3), np.int32)), "expected 1-D"),
    "missing_dataset": (lambda f: f.__delitem__("tokens"), "missing dataset 'tokens'"),
    "missing_header": (lambda f: f.attrs.__delitem__("header"), "missing attribute 'header'"),
    "header_not_json": (_attr("header", "{not json"), "JSONDecodeError"),
    "header_not_object": (_attr("header", "[1, 2]"), "JSON object"),
    "header_missing_key": (lambda f: _attr("header", json.dumps(
        {k: v for k, v in json.loads(f.attrs["header"]).items() if k != "created"}))(f), "missing 'created'"),
    "header_ticket_str": (_header(ticket="7"), "header 'ticket'"),
    "header_bool_version": (_header(min_version=True), "header 'min_version'"),
    "header_meta_list": (_header(meta=[1]), "header 'meta'"),
    "header_bad_writer": (_header(writer="a_b"), "writer"),
    "finish_reasons": (_header(finish_reasons=["stop"]), "finish_reasons"),
    "header_versions": (_header(max_version=77), "contradict"),
    "other_ticket": (_header(ticket=8), "file name says"),
}

CORRUPTIONS_SCHEMA1 = {  # the same guarantees for files of the previous layout
    "nan_logprob": (_set("behav_logprobs", 3, np.nan), "NaN"),
    "negative_version": (_set("versions", 1, -1), "negative"),
    "mask_not_binary": (_set("loss_mask", 0, 2), "0 or 1"),
    "unknown_schema": (_attr("schema_version", 3), "schema_version: expected 2 (or 1"),
    "short_dataset": (_replace("versions", np.zeros(3, np.int32)), "offsets"),
    "bad_offsets": (_replace("offsets", np.array([0, 30, 10, 20, 20], np.int64)), "offsets"),
    "wrong_dtype": (_replace("rewards", np.zeros(4, np.float64)), "rewards"),
    "missing_dataset": (lambda f: f.__delitem__("loss_mask"), "loss_mask"),
    "missing_attr": (lambda f: f.attrs.__delitem__("group_size"), "group_size"),
    "bad_meta_json": (_attr("meta", "{not json"), "JSONDecodeError"),
    "header_versions": (_attr("max_version", 77), "contradict"),
    "other_ticket": (_attr("ticket", 8), "file name says"),
}


def _check_quarantined(sp: Spool, path: Path, case: str, expected: str) -> None:
    if case != "other_ticket":  # that one is only detectable against the file name
        with pytest.raises(SpoolFormatError, match=re.escape(expected)):
            read_group(path)
    [entry] = sp.ready()
    assert sp.load(entry) is None
    assert sp.counts()["quarantined"] == 1 and sp.counts()["ready"] == 0
    assert expected in sp.reason(sp.quarantined()[0])["reason"]


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_invalid_content_is_quarantined(tmp_path: Path, case: str) -> None:
    fn, expected = CORRUPTIONS[case]
    sp = Spool(tmp_path)
    path = sp.publish(make_group(lengths=(5, 0, 12, 3)))
    read_group(path)  # valid before the edit
    _edit(path, fn)
    _check_quarantined(sp, path, case, expected)


@pytest.mark.parametrize("case", sorted(CORRUPTIONS_SCHEMA1))
def test_invalid_schema1_content_is_quarantined(tmp_path: Path, case: str) -> None:
    fn, expected = CORRUPTIONS_SCHEMA1[case]
    sp = Spool(tmp_path)
    path = sp.ready_dir / file_name(make_group())
    shutil.copy(GOLDEN / "spool_schema1.h5", path)
    _edit(path, fn)
    _check_quarantined(sp, path, case, expected)


def test_claim_skips_vanished_files(tmp_path: Path) -> None:
    sp = Spool(tmp_path)
    for t in range(4):
        sp.publish(make_group(ticket=t))
    listed = sp.ready()
    other = Spool(tmp_path).claim([listed[1]])  # a concurrent claimer wins one
    os.unlink(listed[3].path)  # and one disappears altogether
    got = sp.claim(listed)
    assert [e.ticket for e in got] == [0, 2] and [e.ticket for e in other] == [1]
    assert all(e.path.parent == sp.claimed_dir and e.path.exists() for e in got)
    assert {e.ticket for e in sp.claimed()} == {0, 1, 2} and sp.ready() == []


def test_trained_drop_and_release_moves(tmp_path: Path) -> None:
    sp = Spool(tmp_path)
    for t in range(6):
        sp.publish(make_group(ticket=t))
    c = sp.claim(sp.ready()[:5])
    sp.mark_trained(c[:2], step=3)
    sp.mark_trained(c[:2], step=3)  # repeated after an interruption: no error, no change
    ghost = dataclasses.replace(c[0], path=c[0].path.with_name("g000000099_v000003-000005_r0-a.h5"))
    with pytest.raises(FileNotFoundError):  # neither claimed nor trained: a real error, not a repeat
        sp.mark_trained([ghost], step=3)
    sp.mark_trained(c[2:3], step=4)
    sp.drop(c[3], "all rewards equal")
    trained = sp.trained()
    assert {k: [e.ticket for e in v] for k, v in trained.items()} == {3: [0, 1], 4: [2]}
    assert (tmp_path / "trained" / "step_000003" / c[0].name).exists()
    [d] = sp.dropped()
    rec = json.loads((tmp_path / "dropped" / (c[3].name + ".reason.json")).read_text())
    assert d.ticket == 3 and rec["reason"] == "all rewards equal" and rec["time"] <= time.time()
    assert sp.counts() == {"ready": 1, "claimed": 1, "trained": 3, "dropped": 1, "quarantined": 0}
    assert sp.release_claimed() == 1
    assert [e.ticket for e in sp.ready()] == [4, 5] and sp.claimed() == []
    assert sp.load(sp.ready()[0]).ticket == 4
    sp.publish(make_group(ticket=3))  # the same ticket regenerated under the same name ...
    [again] = [e for e in sp.ready() if e.ticket == 3]
    sp.drop(again, "x")  # ... and set aside again: kept beside the first, nothing overwritten
    assert not again.path.exists() and sp.reason(d)["reason"] == "all rewards equal"
    second = tmp_path / "dropped" / "again-1" / again.name
    assert second.exists() and json.loads(second.with_name(again.name + ".reason.json").read_text())["reason"] == "x"


def test_bench_spool_measures_every_operation(tmp_path: Path) -> None:
    """scripts/bench_spool.py runs end to end on a tiny workload and reports every row."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_spool.py"), "--reps", "1", "--files", "4",
                           "--batch", "4", "--dir", str(tmp_path), "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"write_group", "publish", "admit", "admit_refused", "claim", "read_group", "load",
                            "mark_trained", "step_trainer", "step_rollout"}
    assert all(r["median_us"] > 0 for r in results.values())
    assert results["step_trainer"]["median_us"] > 4 * results["load"]["median_us"]  # a step loads B files
    assert "trainer step: claim+load+mark_trained" in proc.stdout


def test_a_commit_of_everything_claimed_renames_the_folder(tmp_path: Path, monkeypatch) -> None:
    """A step's commit is one directory rename when claimed/ holds exactly its files (the trainer's every step):
    claimed/ becomes trained/step_N/ and a new claimed/ is made; anything else is moved file by file."""
    import hpcrl.spool.store as store

    sp = Spool(tmp_path)
    for t in range(5):
        sp.publish(make_group(ticket=t))
    c = sp.claim(sp.ready()[:3])
    folder = os.stat(sp.claimed_dir).st_ino
    synced: list[Path] = []
    monkeypatch.setattr(store, "fsync_dir", synced.append)
    sp.mark_trained(c, step=2)
    step2 = sp.trained_dir / "step_000002"
    assert os.stat(step2).st_ino == folder, "claimed/ itself became the step's folder"
    assert sorted(os.listdir(step2)) == sorted(e.name for e in c) and os.listdir(sp.claimed_dir) == []
    assert sp.sync() == 5 and set(synced) == {step2, sp.claimed_dir, sp.trained_dir, sp.ready_dir, tmp_path}
    assert synced[0] == step2 and synced[-1] == tmp_path, "the claims' folder first, the spool root last"
    # claimed/ holds more than the commit, or the step's folder exists: file by file, nothing else moves
    c = sp.claim(sp.ready())
    sp.mark_trained(c[:1], step=3)
    assert os.stat(sp.claimed_dir).st_ino != os.stat(sp.trained_dir / "step_000003").st_ino
    sp.mark_trained(c[1:], step=2)
    assert {k: [e.ticket for e in v] for k, v in sp.trained().items()} == {2: [0, 1, 2, 4], 3: [3]}
    assert sp.claimed() == [] and sp.ready() == []


def test_claims_and_commits_are_renames_until_sync_makes_them_durable(tmp_path: Path, monkeypatch) -> None:
    """Per step the trainer only renames: resume releases what is claimed or trained after its checkpoint, so only
    a checkpoint needs the moves durable, and sync (called before it) fsyncs each directory they touched once."""
    import hpcrl.spool.store as store

    sp = Spool(tmp_path)
    for t in range(4):
        sp.publish(make_group(ticket=t))
    synced: list[Path] = []
    monkeypatch.setattr(store, "fsync_dir", synced.append)
    c = sp.claim(sp.ready())
    sp.mark_trained(c[:2], step=5)
    sp.mark_trained(c[2:3], step=6)
    assert synced == [], "a claim or a commit fsyncs nothing"
    assert sp.sync() == 5
    step5, step6 = sp.trained_dir / "step_000005", sp.trained_dir / "step_000006"
    assert set(synced) == {step5, step6, sp.claimed_dir, sp.ready_dir, sp.trained_dir}
    assert synced.index(step5) < synced.index(sp.trained_dir) and synced.index(step6) < synced.index(sp.trained_dir)
    assert sp.sync() == 0 and len(synced) == 5, "nothing moved since: nothing to sync"
    sp.mark_trained(c[3:], step=6)  # a commit into an existing step folder: that folder and claimed/
    sp.sync()
    assert synced[5:] == [step6, sp.claimed_dir, sp.trained_dir]


def test_a_move_aside_keeps_its_reason_durable_and_its_directories_for_the_next_sync(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """The reason's content is fsynced before the data file moves; both names become durable at the next sync, the
    trainer's per-step cost staying renames only (a stale file set aside per step was three fsyncs)."""
    import hpcrl.fs.atomic as atomic
    import hpcrl.spool.store as store

    sp = Spool(tmp_path)
    for t in range(2):
        sp.publish(make_group(ticket=t))
    events: list[str] = []
    real_fsync, real_rename = os.fsync, store.rename_noreplace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(f"fsync:{os.readlink(f'/proc/self/fd/{fd}')}"),
                                                   real_fsync(fd))[1])
    monkeypatch.setattr(store, "rename_noreplace",
                        lambda a, b: (events.append(f"rename:{a}"), real_rename(a, b))[1])
    dirs: list[Path] = []
    monkeypatch.setattr(store, "fsync_dir", dirs.append)
    monkeypatch.setattr(atomic, "fsync_dir", dirs.append)
    first, second = sp.ready()
    sp.drop(first, "stale")
    [claimed] = sp.claim([second])
    sp.quarantine(claimed, "bad")
    reason = sp.dropped_dir / (first.name + ".reason.json")
    assert sp.reason(sp.dropped()[0])["reason"] == "stale"
    assert any(e.startswith("fsync:") and ".reason.json" in e for e in events), "the reason's content is durable"
    assert events.index(f"rename:{first.path}") > max(i for i, e in enumerate(events) if e.startswith("fsync:")
                                                     and str(reason.parent) in e and "reason" in e)
    assert dirs == [], "no directory fsync per move"
    assert sp.sync() == 4 and set(dirs) == {sp.dropped_dir, sp.ready_dir, sp.claimed_dir, sp.quarantine_dir}


def test_the_trainer_makes_the_spool_durable_before_it_commits_a_checkpoint() -> None:
    from hpcrl.trainer.main import save

    order: list = []

    class Feed:
        dropped: dict = {}

        def sync(self) -> None:
            order.append("sync")

    class Checkpointer:
        def save(self, engine, version: int, counters: dict) -> None:
            order.append(("save", version, counters["dropped"]))

    save(Checkpointer(), None, 3, Feed(), None)
    save(Checkpointer(), None, 4, None, None)  # a rank without the feed
    assert order == ["sync", ("save", 3, {}), ("save", 4, {})]
