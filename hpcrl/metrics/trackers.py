"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, behind one small protocol.

A :class:`Tracker` takes ``log(scalars, step)`` and ``close()``; :data:`hpcrl.metrics.registry.TRACKERS` maps each
name of ``metrics.trackers`` to its factory (a :class:`~hpcrl.metrics.registry.TrackerSpec` of your own, named
``"package.module:SPEC"``, or its factory alone, adds one). :class:`~hpcrl.metrics.writer.MetricsWriter` opens them
beside its JSONL file and hands each one every record of a step it has not handed over before, so that a component
restarted from an older checkpoint does not log the steps it recomputes twice (the tracker keeps the first leg's
values of those steps; the JSONL file has both), and a leg that was killed before a buffering tracker wrote its last
records has them handed over again from the JSONL file by the next leg: the step series has no gap.

One tracker run per run and component (``trainer``, ``eval``), named after the run directory, resumed after a
restart: W&B by a run id derived from the run directory and component (offline by default: each leg writes
``logs/wandb/<component>-<ms>/wandb/offline-run-*`` with that id, which ``wandb sync`` merges into one run);
MLflow by the run id kept in ``logs/trackers/mlflow-<component>.id`` (a file store in ``logs/mlruns``
unless ``metrics.mlflow_tracking_uri`` names a server).
Lifecycle: opened by the writer's constructor, ``close()`` with the writer (the run is marked finished; a
restarted leg marks it running again).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hpcrl.fs import atomic
from hpcrl.metrics.config import MetricsConfig
from hpcrl.metrics.registry import tracker_spec
from hpcrl.plugins import resolve

__all__ = ["Tracker", "TrackerContext", "open_tracker"]

log = logging.getLogger(__name__)


class Tracker(Protocol):
    # True: what log() took is on disk when it returns; False: only after close() (a killed leg may lose it,
    # and the next leg hands it over again from the JSONL file). A tracker without the attribute counts as True
    durable: bool

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


@dataclass
class TrackerContext:
    log_dir: Path  # <run_dir>/logs
    component: str  # "trainer" or "eval": one tracker run each
    config: dict[str, Any] = field(default_factory=dict)  # the run's resolved config, for the tracker's run page

    @property
    def run_dir(self) -> Path:
        return self.log_dir.parent

    @property
    def run_name(self) -> str:
        return self.run_dir.resolve().name

    def run_id(self) -> str:
        """Stable across legs and hosts: the run directory's path and the component."""
        digest = hashlib.sha1(str(self.run_dir.resolve()).encode()).hexdigest()[:12]
        return f"{digest}-{self.component}"


class TensorBoardTracker:
    durable = True  # flushed after every record
    def __init__(self, cfg: MetricsConfig, ctx: TrackerContext) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(ctx.log_dir / "tensorboard"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self._tb.add_scalar(key, value, step)
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()


class WandbTracker:
    durable = False  # the W&B service buffers; a killed process loses the tail
    def __init__(self, cfg: MetricsConfig, ctx: TrackerContext) -> None:
        # a service inherited from whatever launched the run (a notebook, a test) would outlive this process and
        # still hold a killed leg's run id, which the next leg could then not resume: each process its own service
        os.environ.pop("WANDB_SERVICE", None)
        import wandb

        leg_dir = ctx.log_dir / "wandb" / f"{ctx.component}-{int(time.time() * 1000)}"  # one per leg: none clobbers
        leg_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity or None, id=ctx.run_id(),
                               name=f"{ctx.run_name}/{ctx.component}", group=ctx.run_name, job_type=ctx.component,
                               resume="allow", mode=cfg.wandb_mode, dir=str(leg_dir), config=ctx.config,
                               settings=wandb.Settings(console="off", silent=True))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    durable = True  # written through before log_batch returns
    def __init__(self, cfg: MetricsConfig, ctx: TrackerContext) -> None:
        uri = cfg.mlflow_tracking_uri or (ctx.log_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # MLflow 3 keeps its file store behind this switch; a shared filesystem needs it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        id_file = ctx.log_dir / "trackers" / f"mlflow-{ctx.component}.id"
        if id_file.exists():
            self._run_id = id_file.read_text().strip()
            self._client.update_run(self._run_id, status="RUNNING")
        else:
            exp_id = self._experiment(cfg.mlflow_experiment)
            run = self._client.create_run(exp_id, run_name=f"{ctx.run_name}/{ctx.component}",
                                          tags={"hpcrl.run_dir": str(ctx.run_dir.resolve()),
                                                "hpcrl.component": ctx.component})
            self._run_id = run.info.run_id
            id_file.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_text(id_file, self._run_id)

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        exp = self._client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return self._client.create_experiment(name)
        except MlflowException:  # the trainer and the evaluation component may create it at the same time
            exp = self._client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def held(self) -> tuple[int, int]:
        """The last step this run holds and its last evaluation's step (-1: none): a leg killed after the store
        took a step but before the writer's mark did must not hand that step over again."""
        metrics = self._client.get_run(self._run_id).data.metrics
        steps = {key: max((m.step for m in self._client.get_metric_history(self._run_id, key)), default=-1)
                 for key in metrics}
        return max(steps.values(), default=-1), steps.get("eval/accuracy", -1)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def open_tracker(name: str, cfg: MetricsConfig, ctx: TrackerContext) -> Tracker:
    """The tracker ``name`` names (hpcrl/metrics/registry.py), opened for ``ctx``'s component."""
    spec = tracker_spec(name)
    return resolve(spec.build, f"metrics.trackers: {name}")(cfg, ctx)
