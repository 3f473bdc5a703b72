"""Typed configuration: YAML + ``key=value`` overrides into dataclasses.

Each component owns a dataclass config (``AlgoConfig``, ``RolloutConfig``,
...); :class:`RunConfig` composes them. :func:`load_config` merges a YAML file
with command-line overrides through OmegaConf, then builds the dataclasses
field by field, checking every value against its annotation (``Literal``
choices, numbers, booleans, optionals, nested sections). Any problem raises
:class:`ConfigError` naming the full key and what is allowed, before anything
is started. The resolved config is saved as ``<run_dir>/config.yaml`` and is
what every component process reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hpcrl.fs import atomic
from hpcrl.admission.config import AdmissionConfig
from hpcrl.agent.config import AgentConfig
from hpcrl.algo.config import AlgoConfig
from hpcrl.ckpt.config import CheckpointConfig, InitConfig
from hpcrl.data.config import DataConfig
from hpcrl.eval.config import EvalConfig
from hpcrl.launch.config import LaunchConfig
from hpcrl.metrics.config import MetricsConfig
from hpcrl.model.config import ModelConfig
from hpcrl.reward.config import RewardConfig
from hpcrl.rollout.config import RolloutConfig
from hpcrl.rollout.registry import engine_spec
from hpcrl.rollout.registry import episodes_of
from hpcrl.sft.config import SFTConfig
from hpcrl.trainer.config import TrainerConfig
from hpcrl.watchdog.config import WatchdogConfig
from hpcrl.weights.config import WeightsConfig
from hpcrl.weights.registry import transport_spec


class ConfigError(ValueError):
    """A user-fixable configuration problem; the message names the key."""


@dataclass
class RunConfig:
    run_dir: str = ""  # experiment directory on the shared filesystem; "" = runs/<name>-<timestamp>
    name: str = "run"  # experiment name (used in the default run_dir and logs)
    seed: int = 0  # global seed: data order, sampling, init
    model: ModelConfig = field(default_factory=ModelConfig)
    init: InitConfig = field(default_factory=InitConfig)  # start from another run's checkpoint (--from)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        if self.algo.temperature != self.rollout.temperature:
            raise ValueError(f"algo.temperature: {self.algo.temperature} differs from rollout.temperature "
                             f"{self.rollout.temperature}; the trainer's log-probabilities must use the temperature "
                             "the rollouts sample with (set rollout.temperature alone: algo.temperature follows it)")
        episodes_of(self).check(self)  # the episode runner's own checks (agent.fn)
        if self.eval.agent and not self.agent.fn:
            raise ValueError("eval.agent: runs the agent function on the held-out rows; set agent.fn")
        if self.trainer.lora.publish == "adapter":
            for bad, why in ((not transport_spec(self.weights.mode).adapters, f"weights.mode={self.weights.mode} "
                              "(it does not publish adapters alone, for a server to load)"),
                             (bool(self.init.checkpoint), "init.checkpoint (--from: this run's initial model holds "
                              "the source's adapters merged, and the adapters would be applied twice)"),
                             (engine_spec(self.rollout.engine).adapters(self.trainer.lora.rank) is not None,
                              engine_spec(self.rollout.engine).adapters(self.trainer.lora.rank)),
                             (self.launch.mode == "colocated", "launch.mode=colocated (its engine takes the whole "
                              "policy in memory)")):
                if bad:
                    raise ValueError(f"trainer.lora.publish: adapter does not work with {why}; use "
                                     "trainer.lora.publish=merged")
        if self.launch.autoscale.enabled and self.launch.mode == "colocated":
            raise ValueError("launch.autoscale: a colocated run (launch.mode=colocated) has no rollout replicas")
        if self.launch.autoscale.enabled and self.rollout.server_url and self.launch.autoscale.max_replicas > 1:
            raise ValueError("launch.autoscale.max_replicas: rollout.server_url is one server, which only one "
                             "replica may drive; leave server_url empty to start one server per replica")
        if self.model.dtype == "float16":
            raise ValueError("model.dtype: float16 training needs loss scaling, which the trainer engines do not do "
                             "(its gradients would underflow); use bfloat16, or float32")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load ``path`` (YAML) with ``key=value`` overrides into a validated RunConfig."""
    try:
        base = _load_yaml(Path(path)) if path else OmegaConf.create({})
        bad = [o for o in overrides or [] if "=" not in o]
        if bad:
            raise ConfigError(f"override {bad[0]!r} is not of the form key=value")
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides or [])))
        data = OmegaConf.to_container(merged, resolve=True)
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot read config: {e}") from e
    return build(RunConfig, one_temperature(data or {}), "")


def one_temperature(data: dict) -> dict:
    """One sampling temperature for both sides: ``algo.temperature`` follows ``rollout.temperature`` unless
    set (and :class:`RunConfig` refuses the two when they differ)."""
    rollout = data.get("rollout")
    algo = data.get("algo") if isinstance(data.get("algo"), dict) else {}
    if isinstance(rollout, dict) and "temperature" in rollout and "temperature" not in algo:
        data = {**data, "algo": {**algo, "temperature": rollout["temperature"]}}
    return data


def _load_yaml(path: Path, seen: tuple[Path, ...] = ()) -> Any:
    """Load ``path``; a top-level ``base: other.yaml`` (relative to it) is loaded first and merged under it."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'base' chain loops back to itself")
    node = OmegaConf.load(path)
    if not isinstance(OmegaConf.to_container(node), dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = node.pop("base", None)
    if base is None:
        return node
    return OmegaConf.merge(_load_yaml(path.parent / str(base), seen + (path.resolve(),)), node)


def from_dict(data: dict) -> RunConfig:
    """Build a RunConfig from a plain dict (as saved in config.yaml)."""
    return build(RunConfig, one_temperature(data), "")


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def config_hash(cfg: RunConfig) -> str:
    """Identity of a config (checkpoints record it to warn when a resume changes it)."""
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def save(cfg: RunConfig, path: str | Path) -> None:
    atomic.write_text(path, OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))))


def load_saved(run_dir: str | Path) -> RunConfig:
    """The resolved config a component reads from its run directory."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise ConfigError(f"{path} does not exist: is {run_dir} a run directory?")
    return from_dict(OmegaConf.to_container(OmegaConf.load(path)))


def build(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from ``data``, checking keys and types."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a section (mapping), got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key; allowed keys in {where}: {', '.join(names)}")
    kwargs = {k: _coerce(hints[k], v, f"{prefix}{k}") for k, v in data.items()}
    for name in names:  # absent sections are built here too, so their errors carry the section name
        if name not in kwargs and dataclasses.is_dataclass(hints[name]):
            kwargs[name] = build(hints[name], {}, f"{prefix}{name}.")
    try:
        return cls(**kwargs)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{prefix}{e}") from e


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {tp}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return type(value)(_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)) if origin is list else tuple(
            _coerce(args[min(i, len(args) - 1)], v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    return _scalar(tp, value, key)


def _scalar(tp: Any, value: Any, key: str) -> Any:
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")
