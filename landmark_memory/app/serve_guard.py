"""The server's edge (``serve.py``): OpenAI-shaped errors, and the ASGI guard in front of every
route, which answers only the hosts the server is bound as (no web page reaches it by DNS
rebinding), takes a request that changes something only from the server's own page or a
program (no other web page can make a session or an answer), and never reads a request body
past its limit."""

import asyncio
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An OpenAI-shaped error: ``{"error": {"message", "type", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code

    @property
    def kind(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "code": self.code}}, self.status)


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
ANY_ADDRESS = ("0.0.0.0", "::", "")  # bound to every interface: any Host may reach it, on purpose


def host_of(header: bytes) -> str:
    """The host name of a Host header (``name:port``, ``[v6]:port``), lower case, no port."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def netloc_of(origin: str) -> str:
    """The ``host:port`` of an Origin header's URL; "" where it has none or is no URL (``[::1``)."""
    try:
        return urlsplit(origin).netloc if "://" in origin else ""
    except ValueError:  # an unclosed or invalid IPv6 address
        return ""


GONE = "landmark_memory.client_gone"  # the scope's entry that ``Guard`` sets when the client leaves
CHANGING = ("POST", "PUT", "PATCH", "DELETE")  # methods of requests that change something
JSON_BODY = ("POST", "PUT", "PATCH")  # ... and send a body: a page's form or text/plain needs no preflight


def refusal(scope, headers: dict[bytes, bytes], hosts: set[str] | None, origins: set[str] | None) -> APIError | None:
    """Why the request ``scope`` (its ``headers``) is refused before any route reads it, or None.

    A Host header that is not in ``hosts`` (None: any) is a 403 (DNS rebinding). A request that
    changes something is a 403 when it comes from a web page of another origin (its ``Origin``
    is neither the request's own host nor a host in ``origins``; None: any), and a 415 when its
    body is not declared JSON: the one content type a browser will not send across origins
    without asking first (a CORS preflight, which this server never grants)."""
    host = headers.get(b"host")
    if hosts is not None and host is not None and host_of(host) not in hosts:
        return APIError(403, f"this server answers requests to {', '.join(sorted(hosts))} only, not "
                        f"{host.decode('latin-1')!r}; start it with --allowed-host to answer that name",
                        "host_not_allowed")
    method, origin = scope.get("method", "GET"), headers.get(b"origin")
    if method not in CHANGING:
        return None
    if sum(k.lower() == b"origin" for k, _ in scope.get("headers", [])) > 1:  # a page has one origin, never two
        return APIError(403, f"a {method} with more than one Origin header is refused", "origin_not_allowed")
    if origin is not None and origins is not None:
        told = origin.decode("latin-1").strip().lower()
        netloc = netloc_of(told)
        own = host is not None and netloc == host.decode("latin-1").strip().lower()
        if not own and (not netloc or host_of(netloc.encode()) not in origins):
            return APIError(403, f"a {method} from the web page at {told!r} is refused: this server takes requests "
                            "that change something only from its own page or a program; start it with "
                            "--allowed-host to take them from that host's pages", "origin_not_allowed")
    kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
    if method in JSON_BODY and kind != b"application/json":
        return APIError(415, f"a {method} must send a JSON body with `Content-Type: application/json`, not "
                        f"{kind.decode('latin-1')!r}", "unsupported_media_type")
    return None


class Guard:
    """ASGI middleware in front of every route: what ``refusal`` refuses (a Host that is not
    the address served nor allowed, a change asked by another origin's page or with a body not
    declared JSON) is answered at once; a request body over ``limit`` bytes is a 413 (by its
    Content-Length, or as it streams in, chunked or not), never read past the limit. The body
    is read here and handed on whole; from then on the client's messages are read here too, so
    that a route learns at once when its client has left (``client_gone``), which a route
    behind Starlette's ``BaseHTTPMiddleware`` cannot poll for."""

    def __init__(self, app, limit: int, hosts: set[str] | None, origins: set[str] | None):
        self.app, self.limit, self.hosts, self.origins = app, limit, hosts, origins  # None: any

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        refused = refusal(scope, headers, self.hosts, self.origins)
        if refused is not None:
            return await refused.response()(scope, receive, send)
        too_big = APIError(413, f"the request body is over {self.limit:,} bytes", "request_too_large").response()
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await too_big(scope, receive, send)
        body, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
            if sum(map(len, body)) > self.limit:
                return await too_big(scope, receive, send)
        whole, gone = [{"type": "http.request", "body": b"".join(body), "more_body": False}], asyncio.Event()

        async def watch():  # the one reader of the client's messages once the body is in
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        async def replay():
            if whole:
                return whole.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        watcher = asyncio.create_task(watch())
        try:
            await self.app({**scope, GONE: gone}, replay, send)
        finally:
            watcher.cancel()


def client_gone(scope) -> asyncio.Event:
    """Set once the client of the request ``scope`` (passed through ``Guard``) has left, or its
    response is complete."""
    return scope[GONE]
