"""Configuration of the rollout component."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hpcrl.rollout.registry import AUTO, engine_spec, runner_spec


@dataclass
class RolloutConfig:
    # the inference engine (hpcrl/rollout/registry.py): torch = embedded in the rollout process (tiny models, CPU
    # tests); vllm / sglang = a server the rollout job starts on its node(s) and drives over HTTP (docs/engine.md);
    # or "module:attr" of an EngineSpec of your own
    engine: str = "torch"
    # what one sample is (hpcrl/rollout/registry.py): single_turn = one completion of the prompt; agent = an episode
    # of agent.fn against the job's proxy; auto = agent when agent.fn is set, else single_turn; or "module:attr" of
    # an EpisodeSpec of your own
    episodes: str = "auto"
    # vllm/sglang: drive this running server instead of starting one ("" = start one); it must serve the initial
    # policy and no one else (the rollout pauses and reloads it), so replicas must be 1
    server_url: str = ""
    server_host: str = "127.0.0.1"  # vllm/sglang: address the started server binds (loopback: only this job reaches it)
    server_port: int = 0  # vllm/sglang: port of the started server (0 = a free port)
    server_args: list[str] = field(default_factory=list)  # vllm/sglang: extra command-line arguments of the server
    # vllm/sglang: the command that starts the server, before its arguments ([] = this Python, -m the engine's server
    # module); e.g. a container wrapper: [apptainer, exec, --nv, sglang.sif, python3, -m, sglang.launch_server]
    server_launcher: list[str] = field(default_factory=list)
    tensor_parallel_size: int = 0  # vllm/sglang: 0 = launch.rollout.gpus_per_node (1 without GPUs)
    server_start_timeout_s: float = 600.0  # vllm/sglang: the server must answer its health check within this
    request_timeout_s: float = 1800.0  # vllm/sglang: a generate request unanswered for this long fails the rollout job
    # vllm/sglang: the samples of a prompt group share their first request (a batch of n copies: one round trip)
    coalesce: bool = True
    # sglang: how a version held in memory (collective/colocated weights) reaches the server: stage = written to
    # staging_dir and reloaded from there; group = broadcast into the server over its weight-update group
    server_update: Literal["stage", "group"] = "stage"
    staging_dir: str = ""  # vllm/sglang: node-local directory for weights received in memory ("" = /dev/shm or /tmp)
    replicas: int = 1  # independent rollout processes (all share the admission ledger)
    group_size: int = 8  # samples per prompt (a prompt group)
    max_batch_size: int = 64  # sequences decoded together (continuous batching slots)
    max_new_tokens: int = 8  # response length limit
    temperature: float = 1.0  # sampling temperature (the trainer uses the same one for logprobs)
    threads: int = 1  # torch threads per rollout process
    # engine=torch: where the embedded engine runs: auto = the job's first visible accelerator (CUDA, else an Ascend
    # NPU), else the CPU; or cpu, cuda, cuda:N, npu, npu:N (hpcrl/runtime/device.py)
    device: str = "auto"
    # engine=torch on an accelerator: cap this process's share of the device's memory (0 = no cap), e.g. 0.3 when
    # a trainer shares the device on one node (it gets the rest)
    device_memory_fraction: float = 0.0
    poll_interval_s: float = 0.02  # sleep when blocked on admission or new weights
    # new sequences enter the running batch only when this many slots are free (fewer, larger prefills); 0 = group_size
    admit_min_free: int = 0
    # on new weights: rebuild the KV cache of in-flight sequences by prefill (exact continuation under the new
    # weights), or keep the old cache (PipelineRL-style, no prefill; logprobs stay the sampling ones)
    kv_on_update: Literal["recompute", "keep"] = "recompute"
    # how many tickets a replica takes: fill = while its engine has room (one replica may take a whole synchronous
    # batch while the others idle); even = at most its even share of what the staleness bound lets be
    # outstanding, ceil((max_staleness + 1) * batch_size / replicas) groups, replicas being the fleet's current size
    # (`hpcrl scale`, else rollout.replicas): for synchronous or small-eta runs on fleets whose engines together
    # hold more than the bound (docs/performance.md, "Predictions for GPU clusters")
    ticket_share: Literal["fill", "even"] = "fill"

    def __post_init__(self) -> None:
        engine_spec(self.engine, key="engine").check(self)  # the engine's own checks (kv_on_update, server_update)
        if self.episodes != AUTO:
            runner_spec(self.episodes, key="episodes")  # a known choice; its checks need agent.fn (RunConfig)
        for name in ("replicas", "group_size", "max_batch_size", "max_new_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_batch_size < self.group_size:
            raise ValueError(f"max_batch_size: must be >= group_size ({self.group_size}), got {self.max_batch_size}")
        if not 0 <= self.admit_min_free <= self.max_batch_size:
            raise ValueError(f"admit_min_free: must be in [0, max_batch_size={self.max_batch_size}], "
                             f"got {self.admit_min_free}")
        kind, _, index = self.device.partition(":")
        if self.device != "auto" and (kind not in ("cpu", "cuda", "npu") or (index and not index.isdigit())
                                      or (kind == "cpu" and index)):
            raise ValueError(f"device: expected auto, cpu, cuda[:N] or npu[:N], got {self.device!r}")
        if not 0 <= self.device_memory_fraction < 1:
            raise ValueError(f"device_memory_fraction: must be in [0, 1), got {self.device_memory_fraction}")
        if self.temperature <= 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")
        if not 0 <= self.server_port < 65536:
            raise ValueError(f"server_port: must be in [0, 65535], got {self.server_port}")
        if self.tensor_parallel_size < 0:
            raise ValueError(f"tensor_parallel_size: must be >= 0, got {self.tensor_parallel_size}")
        for name in ("server_start_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.server_url and self.replicas > 1:
            raise ValueError(f"server_url: one server per rollout replica (each one pauses and reloads it), but "
                             f"replicas={self.replicas}; leave server_url empty to start one server per replica")
        if self.server_url and not self.server_url.startswith(("http://", "https://")):
            raise ValueError(f"server_url: expected http://host:port, got {self.server_url!r}")
