"""``landmark-memory serve``: a saved memory over HTTP, in OpenAI's request and response shapes,
and a page that shows which passages each answer read.

    GET  /v1/models             the one model served
    POST /v1/completions        the prompt continued as written after the memory
    POST /v1/chat/completions   the conversation sent, read through the chat template and
                                answered ("stream": true gives server-sent events); with a
                                "session", only its new messages, read into that session
    GET  /v1/memory             what ``landmark-memory info --json`` says
    /v1/sessions                the sessions: list, start, read, delete (``serve_sessions.py``)
    GET  /                      the page: a conversation, its answers, the passages each read

Every answer carries ``passages`` (document, token offset, text, share of lookups) besides OpenAI's fields. This
module makes the application (errors in OpenAI's shape, the API key, the Host check); the routes are plain functions
on routers (``serve_routes.py``, ``serve_sessions.py``) over one ``Served`` state. The model is loaded once and the
memory opened once per answer computed at once (``serve_readers.Readers``): each request takes an open read-only
memory, which first follows the commits made since its last answer (a build running beside the server is seen at its
commits) and afterwards forgets what the question fed it, so answers never see each other and equal a fresh open's,
while the hot cache stays warm. At most ``parallel`` answers are computed at once, the others wait their turn. With an
API key, every ``/v1`` request needs ``Authorization: Bearer KEY``; only requests to the address served (or an allowed
host) are answered, and a request that changes something only from the server's own page or a program
(``serve_guard.py``).
"""

import contextlib
import secrets
from importlib import resources

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..models.loaded import LoadedModel
from ..uses.session import Session
from .serve_guard import ANY_ADDRESS, LOCAL_HOSTS, APIError, Guard
from .serve_readers import Readers, ServeConfig
from .serve_routes import Served, render_page, router
from .serve_sessions import SessionLocks, sessions_router

__all__ = ["ServeConfig", "create_app", "serve"]


def create_app(cfg: ServeConfig, model: LoadedModel) -> FastAPI:
    """The server's application (``uvicorn.run(create_app(...))``), answering from the memory
    at ``cfg.memory`` with ``model`` (``kinds.load_model``'s, loaded once); the memory is opened
    here (a ``MemoryFileError`` if it cannot be read). The routes are ``serve_routes.router``'s
    and ``serve_sessions``'; their state is ``app.state.served``."""
    readers = Readers(cfg, model.model)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        readers.close()

    app = FastAPI(title="landmark-memory", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    page = render_page(resources.files("landmark_memory").joinpath("assets/page.html").read_text(), cfg.model_name)
    locks = SessionLocks()
    app.state.served = Served(cfg, readers, model, answering=anyio.CapacityLimiter(cfg.parallel),
                              inspecting=anyio.CapacityLimiter(1), locks=locks, page=page)
    key = f"Bearer {cfg.api_key}".encode() if cfg.api_key else None

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        given = request.headers.get("authorization", "").encode("latin-1")  # the bytes sent, as sent
        if key and request.url.path.startswith("/v1") and not secrets.compare_digest(given, key):
            return APIError(401, "this server needs `Authorization: Bearer KEY` with the key it was started with",
                            "invalid_api_key").response()
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def malformed(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"malformed request: {first.get('msg', 'invalid body')}" + (f" at {where}" if where else "")
        return APIError(400, message, "invalid_request").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):  # unknown routes, wrong methods, bodies that are no JSON
        words = {404: f"no route {request.url.path}: see GET /v1/models, POST /v1/completions, POST "
                      "/v1/chat/completions, GET /v1/memory, /v1/sessions and GET /",
                 405: f"{request.method} is not allowed on {request.url.path}"}
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return APIError(exc.status_code, words.get(exc.status_code, str(exc.detail)), kind).response()

    @app.exception_handler(APIError)
    async def api_error(request, exc):
        return exc.response()

    @app.exception_handler(Exception)
    async def server_error(request, exc):  # a bug: its traceback goes to the log, the client gets the shape
        return APIError(500, f"the server failed ({type(exc).__name__}); its log says more", "server_error").response()

    def started(name: str) -> None:  # a new session, made over a memory kept open
        with readers.take() as mem:
            Session.open(mem, name, create=True, new=True).close()

    app.include_router(router)
    app.include_router(sessions_router(cfg.memory, locks, started))
    hosts = None if "*" in cfg.allowed_hosts or cfg.host in ANY_ADDRESS else {
        h.strip("[]").lower() for h in (*LOCAL_HOSTS, cfg.host, *cfg.allowed_hosts)}
    origins = None if "*" in cfg.allowed_hosts else {h.strip("[]").lower() for h in cfg.allowed_hosts}
    return Guard(app, cfg.max_body, hosts, origins)


def serve(app, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``create_app``'s application until SIGINT or SIGTERM (requests under way get a
    few seconds to finish)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
