"""A server inference engine (vLLM, SGLang) behind the rollout's submit/poll seam.

The server batches on its own side; this class keeps it busy with HTTP
requests sent from an asyncio event loop on a background thread, and hands
finished sequences to the rollout loop through a queue that
:meth:`RemoteEngine.poll` drains. The wire format of each server lives in a
:class:`ServerBackend` (``vllm_engine``, ``sglang_engine``).

Requests are sent at the next :meth:`~RemoteEngine.poll` after their
:meth:`~RemoteEngine.submit`; sequences submitted between two polls with the
same prompt and length limit (the samples of one prompt group) share their
first request, which asks for ``n`` of them (``coalesce``, on by default):
one HTTP round trip instead of ``n``, whatever the load on the machine. Each sequence interrupted by a weight update goes on with requests of
its own.

Version-exact tokens (abort and resubmit, as AReaL does). Every sequence is
generated in *segments*: one request carrying the prompt plus the tokens
generated so far, asking for the tokens still allowed. A segment runs
entirely under one weight version, and its tokens are tagged with it:

1. ``update_weights`` closes the gate, so no new segment starts;
2. it aborts every request on the server, and again every
   ``abort_retry_s`` until no segment is outstanding (one sent just before
   the gate closed may reach the server after the first abort): each
   aborted segment returns the tokens it has, tagged with the old version;
3. with nothing in flight it pauses the server, loads the version's
   directory (or, for tensors held in this process with an
   ``update_group``, broadcasts them into the server:
   :mod:`hpcrl.rollout.update_group`), resets the prefix cache (cached
   keys/values of the old weights must not be reused), sets the server's
   weight version, resumes;
4. it opens the gate: every interrupted sequence continues with a new
   segment (its prefix is prefilled under the new weights, the same exact
   continuation as the embedded engine's cache rebuild), and its later
   tokens carry the new version.

A sequence's behaviour logprobs are the server's logprobs of the sampled
tokens under the sampling temperature (vLLM: ``processed_logprobs``).

Failure: a request that fails, an answer that does not parse, a request the
server aborts on its own, or no answer within ``request_timeout_s`` raises
:class:`EngineServerError` from the next ``poll`` (the rollout job then fails
and the watchdog resubmits it; its unfinished tickets are reclaimed). A
version directory pruned while the update drained raises
``FileNotFoundError`` with nothing changed (the rollout looks again); a
reload that fails leaves the server's weights unknown, so every later call
raises. A server this engine started is checked at every poll and stopped
by :meth:`close`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Literal, Mapping, Protocol, TypeVar, runtime_checkable

import aiohttp

from hpcrl.rollout.engine import Completion, Request, SamplingParams
from hpcrl.rollout.server import EngineServerError, ServerProcess
from hpcrl.rollout.update_group import UpdateGroup
from hpcrl.weights.version import WeightVersion, storable_tensors

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
T = TypeVar("T")

# An idle pooled connection is dropped after this long. It must be shorter than the server's own keep-alive
# (uvicorn's default, used by vLLM and SGLang, is 5 s): a connection reused just as the server closes it fails the
# request with "Server disconnected" (aiohttp's default of 15 s did, for a rollout idle between batches).
CLIENT_KEEPALIVE_S = 2.0


@dataclass
class Segment:
    """What one generate request returned."""

    output_ids: list[int]
    logprobs: list[float]
    finish: Literal["stop", "length", "abort"]
    message: str = ""  # the server's reason, for an abort


class ServerBackend(Protocol):
    """One server's wire format (a session and the base URL are passed in)."""

    health_path: str  # GET it: 200 once the server can generate

    @staticmethod
    def server_command(model_path: str, *, host: str, port: int, dtype: str, tensor_parallel_size: int,
                       extra: list[str], gpu: bool, staging: Path, launcher: list[str] = (),
                       lora_rank: int = 0) -> tuple[list[str], dict[str, str]]:
        """argv and environment of a server for ``model_path`` (``launcher``: the command before its arguments;
        ``lora_rank`` > 0: published versions are LoRA adapters of that rank)."""
        ...

    async def prepare(self, http: aiohttp.ClientSession, url: str) -> None:
        """Once, before the first request (e.g. learn the served model's name)."""
        ...

    async def generate(self, http: aiohttp.ClientSession, url: str, prompt_ids: list[int], max_new_tokens: int,
                       sampling: SamplingParams, n: int = 1) -> list[Segment]:
        """``n`` independent samples of one prompt, in one request."""
        ...

    async def abort_all(self, http: aiohttp.ClientSession, url: str) -> None: ...

    async def load(self, http: aiohttp.ClientSession, url: str, path: Path, version: int) -> None:
        """Pause (nothing is in flight), load ``path``, reset caches, set ``version``, resume."""
        ...



@runtime_checkable
class PushesWeights(Protocol):
    """A :class:`ServerBackend` that also receives tensors over its own weight-update group
    (``rollout.server_update=group``; its EngineSpec says ``update_group=True``)."""

    async def push(self, http: aiohttp.ClientSession, url: str, group: UpdateGroup,
                   state: Mapping[str, torch.Tensor], version: int) -> None:
        """Pause (nothing is in flight), broadcast ``state`` over ``group`` into the server, set ``version``,
        resume."""
        ...


@dataclass
class _Seq:
    request: Request
    limit: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    task: asyncio.Task | None = None


async def check_response(r: aiohttp.ClientResponse, what: str, text_ok: bool = False) -> dict:
    """The JSON body of a 2xx answer (``text_ok``: a plain-text one too, as ``{"text": ...}``); anything else
    raises EngineServerError with the body."""
    text = await r.text()
    if r.status // 100 != 2:
        raise EngineServerError(f"{what}: HTTP {r.status}: {text[:2000]}")
    if text_ok and not text.lstrip().startswith(("{", "[")):
        return {"text": text}
    try:
        return await r.json(content_type=None) if text else {}
    except ValueError as e:
        raise EngineServerError(f"{what}: answer is not JSON: {text[:500]}") from e


class RemoteEngine:
    """Drives one inference server; see the module docstring for the segment protocol."""

    def __init__(self, backend: ServerBackend, url: str, *, sampling: SamplingParams, staging_dir: Path,
                 server: ServerProcess | None = None, version: int = 0, request_timeout_s: float = 1800.0,
                 abort_retry_s: float = 0.2, coalesce: bool = True, update_group: UpdateGroup | None = None) -> None:
        if update_group is not None and not isinstance(backend, PushesWeights):
            raise TypeError(f"{type(backend).__name__} has no push(): it cannot take versions over an update group")
        self.backend, self.url, self.sampling, self.server = backend, url.rstrip("/"), sampling, server
        self.update_group = update_group  # in-memory versions go to the server over it instead of a staged copy
        self.coalesce = coalesce
        self._submitted: list[_Seq] = []  # since the last flush (under _count_lock)
        self._flush_due = False  # a flush is scheduled on the client loop (under _count_lock)
        self.staging_dir, self.request_timeout_s, self.abort_retry_s = Path(staging_dir), request_timeout_s, abort_retry_s
        self.on_wait: Callable[[], None] | None = None  # called every few seconds while an update blocks (heartbeat)
        self._version = version
        self._done: queue.Queue[tuple[Completion, Request] | BaseException] = queue.Queue()
        self._count_lock = threading.Lock()
        self._in_flight = 0
        self._seqs: dict[int, _Seq] = {}
        self._next_key = 0
        self._outstanding = 0  # generate requests sent and not answered (loop thread only)
        self._interrupts = 0  # aborts this client asked for: an abort the server made on its own is an error
        self._broken: EngineServerError | None = None  # a failed reload: the server's weights are unknown
        self.stats: dict[str, float] = {"requests": 0, "segments": 0, "resubmitted": 0, "weight_updates": 0,
                                        "tokens_generated": 0,
                                        "update_s": 0.0, "update_drain_s": 0.0, "update_load_s": 0.0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-client", daemon=True)
        self._thread.start()
        self._call(self._open_session())

    async def _open_session(self) -> None:
        # no total timeout: a long generation is legitimate; no byte for request_timeout_s is not
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=self.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
        self._http = aiohttp.ClientSession(timeout=timeout, connector=connector)
        self._gate = asyncio.Event()
        self._gate.set()

    def _call(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the client loop and wait for it (calling ``on_wait`` every 5 s); transport errors and
        malformed answers come out as EngineServerError."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        while True:
            try:
                return future.result(5.0)
            except concurrent.futures.TimeoutError:
                if self.on_wait is not None:
                    self.on_wait()
            except (EngineServerError, FileNotFoundError):
                raise
            except Exception as e:  # aiohttp errors, timeouts, a backend's KeyError on a malformed answer
                raise EngineServerError(f"server at {self.url}: {type(e).__name__}: {e}") from e

    def prepare(self) -> None:
        """Ask the backend to get ready (the server must be up); raises EngineServerError."""
        self._call(self.backend.prepare(self._http, self.url))

    # ----------------------------------------------------------------- protocol

    @property
    def version(self) -> int:
        return self._version

    def num_in_flight(self) -> int:
        with self._count_lock:
            return self._in_flight

    def submit(self, request: Request) -> None:
        """Queue ``request``; it is sent at the next :meth:`poll`, with everything submitted before that poll (the
        samples of a prompt group go together however the threads interleave)."""
        limit = request.max_new_tokens or self.sampling.max_new_tokens
        with self._count_lock:
            self._in_flight += 1
            self._submitted.append(_Seq(request, limit))

    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        if self._broken is not None:
            raise self._broken
        with self._count_lock:
            send = bool(self._submitted) and not self._flush_due
            self._flush_due = self._flush_due or send
        if send:  # one flush takes every submission made before it runs
            self._loop.call_soon_threadsafe(self._flush)
        if self.server is not None:
            self.server.check()
        out: list[Completion] = []
        try:
            item = self._done.get(timeout=timeout_s) if timeout_s > 0 else self._done.get_nowait()
            while True:
                if isinstance(item, BaseException):
                    raise item
                out.append(item[0])
                item = self._done.get_nowait()
        except queue.Empty:
            pass
        with self._count_lock:
            self._in_flight -= len(out)
        return out

    def update_weights(self, weights: WeightVersion) -> None:
        if self._broken is not None:
            raise self._broken
        t0 = time.perf_counter()
        if weights.state is not None and self.update_group is not None:
            state = storable_tensors(weights.state)
            self._call(self._update(lambda: self.backend.push(self._http, self.url, self.update_group, state,
                                                              weights.version), weights.version))
        else:
            path = weights.directory(self.staging_dir)
            self._call(self._update(lambda: self.backend.load(self._http, self.url, path, weights.version),
                                    weights.version, path))
        self.stats["weight_updates"] += 1
        self.stats["update_s"] += time.perf_counter() - t0

    def abort_all(self) -> list[Request]:
        aborted = self._call(self._abort_everything())
        with self._count_lock:
            self._in_flight -= len(aborted)
        return aborted

    def close(self) -> None:
        try:
            if self._loop.is_running():
                try:
                    asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30)
                except Exception as e:  # the server may be gone already; closing must still finish
                    log.warning("closing the engine client: %s", e)
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(10)
                if self._thread.is_alive():
                    log.warning("engine client thread did not stop within 10 s")
                else:
                    self._loop.close()
        finally:
            if self.update_group is not None:
                self.update_group.close()
            if self.server is not None:
                self.server.stop()
            shutil.rmtree(self.staging_dir, ignore_errors=True)

    # ----------------------------------------------------------------- client loop

    def _flush(self) -> None:
        """Start what was submitted since the last flush; alike sequences (one prompt, one limit) together."""
        with self._count_lock:
            submitted, self._submitted, self._flush_due = self._submitted, [], False
        alike: dict[tuple, list[_Seq]] = {}
        for seq in submitted:
            key = (tuple(seq.request.prompt_ids), seq.limit) if self.coalesce else (len(alike),)
            alike.setdefault(key, []).append(seq)
        for seqs in alike.values():
            keys = list(range(self._next_key, self._next_key + len(seqs)))
            self._next_key += len(seqs)
            task = self._loop.create_task(self._generate(keys, seqs))
            for key, seq in zip(keys, seqs):
                self._seqs[key], seq.task = seq, task

    async def _generate(self, keys: list[int], seqs: list[_Seq]) -> None:
        """Generate ``seqs`` (alike) to their ends: one first request for all, then each on its own."""
        try:
            segments, interrupts = await self._segments(seqs)
            await asyncio.gather(*(self._go_on(key, seq, segment, interrupts)
                                   for key, seq, segment in zip(keys, seqs, segments)))
        except asyncio.CancelledError:
            raise
        except EngineServerError as e:
            self._done.put(e)
        except Exception as e:  # a transport error or a malformed answer: the rollout must hear of it
            self._done.put(EngineServerError(f"generate request to {self.url} failed: {type(e).__name__}: {e}"))
        finally:
            for key in keys:
                self._seqs.pop(key, None)

    async def _go_on(self, key: int, seq: _Seq, segment: Segment, interrupts: int) -> None:
        """Resubmit ``seq`` after each interruption until it ends; then hand it to :meth:`poll`."""
        while segment.finish == "abort" and len(seq.output_ids) < seq.limit:
            if self._interrupts == interrupts:  # not ours: resubmitting would loop as fast as the server aborts
                raise EngineServerError(f"server aborted a request on its own: {segment.message or 'no reason'}")
            self.stats["resubmitted"] += 1
            (segment,), interrupts = await self._segments([seq])
        reason = "length" if segment.finish == "abort" else segment.finish
        r = seq.request
        self._done.put((Completion(r.id, list(r.prompt_ids), seq.output_ids, seq.logprobs, seq.versions, reason), r))
        self._seqs.pop(key, None)  # no await since the put: an abort lists it once, from the queue

    async def _segments(self, seqs: list[_Seq]) -> tuple[list[Segment], int]:
        """One request, under one weight version: the next segment of each of ``seqs`` (alike so far), recorded;
        also the count of interruptions when it was sent."""
        while not self._gate.is_set():  # re-checked: the gate may close again before this task runs
            await self._gate.wait()
        version, interrupts = self._version, self._interrupts  # no await from the check to here: the
        self._outstanding += 1  # request is counted before an update can see it, and runs under this version
        try:
            seq = seqs[0]
            segments = await self.backend.generate(self._http, self.url, seq.request.prompt_ids + seq.output_ids,
                                                   seq.limit - len(seq.output_ids), self.sampling, n=len(seqs))
        finally:
            self._outstanding -= 1
        if len(segments) != len(seqs):
            raise EngineServerError(f"asked for {len(seqs)} samples of one prompt, the server returned {len(segments)}")
        for seq, segment in zip(seqs, segments):
            self._record(seq, segment, version)
        self.stats["requests"] += 1
        return segments, interrupts

    def _record(self, seq: _Seq, segment: Segment, version: int) -> None:
        if len(segment.output_ids) != len(segment.logprobs):
            raise EngineServerError(f"server returned {len(segment.output_ids)} tokens but "
                                    f"{len(segment.logprobs)} logprobs")
        room = seq.limit - len(seq.output_ids)
        seq.output_ids += segment.output_ids[:room]
        seq.logprobs += segment.logprobs[:room]
        seq.versions += [version] * min(room, len(segment.output_ids))
        self.stats["segments"] += 1
        self.stats["tokens_generated"] += min(room, len(segment.output_ids))

    async def _drain(self) -> None:
        """With the gate closed: abort until no generate request is outstanding."""
        self._interrupts += 1
        while self._outstanding:
            await self.backend.abort_all(self._http, self.url)
            deadline = time.monotonic() + self.abort_retry_s
            while self._outstanding and time.monotonic() < deadline:
                await asyncio.sleep(0.005)

    async def _update(self, load: Callable[[], Awaitable[None]], version: int, path: Path | None = None) -> None:
        """Drain, then ``load`` the version into the server (from ``path``, or pushed), then open the gate."""
        self._gate.clear()
        t0 = time.perf_counter()
        try:
            await self._drain()
            if path is not None and not path.exists():  # pruned while draining: nothing changed; look again
                raise FileNotFoundError(path)
        except BaseException:
            self._gate.set()
            raise
        t1 = time.perf_counter()
        try:
            await load()
        except Exception as e:  # the server may hold a mix of versions now: nothing more may be generated
            where = f"from {path}" if path is not None else "over the weight-update group"
            self._broken = EngineServerError(f"loading version {version} {where} failed: {e}")
            raise self._broken from e
        self._version = version  # before the gate opens: every later segment runs under it
        self.stats["update_drain_s"] += t1 - t0
        self.stats["update_load_s"] += time.perf_counter() - t1
        self._gate.set()

    async def _abort_everything(self) -> list[Request]:
        self._gate.clear()
        self._interrupts += 1
        try:
            tasks = {s.task for s in self._seqs.values() if s.task is not None}
            with self._count_lock:
                submitted, self._submitted = self._submitted, []
            requests = [s.request for s in [*self._seqs.values(), *submitted]]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._seqs.clear()
            self._outstanding = 0
            errors = []
            while True:  # completions not yet polled are dropped too; errors stay for the next poll
                try:
                    item = self._done.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, BaseException):
                    errors.append(item)
                else:
                    requests.append(item[1])
            for e in errors:
                self._done.put(e)
            await self.backend.abort_all(self._http, self.url)
            return requests
        finally:
            self._gate.set()

    async def _shutdown(self) -> None:
        tasks = {s.task for s in self._seqs.values() if s.task is not None}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.close()
