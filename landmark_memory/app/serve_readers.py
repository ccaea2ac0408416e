"""What ``serve.py`` serves: its settings (``ServeConfig``) and the served memory, open
read-only and kept between answers (``Readers``)."""

import contextlib
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..format import MemoryFileError
from ..memory import LandmarkMemory
from ..uses.inspect import describe
from .serve_guard import APIError


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
    shares: int = 0  # a corpus served by this many Ray actors (``served.Shares``); 0: in this process
    ray_address: str | None = None  # the Ray cluster they run on (None: a local one)
    model: str | None = None  # the model as the command named it (the shares load it)


class Readers:
    """The served memory, open read-only and kept: at most ``parallel`` of them, opened as
    answers at once need them (the first at once, so that a memory that cannot be read stops
    the server before it starts), each used by one answer at a time."""

    def __init__(self, cfg: ServeConfig, model):
        self.cfg, self.model = cfg, model
        self.shares = None
        if cfg.shares:
            from .served import Shares

            self.shares = Shares(cfg.memory, cfg.model, cfg.shares, cfg.ray_address)
        self.turns = threading.Semaphore(cfg.parallel)
        self.idle: queue.LifoQueue[LandmarkMemory] = queue.LifoQueue()  # the warmest first
        first = self._open()
        self.latest = first.manifest  # the newest commit a kept memory has taken
        self.idle.put(first)

    def _open(self) -> LandmarkMemory:
        mem = LandmarkMemory.open(self.cfg.memory, self.model, readonly=True, cache_bytes=self.cfg.cache_bytes)
        if self.shares is not None:
            try:
                return self.shares.serve(mem)
            except BaseException:
                mem.close()
                raise
        return mem

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
            elif self.shares is None:
                mem.refresh()
            else:  # (shares answer at the commit they opened: their files and the front's checked)
                self.shares.check_files()
                mem.transfer.check_files()
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
        if self.shares is not None:
            self.shares.close()
