"""The routes of ``serve.py`` in OpenAI's shapes: plain functions on a router, whose state
(settings, the kept memories, the model's tokenizer, the limits on answers at once, the
sessions' locks) is one ``Served`` object the application holds (``served``)."""

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import math
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from ..core.ask_options import AskOptions
from ..core.names import EVIDENCE
from ..models.loaded import LoadedModel
from ..uses.answer import Answer, check_messages, converse, say
from ..uses.answering import choose_policy
from ..uses.asking import Message
from ..uses.question import QuestionError, check_question
from ..uses.search import search
from ..uses.session import Session
from .serve_guard import APIError, client_gone
from .serve_readers import Readers, ServeConfig
from .serve_sessions import SessionLocks, existing, session_errors


@dataclass(frozen=True)
class Page:
    """The page as served: its ``html`` and the ``policy`` (Content-Security-Policy) it is sent with."""

    html: str
    policy: str


def script_json(value) -> str:
    """``value`` as a JavaScript literal inside a page's ``<script>``: JSON with ``<``, ``>`` and ``&``
    escaped too, so that no text (a model folder named ``</script><script>...``) ends the script."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def render_page(template: str, model_name: str) -> Page:
    """The page of ``template`` serving ``model_name``, with a policy that lets the browser run
    its own script and style only (by their sha256: an inline script that escaping ever let in
    does not run), fetch from this server only, and be framed by no other page."""
    model = script_json(model_name)
    # hashed as the template holds them, so that text that escaping let end a script never counts as one
    scripts = " ".join(_sha256(t.replace("{{MODEL}}", model)) for t in re.findall(r"<script>(.*?)</script>", template,
                                                                                  re.S))
    styles = " ".join(_sha256(t) for t in re.findall(r"<style>(.*?)</style>", template, re.S))
    html = template.replace("{{MODEL}}", model)
    policy = (f"default-src 'none'; script-src {scripts}; style-src {styles}; connect-src 'self'; img-src 'self'; "
              "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return Page(html, policy)


@dataclass
class Served:
    """What the routes answer from: ``cfg``, the memory kept open (``readers``), the ``model``
    (``LoadedModel``: its tokenizer, heads, reader and policy), how many answers run at once
    (``answering``) and apart from them (``inspecting``), the sessions' ``locks`` and the ``page``."""

    cfg: ServeConfig
    readers: Readers
    model: LoadedModel
    answering: anyio.CapacityLimiter
    inspecting: anyio.CapacityLimiter
    locks: SessionLocks
    page: Page


def served(request: Request) -> Served:
    """The state of the application serving ``request`` (a dependency of every route)."""
    return request.app.state.served


router = APIRouter()


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


ASKED = AskOptions()  # what a request leaves out is answered as the command line's ``ask`` and ``chat`` answer


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we do not use
    model: str
    max_tokens: int | None = None
    temperature: float = ASKED.temperature
    seed: int | None = None
    stream: bool = False
    passages: int = ASKED.passages
    evidence: str = ASKED.evidence  # what a chat model with retrieval heads reads before the question (``converse``)
    refuse: bool = ASKED.refuse  # say the memory holds no answer where the heads find too little (``converse``)
    policy: str | None = ASKED.policy  # the answer policy (``uses/answering/``); None: the first that fits
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


@router.get("/v1/models")
async def models(s: Served = Depends(served)):
    return {"object": "list", "data": [{"id": s.cfg.model_name, "object": "model", "created": 0,
                                        "owned_by": "landmark-memory"}]}


@router.post("/v1/chat/completions")
async def chat(req: ChatRequest, request: Request, s: Served = Depends(served)):
    if not any(m.role == "user" for m in req.messages):
        raise APIError(400, "messages hold no user message to answer", "invalid_request")
    messages = [Message("system" if m.role == "developer" else m.role, m.text()) for m in req.messages]
    session = None if req.session is None else existing(s.cfg.memory, req.session)
    n = check(s, req, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
              messages, raw=False)
    return await respond(s, "chat", messages, False, req, n, session, request)


@router.post("/v1/completions")
async def complete(req: CompletionRequest, request: Request, s: Served = Depends(served)):
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if len(prompts) != 1:
        raise APIError(400, f"one prompt per request, got {len(prompts)}", "invalid_request")
    n = check(s, req, req.max_tokens, [Message("user", prompts[0])], raw=True)
    return await respond(s, "completion", [Message("user", prompts[0])], True, req, n, None, request)


MAX_PASSAGES = 64  # passages a search may ask for


class SearchRequest(BaseModel):
    question: str
    passages: int = 5


@router.post("/v1/search")
async def search_memory(req: SearchRequest, s: Served = Depends(served)):
    """The passages a question points at and the quote among them (``uses/search.py``), without
    generating."""
    try:
        check_question(req.question)
    except QuestionError as e:
        raise APIError(400, str(e), "invalid_question") from None
    if not 1 <= req.passages <= MAX_PASSAGES:
        raise APIError(400, f"passages must be from 1 to {MAX_PASSAGES}, got {req.passages}", "invalid_passages")

    def run():
        with s.readers.take() as mem:
            return search(mem, s.model, req.question, k=req.passages).to_json()

    return await anyio.to_thread.run_sync(run, limiter=s.answering)


@router.get("/v1/memory")
async def memory(s: Served = Depends(served)):
    return await anyio.to_thread.run_sync(s.readers.describe, limiter=s.inspecting)


@router.get("/", response_class=HTMLResponse)
async def index(s: Served = Depends(served)):
    return HTMLResponse(s.page.html, headers={"Content-Security-Policy": s.page.policy})


def check(s: "Served", req: _Request, limit: int | None, messages: list[Message], raw: bool) -> int:
    """The request's new-token count, everything else about it checked before any answer
    (a streamed answer has sent its status by the time it runs); ``raw``: its messages are read
    as written (a completion)."""
    if req.model != s.cfg.model_name:
        raise APIError(404, f"model {req.model!r} is not served here; GET /v1/models lists the one that is",
                       "model_not_found")
    n = limit if limit is not None else min(ASKED.max_new_tokens, s.cfg.max_tokens)
    if not 0 <= n <= s.cfg.max_tokens:
        raise APIError(400, f"max_tokens must be between 0 and {s.cfg.max_tokens}, got {n}", "invalid_max_tokens")
    if not (math.isfinite(req.temperature) and 0 <= req.temperature <= 2):
        raise APIError(400, f"temperature must be a number from 0 to 2, got {req.temperature}",
                       "invalid_temperature")
    if req.n not in (None, 1):
        raise APIError(400, f"n must be 1: this server gives one choice per request, got {req.n}", "invalid_n")
    if req.logprobs not in (None, False, 0) or req.top_logprobs is not None:
        raise APIError(400, "logprobs and top_logprobs are not supported: leave them out", "invalid_logprobs")
    if req.evidence not in EVIDENCE:
        raise APIError(400, f"evidence must be one of {', '.join(EVIDENCE)}, got {req.evidence!r}", "invalid_evidence")
    try:  # (a policy the model cannot answer by)
        choose_policy(s.model, AskOptions(raw=raw, policy=req.policy))
    except ValueError as e:
        raise APIError(400, str(e), "invalid_policy") from None
    try:  # what converse would refuse, refused before a stream sends its status
        check_messages(messages, seed=req.seed or 0, stop=req.stops())
    except QuestionError as e:
        code = {"empty": "invalid_request", "text": "invalid_prompt", "seed": "invalid_seed",
                "stop": "invalid_stop", "role": "invalid_role"}[e.field]
        raise APIError(400, str(e), code) from None
    return n

def answer(s: "Served", messages: list[Message], raw: bool, req: _Request, n: int, session: str | None,
           on_token=None) -> Answer:
    """The answer to ``messages``: read into the ``session`` named, or after the memory alone."""
    options = AskOptions(max_new_tokens=n, temperature=req.temperature, seed=req.seed or 0, raw=raw,
                         passages=max(0, req.passages), stop=tuple(req.stops()), evidence=req.evidence,
                         refuse=req.refuse, policy=req.policy)
    with s.readers.take() as mem:
        if session is None:
            return converse(mem, s.model, messages, options, on_token=on_token)
        with session_errors():
            kept = Session.open(mem, session, create=False)
        try:
            return say(kept, s.model, messages, options, on_token=on_token)
        finally:
            kept.close()

async def respond(s: "Served", kind: str, messages: list[Message], raw: bool, req: _Request, n: int,
                  session: str | None, request: Request):
    ident, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}", int(time.time())
    head = {"id": ident, "created": created, "model": s.cfg.model_name, **({"session": session} if session else {})}
    if req.stream:
        return StreamingResponse(stream(s, kind, head, messages, raw, req, n, session), media_type="text/event-stream")
    a = await answered(s, messages, raw, req, n, session, request)
    if a is None:  # nobody reads this
        return APIError(499, "the client closed the request before its answer", "client_closed").response()
    choice = ({"message": {"role": "assistant", "content": a.text}} if kind == "chat" else
              {"text": a.text, "logprobs": None})
    return {**head, "object": "chat.completion" if kind == "chat" else "text_completion",
            "choices": [{"index": 0, **choice, "finish_reason": finish(a, n)}], "usage": usage(a),
            "passages": [asdict(p) for p in a.passages], **a.evidence_fields()}

async def answered(s: "Served", messages: list[Message], raw: bool, req: _Request, n: int, session: str | None,
                   request: Request) -> Answer | None:
    """The answer (not streamed), computed in a thread after the answers before it on its
    session and within ``parallel`` answers at once; None when the client left before it was
    done: it stops at its next token, and the session's next request waits until it has."""
    left = threading.Event()

    def on_token(t):
        if left.is_set():
            raise _ClientLeft

    def run():
        on_token(None)  # (a client that left while the answer waited its turn)
        return answer(s, messages, raw, req, n, session, on_token=on_token)

    async def watch():
        await client_gone(request.scope).wait()
        left.set()

    async with turn_of(s, session):
        watcher = asyncio.create_task(watch())
        try:  # (a thread is never abandoned: the turn is held until the answer has stopped)
            return await anyio.to_thread.run_sync(run, limiter=s.answering)
        except _ClientLeft:
            return None
        finally:
            watcher.cancel()

def turn_of(s: "Served", session: str | None):
    """The session's lock (answers on one session one after the other), or nothing to wait for."""
    return s.locks.hold(session) if session is not None else contextlib.nullcontext()

async def stream(s: "Served", kind, head, messages, raw, req, n, session):
    """Server-sent events: each new piece of text as it is generated, then the finish reason
    and the passages, then ``[DONE]``; an error midway is an error event, then ``[DONE]``. A
    client that leaves stops the answer at its next token."""
    loop, pieces, done = asyncio.get_running_loop(), asyncio.Queue(), object()
    left, ended, result = threading.Event(), asyncio.Event(), {}
    stops = req.stops()
    hold = max(map(len, stops), default=1) - 1  # text that may yet become a stop string waits

    def on_token(t):
        if left.is_set():
            raise _ClientLeft
        loop.call_soon_threadsafe(pieces.put_nowait, t)

    def run():
        try:
            result["answer"] = answer(s, messages, raw, req, n, session, on_token=on_token)
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
            loop.call_soon_threadsafe(ended.set)

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
        async with turn_of(s, session), s.answering:  # a turn, waited for without a thread
            threading.Thread(target=run, daemon=True).start()
            try:
                while (t := await pieces.get()) is not done:
                    tokens.append(t)
                    text = s.model.tokenizer.decode(tokens)
                    ready = min([text.find(s) for s in stops if s in text] or [len(text) - hold])
                    if not text.endswith("\ufffd") and ready > len(shown):  # a split character waits for its last byte
                        yield event(text[len(shown):ready])
                        shown = text[:ready]
            finally:  # the client left, or the answer ended: the turn is held until its thread has
                left.set()
                with anyio.CancelScope(shield=True):
                    await ended.wait()
        if "error" in result:
            e = result["error"]
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': e.kind, 'code': e.code}})}\n\n"
        else:
            a = result["answer"]
            if a.text[len(shown):]:
                yield event(a.text[len(shown):])
            yield event(finish_reason=finish(a, n), extra={"passages": [asdict(p) for p in a.passages],
                                                         **a.evidence_fields(), "usage": usage(a)})
        yield "data: [DONE]\n\n"
    finally:  # the client left (or the stream ended): the answer stops at its next token
        left.set()

def usage(a: Answer) -> dict:
    asked = a.prompt_tokens
    return {"prompt_tokens": asked, "completion_tokens": len(a.tokens), "total_tokens": asked + len(a.tokens)}


class _ClientLeft(Exception):
    """Raised in an answer's thread when its stream's client has gone."""


def finish(a: Answer, n: int) -> str:
    """OpenAI's finish reason: the answer ran into ``max_tokens``, or ended by itself or at a
    stop string."""
    return "length" if a.stop is None and len(a.tokens) >= n and n > 0 else "stop"
