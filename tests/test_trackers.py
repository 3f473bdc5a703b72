"""The metrics trackers for real: Weights & Biases in offline mode and an MLflow file store.

A component that restarts logs into the same tracker run, and the steps it recomputes from an older
checkpoint are not logged twice: each tracker's step series has no gap and no duplicate. Here with the
writer alone; with a real run whose trainer is killed and restarted in :func:`test_a_restarted_run_...`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from hpcrl.config import ConfigError, load_config
from hpcrl.metrics.config import MetricsConfig
from hpcrl.metrics.registry import TrackerSpec, register_tracker
from hpcrl.metrics.trackers import TrackerContext
from hpcrl.metrics.writer import MetricsWriter, read_metrics

pytest.importorskip("wandb", reason="pip install -e '.[trackers]'")
pytest.importorskip("mlflow", reason="pip install -e '.[trackers]'")

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
BOTH = MetricsConfig(trackers=["wandb", "mlflow"])


def wandb_history(log_dir: Path, component: str) -> dict[str | None, list[tuple[int, float]]]:
    """Every offline W&B run of ``component`` under ``log_dir`` by run id: its (step, reward/mean) records,
    read from the .wandb files (a LevelDB-style log of protobuf records, what `wandb sync` uploads)."""
    out: dict[str | None, list[tuple[int, float]]] = {}
    for f in sorted((log_dir / "wandb").glob(f"{component}-*/wandb/offline-run-*/run-*.wandb")):
        for run_id, rows in wandb_history_of(f).items():
            out.setdefault(run_id, []).extend(rows)
    return out


def wandb_legs(log_dir: Path, component: str) -> list[tuple[str | None, list[int]]]:
    """Each leg's offline W&B run (its run id: None if the leg was killed before writing it) and steps."""
    legs = []
    for d in sorted((log_dir / "wandb").glob(f"{component}-*"), key=lambda p: int(p.name.split("-")[-1])):
        files = list(d.glob("wandb/offline-run-*/run-*.wandb"))
        assert len(files) == 1, files
        (run_id, rows), = wandb_history_of(files[0]).items()
        legs.append((run_id, [s for s, _ in rows]))
    return legs


def wandb_history_of(f: Path) -> dict[str | None, list[tuple[int, float]]]:
    from wandb.proto import wandb_internal_pb2 as pb

    run_id, rows = None, []
    for raw in _log_records(f.read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            if "reward/mean" in items:
                rows.append((int(items["_step"]), float(items["reward/mean"])))
    return {run_id: rows}


def _log_records(data: bytes):
    pos, block, buf = 7, 32768, b""  # a 7-byte file header, then 32 KiB blocks of framed chunks
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk


def mlflow_history(log_dir: Path, component: str) -> list[tuple[int, float]]:
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(log_dir / "mlruns").resolve().as_uri())
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.`hpcrl.component` = '{component}'")
    assert len(runs) == 1, [r.info.run_name for r in runs]  # one tracker run, resumed
    return sorted((m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, "reward/mean"))


def rounded(rows: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(s, round(v, 6)) for s, v in rows]


def test_a_restarted_writer_resumes_its_tracker_runs_without_logging_a_step_twice(tmp_path) -> None:
    logs = tmp_path / "run" / "logs"
    first = MetricsWriter(logs, trackers=BOTH, config={"seed": 0})
    for step in range(6):
        first.write({"step": step, "reward/mean": step / 10, "note": "not a scalar", "flag": True})
    first.close()
    second = MetricsWriter(logs, trackers=BOTH)  # restarted from a checkpoint of step 3: 4 and 5 come again
    for step in range(4, 10):
        second.write({"step": step, "reward/mean": 1 + step / 10})
    second.close()
    expected = [(s, round(s / 10 if s < 6 else 1 + s / 10, 6)) for s in range(10)]
    assert rounded(mlflow_history(logs, "trainer")) == expected
    runs = wandb_history(logs, "trainer")
    run_id = TrackerContext(logs, "trainer").run_id()
    assert list(runs) == [run_id] and rounded(sorted(runs[run_id])) == expected
    assert len(list((logs / "wandb").glob("trainer-*"))) == 2  # one directory per leg: neither clobbers the other
    assert len((logs / "metrics.jsonl").read_text().splitlines()) == 12  # the JSONL keeps every record


def test_a_leg_killed_between_the_store_and_the_mark_does_not_log_that_step_twice(tmp_path) -> None:
    """MLflow took step 5 and the process died before the writer's mark did (the mark says 4): the next leg asks
    the store what it holds and does not hand step 5 over again (a restarted run's CI check caught that)."""
    logs = tmp_path / "run" / "logs"
    mlflow_only = MetricsConfig(trackers=["mlflow"])
    first = MetricsWriter(logs, trackers=mlflow_only)
    for step in range(6):
        first.write({"step": step, "reward/mean": step / 10, **({"eval/accuracy": 0.5} if step == 5 else {})})
    first.close()
    (logs / "trackers" / "trainer-mlflow.step").write_text(json.dumps({"step": 4, "eval": 0}))  # the mark lagged
    second = MetricsWriter(logs, trackers=mlflow_only)
    second.write({"step": 6, "reward/mean": 0.6})
    second.close()
    assert [s for s, _ in mlflow_history(logs, "trainer")] == list(range(7))


def test_the_config_names_trackers_it_can_open(tmp_path) -> None:
    assert load_config(QUICKSTART, ["metrics.trackers=[tensorboard,wandb,mlflow]"]).metrics.trackers[1] == "wandb"
    with pytest.raises(ConfigError, match=r"trackers: must be one of \['mlflow', 'tensorboard', 'wandb'\]"):
        load_config(QUICKSTART, ["metrics.trackers=[neptune]"])
    assert load_config(QUICKSTART, ["metrics.trackers=[test_trackers:Recorder]"])  # a factory alone, as before specs
    with pytest.raises(ConfigError, match="is a PosixPath, not the TrackerSpec"):
        load_config(QUICKSTART, ["metrics.trackers=[test_trackers:QUICKSTART]"])
    register_tracker(TrackerSpec("absent", build=Recorder, package="hpcrl_no_such_package", extra="trackers"))
    with pytest.raises(ConfigError, match=r"absent needs the hpcrl_no_such_package package: pip install -e '.\[trackers\]'"):
        load_config(QUICKSTART, ["metrics.trackers=[absent]"])
    with pytest.raises(ConfigError, match="each at most once"):
        load_config(QUICKSTART, ["metrics.trackers=[wandb,wandb]"])
    own = MetricsWriter(tmp_path / "logs", trackers=MetricsConfig(trackers=["test_trackers:RECORDER"]))
    own.write({"step": 1, "x": 2})
    own.write({"step": 1, "x": 3})  # the same step again: not handed over twice
    own.close()
    assert Recorder.seen == [(1, {"x": 2.0}), "closed"]


class Recorder:
    """A tracker of one's own: its spec (RECORDER, below) is named ``module:attr`` in metrics.trackers."""

    seen: list = []

    def __init__(self, cfg, ctx) -> None:
        Recorder.seen = []

    def log(self, scalars, step) -> None:
        Recorder.seen.append((step, scalars))

    def close(self) -> None:
        Recorder.seen.append("closed")


@pytest.mark.slow
def test_a_restarted_run_leaves_one_tracker_run_per_component_without_gaps(restarted_run) -> None:
    """The trainer killed after step 8 and restarted from a checkpoint: its W&B and MLflow runs hold steps
    1..30 once each; the evaluation component's hold its evaluations once each."""
    logs = restarted_run / "logs"
    legs = {r.get("leg") for r in read_metrics(logs / "metrics.jsonl")}
    assert legs == {1, 2}
    ml = [s for s, _ in mlflow_history(logs, "trainer")]
    assert ml == list(range(1, 31)), ml
    legs = wandb_legs(logs, "trainer")
    assert len(legs) == 2 and {run_id for run_id, _ in legs} <= {None, TrackerContext(logs, "trainer").run_id()}
    for _, steps in legs:
        assert steps == sorted(set(steps))  # increasing within a leg
    # what `wandb sync` makes of the legs in order: one run, a step at or below one already there is dropped
    merged, top = [], 0
    for _, steps in legs:
        merged += [s for s in steps if s > top]
        top = max([top, *steps])
    assert merged == list(range(1, 31)), legs
    evaluated = sorted({int(r["step"]) for r in read_metrics(logs / "eval.jsonl")})
    ml_eval = mlflow_eval_steps(logs)
    assert ml_eval == evaluated and len(ml_eval) == len(set(ml_eval)), (ml_eval, evaluated)


def mlflow_eval_steps(logs: Path) -> list[int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(logs / "mlruns").resolve().as_uri())
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string="tags.`hpcrl.component` = 'eval'")
    assert len(runs) == 1
    return sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "eval/accuracy"))


RECORDER = TrackerSpec("recorder", build=Recorder)


class Flaky(Recorder):
    """Fails at step 3 (a tracker server that went away)."""

    def log(self, scalars, step) -> None:
        if step == 3:
            raise ConnectionError("tracker server unreachable")
        super().log(scalars, step)


FLAKY = TrackerSpec("flaky", build=Flaky)


def test_late_evaluations_failures_and_bad_marks(tmp_path, caplog) -> None:
    logs = tmp_path / "logs"
    own = MetricsConfig(trackers=["test_trackers:FLAKY"])
    first = MetricsWriter(logs, trackers=own)
    for step in range(1, 6):
        first.write({"step": step, "r": step})
    first.close()  # no kill: the tracker failed at step 3 and got nothing after it in this leg
    assert Recorder.seen == [(1, {"r": 1.0}), (2, {"r": 2.0}), "closed"] and "left out" in caplog.text
    assert json.loads((logs / "trackers" / "trainer-test_trackers_FLAKY.step").read_text())["step"] == 2
    second = MetricsWriter(logs, trackers=MetricsConfig(trackers=["test_trackers:RECORDER"]))
    assert [s for s, _ in Recorder.seen] == [1, 2, 3, 4, 5]  # another name, its own mark: the whole file first
    second.close()
    (logs / "trackers" / "trainer-test_trackers_RECORDER.step").write_text("")  # a lost node's empty mark
    third = MetricsWriter(logs, trackers=MetricsConfig(trackers=["test_trackers:RECORDER"]))
    assert [s for s, _ in Recorder.seen] == [1, 2, 3, 4, 5]  # replayed, not stuck
    third.write({"step": 2, "eval/accuracy": 0.5})  # a version evaluated late (resumed with eval.mode=trainer)
    third.write({"step": 4, "r": 9})  # recomputed from an older checkpoint: not again
    third.write({"step": 6, "r": 6, "eval/accuracy": 0.7})
    third.write({"step": 5, "eval/accuracy": 0.6})  # an evaluation older than one handed over: not again
    third.close()
    assert Recorder.seen[5:] == [(2, {"eval/accuracy": 0.5}), (6, {"r": 6.0, "eval/accuracy": 0.7}), "closed"]


def test_a_run_from_before_the_marks_does_not_log_its_steps_to_tensorboard_again(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path / "logs"
    logs.mkdir()
    old = MetricsWriter(logs)  # what the code before the marks did: every record to TensorBoard
    for step in range(1, 4):
        old.write({"step": step, "reward/mean": step})
    old.close()
    for mark in (logs / "trackers").iterdir():
        mark.unlink()
    resumed = MetricsWriter(logs)
    resumed.write({"step": 4, "reward/mean": 4})
    resumed.close()
    acc = EventAccumulator(str(logs / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2, 3, 4]
