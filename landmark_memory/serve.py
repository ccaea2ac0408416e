"""``landmark-memory serve``: a saved memory over HTTP, in OpenAI's request and response shapes,
and a page that shows which passages each answer read.

    GET  /v1/models             the one model served
    POST /v1/completions        the prompt continued as written after the memory
    POST /v1/chat/completions   the last user message asked through the chat template
                                ("stream": true gives server-sent events)
    GET  /v1/memory             what ``landmark-memory info --json`` says
    GET  /                      the page: a question, the answer, the passages it read

Every answer carries ``passages`` (document, token offset, text, share of lookups) besides
OpenAI's fields. The model is loaded once and the memory opened once per answer computed at
once (``Readers``): each request takes an open read-only memory, which first follows the commits
made since its last answer (a build running beside the server is seen at its commits) and
afterwards forgets what the question fed it, so answers never see each other and equal a fresh
open's, while the hot cache stays warm. At most ``parallel`` answers are computed at once, the
others wait their turn. With an API key, every ``/v1`` request needs ``Authorization: Bearer KEY``.
"""

import contextlib
import json
import queue
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from .answer import Answer, ask
from .memory import LandmarkMemory, MemoryFileError
from .memory.inspect import describe


@dataclass(frozen=True)
class ServeConfig:
    """What a server serves and its limits."""

    memory: Path
    model_name: str
    api_key: str | None = None
    parallel: int = 2  # answers computed at once
    max_tokens: int = 512  # the most new tokens a request may ask for
    max_body: int = 1 << 20  # bytes of a request body
    cache_bytes: int = 64 << 20  # hot-block cache of each request's memory


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we do not use
    model: str
    max_tokens: int | None = None
    temperature: float = 0.0
    seed: int | None = None
    stream: bool = False
    passages: int = 3


class ChatRequest(_Request):
    messages: list[Message]
    max_completion_tokens: int | None = None


class CompletionRequest(_Request):
    prompt: str | list[str]


class APIError(Exception):
    """An OpenAI-shaped error: ``{"error": {"message", "type", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse({"error": {"message": str(self), "type": kind, "code": self.code}}, self.status)


class _BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is a 413 (by its Content-Length, or
    as it streams in), never read whole."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = APIError(413, f"the request body is over {self.limit:,} bytes", "request_too_large").response()
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await too_big(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise APIError(413, f"the request body is over {self.limit:,} bytes", "request_too_large")
            return message

        try:
            await self.app(scope, counted, send)
        except APIError as e:
            await e.response()(scope, receive, send)


class Readers:
    """The served memory, open read-only and kept: at most ``parallel`` of them, opened as
    answers at once need them (the first at once, so that a memory that cannot be read stops
    the server before it starts), each used by one answer at a time."""

    def __init__(self, cfg: ServeConfig, model):
        self.cfg, self.model = cfg, model
        self.turns = threading.Semaphore(cfg.parallel)
        self.idle: queue.LifoQueue[LandmarkMemory] = queue.LifoQueue()  # the warmest first
        self.idle.put(self._open())

    def _open(self) -> LandmarkMemory:
        return LandmarkMemory.open(self.cfg.memory, self.model, readonly=True, cache_bytes=self.cfg.cache_bytes)

    @contextlib.contextmanager
    def take(self) -> Iterator[LandmarkMemory]:
        """An open memory at the memory's last commit, for one answer; afterwards it forgets
        what the answer fed it and waits for the next."""
        with self.turns:
            try:
                mem = self.idle.get_nowait()
            except queue.Empty:
                mem = None
            try:
                if mem is None:
                    mem = self._open()
                else:
                    mem.refresh()
            except MemoryFileError as e:  # rebuilt in place, damaged, or gone: open it again, or give up
                if mem is not None:
                    mem.close()
                try:
                    mem = self._open()
                except MemoryFileError:
                    raise APIError(503, f"the memory cannot be read: {e}", "memory_unavailable") from None
            try:
                yield mem
            finally:  # an answer that failed half-way leaves nothing behind either
                try:
                    mem.rewind()
                except BaseException:
                    mem.close()
                    raise
                self.idle.put(mem)

    def describe(self) -> dict:
        """What ``landmark-memory info --json`` says, from the commit a kept memory holds."""
        with self.take() as mem:
            return describe(self.cfg.memory, mem.manifest)

    def close(self) -> None:
        while not self.idle.empty():
            self.idle.get_nowait().close()


def create_app(cfg: ServeConfig, model, tokenizer) -> FastAPI:
    """The server's application (``uvicorn.run(create_app(...))``), answering from the memory
    at ``cfg.memory`` with ``model`` (loaded once) and its ``tokenizer``; the memory is opened
    here (a ``MemoryFileError`` if it cannot be read)."""
    readers = Readers(cfg, model)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        readers.close()

    app = FastAPI(title="landmark-memory", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    page = resources.files("landmark_memory").joinpath("assets/page.html").read_text()

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if cfg.api_key and request.url.path.startswith("/v1") and not secrets.compare_digest(
                request.headers.get("authorization", ""), f"Bearer {cfg.api_key}"):
            return APIError(401, "this server needs `Authorization: Bearer KEY` with the key it was started with",
                            "invalid_api_key").response()
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def malformed(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"malformed request: {first.get('msg', 'invalid body')}" + (f" at {where}" if where else "")
        return APIError(400, message, "invalid_request").response()

    @app.exception_handler(APIError)
    async def api_error(request, exc):
        return exc.response()

    def check(req: _Request, limit: int | None) -> int:
        if req.model != cfg.model_name:
            raise APIError(404, f"model {req.model!r} is not served here; GET /v1/models lists the one that is",
                           "model_not_found")
        n = limit if limit is not None else 16
        if not 0 <= n <= cfg.max_tokens:
            raise APIError(400, f"max_tokens must be between 0 and {cfg.max_tokens}, got {n}", "invalid_max_tokens")
        return n

    def answer(question: str, raw: bool, req: _Request, n: int, on_token=None) -> Answer:
        if not question.strip():
            raise APIError(400, "the question is empty", "invalid_request")
        with readers.take() as mem:
            return ask(mem, tokenizer, question, max_new_tokens=n, temperature=req.temperature,
                       seed=req.seed or 0, raw=raw, passages=max(0, req.passages), on_token=on_token)

    def respond(kind: str, question: str, raw: bool, req: _Request, n: int):
        ident, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}", int(time.time())
        head = {"id": ident, "created": created, "model": cfg.model_name}
        if not req.stream:
            a = answer(question, raw, req, n)
            choice = ({"message": {"role": "assistant", "content": a.text}} if kind == "chat" else
                      {"text": a.text, "logprobs": None})
            return {**head, "object": "chat.completion" if kind == "chat" else "text_completion",
                    "choices": [{"index": 0, **choice, "finish_reason": finish(a, n)}], "usage": usage(question, a),
                    "passages": [asdict(p) for p in a.passages]}
        return StreamingResponse(stream(kind, head, question, raw, req, n), media_type="text/event-stream")

    def stream(kind, head, question, raw, req, n):
        """Server-sent events: each new piece of text as it is generated, then the finish reason
        and the passages, then ``[DONE]``."""
        pieces, done = queue.Queue(), object()
        tokens, shown = [], ""
        result = {}

        def run():
            try:
                result["answer"] = answer(question, raw, req, n, on_token=pieces.put)
            except APIError as e:
                result["error"] = e
            finally:
                pieces.put(done)

        threading.Thread(target=run, daemon=True).start()
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def event(text="", finish_reason=None, extra=None, delta=None):
            choice = ({"delta": delta or ({"content": text} if text else {})} if kind == "chat" else
                      {"text": text, "logprobs": None})
            doc = {**head, "object": obj, "choices": [{"index": 0, **choice, "finish_reason": finish_reason}],
                   **(extra or {})}
            return f"data: {json.dumps(doc)}\n\n"

        if kind == "chat":
            yield event(delta={"role": "assistant"})
        while (t := pieces.get()) is not done:
            tokens.append(t)
            text = tokenizer.decode(tokens)
            if not text.endswith("\ufffd"):  # a character split over tokens waits for its last byte
                yield event(text[len(shown):])
                shown = text
        if "error" in result:
            yield f"data: {json.dumps({'error': {'message': str(result['error']), 'code': result['error'].code}})}\n\n"
        else:
            a = result["answer"]
            if a.text[len(shown):]:
                yield event(a.text[len(shown):])
            yield event(finish_reason=finish(a, n), extra={"passages": [asdict(p) for p in a.passages],
                                                         "usage": usage(question, a)})
        yield "data: [DONE]\n\n"

    def usage(question: str, a: Answer) -> dict:
        asked = len(tokenizer.encode(question).ids)
        return {"prompt_tokens": asked, "completion_tokens": len(a.tokens), "total_tokens": asked + len(a.tokens)}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "landmark-memory"}]}

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest):
        n = check(req, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens)
        user = [m for m in req.messages if m.role == "user"]
        if not user:
            raise APIError(400, "messages hold no user message to answer", "invalid_request")
        content = user[-1].content
        question = content if isinstance(content, str) else " ".join(
            part.get("text", "") for part in content or [] if part.get("type") == "text")
        return respond("chat", question, False, req, n)

    @app.post("/v1/completions")
    def complete(req: CompletionRequest):
        n = check(req, req.max_tokens)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise APIError(400, f"one prompt per request, got {len(prompts)}", "invalid_request")
        return respond("completion", prompts[0], True, req, n)

    @app.get("/v1/memory")
    def memory():
        return readers.describe()

    @app.get("/", response_class=HTMLResponse)
    def index():
        return page.replace("{{MODEL}}", json.dumps(cfg.model_name))

    return _BodyLimit(app, cfg.max_body)


def finish(a: Answer, n: int) -> str:
    """OpenAI's finish reason: the answer ran into ``max_tokens``, or ended by itself."""
    return "length" if len(a.tokens) >= n and n > 0 else "stop"


def serve(app, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``create_app``'s application until SIGINT or SIGTERM (requests under way get a
    few seconds to finish)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
