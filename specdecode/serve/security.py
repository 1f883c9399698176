"""What keeps other websites and slow clients from using the server: an ASGI guard in front of the
app (Host and Origin checks, JSON-only generation requests, security headers on every answer) and
an HTTP protocol that closes connections stuck in the middle of a request.

Why: without an API key, a page the user visits could POST a "simple" cross-site request
(`Content-Type: text/plain`) to start generations, and DNS rebinding could read replies through
a Host name that points at 127.0.0.1. A browser always sends Origin on such a POST and the Host it
thinks it talks to, so both are checked.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
LOOPBACK = ("localhost", "127.0.0.1", "[::1]", "::1")
# the live page loads nothing from elsewhere and is never framed
PAGE_HEADERS = [(b"content-security-policy", b"default-src 'self'; script-src 'self' 'unsafe-inline'; "
                                             b"style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                                             b"frame-ancestors 'none'"),
                (b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY")]


def _host_name(host: str) -> str:
    """"host:port" or "[v6]:port" → the name alone, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class RequestGuard:
    """ASGI middleware. A request is refused (an OpenAI-style error body) when:
    its Host is not the bound address, a loopback name or in `allowed_hosts` (400); it has an
    Origin that is not the server's own or in `allowed_origins` (403); it POSTs to a generation
    endpoint with a content type other than application/json (415). "*" in a list allows any.
    Every answer carries the security headers (PAGE_HEADERS); an allowed foreign origin also gets
    CORS headers, preflight included.

    Args:
        bound_host: the address the server listens on.  port: its port.
    """

    def __init__(self, app, bound_host: str, port: int, allowed_hosts=(), allowed_origins=()):
        self.app, self.port = app, port
        self.hosts = {_host_name(h) for h in (bound_host, *LOOPBACK, *allowed_hosts)}
        self.any_host = "*" in allowed_hosts
        own = {f"http://{h}:{port}" for h in (bound_host, *LOOPBACK)}
        self.origins = own | {o.rstrip("/").lower() for o in allowed_origins}
        self.foreign = {o.rstrip("/").lower() for o in allowed_origins} - own
        self.any_origin = "*" in allowed_origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        origin = headers.get("origin", "").rstrip("/").lower()
        refusal = self._refusal(scope, headers, origin)
        if refusal is not None:
            return await _answer(send, *refusal)
        cors = []
        if origin and (origin in self.foreign or (self.any_origin and origin not in self.origins)):
            cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
            if scope["method"] == "OPTIONS":  # a preflight: what a cross-site client may send
                return await _answer(send, 204, None, cors + [
                    (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                    (b"access-control-allow-headers", b"authorization, content-type"),
                    (b"access-control-max-age", b"600")])

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + PAGE_HEADERS + cors)
            await send(message)

        return await self.app(scope, receive, send_with_headers)

    def _refusal(self, scope, headers: dict, origin: str):
        host = _host_name(headers.get("host", ""))
        if not self.any_host and host not in self.hosts:
            return 400, (f"Host {headers.get('host', '')!r} is not served here; start the server with "
                         "--allowed-hosts to accept it"), []
        if origin and (origin == "null" or (not self.any_origin and origin not in self.origins)):
            return 403, (f"requests from the web page at {origin!r} are refused; start the server with "
                         "--allowed-origins to accept them"), []
        if scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return 415, (f"Content-Type must be application/json, got {media or 'none'!r}"), []
        return None


async def _answer(send, status: int, message: str | None, headers: list) -> None:
    body = b"" if message is None else json.dumps(
        {"error": {"message": message, "type": "invalid_request_error" if status != 403 else "permission_error",
                   "param": None, "code": None}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": headers + PAGE_HEADERS + ([(b"content-type", b"application/json")] if body else [])})
    await send({"type": "http.response.body", "body": body})


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that takes longer than `request_timeout`
    seconds to deliver a request (its headers and body) from its first byte or from the
    connection's start: a client that sends half a request cannot hold a connection. Idle time
    between requests stays uvicorn's keep-alive timeout; a response may take as long as it needs."""

    request_timeout = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._since = self.loop.time()  # a new connection owes its first request
        self._timer = self.loop.call_later(self.request_timeout, self._check)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._receiving():
            if self._since is None:
                self._since = self.loop.time()
        else:
            self._since = None

    def _receiving(self) -> bool:
        state = self.conn.their_state
        return state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))

    def _check(self) -> None:
        if self.transport.is_closing():
            return
        if self._since is not None and self.loop.time() - self._since >= self.request_timeout:
            self.transport.close()
            return
        wait = self.request_timeout if self._since is None else self.request_timeout - (self.loop.time() - self._since)
        self._timer = self.loop.call_later(max(wait, 0.05), self._check)

    def connection_lost(self, exc) -> None:
        self._timer.cancel()
        super().connection_lost(exc)


def timed_protocol(request_timeout: float) -> type:
    """TimedH11Protocol with this timeout (seconds), for uvicorn.Config(http=...)."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"request_timeout": float(request_timeout)})
