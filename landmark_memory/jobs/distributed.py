"""Reading documents on Ray: across processes and machines, the build's driver merging them.

``RayReader`` is a context manager: without an address it starts a local Ray instance sized
for its workers and shuts it down at the end; with one (``"auto"`` or ``HOST:PORT``) it joins a
running cluster (``ray start --head``, then ``ray start --address HOST:PORT`` on each other
machine); a program that called ``ray.init`` itself keeps its own Ray. Each worker is a Ray
actor that loads the model once and sets torch, numba and FAISS to its share of the cores
(``threads``, what Ray reserves for it: never more threads than cores). Documents go to idle
workers in the inputs' order. A worker that dies (killed, its machine lost) is restarted by
Ray, which runs its document again: the document goes on from its last commit.

The memory folder must be on a filesystem every worker reaches (on one machine any local
disk; across machines a shared one): each worker checks that it sees a probe file the driver
put beside the memory, before anything is written.
"""

import contextlib
import os
import secrets
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from ..format import MemoryDir
from ..format.corpus_files import committed_tokens
from .reading import DocumentJob, DocumentResult, batches, read_batch

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}  # as the build command (entry.py): no spinning on shared cores
RESTARTS = 3  # a worker (and the document it was reading) is restarted this many times, then the build fails


class WorkerError(RuntimeError):
    """A worker died more often than Ray restarts it."""


def available_cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0))


def start_ray(address: str | None, cpus: int) -> bool:
    """Ray for this process's actors: joined at ``address`` ("auto" or HOST:PORT), or started on
    this machine with ``cpus`` CPUs; nothing where a program already started it. Returns whether
    it was started here (``stop_ray`` then shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    if address is None:
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        return True
    check_address(address)
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError) as e:
        raise ValueError(f"cannot join the Ray cluster at {address} ({e}); start one with `ray start --head`, or leave "
                         "out the address to run on this machine") from None
    return True


class _Held:
    """SIGINT and SIGTERM noted (``noted``), not acted on: a signal handler."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.noted: list[int] = []
        self.active = threading.current_thread() is threading.main_thread()  # (signals reach the main thread only)

    def __call__(self, signum, frame):
        self.noted.append(signum)

    def hold(self) -> None:
        """Be the handler (again: ``ray.init`` sets Ray's own SIGTERM handler in C++ in its last
        few milliseconds, and ``ray.shutdown`` the default one); nothing off the main thread."""
        for s in self.SIGNALS if self.active else ():
            signal.signal(s, self)


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM held back while Ray starts, then raised again once it has started or has
    been shut down (``RayReader``): a signal acted on midway through ``ray.init`` (a
    KeyboardInterrupt, or the SIGTERM handler Ray sets, which exits from inside its start) left its
    threads to crash the process at exit. Neither Ray's Python SIGTERM handler nor its C++
    failure-signal handler (which printed a stack for a SIGTERM in ``ray.init``'s last
    milliseconds) is set meanwhile in this process; the caller calls ``hold()`` after each step
    of the start all the same. Yields the ``_Held`` handler, whose ``noted`` says what came."""
    import ray._private.ray_constants as ray_constants
    import ray._private.utils as ray_utils

    held = _Held()
    if not held.active:
        yield held
        return
    old = {s: signal.getsignal(s) for s in held.SIGNALS}
    held.hold()
    ray_sets, ray_fails = ray_utils.set_sigterm_handler, ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    ray_utils.set_sigterm_handler = lambda handler: None
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True  # (read as the driver's core worker starts)
    try:
        yield held
    finally:
        ray_utils.set_sigterm_handler = ray_sets
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = ray_fails
        for s, handler in old.items():  # (None: a handler not set from Python; the default stands in)
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
    if held.noted:
        signal.raise_signal(held.noted[0])  # (to the handler before: the command's, or Python's KeyboardInterrupt)


def stop_ray(actors: list, started: bool) -> None:
    """Kill ``actors`` (Ray actor handles) and shut Ray down if ``start_ray`` started it here:
    nothing this process began is left running."""
    import ray

    for a in actors:
        ray.kill(a)
    actors.clear()
    if started:
        with signals_deferred():  # (ray.shutdown leaves SIGTERM at its default: the handler before is set back)
            ray.shutdown()


def set_threads(n: int) -> None:
    """torch, FAISS (OpenMP) and numba use ``n`` threads in this process."""
    import faiss
    import numba
    import torch

    torch.set_num_threads(n)
    faiss.omp_set_num_threads(n)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


class _Worker:
    """A Ray actor (made remote in ``RayReader``): the model, loaded once, reads documents."""

    def __init__(self, model: str | None, device: str, block_size: int | None, threads: int):
        from ..models.kinds import load_model

        set_threads(threads)
        self.model = load_model(model, device, block_size).model

    def sees(self, probe: str, token: str) -> bool:
        try:
            return Path(probe).read_text() == token
        except OSError:
            return False

    def read(self, batch: tuple[DocumentJob, ...], progress=None) -> list[DocumentResult]:
        import ray

        context = ray.get_runtime_context()
        return read_batch(batch, self.model, stop=context.is_canceled, on_tokens=_Reporter(progress, batch[0].folder))


class _Reporter:
    """A worker's tokens read, sent to the driver's progress queue (a Ray ``Queue``) at most every
    ``every`` seconds, so that the build's bar moves between commits."""

    def __init__(self, progress, folder: Path, every: float = 1.0):
        self.progress, self.folder, self.every = progress, str(folder), every
        self.unsent, self.last = 0, time.monotonic()

    def __call__(self, n: int) -> None:
        import ray

        self.unsent += n
        if self.progress is not None and time.monotonic() - self.last >= self.every:
            try:
                self.progress.put_nowait((self.folder, self.unsent))
            except ray.exceptions.RayError:  # the bar is a courtesy: reading goes on without it
                self.progress = None
            self.unsent, self.last = 0, time.monotonic()


def check_address(address: str) -> None:
    """Refuse a ``HOST:PORT`` nothing answers at, in seconds rather than after Ray's own retries."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address takes auto or HOST:PORT (what `ray start --head` printed), got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ValueError(f"cannot reach a Ray cluster at {address} ({e.strerror or e}); start one with "
                         "`ray start --head` and pass the address it prints, or drop --ray-address to run "
                         "on this machine") from None


class RayReader:
    """``workers`` Ray actors reading documents with ``threads`` cores each (default: this
    machine's cores shared out when Ray is local, else the cluster's CPUs shared out, at most
    the smallest machine's), started with every one seeing the folder of ``memory`` (when given).
    SIGINT or SIGTERM while they start stops the start cleanly and is then raised again."""

    def __init__(self, workers: int, address: str | None, model: str | None, device: str = "cpu",
                 block_size: int | None = None, threads: int | None = None, memory: str | Path | None = None):
        if workers < 1:
            raise ValueError(f"--workers must be at least 1, got {workers}")
        self.workers, self.address, self.threads, self.memory = workers, address, threads, memory
        self.model_args = (model, device, block_size)
        self._started, self.actors = False, []

    def __enter__(self) -> "RayReader":
        if self.address is not None and "ray" not in sys.modules:  # (a program that imported Ray set it up)
            # Ray 2.52+ clusters authenticate their members with a token (~/.ray/auth_token), which
            # a driver joining by HOST:PORT sends only in token mode, read when Ray is imported
            os.environ.setdefault("RAY_AUTH_MODE", "token")
        try:
            import ray
        except ImportError:
            raise ValueError("--workers reads documents on Ray, which is not installed here: install the package's "
                             "ray extra (pip install -e '.[ray]')") from None

        if not ray.is_initialized() and self.address is None:
            cores = available_cores()
            if self.workers > cores:
                raise ValueError(f"--workers {self.workers} on a machine with {cores} cores: give at most {cores} "
                                 "(one core each), or join a cluster with --ray-address")
            self.threads = self.threads or cores // self.workers
        with signals_deferred() as held:  # (a signal noted: Ray shut down again, then the signal raised)
            try:
                for step in (self._start_ray, self._start_workers, self._check_reaches):
                    if not held.noted:
                        step(ray)
                        held.hold()
            except BaseException:
                self.__exit__(None, None, None)
                raise
            if held.noted:
                self.__exit__(None, None, None)
        return self

    def _start_ray(self, ray):
        self._started = start_ray(self.address, self.workers * (self.threads or 1))

    def _start_workers(self, ray):
        cpus = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]]
        threads = self.threads or max(1, min(int(sum(cpus)) // self.workers, int(max(cpus, default=1))))
        if self.workers * threads > sum(cpus):
            raise ValueError(f"{self.workers} workers of {threads} cores need {self.workers * threads} CPUs; the Ray "
                             f"cluster has {sum(cpus):g}: give fewer --workers")
        self.threads = threads
        worker = ray.remote(_Worker).options(
            num_cpus=threads, max_restarts=RESTARTS, max_task_retries=RESTARTS, scheduling_strategy="SPREAD",
            runtime_env={"env_vars": {**WORKER_ENV, **{v: str(threads) for v in THREAD_VARIABLES}}})
        self.actors = [worker.remote(*self.model_args, threads) for _ in range(self.workers)]

    def _check_reaches(self, ray) -> None:
        """Refuse a memory folder some worker cannot see (a path on this machine's own disk
        while workers run on others): a probe file beside it, removed again."""
        if self.memory is None:
            return
        memory = Path(self.memory)
        where = next(p for p in [memory.resolve(), *memory.resolve().parents] if p.is_dir())
        probe, token = where / f".landmark-memory-probe.{secrets.token_hex(8)}", secrets.token_hex(16)
        probe.write_text(token)
        try:
            seen = ray.get([a.sees.remote(str(probe), token) for a in self.actors])
        finally:
            probe.unlink(missing_ok=True)
        if not all(seen):
            raise ValueError(f"{sum(not s for s in seen)} of {len(seen)} workers cannot see {where}: the memory folder "
                             "must be on a filesystem every worker reaches (a shared disk mounted at the same path "
                             "on every machine)")

    def run(self, jobs, stop, bar):
        if not self.actors:  # a signal stopped the start and Ray is down: any call would start another (auto-init)
            return
        import ray
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        todo, running = list(batches(jobs)), {}  # ref -> (actor, batch)
        # per batch, by its first document's folder: tokens the bar counts; per document folder: tokens committed
        # when it started
        shown, first = {}, {}
        idle, cancelled, polled = list(self.actors), False, time.monotonic()
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        # workers' tokens read since they last said, on this machine (a worker's machine may be lost)
        progress = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})

        def start():  # each idle worker its next batch
            while idle and todo and not cancelled:
                actor, batch = idle.pop(0), todo.pop(0)
                first.update((job.folder, 0 if job.in_memory else _committed(job.folder)) for job in batch)
                shown[batch[0].folder] = sum(first[job.folder] for job in batch)
                running[actor.read.remote(batch, progress)] = (actor, batch)

        try:
            while todo or running:
                start()
                if stop() and not cancelled:  # the documents under way commit and return
                    for ref in running:
                        ray.cancel(ref)
                    cancelled, todo = True, []
                if time.monotonic() - polled >= 1.0:  # (each ask a round trip: workers send at most once a second)
                    polled = time.monotonic()
                    for folder, n in progress.get_nowait_batch(progress.qsize()):  # the bar moves as they read
                        if Path(folder) in shown:  # (a finished document's count is its commit's, below)
                            shown[Path(folder)] += n
                            bar.update(n)
                done, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
                results = []
                for ref in done:
                    actor, batch = running.pop(ref)
                    try:
                        read = ray.get(ref)
                    except ray.exceptions.TaskCancelledError:  # stopped: what it read is what it committed
                        read = [DocumentResult(j.folder, _committed(j.folder) - first[j.folder], False) for j in batch]
                    except ray.exceptions.RayTaskError as e:  # the document's own error, as this process would give it
                        raise e.cause if isinstance(e.cause, (ValueError, OSError)) else e from None
                    except ray.exceptions.RayActorError as e:
                        raise WorkerError(f"the worker reading {batch[0].path} died {RESTARTS + 1} times ({e}); what "
                                          "it committed is kept: run the build again") from None
                    idle.append(actor)
                    kept = sum(r.added if r.read is not None else _committed(r.folder) for r in read)  # RAM: no folder
                    bar.update(kept - shown.pop(batch[0].folder))
                    results += read
                start()  # before the caller merges what came: the workers read on meanwhile
                yield from results
        finally:
            ray.kill(progress.actor)

    def __exit__(self, *exc):
        stop_ray(self.actors, self._started)
        self._started = False


def _committed(folder: Path) -> int:
    """Tokens of the document in ``folder`` its last commit holds (0 before its first, or while
    its manifest is being replaced)."""
    try:
        return committed_tokens(MemoryDir(folder, writable=False).read_manifest())
    except (OSError, ValueError):
        return 0
