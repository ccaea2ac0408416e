"""The server's sessions (``serve.py``): conversations kept by name across requests and restarts.

    POST   /v1/sessions          start one: {"name": optional} -> 201 {"name", "turns": []}
    GET    /v1/sessions          every session: name, turns, tokens, last used
    GET    /v1/sessions/{name}   one, with its turns (role, text, an answer's passages)
    DELETE /v1/sessions/{name}   remove it

A chat request names its session in the body's ``session`` field (the OpenAI client:
``extra_body={"session": NAME}``) and sends only its new messages; each is read into the
session (``answer.say``), which a restart keeps. Requests on one session are answered one after
the other: each waits for the one before it on the session's lock, holding no thread and no
answer slot, so different sessions go on in parallel within ``--parallel``.
"""

import contextlib
from dataclasses import asdict

import anyio
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from ..format import MemoryFileError
from ..format.session_files import (
    SessionError,
    check_name,
    delete_session,
    list_sessions,
    new_name,
    read_session,
    require_session,
)
from .serve_guard import APIError

STATUS = {"name": (400, "invalid_session_name"), "missing": (404, "session_not_found"),
          "exists": (409, "session_exists"), "busy": (409, "session_busy"), "other": (409, "session_mismatch")}


def session_error(e: SessionError) -> APIError:
    """A ``SessionError`` as the server answers it: 400, 404 or 409."""
    status, code = STATUS[e.kind]
    return APIError(status, str(e), code)


@contextlib.contextmanager
def session_errors():
    """Errors of a session's files as the server answers them."""
    try:
        yield
    except SessionError as e:
        raise session_error(e) from None
    except MemoryFileError as e:
        raise APIError(503, f"the session cannot be read: {e}", "session_unavailable") from None


class SessionLocks:
    """A lock per session name: a request on a session waits for the one before it."""

    def __init__(self):
        self._locks: dict[str, anyio.Lock] = {}

    def hold(self, name: str) -> anyio.Lock:
        """The lock of the session ``name`` (``async with``)."""
        return self._locks.setdefault(name, anyio.Lock())


class NewSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None


def checked_name(name: str) -> str:
    """``name`` if it is a session name, else a 400."""
    try:
        return check_name(name)
    except SessionError as e:
        raise session_error(e) from None


def existing(memory, name: str) -> str:
    """``name`` if the memory has that session, else a 400 or a 404 (checked before a stream
    sends its status)."""
    with session_errors():
        require_session(memory, name)
    return name


def sessions_router(memory, locks: SessionLocks, started) -> APIRouter:
    """The ``/v1/sessions`` routes over the memory at ``memory``; ``started(name)`` makes a new
    session (it needs an open memory and the model: ``serve.py`` gives it)."""
    router = APIRouter()

    @router.get("/v1/sessions")
    async def sessions():
        with session_errors():
            rows = await anyio.to_thread.run_sync(list_sessions, memory)
        return {"object": "list", "data": [asdict(s) for s in rows]}

    @router.post("/v1/sessions", status_code=201)
    async def start(body: NewSession | None = None):
        name = checked_name(body.name) if body is not None and body.name is not None else new_name()
        async with locks.hold(name):
            with session_errors():
                await anyio.to_thread.run_sync(started, name)
        return {"name": name, "turns": []}

    @router.get("/v1/sessions/{name}")
    async def session(name: str):
        name = checked_name(name)
        with session_errors():
            m, turns = await anyio.to_thread.run_sync(read_session, memory, name)
        return {"name": name, "tokens": m.tokens, "updated": m.updated, "turns": [asdict(t) for t in turns]}

    @router.delete("/v1/sessions/{name}")
    async def delete(name: str):
        name = checked_name(name)
        async with locks.hold(name):  # (after the answer under way on it, if any)
            with session_errors():
                await anyio.to_thread.run_sync(delete_session, memory, name)
        return {"name": name, "deleted": True}

    return router
