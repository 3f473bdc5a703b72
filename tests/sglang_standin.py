"""A stand-in SGLang server, for tests at the HTTP boundary (no GPU, no sglang install).

It serves the native endpoints an RL rollout uses, with SGLang's request and
response shapes, backed by a real tiny HF causal LM decoding one token per
forward (full recompute, CPU). It follows the SGLang 0.5.8-0.5.15 HTTP API,
read from the sglang 0.5.10 wheel (0.5.4, 0.5.6 and 0.5.23 checked for drift).
Where the shapes come from (paths inside the wheel, ``sglang/srt/``):

- routes, status codes, ``{success, message}`` bodies: ``entrypoints/http_server.py``;
  request bodies (GenerateReqInput, PauseGenerationReqInput, AbortReq,
  UpdateWeightFromDiskReqInput, UpdateWeightVersionReqInput,
  InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput): ``managers/io_struct.py``.
- ``{"text", "output_ids", "meta_info"}`` with ``meta_info`` = id, finish_reason,
  prompt_tokens, weight_version (read when the output is emitted), logprobs as
  ``[logprob, token_id, text|None]``, completion_tokens, cached_tokens; pause
  ("abort" finishes in-flight requests, new /generate waits until continue);
  weight updates waiting for in-flight requests unless paused; the reduced
  shape of a request aborted before its first token: ``managers/tokenizer_manager.py``.
- finish reasons ``{"type": "length", "length"}`` / ``{"type": "stop", "matched"}`` /
  ``{"type": "abort", "message", "status_code", "err_type"}``, length checked
  before stop tokens, the matched eos kept in ``output_ids`` (only ``text`` is
  trimmed): ``managers/schedule_batch.py`` (Req.check_finished), ``managers/detokenizer_manager.py``.
- logprob = log_softmax(logits / temperature)[token], raw log_softmax when greedy
  (temperature < 1e-6); input logprobs raw, the first one None: ``layers/sampler.py``,
  ``managers/scheduler_output_processor_mixin.py``; sampling keys: ``sampling/sampling_params.py``.
- weight-update groups: ``init_custom_process_group`` (``utils/common.py``), one
  broadcast from rank 0 per tensor (``model_executor/model_runner.py``).

Not modelled: streaming, text prompts, stop strings, top_logprobs, KV/radix cache.
For tests: ``GET /standin/calls`` lists every call as ``{"method", "path", "body"}``;
``--token-delay-s`` (default 0.002) is slept once per decode tick.
Run: ``python tests/sglang_standin.py --model-path DIR --host 127.0.0.1 --port P``.
"""
from __future__ import annotations

import argparse, asyncio, json, os, socket, sys, time, uuid
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

SAMPLING_KEYS = set("""max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty
    presence_penalty repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag ignore_eos
    skip_special_tokens spaces_between_special_tokens no_stop_trim custom_params stream_interval logit_bias
    sampling_seed""".split())
HEALTH_TIMEOUT_S = float(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))


def init_custom_process_group(backend, init_method, world_size, rank, group_name, timeout=timedelta(seconds=300)):
    """SGLang's rendezvous for a weight-update group; a trainer test joins as rank 0 with the same call."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class Req:
    def __init__(self, rid, ids, sp, want_lp, in_lp, text_lp):
        self.rid, self.ids, self.sp, self.want_lp, self.in_lp, self.text_lp = rid, ids, sp, want_lp, in_lp, text_lp
        self.out, self.lps, self.t0 = [], [], time.time()
        self.done = asyncio.get_running_loop().create_future()


class StandIn:
    def __init__(self, args):
        from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
        self.model_path, self.delay = args.model_path, args.token_delay_s
        self.model = AutoModelForCausalLM.from_pretrained(args.model_path, local_files_only=True,
                                                          dtype=torch.float32).eval()
        try:  # responses carry "text" only when the folder has a tokenizer
            fast = (Path(args.model_path) / "tokenizer.json").exists()
            self.tok = (PreTrainedTokenizerFast if fast else AutoTokenizer).from_pretrained(
                args.model_path, local_files_only=True)
        except Exception:  # noqa: BLE001
            self.tok = None
        eos = [getattr(self.model.generation_config, "eos_token_id", None), self.model.config.eos_token_id,
               getattr(self.tok, "eos_token_id", None)]  # SGLang takes the union of these
        self.eos = {e for x in eos for e in (x if isinstance(x, list) else [x]) if e is not None}
        self.vocab = self.model.config.vocab_size
        self.context_len = args.context_length or self.model.config.max_position_embeddings
        self.version, self.paused, self.mode, self.writers = args.weight_version, False, "abort", 0
        self.running: list[Req] = []
        self.calls: list[dict] = []
        self.groups: dict = {}
        self.gen = torch.Generator().manual_seed(args.random_seed or 0)
        self.tick = asyncio.Event()

    async def loop(self):
        """Round robin: one token for each in-flight request per tick, then yield to the HTTP handlers."""
        while True:
            if self.paused or not self.running:
                self.tick.clear()
                await self.tick.wait()
                continue
            for r in list(self.running):
                try:
                    self._step(r)
                except Exception as e:  # noqa: BLE001 - e.g. past max_position_embeddings
                    self._finish(r, {"type": "abort", "message": str(e), "status_code": None, "err_type": None})
            await asyncio.sleep(self.delay)

    @torch.no_grad()
    def _step(self, r: Req):
        sp = r.sp
        logits = self.model(torch.tensor([r.ids + r.out])).logits[0, -1].float()
        t = float(sp.get("temperature", 1.0))
        if t < 1e-6:
            tok = int(logits.argmax())
            lp = torch.log_softmax(logits, -1)[tok]
        else:
            logp = torch.log_softmax(logits / t, -1)
            probs = logp.exp()
            if int(sp.get("top_k", -1)) > 0:
                probs[probs < torch.topk(probs, min(int(sp["top_k"]), probs.numel())).values[-1]] = 0
            if float(sp.get("top_p", 1.0)) < 1.0:
                sorted_p, idx = probs.sort(descending=True)
                probs[idx[(sorted_p.cumsum(0) - sorted_p) > float(sp["top_p"]) * sorted_p.sum()]] = 0
            tok = int(torch.multinomial(probs, 1, generator=self.gen))
            lp = logp[tok]
        r.out.append(tok)
        r.lps.append(float(lp))
        max_new = int(sp.get("max_new_tokens", 128))
        if len(r.out) >= max_new:
            self._finish(r, {"type": "length", "length": max_new})
        elif not sp.get("ignore_eos", False) and (tok in self.eos or tok in (sp.get("stop_token_ids") or ())):
            self._finish(r, {"type": "stop", "matched": tok})

    def _finish(self, r: Req, reason: dict):
        self.running.remove(r)
        meta = {"id": r.rid, "finish_reason": reason, "prompt_tokens": len(r.ids), "weight_version": self.version}
        if r.want_lp:
            meta["input_token_logprobs"] = r.in_lp
            meta["output_token_logprobs"] = [[lp, t, self._decode([t]) if r.text_lp else None]
                                             for lp, t in zip(r.lps, r.out)]
        meta.update(completion_tokens=len(r.out), cached_tokens=0, e2e_latency=time.time() - r.t0)
        trim = reason["type"] == "stop" and not r.sp.get("no_stop_trim", False)
        text = self._decode(r.out[:-1] if trim else r.out, r.sp.get("skip_special_tokens", True))
        r.done.set_result({"text": text, "output_ids": list(r.out), "meta_info": meta})

    def _decode(self, ids, skip=False):
        return self.tok.decode(ids, skip_special_tokens=skip) if self.tok is not None else ""

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Scheduler.abort_request: rids match by prefix; a request without a token yet is in the waiting queue."""
        for r in [r for r in self.running if abort_all or (rid and r.rid.startswith(rid))]:
            if r.out:
                self._finish(r, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
                continue
            self.running.remove(r)
            meta = {"id": r.rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}
            if r.want_lp:
                meta.update(input_token_logprobs=[], output_token_logprobs=[])
            r.done.set_result({"text": "", "output_ids": [], "meta_info": {**meta, "completion_tokens": 0}})

    @torch.no_grad()
    def new_req(self, body: dict, i: int | None) -> Req:
        pick = (lambda v: v[i] if i is not None and isinstance(v, list) else v)
        ids, sp = pick(body["input_ids"]), dict(pick(body.get("sampling_params")) or {})
        if not ids or any(not isinstance(t, int) or not 0 <= t < self.vocab for t in ids):
            raise ValueError(f"input_ids must be a non-empty list of token ids in [0, {self.vocab})")
        if unknown := set(sp) - SAMPLING_KEYS:
            raise ValueError(f"unexpected sampling_params keys: {sorted(unknown)}")
        if len(ids) >= self.context_len:
            raise ValueError(f"The input ({len(ids)} tokens) is longer than the model's context length "
                             f"({self.context_len} tokens).")
        if sp.get("max_new_tokens") is not None and sp["max_new_tokens"] + len(ids) >= self.context_len:
            raise ValueError(f"Requested token count exceeds the model's maximum context length of "
                             f"{self.context_len} tokens.")
        want_lp, in_lp = bool(pick(body.get("return_logprob")) or False), None
        if want_lp:  # logprob_start_len -1 (default): only the last prompt token, [None, id, None]
            start = pick(body.get("logprob_start_len"))
            start = len(ids) - 1 if start is None or start == -1 else int(start)
            if not 0 <= start < len(ids):
                raise ValueError(f"logprob_start_len={start} is higher than the number of input tokens {len(ids)}")
            logp = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), -1)
            in_lp = [[None if p == start else float(logp[p - 1, ids[p]]), ids[p], None] for p in range(start, len(ids))]
        rid = pick(body.get("rid")) or uuid.uuid4().hex
        rid = f"{rid}_{i}" if i is not None and isinstance(body.get("rid"), str) else rid
        return Req(str(rid), list(ids), sp, want_lp, in_lp, bool(body.get("return_text_in_logprobs")))

    async def wait_admitted(self, timeout: float | None = None) -> bool:
        """TokenizerManager.generate_request: wait while paused, then behind a pending weight update."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.paused or self.writers:
            if end is not None and time.monotonic() > end:
                return False
            await asyncio.sleep(0.005)
        return True

    @asynccontextmanager
    async def exclusive(self):
        """model_update_lock.writer_lock: wait for in-flight requests (not when paused), hold off new ones."""
        self.writers += 1
        try:
            while self.running and not self.paused:
                await asyncio.sleep(0.005)
            yield
        finally:
            self.writers -= 1

    def load(self, state: dict, body: dict, ok: str) -> tuple[bool, str]:
        """Load HF-named tensors (a tied lm_head may be absent); unknown names or shapes fail, nothing loaded."""
        own = self.model.state_dict()
        if unknown := sorted(set(state) - set(own)):
            return False, f"Failed to update weights: unknown parameter names {unknown[:5]}."
        if bad := [k for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape)]:
            return False, f"Failed to update weights: shape mismatch for {bad[:5]}."
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)
        if body.get("weight_version") is not None:
            self.version = str(body["weight_version"])
            ok += f" Weight version updated to {self.version}."
        return True, ok


def _bad(message: str):  # a body that does not validate: FastAPI's error, which SGLang turns into a 400
    return JSONResponse({"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
                        status_code=400)


def _result(success: bool, message: str, **extra):
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


def build_app(args) -> FastAPI:
    S: StandIn | None = None

    @asynccontextmanager
    async def lifespan(_app):
        nonlocal S
        S = StandIn(args)
        task = asyncio.create_task(S.loop())
        print("The server is fired up and ready to roll!", file=sys.stderr, flush=True)
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)

    def route(path, methods=("POST",), required=None):
        """Register ``fn(body)``; records the call; ``required`` (key names) asks for a JSON object body."""
        def wrap(fn):
            async def handler(request: Request):
                raw = await request.body()
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                S.calls.append({"method": request.method, "path": request.url.path, "body": body})
                if required is not None and not isinstance(body, dict):
                    return _bad("a JSON object body is required")
                if missing := [k for k in required or () if k not in body]:
                    return _bad(f"missing field(s) {missing}")
                return await fn(body if isinstance(body, dict) else {})
            app.add_api_route(path, handler, methods=list(methods))
            return fn
        return wrap

    @route("/health", methods=("GET",))
    @route("/health_generate", methods=("GET",))
    async def health(_body):  # its 1-token request cannot run while paused: 503 after the timeout
        return Response(status_code=200 if await S.wait_admitted(HEALTH_TIMEOUT_S) else 503)

    @route("/generate", methods=("POST", "PUT"))
    async def generate(body):
        if body.get("input_ids") is None or body.get("stream"):
            msg = "the stand-in takes input_ids only, without stream" if body.get("text") or body.get("stream") \
                else "Either text or input_ids should be provided."
            return JSONResponse({"error": {"message": msg}}, 400)
        ids = body["input_ids"]
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        await S.wait_admitted()
        try:
            reqs = [S.new_req(body, i) for i in range(len(ids))] if batch else [S.new_req(body, None)]
        except (ValueError, TypeError) as e:
            return JSONResponse({"error": {"message": str(e)}}, 400)
        S.running.extend(reqs)
        S.tick.set()
        outs = [await r.done for r in reqs]
        return JSONResponse(outs if batch else outs[0])

    @route("/pause_generation", required=())  # 0.5.6+: a PauseGenerationReqInput body is required
    async def pause(body):
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _bad(f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        S.paused, S.mode = True, mode
        if mode == "abort":  # retract / in_place: requests stay and resume on continue
            S.abort(abort_all=True)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @route("/continue_generation", required=())
    async def cont(_body):
        S.paused = False
        S.tick.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @route("/abort_request", required=())
    async def abort(body):
        S.abort(str(body.get("rid") or ""), bool(body.get("abort_all", False)))
        return Response(status_code=200)

    @route("/flush_cache", methods=("GET", "POST"))
    async def flush(_body):
        busy = bool(S.running) and not (S.paused and S.mode == "retract")
        return Response("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                        "waiting requests, the operation will not be performed.)\n", status_code=400 if busy else 200)

    @route("/update_weights_from_disk", required=("model_path",))
    async def update_from_disk(body):
        from safetensors.torch import load_file
        if body.get("abort_all_requests"):
            S.abort(abort_all=True)
        async with S.exclusive():
            files = sorted(Path(body["model_path"]).glob("*.safetensors"))
            try:
                if not files:
                    raise FileNotFoundError(f"no *.safetensors in {body['model_path']}")
                ok, msg = S.load({k: v for f in files for k, v in load_file(str(f)).items()}, body,
                                 "Succeeded to update model weights.")
            except Exception as e:  # noqa: BLE001
                ok, msg = False, f"Failed to get weights iterator: {e}."
            if ok:
                S.model_path = body["model_path"]
        return _result(ok, msg, num_paused_requests=0)

    @route("/update_weight_version", required=("new_version",))
    async def update_version(body):
        if body.get("abort_all_requests", True):
            S.abort(abort_all=True)
        S.version = str(body["new_version"])
        return _result(True, f"Weight version updated to {S.version}", new_version=S.version)

    @route("/get_weight_version", methods=("GET",))
    @route("/weight_version", methods=("GET",))
    async def weight_version(_body):
        return {"weight_version": S.version}

    @route("/get_model_info", methods=("GET",))
    @route("/model_info", methods=("GET",))
    async def model_info(_body):
        return {"model_path": S.model_path, "tokenizer_path": args.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": S.version}

    @route("/init_weights_update_group", required=("master_address", "master_port", "rank_offset", "world_size"))
    async def init_group(body):
        name = body.get("group_name", "weight_update_group")
        try:  # blocks until the trainer (rank 0) joins: off the event loop
            S.groups[name] = await asyncio.to_thread(
                init_custom_process_group, body.get("backend", "nccl"),
                f"tcp://{body['master_address']}:{body['master_port']}", int(body["world_size"]),
                int(body["rank_offset"]), name)
        except Exception as e:  # noqa: BLE001
            return _result(False, f"Failed to initialize custom process group: {e}.")
        return _result(True, "Succeeded to initialize custom process group.")

    @route("/destroy_weights_update_group", required=())
    async def destroy_group(body):
        pg = S.groups.pop(body.get("group_name", "weight_update_group"), None)
        if pg is None:
            return _result(False, "The group to be destroyed does not exist.")
        torch.distributed.destroy_process_group(pg)
        return _result(True, "Succeeded to destroy custom process group.")

    @route("/update_weights_from_distributed", required=("names", "dtypes", "shapes"))
    async def update_from_distributed(body):
        pg = S.groups.get(body.get("group_name", "weight_update_group"))
        if pg is None:
            return _result(False, "Please call `init_weights_update_group` first.")
        if body.get("abort_all_requests"):
            S.abort(abort_all=True)
        async with S.exclusive():
            tensors = [torch.empty(s, dtype=getattr(torch, d)) for d, s in zip(body["dtypes"], body["shapes"])]

            def receive():
                for work in [pg.broadcast([t], torch.distributed.BroadcastOptions()) for t in tensors]:
                    work.wait()
            try:
                await asyncio.to_thread(receive)
                ok, msg = S.load(dict(zip(body["names"], tensors)), body, "Succeeded to update parameter online.")
            except Exception as e:  # noqa: BLE001
                ok, msg = False, str(e)
        return _result(ok, msg if ok else f"Failed to update parameter online: {msg}")

    @app.get("/standin/calls")
    async def calls():
        return S.calls

    return app


def main(argv=None):
    p = argparse.ArgumentParser(description="SGLang stand-in server for tests")
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--token-delay-s", type=float, default=0.002)
    args, _ignored = p.parse_known_args(argv)  # --tp-size, --dtype, --mem-fraction-static, ... are accepted
    if not (Path(args.model_path) / "config.json").is_file():
        print(f"error: model path {args.model_path!r} does not exist or has no config.json", file=sys.stderr)
        sys.exit(1)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"error: cannot bind {args.host}:{args.port}: {e}", file=sys.stderr)
        sys.exit(1)
    torch.set_num_threads(1)  # a tiny model; leaves the other cores to the test's trainer
    uvicorn.Server(uvicorn.Config(build_app(args), log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    main()
