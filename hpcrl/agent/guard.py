"""The agent proxy's front door: who may ask, how much, and one request's failure kept to itself.

:class:`Guard` is plain ASGI middleware around the proxy's FastAPI app. For
every HTTP request, in this order:

1. **Authenticate before reading anything**: ``/admin/*`` answers 404 when
   the proxy has no admin API and 401 without the admin key; ``/v1/*``
   answers 401 unless the Bearer key is an open episode's. Neither reads or
   parses the body first, so an unknown client learns nothing about the
   routes and costs nothing; such an answer to a request with a body closes
   the connection (the body is never read).
2. **Bound the body**: a ``Content-Length`` above ``agent.max_request_bytes``
   gets 413 at once; a body without one is read up to the limit and then
   refused the same way.
3. **Quota per episode** (``/v1/*``): at most ``agent.session_max_in_flight``
   requests of one episode (all its keys together) at once and
   ``agent.session_rate_limit`` per second (a token bucket holding one
   second's worth); beyond either, 429 with ``Retry-After``. The body has
   been read, so the connection stays open for the client's retry.
4. **Contain failures**: the app's exception handlers answer every error in
   OpenAI's shape; an exception that escapes after the answer was sent is
   logged here and not passed on, so the server keeps the connection (it
   would otherwise drop it under a client that sends its next request on it).

Every refusal is counted by its code in the proxy's ``counts``
(``rejected_<code>``), which the rollout job writes to its stats.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from hpcrl.agent.schema import ProxyError, error_response

if TYPE_CHECKING:
    from hpcrl.agent.proxy import AgentProxy

__all__ = ["Guard", "Quota"]

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


@dataclass
class Quota:
    """One episode's request budget: ``max_in_flight`` at once, ``rate`` per second (0: no cap)."""

    rate: float = 0.0
    max_in_flight: int = 0
    in_flight: int = 0
    tokens: float = field(default=0.0)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = max(self.rate, 1.0)

    def admit(self) -> None:
        """Take one request, or raise the 429 that refuses it."""
        if self.max_in_flight and self.in_flight >= self.max_in_flight:
            raise ProxyError(429, f"this episode already has {self.in_flight} requests in flight "
                             f"(agent.session_max_in_flight={self.max_in_flight})", "too_many_requests_in_flight",
                             kind="rate_limit_error", headers={"retry-after": "1"})
        if self.rate:
            now = time.monotonic()
            self.tokens = min(max(self.rate, 1.0), self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens < 1.0:
                wait = math.ceil((1.0 - self.tokens) / self.rate)
                raise ProxyError(429, f"this episode's requests exceed agent.session_rate_limit={self.rate:g}/s",
                                 "rate_limit_exceeded", kind="rate_limit_error", headers={"retry-after": str(wait)})
            self.tokens -= 1.0
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1


class Guard:
    """ASGI middleware: authentication, body size, quotas and containment before ``app`` (module docstring)."""

    def __init__(self, app: Callable, proxy: AgentProxy, max_body: int) -> None:
        self.app, self.proxy, self.max_body = app, proxy, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        try:
            quota = self._authenticate(scope["path"], _bearer(headers))
        except ProxyError as e:
            await self._refuse(e, scope, receive, send, close=has_body)
            return
        try:
            body = await self._read(headers, receive)
        except ProxyError as e:
            await self._refuse(e, scope, receive, send, close=True)
            return
        except _Disconnected:
            return
        try:
            if quota is not None:
                quota.admit()
        except ProxyError as e:
            await self._refuse(e, scope, receive, send)
            return
        try:
            await self._contained(scope, _replay(body, receive), send)
        finally:
            if quota is not None:
                quota.release()

    def _authenticate(self, path: str, key: str) -> Quota | None:
        """The episode's quota for ``/v1/*``, None for other routes; raises the 401/404 that refuses the key."""
        if path == "/admin" or path.startswith("/admin/"):
            self.proxy.check_admin(key)
            return None
        if path == "/v1" or path.startswith("/v1/"):
            return self.proxy.session_of(key).quota
        return None

    async def _read(self, headers: dict[bytes, bytes], receive: Receive) -> bytes:
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            raise _too_large(self.max_body)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise _too_large(self.max_body)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _contained(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:  # noqa: BLE001 - one request's failure stays its own (answered already, or here)
            if started:  # the app's handler answered it in OpenAI's shape, then re-raised: keep the connection
                log.debug("agent proxy: %s %s failed after its answer: %r", scope["method"], scope["path"], e)
                return
            log.exception("agent proxy: %s %s failed", scope["method"], scope["path"])
            self.proxy.count("internal_error")
            await error_response(500, f"internal error ({type(e).__name__})", "internal_error",
                                 kind="server_error")(scope, receive, send)

    async def _refuse(self, e: ProxyError, scope: Scope, receive: Receive, send: Send, close: bool = False) -> None:
        self.proxy.count(e.code)
        await e.response(close=close)(scope, receive, send)


class _Disconnected(Exception):
    """The client went away while sending its body."""


def _too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"the request body exceeds agent.max_request_bytes={limit}", "request_too_large")


def _bearer(headers: dict[bytes, bytes]) -> str:
    auth = headers.get(b"authorization", b"").decode("latin-1")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ""


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body read here, then the client's own events (its disconnect)."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
