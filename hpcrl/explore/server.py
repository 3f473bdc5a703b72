"""The run explorer's web server: one page and a small read-only JSON API over :class:`RunView`.

Routes (GET only):

- ``/``: the page; ``/static/<file>``: its script, style and the chart library (Plotly's bundled
  ``plotly.min.js``, served from the installed ``plotly`` package: nothing comes from a CDN).
- ``/api/summary``, ``/api/curves?since=N``, ``/api/events``, ``/api/groups?kind=&step_min=&...``,
  ``/api/group?path=<spool path>``.

Security: it binds 127.0.0.1 unless told otherwise and needs an access token (given, or generated and
printed; on loopback it may be turned off): the URL it prints carries ``?token=``, the page then holds it in
an HttpOnly cookie, and API clients may send ``Authorization: Bearer <token>``. Without a token, requests
whose ``Host`` header names another host are refused (a DNS-rebinding page cannot read the run). A path
outside the run's spool is refused with 403, a bad parameter with 400; a failing request never stops the
server.
Lifecycle: :func:`make_server` builds it, ``serve_forever()`` runs it (a thread per request),
``shutdown()`` ends it; the run directory is never written.
"""

from __future__ import annotations

import hmac
import http.server
import json
import logging
import math
import mimetypes
import secrets
import socket
import threading
from dataclasses import fields
from http import HTTPStatus
from importlib import resources
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from hpcrl.explore.reader import GroupQuery, RunView

__all__ = ["Explorer", "make_server", "plotly_js", "static_file"]

log = logging.getLogger(__name__)
STATIC = ("explore.js", "explore.css")
COOKIE = "hpcrl_explore"
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class BadRequest(ValueError):
    pass


def plotly_js() -> bytes:
    """The chart library, from the installed ``plotly`` package (``pip install -e '.[explore]'``)."""
    try:
        return resources.files("plotly").joinpath("package_data", "plotly.min.js").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise RuntimeError("the run explorer draws with Plotly's bundled plotly.min.js: "
                           "pip install -e '.[explore]' (or pip install plotly)") from e


def static_file(name: str) -> bytes:
    if name == "plotly.min.js":
        return plotly_js()
    if name in STATIC or name == "index.html":
        return resources.files("hpcrl.explore").joinpath("page", name).read_bytes()
    raise FileNotFoundError(name)


def _int(params: dict[str, str], name: str, default: int | None = None) -> int | None:
    v = params.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise BadRequest(f"{name}: expected an integer, got {v!r}") from None


def _float(params: dict[str, str], name: str) -> float | None:
    v = params.get(name)
    if v is None or v == "":
        return None
    try:
        x = float(v)
    except ValueError:
        raise BadRequest(f"{name}: expected a number, got {v!r}") from None
    if not math.isfinite(x):
        raise BadRequest(f"{name}: must be finite, got {v!r}")
    return x


def group_query(params: dict[str, str]) -> GroupQuery:
    known = {f.name for f in fields(GroupQuery)}
    unknown = set(params) - known - {"token"}
    if unknown:
        raise BadRequest(f"unknown parameter(s): {', '.join(sorted(unknown))}")
    try:
        return GroupQuery(kind=params.get("kind", "trained"), step_min=_int(params, "step_min"),
                          step_max=_int(params, "step_max"), ticket=_int(params, "ticket"),
                          replica=params.get("replica") or None, reason=params.get("reason") or None,
                          reward_min=_float(params, "reward_min"), reward_max=_float(params, "reward_max"),
                          offset=_int(params, "offset", 0), limit=_int(params, "limit", 50))
    except BadRequest:
        raise
    except ValueError as e:
        raise BadRequest(str(e)) from None


class Explorer:
    """The API of one run, independent of HTTP (the static export calls it too)."""

    def __init__(self, view: RunView) -> None:
        self.view = view
        self.routes: dict[str, Callable[[dict[str, str]], Any]] = {
            "/api/summary": lambda p: self.view.summary(),
            "/api/curves": lambda p: self.view.curves(max(0, _int(p, "since", 0) or 0)),
            "/api/events": lambda p: {"events": self.view.events(), "components": self.view.components()},
            "/api/groups": lambda p: self.view.groups(group_query(p)),
            "/api/group": self._group,
        }

    def _group(self, params: dict[str, str]) -> dict:
        if "path" not in params:
            raise BadRequest("path: required (a path from /api/groups)")
        return self.view.group(params["path"])

    def handle(self, path: str, params: dict[str, str]) -> tuple[int, Any]:
        route = self.routes.get(path)
        if route is None:
            return HTTPStatus.NOT_FOUND, {"error": f"no such route: {path}"}
        try:
            return HTTPStatus.OK, route(params)
        except BadRequest as e:
            return HTTPStatus.BAD_REQUEST, {"error": str(e)}
        except PermissionError as e:
            return HTTPStatus.FORBIDDEN, {"error": str(e)}
        except FileNotFoundError as e:
            return HTTPStatus.NOT_FOUND, {"error": str(e)}


class _Handler(http.server.BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"
    timeout = 30  # an idle keep-alive connection gives its thread back

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: one debug line per request
        log.debug("%s " + fmt, self.address_string(), *args)

    def do_GET(self) -> None:  # noqa: N802 - the http.server hook
        try:
            self._get()
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # noqa: BLE001 - one failing request must not stop the explorer
            log.exception("explorer request %s failed", self.path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(e).__name__}: {e}"})

    def _get(self) -> None:
        url = urlsplit(self.path)
        try:
            raw = parse_qs(url.query, keep_blank_values=True, strict_parsing=False, max_num_fields=32)
        except ValueError as e:
            return self._send(HTTPStatus.BAD_REQUEST, {"error": f"query: {e}"})
        if any(len(v) > 1 for v in raw.values()):
            return self._send(HTTPStatus.BAD_REQUEST, {"error": "each parameter at most once"})
        params = {k: v[0] for k, v in raw.items()}
        if not self._host_ok():
            return self._send(HTTPStatus.FORBIDDEN, {"error": "Host header does not name this server"})
        new_cookie = None
        if self.server.token:
            given = params.get("token") or self._bearer() or self._cookie()
            if not given or not hmac.compare_digest(given.encode(), self.server.token.encode()):
                return self._send(HTTPStatus.UNAUTHORIZED, {"error": "access token required: open the URL the "
                                                            "explorer printed (it carries ?token=)"})
            if params.get("token"):
                new_cookie = f"{self._cookie_name()}={self.server.token}; HttpOnly; SameSite=Strict; Path=/"
        params.pop("token", None)
        if url.path in ("/", "/index.html"):
            return self._send_bytes(HTTPStatus.OK, static_file("index.html"), "text/html; charset=utf-8", new_cookie)
        if url.path.startswith("/static/"):
            name = url.path[len("/static/"):]
            try:
                body = static_file(name)
            except FileNotFoundError:
                return self._send(HTTPStatus.NOT_FOUND, {"error": f"no such file: {name}"})
            ctype = mimetypes.guess_type(name)[0] or "application/octet-stream"
            return self._send_bytes(HTTPStatus.OK, body, ctype, cache=True)
        status, body = self.server.explorer.handle(url.path, params)
        self._send(status, body)

    def _host_ok(self) -> bool:
        if self.server.token:  # off loopback the token is the guard (clients name the host as they like)
            return True
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]").lower()
        return host in self.server.hosts

    def _bearer(self) -> str:
        auth = self.headers.get("Authorization") or ""
        return auth[7:].strip() if auth.lower().startswith("bearer ") else ""

    def _cookie_name(self) -> str:
        return f"{COOKIE}_{self.server.server_address[1]}"  # two explorers on one host keep their own tokens

    def _cookie(self) -> str:
        for part in (self.headers.get("Cookie") or "").split(";"):
            k, _, v = part.strip().partition("=")
            if k == self._cookie_name():
                return v
        return ""

    def _send(self, status: int, obj: Any) -> None:
        body = json.dumps(obj, allow_nan=False, default=_finite).encode()
        self._send_bytes(status, body, "application/json")

    def _send_bytes(self, status: int, body: bytes, ctype: str, cookie: str | None = None,
                    cache: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy",
                         "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'")
        if cookie:
            self.send_header("Set-Cookie", cookie)
        self.end_headers()
        self.wfile.write(body)


def _finite(v: Any) -> Any:
    raise TypeError(f"not JSON: {type(v).__name__}")


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    explorer: Explorer
    token: str
    hosts: set[str]

    def handle_error(self, request: Any, client_address: Any) -> None:  # a broken client is logged, not raised
        log.debug("explorer: connection from %s failed", client_address, exc_info=True)


def make_server(view: RunView, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> _Server:
    """A server for ``view`` on ``host:port`` (0: any free port), guarded by ``token`` (None: a generated one,
    ``server.token``; "": none, on loopback only: other users of a shared login node can reach loopback)."""
    if token == "" and host not in LOOPBACK:
        raise ValueError(f"--host {host}: off loopback the explorer needs an access token")
    if token is None:
        token = secrets.token_urlsafe(24)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    cls = type("ExplorerServer", (_Server,), {"address_family": family})
    srv = cls((host, port), _Handler)
    srv.explorer, srv.token = Explorer(view), token or ""
    srv.hosts = {h.lower() for h in (*LOOPBACK, host, socket.gethostname(), socket.getfqdn())}
    return srv


def serve_in_thread(srv: _Server) -> threading.Thread:
    t = threading.Thread(target=srv.serve_forever, name="explorer", daemon=True)
    t.start()
    return t


def url_of(srv: _Server) -> str:
    host, port = srv.server_address[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/" + (f"?token={srv.token}" if srv.token else "")

