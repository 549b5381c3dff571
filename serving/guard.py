"""The guard in front of the routes: who may ask (the API key, the Host header), whether the server still takes
requests, and each request's body, read whole within a time and a size its route allows. Its refusals are
`ApiError`s, answered in OpenAI's error shape (shapes.py) with the status OpenAI's clients expect."""

import asyncio
import hashlib
import hmac
import ipaddress
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from serving import shapes
from serving.engine import Engine
from serving.metrics import Metrics


class ApiError(Exception):
    """An answer of OpenAI's error shape. A 500 closes its connection, saying so: whatever failed may have left the
    connection, or what the server keeps for it, in a state nobody should reuse."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        if status == 500:
            headers = {"Connection": "close"} | (headers or {})
        self.status, self.message, self.type, self.code, self.param, self.headers = status, message, type, code, param, headers

    def response(self, metrics: Metrics) -> JSONResponse:
        """The error in OpenAI's shape, counted by status."""
        metrics.error(self.status)
        return JSONResponse(shapes.error_body(self.message, self.type, self.code, self.param), status_code=self.status,
                            headers=self.headers)


def host_name(header: str) -> str | None:
    """The host a Host header names, without its port ("[::1]:8080" -> "::1"); None if it is malformed."""
    host = header.strip().lower()
    if host.startswith("["):  # an IPv6 literal, and perhaps a port
        name, bracket, port = host[1:].partition("]")
        return name if bracket and (not port or port[:1] == ":" and port[1:].isdigit()) else None
    name, colon, port = host.partition(":")
    return name if not colon or port.isdigit() else None


def ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class Access:
    """Who may ask: the API key (None: anyone), and the hosts a request's
    Host header may name (None: any). The hosts guard against DNS
    rebinding: a web page whose name has come to resolve to this machine
    sends its own name. An address (127.0.0.1, a pod's IP) cannot be
    rebound, and browsers always send a Host header: both pass."""

    api_key: str | None = None
    hosts: frozenset | None = None

    def refusal(self, path: str, headers: dict) -> ApiError | None:
        host = headers.get(b"host")
        if self.hosts is not None and host is not None:
            name = host_name(host.decode("latin-1"))
            if name is None or not (name in self.hosts or ip_literal(name)):
                return ApiError(400, "this server does not answer for that Host header (server.py --allowed-hosts)",
                                code="invalid_host")
        if self.api_key is None or path == "/health":  # load balancers probe without a key
            return None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not same(token.strip(), self.api_key.encode()):
            return ApiError(401, "a valid API key is needed (Authorization: Bearer KEY)", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        return None


def same(given: bytes, key: bytes) -> bool:
    """Compared in constant time, as digests: neither the key's characters nor its length show in the time taken."""
    return hmac.compare_digest(hashlib.sha256(given).digest(), hashlib.sha256(key).digest())


class ClientGone(Exception):
    """The client left before its body arrived: there is no one to answer."""


class Guard:
    """Checks before the app sees a request: the Host header and the API key
    (Access), shutdown, and the body, read whole within `read_timeout`
    seconds and at most its route's limit (declared or counted: a chunked
    body has no declared length): `body_limits` by path, `max_body_bytes`
    for any other. Plain ASGI: a BaseHTTPMiddleware would relay every
    streamed chunk through a task."""

    def __init__(self, app, engine: Engine, access: Access, max_body_bytes: int, read_timeout: float,
                 body_limits: dict | None = None, body_seconds: dict | None = None):
        self.app, self.engine, self.access = app, engine, access
        self.max_body_bytes, self.read_timeout, self.body_limits = max_body_bytes, read_timeout, body_limits or {}
        self.body_seconds = body_seconds or {}  # a route's own time for its body (an upload), by path

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrived"] = time.perf_counter()  # request.state.arrived: the metrics' clock
        headers = dict(scope["headers"])
        try:
            refused = self.access.refusal(scope["path"], headers)
            if refused:
                raise refused
            if self.engine.draining and scope["method"] == "POST":
                # (a load balancer's client tries another replica, or this one's successor, a second on)
                raise ApiError(503, "the server is shutting down", "server_error", headers={"Retry-After": "1"})
            limit = self.body_limits.get(scope["path"], self.max_body_bytes)
            if int(headers.get(b"content-length", b"0") or 0) > limit:
                raise self.too_big(limit)
            seconds = self.body_seconds.get(scope["path"], self.read_timeout)
            body = await self.body(receive, limit, seconds) if scope["method"] == "POST" else None
        except ApiError as e:
            return await e.response(self.engine.metrics)(scope, receive, send)
        except ClientGone:
            return
        if body is None:
            return await self.app(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:  # after the body: what the client does next (a disconnect)
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    @staticmethod
    def too_big(limit: int) -> ApiError:
        return ApiError(413, f"the body is over {limit:,} bytes")

    async def body(self, receive, limit: int, seconds: float) -> bytes:
        deadline, parts, size = time.monotonic() + seconds, [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                raise ApiError(408, f"the body did not arrive within {seconds:g} s", code="timeout",
                               headers={"Connection": "close"})
            if message["type"] == "http.disconnect":
                raise ClientGone()
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > limit:
                raise self.too_big(limit)
            if not message.get("more_body", False):
                return b"".join(parts)
