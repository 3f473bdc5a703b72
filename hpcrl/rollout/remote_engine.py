"""A server inference engine (vLLM, SGLang) behind the rollout's submit/poll seam.

The server batches on its own side; this class keeps it busy with one HTTP
request per submitted sequence, sent from an asyncio event loop on a
background thread, and hands finished sequences to the rollout loop through
a queue that :meth:`RemoteEngine.poll` drains. The wire format of each
server lives in a :class:`ServerBackend` (``vllm_engine``, ``sglang_engine``).

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
   directory, resets the prefix cache (cached keys/values of the old
   weights must not be reused), sets the server's weight version, resumes;
4. it opens the gate: every interrupted sequence continues with a new
   segment (its prefix is prefilled under the new weights, the same exact
   continuation as the embedded engine's cache rebuild), and its later
   tokens carry the new version.

A sequence's behaviour logprobs are the server's logprobs of the sampled
tokens under the sampling temperature (vLLM: ``processed_logprobs``).

Failure: a request that fails, an answer that does not parse, or no answer
within ``request_timeout_s`` raises :class:`EngineServerError` from the next
``poll`` (the rollout job then fails and the watchdog resubmits it; its
unfinished tickets are reclaimed). A server this engine started is checked
at every poll and stopped by :meth:`close`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import aiohttp

from hpcrl.rollout.engine import Completion, Request, SamplingParams
from hpcrl.rollout.server import EngineServerError, ServerProcess
from hpcrl.weights.version import WeightVersion

log = logging.getLogger(__name__)


@dataclass
class Segment:
    """What one generate request returned."""

    output_ids: list[int]
    logprobs: list[float]
    finish: Literal["stop", "length", "abort"]


class ServerBackend(Protocol):
    """One server's wire format (a session and the base URL are passed in)."""

    health_path: str  # GET it: 200 once the server can generate

    async def prepare(self, http: aiohttp.ClientSession, url: str) -> None:
        """Once, before the first request (e.g. learn the served model's name)."""
        ...

    async def generate(self, http: aiohttp.ClientSession, url: str, prompt_ids: list[int], max_new_tokens: int,
                       sampling: SamplingParams) -> Segment: ...

    async def abort_all(self, http: aiohttp.ClientSession, url: str) -> None: ...

    async def load(self, http: aiohttp.ClientSession, url: str, path: Path, version: int) -> None:
        """Pause (nothing is in flight), load ``path``, reset caches, set ``version``, resume."""
        ...


@dataclass
class _Seq:
    request: Request
    limit: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    task: asyncio.Task | None = None


async def check_response(r: aiohttp.ClientResponse, what: str) -> dict:
    """The JSON body of a 2xx answer; anything else raises EngineServerError with the body."""
    text = await r.text()
    if r.status // 100 != 2:
        raise EngineServerError(f"{what}: HTTP {r.status}: {text[:2000]}")
    try:
        return await r.json(content_type=None) if text else {}
    except ValueError as e:
        raise EngineServerError(f"{what}: answer is not JSON: {text[:500]}") from e


class RemoteEngine:
    def __init__(self, backend: ServerBackend, url: str, *, sampling: SamplingParams, staging_dir: Path,
                 server: ServerProcess | None = None, version: int = 0, request_timeout_s: float = 600.0,
                 abort_retry_s: float = 0.2) -> None:
        self.backend, self.url, self.sampling, self.server = backend, url.rstrip("/"), sampling, server
        self.staging_dir, self.request_timeout_s, self.abort_retry_s = Path(staging_dir), request_timeout_s, abort_retry_s
        self._version = version
        self._done: queue.Queue[Completion | BaseException] = queue.Queue()
        self._count_lock = threading.Lock()
        self._in_flight = 0
        self._seqs: dict[int, _Seq] = {}
        self._next_key = 0
        self._outstanding = 0  # generate requests sent and not answered (loop thread only)
        self.stats: dict[str, float] = {"segments": 0, "resubmitted": 0, "weight_updates": 0, "tokens_generated": 0,
                                        "update_s": 0.0, "update_drain_s": 0.0, "update_load_s": 0.0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-client", daemon=True)
        self._thread.start()
        self._call(self._open_session())

    async def _open_session(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        self._http = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        self._gate = asyncio.Event()
        self._gate.set()

    def _call(self, coro, timeout: float | None = None):
        """Run ``coro`` on the client loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def prepare(self) -> None:
        """Ask the backend to get ready (the server must be up); raises EngineServerError."""
        try:
            self._call(self.backend.prepare(self._http, self.url), timeout=self.request_timeout_s)
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError) as e:
            raise EngineServerError(f"server at {self.url} did not answer as expected: {type(e).__name__}: {e}") from e

    # ----------------------------------------------------------------- protocol

    @property
    def version(self) -> int:
        return self._version

    def num_in_flight(self) -> int:
        with self._count_lock:
            return self._in_flight

    def submit(self, request: Request) -> None:
        limit = request.max_new_tokens or self.sampling.max_new_tokens
        with self._count_lock:
            self._in_flight += 1
        self._loop.call_soon_threadsafe(self._start, _Seq(request, limit))

    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        if self.server is not None:
            self.server.check()
        out: list[Completion] = []
        try:
            item = self._done.get(timeout=timeout_s) if timeout_s > 0 else self._done.get_nowait()
            while True:
                if isinstance(item, BaseException):
                    raise item
                out.append(item)
                item = self._done.get_nowait()
        except queue.Empty:
            pass
        with self._count_lock:
            self._in_flight -= len(out)
        return out

    def update_weights(self, weights: WeightVersion) -> None:
        path = weights.directory(self.staging_dir)
        t0 = time.perf_counter()
        self._call(self._update(path, weights.version))
        self.stats["weight_updates"] += 1
        self.stats["update_s"] += time.perf_counter() - t0

    def abort_all(self) -> list[Request]:
        aborted = self._call(self._abort_everything())
        with self._count_lock:
            self._in_flight -= len(aborted)
        return aborted

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self._call(self._shutdown(), timeout=30)
            except Exception as e:  # the server may be gone already; closing must still finish
                log.warning("closing the engine client: %s", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.staging_dir, ignore_errors=True)

    # ----------------------------------------------------------------- client loop

    def _start(self, seq: _Seq) -> None:
        key, self._next_key = self._next_key, self._next_key + 1
        self._seqs[key] = seq
        seq.task = self._loop.create_task(self._generate(key, seq))

    async def _generate(self, key: int, seq: _Seq) -> None:
        try:
            while True:
                await self._gate.wait()
                version = self._version
                self._outstanding += 1
                try:
                    segment = await self.backend.generate(self._http, self.url, seq.request.prompt_ids + seq.output_ids,
                                                          seq.limit - len(seq.output_ids), self.sampling)
                finally:
                    self._outstanding -= 1
                self._record(seq, segment, version)
                if segment.finish != "abort" or len(seq.output_ids) >= seq.limit:
                    break
                self.stats["resubmitted"] += 1
            reason = "length" if segment.finish == "abort" else segment.finish
            r = seq.request
            self._done.put(Completion(r.id, list(r.prompt_ids), seq.output_ids, seq.logprobs, seq.versions, reason))
        except asyncio.CancelledError:
            raise
        except EngineServerError as e:
            self._done.put(e)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as e:
            self._done.put(EngineServerError(f"generate request to {self.url} failed: {type(e).__name__}: {e}"))
        finally:
            self._seqs.pop(key, None)

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
        while self._outstanding:
            await self.backend.abort_all(self._http, self.url)
            deadline = time.monotonic() + self.abort_retry_s
            while self._outstanding and time.monotonic() < deadline:
                await asyncio.sleep(0.005)

    async def _update(self, path: Path, version: int) -> None:
        self._gate.clear()
        try:
            t0 = time.perf_counter()
            await self._drain()
            t1 = time.perf_counter()
            await self.backend.load(self._http, self.url, path, version)
            self._version = version  # before the gate opens: every later segment runs under it
            self.stats["update_drain_s"] += t1 - t0
            self.stats["update_load_s"] += time.perf_counter() - t1
        finally:
            self._gate.set()

    async def _abort_everything(self) -> list[Request]:
        self._gate.clear()
        try:
            tasks = [s.task for s in self._seqs.values() if s.task is not None]
            requests = [s.request for s in self._seqs.values()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.backend.abort_all(self._http, self.url)
            self._seqs.clear()
            self._outstanding = 0
            while True:  # completions not yet polled are dropped too
                try:
                    item = self._done.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, Completion):
                    requests.append(Request(item.id, item.prompt_ids))
            return requests
        finally:
            self._gate.set()

    async def _shutdown(self) -> None:
        for s in list(self._seqs.values()):
            if s.task is not None:
                s.task.cancel()
        await self._http.close()
