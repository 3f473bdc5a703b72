"""The agent proxy's front door: who may ask, how much, and one request's failure kept to itself.

:class:`Guard` is plain ASGI middleware around the proxy's FastAPI app. For
every HTTP request, in this order:

1. **Authenticate before reading anything**: ``/admin/*`` answers 404 when
   the proxy has no admin API and 401 without the admin key; ``/v1/*``
   answers 401 unless the Bearer key is an open episode's (one
   ``Authorization`` header, no more); any other path is 404. None of these
   reads or parses the body, so an unknown client learns nothing about the
   routes and costs nothing; such an answer to a request with a body closes
   the connection (the body is never read). The routes take the episode the
   guard found (``request.state.session``), never the header again.
2. **Quota per episode** (``/v1/*``): at most ``agent.session_max_in_flight``
   completions of one episode (all its keys together; a request of ``n``
   counts ``n``, the extra ones taken by the route) in flight, and
   ``agent.session_rate_limit`` requests per second (a bucket holding one
   second's worth); beyond either, 429 with ``Retry-After``, before the body
   is read.
3. **Bound the body**: a ``Content-Length`` above ``agent.max_request_bytes``
   gets 413 at once; a body without one is read up to the limit and then
   refused the same way.
4. **Contain failures**: the app's exception handlers answer every error in
   OpenAI's shape; an exception that escapes after a complete answer is
   logged here and not passed on, so the server keeps the connection (it
   would otherwise drop it under a client that sends its next request on it).
   A stream cut short by an error ends its connection.

Every refusal is counted by its code in the proxy's ``counts``
(``rejected_<code>``), which the rollout job writes to its stats.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from hpcrl.agent.schema import ProxyError, error_response

if TYPE_CHECKING:
    from hpcrl.agent.proxy import AgentProxy, Session

__all__ = ["Guard"]

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


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
            session = self._authenticate(_route_path(scope), _bearer(scope["headers"]))
            if session is not None:
                session.quota.admit()
        except ProxyError as e:
            await self._refuse(e, scope, receive, send, close=has_body)
            return
        try:
            body = await self._read(headers, receive)
            if session is not None:
                scope.setdefault("state", {})["session"] = session
            await self._contained(scope, _replay(body, receive), send)
        except ProxyError as e:
            await self._refuse(e, scope, receive, send, close=True)
        except _Disconnected:
            pass
        finally:
            if session is not None:
                session.quota.release()

    def _authenticate(self, path: str, key: str) -> Session | None:
        """The episode of a ``/v1/*`` request, None for the admin API; raises the 401/404 that refuses it."""
        if path == "/admin" or path.startswith("/admin/"):
            self.proxy.check_admin(key)
            return None
        if path == "/v1" or path.startswith("/v1/"):
            return self.proxy.session_of(key)
        raise ProxyError(404, f"not found: {path[:200]}", "not_found")

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


def _bearer(headers: list[tuple[bytes, bytes]]) -> str:
    """The Bearer key of the request; "" without one; 401 for several ``Authorization`` headers (the guard and
    the routes must never read different ones)."""
    given = [v.decode("latin-1") for k, v in headers if k.lower() == b"authorization"]
    if len(given) > 1:
        raise ProxyError(401, "send one Authorization header", "invalid_api_key")
    auth = given[0] if given else ""
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ""


def _route_path(scope: Scope) -> str:
    """The path the app routes on: ``path`` without the ``root_path`` it is served under (as Starlette does)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


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
