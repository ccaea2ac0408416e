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

Every answer carries ``passages`` (document, token offset, text, share of lookups) besides
OpenAI's fields. The model is loaded once and the memory opened once per answer computed at
once (``Readers``): each request takes an open read-only memory, which first follows the commits
made since its last answer (a build running beside the server is seen at its commits) and
afterwards forgets what the question fed it, so answers never see each other and equal a fresh
open's, while the hot cache stays warm. At most ``parallel`` answers are computed at once, the
others wait their turn. With an API key, every ``/v1`` request needs ``Authorization: Bearer KEY``;
only requests to the address served (or an allowed host) are answered (``serve_guard.py``).
"""

import asyncio
import contextlib
import json
import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..memory import LandmarkMemory, MemoryFileError
from ..memory.answer import Answer, Message, QuestionError, check_messages, converse, say
from ..memory.inspect import describe
from ..memory.session import Session
from .serve_guard import ANY_ADDRESS, LOCAL_HOSTS, APIError, Guard
from .serve_sessions import SessionLocks, existing, session_errors, sessions_router


@dataclass(frozen=True)
class ServeConfig:
    """What a server serves and its limits."""

    memory: Path
    model_name: str
    api_key: str | None = None
    host: str = "127.0.0.1"  # the address served: a Host header naming it is answered
    allowed_hosts: tuple[str, ...] = ()  # other Host headers answered ("*": any)
    parallel: int = 2  # answers computed at once
    max_tokens: int = 512  # the most new tokens a request may ask for
    max_body: int = 1 << 20  # bytes of a request body
    cache_bytes: int = 64 << 20  # hot-block cache of each request's memory


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The content as text (OpenAI's content parts joined), refused when a part is no text."""
        if isinstance(self.content, list) and not all(
                part.get("type") == "text" and isinstance(part.get("text"), str) for part in self.content):
            raise APIError(400, "a message's content parts must all be {\"type\": \"text\", \"text\": a string}: "
                           "this server reads text only", "invalid_content")
        return self.content if isinstance(self.content, str) else " ".join(p["text"] for p in self.content or [])


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we do not use
    model: str
    max_tokens: int | None = None
    temperature: float = 0.0
    seed: int | None = None
    stream: bool = False
    passages: int = 3
    stop: str | list[str] | None = None
    n: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None

    def stops(self) -> list[str]:
        """The stop strings (OpenAI: a string or up to 4; ``check_question`` refuses empty ones)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(400, f"stop holds at most 4 strings, got {len(stops)}", "invalid_stop")
        return stops


class ChatRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    session: str | None = None  # read the messages into this session (``serve_sessions.py``)


class CompletionRequest(_Request):
    prompt: str | list[str]


class Readers:
    """The served memory, open read-only and kept: at most ``parallel`` of them, opened as
    answers at once need them (the first at once, so that a memory that cannot be read stops
    the server before it starts), each used by one answer at a time."""

    def __init__(self, cfg: ServeConfig, model):
        self.cfg, self.model = cfg, model
        self.turns = threading.Semaphore(cfg.parallel)
        self.idle: queue.LifoQueue[LandmarkMemory] = queue.LifoQueue()  # the warmest first
        first = self._open()
        self.latest = first.manifest  # the newest commit a kept memory has taken
        self.idle.put(first)

    def _open(self) -> LandmarkMemory:
        return LandmarkMemory.open(self.cfg.memory, self.model, readonly=True, cache_bytes=self.cfg.cache_bytes)

    @contextlib.contextmanager
    def take(self) -> Iterator[LandmarkMemory]:
        """An open memory at the memory's last commit, for one answer; afterwards it forgets
        what the answer fed it and waits for the next."""
        with self.turns:
            with self._taken() as mem:
                yield mem

    @contextlib.contextmanager
    def _taken(self) -> Iterator[LandmarkMemory]:
        """``take`` once the caller has its turn."""
        try:
            mem = self.idle.get_nowait()
        except queue.Empty:
            mem = None
        try:
            if mem is None:
                mem = self._open()
            else:
                mem.refresh()
        except (MemoryFileError, OSError) as e:  # rebuilt in place, damaged, or gone: open it again, or give up
            if mem is not None:
                mem.close()
            try:
                mem = self._open()
            except (MemoryFileError, OSError):
                raise APIError(503, f"the memory cannot be read: {e}", "memory_unavailable") from None
        self.latest = mem.manifest
        try:
            yield mem
        except MemoryFileError as e:  # found damaged while answering
            raise APIError(503, f"the memory cannot be read: {e}", "memory_unavailable") from None
        finally:  # an answer that failed half-way leaves nothing behind either
            try:
                mem.rewind()
            except BaseException:
                mem.close()
                raise
            self.idle.put(mem)

    def describe(self) -> dict:
        """What ``landmark-memory info --json`` says, of the commit a kept memory holds: the
        newest, taken now where a turn is free; else the one the last answer read (never
        waiting behind answers)."""
        if self.turns.acquire(blocking=False):
            try:
                with self._taken():
                    pass
            finally:
                self.turns.release()
        try:
            return describe(self.cfg.memory, self.latest)
        except (MemoryFileError, OSError) as e:
            raise APIError(503, f"the memory cannot be read: {e}", "memory_unavailable") from None

    def close(self) -> None:
        while not self.idle.empty():
            self.idle.get_nowait().close()


def create_app(cfg: ServeConfig, model, tokenizer) -> FastAPI:
    """The server's application (``uvicorn.run(create_app(...))``), answering from the memory
    at ``cfg.memory`` with ``model`` (loaded once) and its ``tokenizer``; the memory is opened
    here (a ``MemoryFileError`` if it cannot be read)."""
    readers = Readers(cfg, model)
    answering = anyio.CapacityLimiter(cfg.parallel)  # queued answers wait here, holding no thread

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        readers.close()

    app = FastAPI(title="landmark-memory", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    page = resources.files("landmark_memory").joinpath("assets/page.html").read_text()
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
        return APIError(exc.status_code, words.get(exc.status_code, str(exc.detail)),
                        {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")).response()

    @app.exception_handler(APIError)
    async def api_error(request, exc):
        return exc.response()

    @app.exception_handler(Exception)
    async def server_error(request, exc):  # a bug: its traceback goes to the log, the client gets the shape
        return APIError(500, f"the server failed ({type(exc).__name__}); its log says more", "server_error").response()

    def check(req: _Request, limit: int | None, messages: list[Message]) -> int:
        """The request's new-token count, everything else about it checked before any answer
        (a streamed answer has sent its status by the time it runs)."""
        if req.model != cfg.model_name:
            raise APIError(404, f"model {req.model!r} is not served here; GET /v1/models lists the one that is",
                           "model_not_found")
        n = limit if limit is not None else 16
        if not 0 <= n <= cfg.max_tokens:
            raise APIError(400, f"max_tokens must be between 0 and {cfg.max_tokens}, got {n}", "invalid_max_tokens")
        if not (math.isfinite(req.temperature) and 0 <= req.temperature <= 2):
            raise APIError(400, f"temperature must be a number from 0 to 2, got {req.temperature}",
                           "invalid_temperature")
        if req.n not in (None, 1):
            raise APIError(400, f"n must be 1: this server gives one choice per request, got {req.n}", "invalid_n")
        if req.logprobs not in (None, False, 0) or req.top_logprobs is not None:
            raise APIError(400, "logprobs and top_logprobs are not supported: leave them out", "invalid_logprobs")
        try:  # what converse would refuse, refused before a stream sends its status
            check_messages(messages, seed=req.seed or 0, stop=req.stops())
        except QuestionError as e:
            code = {"empty": "invalid_request", "text": "invalid_prompt", "seed": "invalid_seed",
                    "stop": "invalid_stop", "role": "invalid_role"}[e.field]
            raise APIError(400, str(e), code) from None
        return n

    def answer(messages: list[Message], raw: bool, req: _Request, n: int, session: str | None, on_token=None):
        """The answer to ``messages``: read into the ``session`` named, or after the memory alone."""
        options = dict(max_new_tokens=n, temperature=req.temperature, seed=req.seed or 0, raw=raw,
                       passages=max(0, req.passages), stop=req.stops(), on_token=on_token)
        with readers.take() as mem:
            if session is None:
                return converse(mem, tokenizer, messages, **options)
            with session_errors():
                s = Session.open(mem, session, create=False)
            try:
                return say(s, tokenizer, messages, **options)
            finally:
                s.close()

    async def respond(kind: str, messages: list[Message], raw: bool, req: _Request, n: int, session: str | None):
        ident, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}", int(time.time())
        head = {"id": ident, "created": created, "model": cfg.model_name, **({"session": session} if session else {})}
        if req.stream:
            return StreamingResponse(stream(kind, head, messages, raw, req, n, session), media_type="text/event-stream")
        async with turn_of(session):
            a = await anyio.to_thread.run_sync(answer, messages, raw, req, n, session, limiter=answering)
        choice = ({"message": {"role": "assistant", "content": a.text}} if kind == "chat" else
                  {"text": a.text, "logprobs": None})
        return {**head, "object": "chat.completion" if kind == "chat" else "text_completion",
                "choices": [{"index": 0, **choice, "finish_reason": finish(a, n)}], "usage": usage(a),
                "passages": [asdict(p) for p in a.passages]}

    def turn_of(session: str | None):
        """The session's lock (answers on one session one after the other), or nothing to wait for."""
        return locks.hold(session) if session is not None else contextlib.nullcontext()

    async def stream(kind, head, messages, raw, req, n, session):
        """Server-sent events: each new piece of text as it is generated, then the finish reason
        and the passages, then ``[DONE]``; an error midway is an error event, then ``[DONE]``. A
        client that leaves stops the answer at its next token."""
        loop, pieces, done = asyncio.get_running_loop(), asyncio.Queue(), object()
        left, result = threading.Event(), {}
        stops = req.stops()
        hold = max(map(len, stops), default=1) - 1  # text that may yet become a stop string waits

        def on_token(t):
            if left.is_set():
                raise _ClientLeft
            loop.call_soon_threadsafe(pieces.put_nowait, t)

        def run():
            try:
                result["answer"] = answer(messages, raw, req, n, session, on_token=on_token)
            except _ClientLeft:
                pass
            except APIError as e:
                result["error"] = e
            except Exception as e:  # noqa: BLE001 - a stream has sent 200: the error goes in an event
                result["error"] = APIError(500, f"the server failed ({type(e).__name__}); its log says more",
                                           "server_error")
                logging.getLogger(__name__).exception("answer failed")
            finally:
                loop.call_soon_threadsafe(pieces.put_nowait, done)

        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def event(text="", finish_reason=None, extra=None, delta=None):
            choice = ({"delta": delta or ({"content": text} if text else {})} if kind == "chat" else
                      {"text": text, "logprobs": None})
            doc = {**head, "object": obj, "choices": [{"index": 0, **choice, "finish_reason": finish_reason}],
                   **(extra or {})}
            return f"data: {json.dumps(doc)}\n\n"

        tokens, shown = [], ""
        try:
            if kind == "chat":
                yield event(delta={"role": "assistant"})
            async with turn_of(session), answering:  # a turn, waited for without a thread
                threading.Thread(target=run, daemon=True).start()
                while (t := await pieces.get()) is not done:
                    tokens.append(t)
                    text = tokenizer.decode(tokens)
                    ready = min([text.find(s) for s in stops if s in text] or [len(text) - hold])
                    if not text.endswith("\ufffd") and ready > len(shown):  # a split character waits for its last byte
                        yield event(text[len(shown):ready])
                        shown = text[:ready]
            if "error" in result:
                e = result["error"]
                yield f"data: {json.dumps({'error': {'message': str(e), 'type': e.kind, 'code': e.code}})}\n\n"
            else:
                a = result["answer"]
                if a.text[len(shown):]:
                    yield event(a.text[len(shown):])
                yield event(finish_reason=finish(a, n), extra={"passages": [asdict(p) for p in a.passages],
                                                             "usage": usage(a)})
            yield "data: [DONE]\n\n"
        finally:  # the client left (or the stream ended): the answer stops at its next token
            left.set()

    def usage(a: Answer) -> dict:
        asked = a.prompt_tokens
        return {"prompt_tokens": asked, "completion_tokens": len(a.tokens), "total_tokens": asked + len(a.tokens)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "landmark-memory"}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        if not any(m.role == "user" for m in req.messages):
            raise APIError(400, "messages hold no user message to answer", "invalid_request")
        messages = [Message("system" if m.role == "developer" else m.role, m.text()) for m in req.messages]
        session = None if req.session is None else existing(cfg.memory, req.session)
        n = check(req, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
                  messages)
        return await respond("chat", messages, False, req, n, session)

    @app.post("/v1/completions")
    async def complete(req: CompletionRequest):
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise APIError(400, f"one prompt per request, got {len(prompts)}", "invalid_request")
        n = check(req, req.max_tokens, [Message("user", prompts[0])])
        return await respond("completion", [Message("user", prompts[0])], True, req, n, None)

    @app.get("/v1/memory")
    async def memory():
        return await anyio.to_thread.run_sync(readers.describe, limiter=inspecting)

    inspecting = anyio.CapacityLimiter(1)  # its own thread: never queued behind answers

    def started(name: str) -> None:  # a new session, made over a memory kept open
        with readers.take() as mem:
            Session.open(mem, name, create=True, new=True).close()

    locks = SessionLocks()
    app.include_router(sessions_router(cfg.memory, locks, started))

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return page.replace("{{MODEL}}", json.dumps(cfg.model_name))

    hosts = None if "*" in cfg.allowed_hosts or cfg.host in ANY_ADDRESS else {
        h.strip("[]").lower() for h in (*LOCAL_HOSTS, cfg.host, *cfg.allowed_hosts)}
    return Guard(app, cfg.max_body, hosts)


class _ClientLeft(Exception):
    """Raised in an answer's thread when its stream's client has gone."""


def finish(a: Answer, n: int) -> str:
    """OpenAI's finish reason: the answer ran into ``max_tokens``, or ended by itself or at a
    stop string."""
    return "length" if a.stop is None and len(a.tokens) >= n and n > 0 else "stop"


def serve(app, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``create_app``'s application until SIGINT or SIGTERM (requests under way get a
    few seconds to finish)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
