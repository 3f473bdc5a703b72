"""The rollout-engine registry: the one place that maps ``rollout.engine`` to an implementation.

An :class:`EngineSpec` says how to build an engine and what the config may ask
of it; :data:`ENGINES` holds the built-in ones (``torch``, ``vllm``,
``sglang``), and :func:`register_engine` adds another within one process
(tests; a run's processes each load the config, so an engine of your own
is named there by import path, below). The config takes its
choices, its error message and each engine's own checks from here
(:meth:`EngineSpec.check`), and :func:`hpcrl.rollout.engines.build_engine`
builds what the spec names, so a new engine is one module and one
registration.

An engine outside hpcrl is named by import path in the config,
``rollout.engine: my_pkg.engines:SPEC``, where ``SPEC`` is an
:class:`EngineSpec`: the module is imported (and the spec registered under that
name) when the config is validated, in every process that loads it, so keep
such a module light (import torch inside ``build``).

The second registry here, :data:`RUNNERS`, maps ``rollout.episodes`` to an
episode runner (below).

This module is light (no torch): the config layer imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from hpcrl.plugins import Registry

if TYPE_CHECKING:
    from hpcrl.config import RunConfig
    from hpcrl.rollout.config import RolloutConfig

__all__ = ["AUTO", "ENGINES", "RUNNERS", "EngineSpec", "EpisodeSpec", "engine_spec", "episodes_of", "register_engine",
           "register_runner", "runner_spec"]


@dataclass(frozen=True)
class EngineSpec:
    name: str
    # (cfg: RolloutConfig, site: EngineSite, *, seed: int, tokenizer, model) -> InferenceEngine, or its
    # "module:function" (imported when an engine is built, so that the config stays light)
    build: str | Callable[..., Any]
    # a server the rollout job drives: every interrupted request is recomputed (no rollout.kv_on_update=keep)
    server: bool = False
    # "module:Class" of its wire format (a ServerBackend), for the server engines built by build_server
    backend: str = ""
    # receives in-memory versions over its own weight-update group (rollout.server_update=group)
    update_group: bool = False
    # LoRA adapters it loads when versions are published alone (trainer.lora.publish=adapter): None = any rank,
    # 0 = none
    max_adapter_rank: int | None = None
    title: str = ""  # how messages name it ("vLLM"); the name when empty

    def __post_init__(self) -> None:
        if self.server and self.build == "hpcrl.rollout.engines:build_server" and not self.backend:
            raise ValueError(f"rollout.engine: {self.name!r} is built by build_server, which needs its backend "
                             "('module:Class' of a ServerBackend)")

    def check(self, cfg: RolloutConfig) -> None:
        """The engine's own checks of the rollout config; ValueError names the key relative to ``rollout``
        (``kv_on_update: ...``: the config loader adds the section)."""
        if self.server and cfg.kv_on_update == "keep":
            raise ValueError(f"kv_on_update: 'keep' needs an embedded engine such as rollout.engine=torch (a "
                             f"{self.name} server recomputes the prefix of every interrupted request); use 'recompute'")
        if cfg.server_update == "group" and not self.update_group:
            groups = [s.name for s in ENGINES.values() if s.update_group]
            raise ValueError(f"server_update: 'group' needs a rollout.engine with a weight-update group "
                             f"({', '.join(groups)}; with {self.name!r} a version held in memory is staged: vLLM's "
                             "transfer engines need CUDA on both sides); use 'stage'")

    def adapters(self, rank: int) -> str | None:
        """Why this engine cannot take published LoRA adapters of ``rank`` (None: it can)."""
        if self.max_adapter_rank is None or rank <= self.max_adapter_rank:
            return None
        if self.max_adapter_rank == 0:
            takers = [s.name for s in ENGINES.values() if s.max_adapter_rank != 0]
            return f"rollout.engine={self.name} (hpcrl loads adapters into {', '.join(takers)})"
        return f"trainer.lora.rank={rank} and rollout.engine={self.name} ({self.title or self.name} serves " \
               f"adapters up to rank {self.max_adapter_rank})"


ENGINES = Registry("rollout.engine", EngineSpec)
register_engine = ENGINES.register  # make a spec a choice of rollout.engine (within this process)
engine_spec = ENGINES.lookup  # the spec a value of rollout.engine names (a registered name, or module:attr)


register_engine(EngineSpec("torch", build="hpcrl.rollout.engines:build_torch"))
register_engine(EngineSpec("vllm", build="hpcrl.rollout.engines:build_server", server=True,
                           backend="hpcrl.rollout.vllm_engine:VLLMBackend", max_adapter_rank=512, title="vLLM"))
register_engine(EngineSpec("sglang", build="hpcrl.rollout.engines:build_server", server=True,
                           backend="hpcrl.rollout.sglang_engine:SGLangBackend", update_group=True,
                           max_adapter_rank=0, title="SGLang"))


# -- episode runners ---------------------------------------------------------------------------------------
# What one sample is belongs to an EpisodeRunner (hpcrl/rollout/episodes.py), built by the rollout job from the
# EpisodeSpec that rollout.episodes names: single_turn = one completion of the prompt (SingleTurn); agent = an
# episode of agent.fn against the job's proxy (hpcrl/agent/runner.py); auto (the default) = agent when agent.fn is
# set, else single_turn; or "module:attr" of a spec of your own. Its build takes (cfg: RunConfig, engine,
# tokenizer, reward: Scorer, model_path) and returns the runner; the rollout job closes it.

AUTO = "auto"


@dataclass(frozen=True)
class EpisodeSpec:
    name: str
    # (cfg: RunConfig, engine, tokenizer, reward: Scorer, model_path: str) -> EpisodeRunner, or its
    # "module:function" (imported when a rollout job builds it)
    build: str | Callable[..., Any]
    agent: bool = False  # it runs agent.fn (which must then be set); a runner without it refuses agent.fn

    def check(self, cfg: RunConfig) -> None:
        """The runner's own checks of the run's config (ValueError naming the full key)."""
        if self.agent and not cfg.agent.fn:
            raise ValueError(f"rollout.episodes: {self.name!r} runs the agent function; set agent.fn")
        if cfg.agent.fn and not self.agent:
            raise ValueError(f"agent.fn: set, but rollout.episodes={self.name} does not run agents (use 'auto' or "
                             f"{', '.join(repr(s.name) for s in RUNNERS.values() if s.agent)})")


RUNNERS = Registry("rollout.episodes", EpisodeSpec)
register_runner = RUNNERS.register  # make a spec a choice of rollout.episodes (within this process)
runner_spec = RUNNERS.lookup  # the spec a value of rollout.episodes names (a registered name, or module:attr)


def episodes_of(cfg: RunConfig) -> EpisodeSpec:
    """The runner a run's rollout jobs build (``auto`` resolved by ``agent.fn``)."""
    name = cfg.rollout.episodes
    if name == AUTO:
        name = "agent" if cfg.agent.fn else "single_turn"
    return runner_spec(name)


register_runner(EpisodeSpec("single_turn", build="hpcrl.rollout.episodes:build_single_turn"))
register_runner(EpisodeSpec("agent", build="hpcrl.agent.runner:build_agent_episodes", agent=True))
