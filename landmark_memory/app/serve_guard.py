"""The server's edge (``serve.py``): OpenAI-shaped errors, and the ASGI guard in front of every
route, which answers only the hosts the server is bound as (no web page reaches it by DNS
rebinding) and never reads a request body past its limit."""

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


class Guard:
    """ASGI middleware in front of every route: a Host header that is not the address served
    (nor ``allowed``) is a 403, so that no web page reaches the server by DNS rebinding; a
    request body over ``limit`` bytes is a 413 (by its Content-Length, or as it streams in,
    chunked or not), never read past the limit. The body is read here and handed on whole."""

    def __init__(self, app, limit: int, hosts: set[str] | None):
        self.app, self.limit, self.hosts = app, limit, hosts  # hosts None: any

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        host = headers.get(b"host")
        if self.hosts is not None and host is not None and host_of(host) not in self.hosts:
            return await APIError(403, f"this server answers requests to {', '.join(sorted(self.hosts))} only, not "
                                  f"{host.decode('latin-1')!r}; start it with --allowed-host to answer that name",
                                  "host_not_allowed").response()(scope, receive, send)
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
        whole = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

        async def replay():
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)
