"""Build the inference engine that ``rollout.engine`` names: its
:class:`~hpcrl.rollout.registry.EngineSpec` says which builder below (or of its own) makes it.

- ``torch`` (:func:`build_torch`): :class:`~hpcrl.rollout.torch_engine.TorchEngine`
  on the model in this process.
- ``vllm`` / ``sglang`` (:func:`build_server`): a
  :class:`~hpcrl.rollout.remote_engine.RemoteEngine` driving a server whose
  wire format and command the spec's backend gives. Unless ``rollout.server_url`` names a running one, the
  server is started here as a child of the rollout job
  (:class:`~hpcrl.rollout.server.ServerProcess`), on ``server_host`` and a
  free port, with tensor parallelism over the job's GPUs, its log in
  ``<run_dir>/logs/<name>-server.log``; it is stopped by the engine's
  ``close``. Weights that exist only in memory (collective and colocated
  modes) and the server's view of the model are staged in a node-local
  directory (``rollout.staging_dir``, default ``/dev/shm``) named by the
  rollout's host and pid; ``close`` removes it, and a later start on the
  same host removes those of processes that died. The server loads the initial policy; the rollout then hands it
  the newest published version like any later one.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hpcrl.rollout.config import RolloutConfig
from hpcrl.rollout.engine import InferenceEngine, SamplingParams
from hpcrl.plugins import resolve
from hpcrl.rollout.registry import engine_spec

log = logging.getLogger(__name__)


@dataclass
class EngineSite:
    """Where an engine runs: what the rollout job knows about itself."""

    model_path: str  # HuggingFace folder of the initial policy
    dtype: str  # model.dtype
    log_dir: Path  # server logs go here
    name: str  # e.g. "rollout-0-ab12cd": names the server log and the staging directory
    gpus: int = 0  # accelerators of this job's node (tensor parallel size when rollout.tensor_parallel_size=0)
    on_wait: Callable[[], None] | None = None  # called while a server starts (keeps the job's heartbeat fresh)
    lora_rank: int = 0  # > 0: published versions are LoRA adapters of this rank (trainer.lora.publish: adapter)


def build_engine(cfg: RolloutConfig, site: EngineSite, *, seed: int, tokenizer, model=None) -> InferenceEngine:
    """The engine ``rollout.engine`` names (:mod:`hpcrl.rollout.registry`), built by its spec."""
    spec = engine_spec(cfg.engine)
    return resolve(spec.build, "rollout.engine")(cfg, site, seed=seed, tokenizer=tokenizer, model=model)


def sampling_of(cfg: RolloutConfig) -> SamplingParams:
    return SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)


def build_torch(cfg: RolloutConfig, site: EngineSite, *, seed: int, tokenizer, model=None) -> InferenceEngine:
    """The embedded engine, on ``model`` (colocated mode: the trainer's, where it is) or the initial policy loaded
    here onto ``rollout.device``, whose memory this process may then use up to ``rollout.device_memory_fraction``."""
    from hpcrl.model.hf_io import load_model
    from hpcrl.rollout.torch_engine import TorchEngine
    from hpcrl.runtime.device import limit_memory, of, place

    if model is None:
        device = place(cfg.device, "rollout.device")
        of(device).set_device(device.index or 0)
        limit_memory(device, cfg.device_memory_fraction)
        model = load_model(site.model_path, site.dtype).to(device)
        log.info("embedded engine on %s%s", device, f" (memory share {cfg.device_memory_fraction})"
                 if cfg.device_memory_fraction and device.type != "cpu" else "")
    return TorchEngine(model,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       max_batch_size=cfg.max_batch_size, sampling=sampling_of(cfg), seed=seed,
                       min_admit=cfg.admit_min_free or cfg.group_size,
                       keep_cache_on_update=cfg.kv_on_update == "keep")


def build_server(cfg: RolloutConfig, site: EngineSite, *, seed: int, tokenizer, model=None) -> InferenceEngine:
    """A :class:`~hpcrl.rollout.remote_engine.RemoteEngine` over the server the spec's backend speaks to: started
    here (its command from the backend) unless ``rollout.server_url`` names a running one."""
    from hpcrl.rollout.remote_engine import RemoteEngine
    from hpcrl.rollout.server import ServerProcess
    from hpcrl.runtime.net import free_port

    backend = resolve(engine_spec(cfg.engine).backend, "rollout.engine")()
    staging = _staging_dir(Path(cfg.staging_dir or _node_local()), site.name)
    staging.mkdir(parents=True, exist_ok=True)
    server, url = None, cfg.server_url
    tp = cfg.tensor_parallel_size or (1 if url else max(site.gpus, 1))
    if not url:
        port = cfg.server_port or free_port(cfg.server_host)
        argv, env = backend.server_command(site.model_path, host=cfg.server_host, port=port, dtype=site.dtype,
                                           tensor_parallel_size=tp, extra=cfg.server_args, gpu=site.gpus > 0,
                                           staging=staging, launcher=cfg.server_launcher, lora_rank=site.lora_rank)
        url = f"http://{cfg.server_host}:{port}"
        server = ServerProcess(argv, health_url=url + backend.health_path, env=env,
                               log_path=site.log_dir / f"{site.name}-server.log",
                               start_timeout_s=cfg.server_start_timeout_s)
    try:
        if server is not None:
            server.start(site.on_wait)
        group = None
        if cfg.server_update == "group":  # the server's workers connect to this process: a server this job
            from hpcrl.rollout.update_group import UpdateGroup  # started on loopback finds it there, others by name
            local = not cfg.server_url and cfg.server_host in ("127.0.0.1", "localhost", "::1")
            address = "127.0.0.1" if local else socket.getfqdn()
            group = UpdateGroup(address, 1 + tp, name=f"hpcrl-{site.name}", timeout_s=cfg.server_start_timeout_s)
        engine = RemoteEngine(backend, url, sampling=sampling_of(cfg), staging_dir=staging, server=server,
                              request_timeout_s=cfg.request_timeout_s, coalesce=cfg.coalesce, update_group=group)
    except BaseException:
        if server is not None:
            server.stop()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        engine.prepare()
    except BaseException:
        engine.close()
        raise
    engine.on_wait = site.on_wait
    return engine


def _staging_dir(root: Path, name: str) -> Path:
    """``root/hpcrl-<name>@<host>.<pid>``, after removing those of this host's processes that are gone."""
    host = socket.gethostname()
    for old in root.glob(f"hpcrl-*@{host}.*"):
        pid = old.name.rsplit(".", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)
    return root / f"hpcrl-{name}@{host}.{os.getpid()}"


def _node_local() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
