"""SGLang as a rollout engine: the server command and its wire format.

The server is ``python -m sglang.launch_server`` (CUDA only: it cannot run
on the CPU machines hpcrl is tested on, so this adapter is tested against a
stand-in that implements the same HTTP shapes, ``tests/sglang_standin.py``,
and by ``sglang``-marked tests where a real server exists). Requests and
answers, SGLang 0.5.x native API (``sglang/srt/entrypoints/http_server.py``,
``managers/io_struct.py``):

- generate: ``POST /generate`` with ``input_ids``, ``sampling_params``
  (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
  ``ignore_eos``, ``skip_special_tokens``, ``no_stop_trim``) and
  ``return_logprob: true``. ``meta_info.output_token_logprobs`` holds
  ``[logprob, token_id, text]`` per output token, ``log softmax(logits / T)``;
  the tokens are taken from there (0.5.1-0.5.4 prefix ``output_ids`` with
  prompt tokens), eos included;
  ``meta_info.finish_reason.type`` is ``stop``, ``length`` or ``abort``. An
  aborted request returns the tokens it had; one aborted before its first
  token may have no ``output_ids`` at all (<= 0.5.5).
- abort: ``POST /abort_request {"abort_all": true}``.
- new weights (nothing in flight): ``POST /pause_generation {"mode":
  "abort"}``, ``POST /update_weights_from_disk {"model_path": DIR,
  "weight_version": "N", "flush_cache": true}`` (SGLang reads the
  ``*.safetensors`` of DIR; answers ``{"success", "message"}``), ``POST
  /update_weight_version`` (0.5.6 does not set the version on a paused
  update), ``POST /continue_generation {}``.

- new weights held in memory, with ``rollout.server_update=group``
  (:mod:`hpcrl.rollout.update_group`): once, ``POST /init_weights_update_group
  {"master_address", "master_port", "rank_offset": 1, "world_size": 1 + TP,
  "group_name", "backend"}`` while the rollout joins as rank 0; per version,
  after the pause, ``POST /update_weights_from_distributed {"names",
  "dtypes", "shapes", "group_name", "flush_cache": true, "weight_version"}``
  while the rollout broadcasts the tensors in that order; then the version
  and ``/continue_generation`` as above.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Mapping

import aiohttp
import torch

from hpcrl.rollout.engine import SamplingParams
from hpcrl.rollout.remote_engine import Segment, check_response
from hpcrl.rollout.server import EngineServerError
from hpcrl.rollout.update_group import UpdateGroup, announce


LAUNCHER = [sys.executable, "-m", "sglang.launch_server"]  # the tests point this at the stand-in


def server_command(model_path: str, *, host: str, port: int, dtype: str, tensor_parallel_size: int,
                   extra: list[str], gpu: bool, staging: Path, launcher: list[str] = (),
                   lora_rank: int = 0) -> tuple[list[str], dict[str, str]]:
    """argv and environment of an SGLang server for ``model_path`` (``launcher``: the command before the
    arguments). Published LoRA adapters (``lora_rank`` > 0) are not loaded into SGLang: refused."""
    if lora_rank:
        raise ValueError("rollout.engine=sglang takes whole published policies; set trainer.lora.publish=merged")
    argv = [*(launcher or LAUNCHER), "--model-path", model_path, "--host", host, "--port", str(port),
            "--tp-size", str(tensor_parallel_size), "--dtype", dtype, "--skip-server-warmup"]
    return argv + list(extra), {}


def _segment(answer: dict) -> Segment:
    """One answer of ``/generate``."""
    meta = answer["meta_info"]
    # each entry is [logprob, token_id, text]: the ids come from there (0.5.1-0.5.4 prefix output_ids with
    # prompt tokens; a request aborted before its first token may have no output_ids at all)
    entries = meta.get("output_token_logprobs") or []
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type", "length") if isinstance(finish, dict) else str(finish)
    return Segment([int(e[1]) for e in entries], [float(e[0]) for e in entries],
                   kind if kind in ("stop", "length", "abort") else "length",
                   message=str(finish.get("message", "")) if isinstance(finish, dict) else "")


class SGLangBackend:
    """SGLang's wire format for :class:`~hpcrl.rollout.remote_engine.RemoteEngine`."""

    health_path = "/health"
    server_command = staticmethod(server_command)  # the command that starts one

    async def prepare(self, http: aiohttp.ClientSession, url: str) -> None:
        """Check that the server speaks SGLang's API (``/get_model_info`` exists in every 0.5.x)."""
        async with http.get(f"{url}/get_model_info") as r:
            info = await check_response(r, "GET /get_model_info")
        if "model_path" not in info:
            raise EngineServerError(f"{url}/get_model_info does not look like SGLang's: {str(info)[:300]}")

    async def generate(self, http: aiohttp.ClientSession, url: str, prompt_ids: list[int], max_new_tokens: int,
                       sampling: SamplingParams, n: int = 1) -> list[Segment]:
        """``n`` > 1: one batch request (``input_ids`` a list of ``n`` copies), answered by a list."""
        body = {"input_ids": [prompt_ids] * n if n > 1 else prompt_ids, "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_new_tokens,
                                    "temperature": 0.0 if sampling.greedy else sampling.temperature,
                                    "top_p": 1.0, "top_k": -1, "ignore_eos": sampling.ignore_eos,
                                    "skip_special_tokens": False, "no_stop_trim": True}}
        async with http.post(f"{url}/generate", json=body) as r:
            data = await check_response(r, "POST /generate")
        return [_segment(answer) for answer in (data if n > 1 else [data])]

    async def abort_all(self, http: aiohttp.ClientSession, url: str) -> None:
        async with http.post(f"{url}/abort_request", json={"abort_all": True}) as r:
            await check_response(r, "POST /abort_request")

    async def load(self, http: aiohttp.ClientSession, url: str, path: Path, version: int) -> None:
        await self._post(http, url, "/pause_generation", {"mode": "abort"})
        try:  # SGLang rolls a refused update back; either way the server must not stay paused
            answer = await self._post(http, url, "/update_weights_from_disk",
                                      {"model_path": str(path), "weight_version": str(version), "flush_cache": True})
            if not answer.get("success", False):
                raise EngineServerError(f"SGLang refused version {version} from {path}: {answer.get('message')}")
            await self._post(http, url, "/update_weight_version",
                             {"new_version": str(version), "abort_all_requests": False})
        finally:
            await self._post(http, url, "/continue_generation", {})

    async def push(self, http: aiohttp.ClientSession, url: str, group: UpdateGroup, state: Mapping[str, torch.Tensor],
                   version: int) -> None:
        await self._post(http, url, "/pause_generation", {"mode": "abort"})
        try:
            if not group.joined:
                body = {"master_address": group.address, "master_port": group.port, "rank_offset": 1,
                        "world_size": group.world_size, "group_name": group.name, "backend": group.backend}
                answer, _ = await asyncio.gather(self._post(http, url, "/init_weights_update_group", body),
                                                 asyncio.to_thread(group.join))
                if not answer.get("success", False):
                    raise EngineServerError(f"SGLang did not join the weight-update group: {answer.get('message')}")
            body = {**announce(state), "group_name": group.name, "flush_cache": True, "weight_version": str(version)}
            answer, _ = await asyncio.gather(self._post(http, url, "/update_weights_from_distributed", body),
                                             asyncio.to_thread(group.broadcast, list(state.values())))
            if not answer.get("success", False):
                raise EngineServerError(f"SGLang refused version {version} over the group: {answer.get('message')}")
            await self._post(http, url, "/update_weight_version",
                             {"new_version": str(version), "abort_all_requests": False})
        finally:
            await self._post(http, url, "/continue_generation", {})

    @staticmethod
    async def _post(http: aiohttp.ClientSession, url: str, route: str, body: dict) -> dict:
        async with http.post(f"{url}{route}", json=body) as r:
            return await check_response(r, f"POST {route}")
