"""vLLM as a rollout engine: the server command and its wire format.

The server is vLLM's OpenAI-compatible API server with its RL endpoints
(``VLLM_SERVER_DEV_MODE=1``), started by the rollout job
(:func:`hpcrl.rollout.engines.build_engine`) or named by
``rollout.server_url``. Requests and answers:

- generate: ``POST /v1/completions`` with the prompt as token ids,
  ``max_tokens``, ``temperature``, ``logprobs: 0`` and
  ``return_token_ids: true``; the answer's ``choices[0].token_ids`` are the
  sampled tokens (eos included when it stopped on eos) and
  ``logprobs.token_logprobs`` their logprobs. The server runs with
  ``--logprobs-mode processed_logprobs``, so those are
  ``log softmax(logits / T)``, the behaviour logprobs the trainer corrects
  with. An aborted request answers ``finish_reason: "abort"`` with the tokens
  it had.
- abort: ``POST /abort_requests {}`` aborts everything in flight.
- a published LoRA adapter (``trainer.lora.publish: adapter``; the server
  started with ``--enable-lora``): ``POST /v1/unload_lora_adapter`` of the
  previous one, ``POST /v1/load_lora_adapter {"lora_name":
  "policy-v<N>-<instance>.<k>", "lora_path": DIR}`` (a name never used
  before), ``POST /reset_prefix_cache``; the next requests name it as their
  model.
- new weights (nothing in flight): ``POST /pause?mode=abort``, ``POST
  /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path":
  DIR}}`` (DIR holds ``model.safetensors`` with HuggingFace names),
  ``POST /reset_prefix_cache``, ``POST /update_weight_version``, ``POST
  /resume``.

Tied embeddings: vLLM 0.32's in-place reload does not re-tie ``lm_head`` to
the reloaded embedding (the layerwise loader puts the old head back: tokens
then come from neither version). So a tied model is served *untied*: the
server loads :func:`untied_view` of the model folder (``tie_word_embeddings:
false`` and an explicit ``lm_head.weight`` copied from the embedding), and
every published version carries ``lm_head.weight`` as its own tensor
(:func:`hpcrl.weights.version.storable_tensors`). The logits are the same.

On GPU nodes vLLM also takes weights over NCCL (``/init_weight_transfer_engine``,
``/update_weights``); hpcrl's collective mode instead receives the broadcast
in the rollout process and hands vLLM a staged directory on node-local
storage (see docs/engine.md).
"""

from __future__ import annotations

import json
import shutil
import uuid
import sys
from pathlib import Path

import aiohttp
from safetensors import safe_open
from safetensors.torch import save_file

from hpcrl.rollout.engine import SamplingParams
from hpcrl.rollout.remote_engine import Segment, check_response
from hpcrl.weights import adapter

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file of a HuggingFace folder."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: f.name for k in st.keys()})
    return out


def untied_view(model_path: str | Path, staging: Path) -> Path:
    """``model_path`` itself if its head is untied, else a view of it under ``staging`` with an explicit head."""
    src = Path(model_path)
    if not (src / "config.json").is_file():
        return src  # not a model folder: the server says so in its own words
    config = json.loads((src / "config.json").read_text())
    weight_map = _weight_map(src)
    if not config.get("tie_word_embeddings") and HEAD in weight_map:
        return src
    if EMBED not in weight_map:
        raise ValueError(f"model.path: {src} ties its output head to the embedding, and hpcrl serves such a "
                         f"model with vLLM only when the embedding is named {EMBED!r}")
    view = staging / "server-model"
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors.index.json"):
            (view / f.name).symlink_to(f.resolve())
    with safe_open(str(src / weight_map[EMBED]), "pt") as st:
        save_file({HEAD: st.get_tensor(EMBED).clone()}, str(view / "lm_head.safetensors"))
    weight_map[HEAD] = "lm_head.safetensors"
    (view / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (view / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=1))
    return view


LAUNCHER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
LORA_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values of vLLM's --max-lora-rank


def server_command(model_path: str, *, host: str, port: int, dtype: str, tensor_parallel_size: int,
                   extra: list[str], gpu: bool, staging: Path, launcher: list[str] = (),
                   lora_rank: int = 0) -> tuple[list[str], dict[str, str]]:
    """argv and environment of a vLLM server for ``model_path`` (``launcher``: the command before the arguments;
    ``lora_rank`` > 0: published versions are LoRA adapters of that rank, loaded at run time)."""
    served = str(untied_view(model_path, staging))
    argv = [*(launcher or LAUNCHER), "--model", served,
            "--served-model-name", "policy", "--host", host, "--port", str(port), "--dtype", dtype,
            "--logprobs-mode", "processed_logprobs", "--tensor-parallel-size", str(tensor_parallel_size),
            "--disable-uvicorn-access-log"]
    if not gpu:
        argv.append("--enforce-eager")  # no CUDA graphs on CPU
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # the RL endpoints: pause, reload, weight version, resume
    if lora_rank:  # one adapter at a time: each version's replaces the last one's
        argv += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(_lora_slot(lora_rank))]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    if not gpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB of KV cache; override in the job's environment
    return argv + list(extra), env


def _lora_slot(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds ``rank``."""
    for slot in LORA_SLOTS:
        if rank <= slot:
            return slot
    raise ValueError(f"trainer.lora.rank={rank}: vLLM serves adapters up to rank {LORA_SLOTS[-1]}")


def _segment(choice: dict) -> Segment:
    """One choice of a ``/v1/completions`` answer."""
    ids = list(choice.get("token_ids") or [])
    lps = list((choice.get("logprobs") or {}).get("token_logprobs") or [])
    return Segment(ids, [float(x) for x in lps], _FINISH.get(choice.get("finish_reason"), "length"))


class VLLMBackend:
    """vLLM's wire format for :class:`~hpcrl.rollout.remote_engine.RemoteEngine`."""

    health_path = "/health"
    server_command = staticmethod(server_command)  # the command that starts one

    def __init__(self, model: str = "policy") -> None:
        self.model = model
        self.adapter: str | None = None  # the LoRA adapter requests name once a published adapter is loaded
        self._instance, self._loads = uuid.uuid4().hex[:8], 0

    async def prepare(self, http: aiohttp.ClientSession, url: str) -> None:
        """Take the served model name from ``/v1/models`` (it may be a server hpcrl did not start)."""
        async with http.get(f"{url}/v1/models") as r:
            data = await check_response(r, "GET /v1/models")
        self.model = data["data"][0]["id"]

    async def generate(self, http: aiohttp.ClientSession, url: str, prompt_ids: list[int], max_new_tokens: int,
                       sampling: SamplingParams, n: int = 1) -> list[Segment]:
        # n > 1: a batch of n copies of the prompt, not vLLM's n (an aborted n > 1 request answers without the
        # tokens it had generated; each prompt of a batch is its own request and keeps them)
        body = {"model": self.adapter or self.model, "prompt": [prompt_ids] * n if n > 1 else prompt_ids,
                "max_tokens": max_new_tokens,
                "temperature": 0.0 if sampling.greedy else sampling.temperature, "top_p": 1.0, "top_k": -1,
                "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
                "ignore_eos": sampling.ignore_eos}
        async with http.post(f"{url}/v1/completions", json=body) as r:
            data = await check_response(r, "POST /v1/completions")
        return [_segment(choice) for choice in sorted(data["choices"], key=lambda c: c["index"])]

    async def abort_all(self, http: aiohttp.ClientSession, url: str) -> None:
        async with http.post(f"{url}/abort_requests", json={}) as r:
            await check_response(r, "POST /abort_requests")

    async def load(self, http: aiohttp.ClientSession, url: str, path: Path, version: int) -> None:
        if adapter.is_adapter(path):
            return await self._load_adapter(http, url, path, version)
        await self._post(http, url, "/pause?mode=abort")
        try:  # a failed reload fails the rollout job; the server must not stay paused meanwhile
            await self._post(http, url, "/collective_rpc",
                             {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
            await self._post(http, url, "/reset_prefix_cache")
            await self._post(http, url, "/update_weight_version", {"new_version": str(version)})
        finally:
            await self._post(http, url, "/resume")

    async def _load_adapter(self, http: aiohttp.ClientSession, url: str, path: Path, version: int) -> None:
        """A published LoRA adapter in place of the previous one (nothing is in flight: the engine drained the
        server); the next requests name it. The base weights stay as the server loaded them."""
        if self.adapter is not None:
            await self._post(http, url, "/v1/unload_lora_adapter", {"lora_name": self.adapter}, text_ok=True)
            self.adapter = None
        # a name never used before: a version number comes back with other weights after a trainer's resume, and a
        # server this process did not start may hold an earlier rollout's adapters
        self._loads += 1
        name = f"policy-v{version}-{self._instance}.{self._loads}"
        await self._post(http, url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                         text_ok=True)
        await self._post(http, url, "/reset_prefix_cache")  # (its keys hold the adapter's name; belt and braces)
        self.adapter = name

    @staticmethod
    async def _post(http: aiohttp.ClientSession, url: str, route: str, body: dict | None = None,
                    text_ok: bool = False) -> dict:
        async with http.post(f"{url}{route}", json=body) as r:
            return await check_response(r, f"POST {route}", text_ok)
