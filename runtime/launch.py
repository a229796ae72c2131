"""Start local ranks with an initialised default process group and run functions on them.

Two ways to get an SPMD program onto several ranks of this machine:

* ``launch(fn, world_size, args)`` starts ``world_size`` processes (forked from a
  multiprocessing fork server that has imported torch once; ``spawn`` where there is none),
  initialises the default gloo group on ``tcp://127.0.0.1:<free port>``
  in each, runs ``fn(*args)`` on every rank and returns the results by rank. Under
  ``torchrun`` it spawns nothing: it joins the group torchrun set up, runs ``fn`` in
  this process and all-gathers every rank's result.
* ``RankPool(world_size)`` keeps the ranks alive between calls, so a test module pays the
  start cost once and runs many functions on the same ranks::

      with RankPool(4) as pool:
          losses = pool.run(train_two_steps, config)   # list indexed by rank

Failures never hang the caller. If a rank raises, every rank is killed (the others are
usually blocked in a collective waiting for it) and ``RankError`` carries the failed
rank's traceback; a rank that dies without reporting (segfault, ``os._exit``) gives a
``RankError`` with its exit code; a rank that hangs is named by its peers once their collective
times out (:class:`~graphpass.runtime.rank_progress.HungRankError`), and the ``RankError`` blames
it (``reported_by`` is the peer); a run that outlives ``timeout_s`` kills every rank and
raises ``TimeoutError`` naming the ranks that had not finished. The next ``run`` on the
same pool starts fresh ranks.

A plain torchrun script needs neither: ``graphpass.compile`` calls :func:`join_torchrun_job`,
which joins the job's group as DeepSpeed and Accelerate do, and records each rank's uncaught
error in torch elastic's error file so that torchrun's root cause is the rank that failed first
(:mod:`graphpass.runtime.elastic_errors`).

Functions, arguments and results cross process boundaries by pickle: ``fn`` must be a
module-level function of an importable module (or of the ``__main__`` script, which then
needs an ``if __name__ == "__main__":`` guard, as with any ``spawn`` start). Each rank
starts with the parent's ``sys.path`` and environment as they are at the start, so functions
defined in test modules and scripts resolve.

Only the loopback interface is used: the rendezvous store listens on 127.0.0.1 and,
unless ``GLOO_SOCKET_IFNAME`` is already set, gloo is pinned to the loopback interface.

torchrun on this machine: ``python -m torch.distributed.run --nproc-per-node N
--master-addr 127.0.0.1 --master-port <free_port()> --local-addr 127.0.0.1 script.py``
(the default ``static`` rendezvous for one node) keeps everything on 127.0.0.1; no
hostname lookup is needed.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from graphpass.runtime.elastic_errors import record_uncaught_errors
from graphpass.runtime.mesh import release_at_exit
from graphpass.runtime.rank_progress import HungRankError

__all__ = ["RankError", "RankPool", "free_port", "in_torchrun", "init_from_env", "join_torchrun_job", "launch"]

logger = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# Messages from ranks to the parent: (kind, rank, task_id, payload).
_READY = "ready"  # payload: None
_INIT_FAILED = "init_failed"  # payload: traceback text
_DONE = "done"  # payload: pickled result
_FAILED = "failed"  # payload: (traceback text, ranks a HungRankError names or ())

# How long the parent keeps collecting reports after the first failure before it kills the
# ranks, so that a rank that died (the usual root cause) is blamed rather than a peer whose
# collective broke because of it.
_FAILURE_SETTLE_S = 0.5
# Poll period of the parent's wait loop: bounds the latency of noticing a dead rank.
_POLL_S = 0.05
# Grace between SIGTERM and SIGKILL when tearing ranks down.
_TERMINATE_GRACE_S = 2.0
# Time a clean shutdown waits for ranks to leave their loop before killing them.
_SHUTDOWN_GRACE_S = 5.0
# Spawning a rank imports torch (1-3 s here); allow generous extra time beyond the
# rendezvous timeout before declaring start-up hung.
_STARTUP_EXTRA_S = 60.0
_PORT_RETRIES = 3


class RankError(RuntimeError):
    """A rank failed (or hung) while running a function.

    Attributes:
        rank: The rank that failed, or the rank that hung when its peers' collective timed out
            waiting for it (``reported_by`` is then set).
        remote_traceback: The formatted traceback of that rank (of ``reported_by`` for a hung
            rank: its :class:`~graphpass.runtime.rank_progress.HungRankError`, with the hung
            rank's stack), or ``None`` when the rank died without reporting one.
        exitcode: The rank's process exit code when it died without reporting, else ``None``.
        reported_by: For a hung rank, the rank whose collective timed out waiting for it.
    """

    def __init__(
        self,
        rank: int,
        remote_traceback: str | None,
        *,
        exitcode: int | None = None,
        note: str = "",
        reported_by: int | None = None,
    ) -> None:
        if remote_traceback is not None:
            detail = "\n" + remote_traceback.rstrip()
        else:
            detail = f" process exited with code {exitcode} without reporting a result"
        what = "failed" if reported_by is None else f"hung (reported by rank {reported_by})"
        super().__init__(f"rank {rank} {what}:{detail}{note}")
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        self.reported_by = reported_by
        self._note = note

    def __reduce__(self):
        return (_rebuild_rank_error, (self.rank, self.remote_traceback, self.exitcode, self._note, self.reported_by))


def _rebuild_rank_error(rank, remote_traceback, exitcode, note, reported_by=None):
    return RankError(rank, remote_traceback, exitcode=exitcode, note=note, reported_by=reported_by)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    Another process may take it before it is used; ``RankPool`` retries start-up on a new
    port when the rendezvous finds the port in use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_LOOPBACK, 0))
        return sock.getsockname()[1]


def in_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (or set up like one).

    True when ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are all set.
    Ranks started by ``RankPool`` set them too, so a nested ``launch`` runs in-process.
    """
    return all(name in os.environ for name in _TORCHRUN_ENV)


def init_from_env(timeout_s: float = 60.0, *, backend: str = "gloo") -> None:
    """Initialise the default process group from torchrun's environment, once.

    Does nothing if the default group already exists.

    Args:
        timeout_s: Collective timeout of the group, in seconds.
        backend: Process group backend.

    Raises:
        ValueError: If the torchrun variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
            ``MASTER_PORT``) are not all set.
    """
    record_uncaught_errors()  # torchrun's root cause: the rank that failed first
    if dist.is_initialized():
        return
    missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise ValueError(
            f"init_from_env needs the torchrun environment, but {', '.join(missing)} "
            "is not set; start the script with torchrun or use launch()/RankPool"
        )
    if os.environ["MASTER_ADDR"] in (_LOOPBACK, "localhost"):
        pin_gloo_to_loopback()  # single-node run: keep gloo off external interfaces
    dist.init_process_group(
        backend, init_method="env://", timeout=timedelta(seconds=timeout_s)
    )
    logger.debug("joined the default group as rank %d of %d", dist.get_rank(), dist.get_world_size())


#: Collective timeout a rank joins torchrun's job with (compile's default, which ``compile(timeout_s=)``
#: then replaces): gloo on CPU, NCCL on GPU.
_JOIN_TIMEOUT_S = {"gloo": 300.0, "nccl": 600.0}


def join_torchrun_job() -> None:
    """Join the job's default process group if this is a torchrun rank that has not yet (as
    DeepSpeed and Accelerate do), so a plain torchrun script needs no :func:`launch`.

    The backend is NCCL when CUDA is available (this rank's device set from ``LOCAL_RANK``), else
    gloo; the group is released at exit (:func:`~graphpass.runtime.mesh.release_at_exit`). Does
    nothing outside torchrun or when the group exists, except that a torchrun rank's uncaught
    errors are recorded for torchrun's root cause either way
    (:mod:`graphpass.runtime.elastic_errors`).
    """
    if not in_torchrun():
        return
    record_uncaught_errors()
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    init_from_env(_JOIN_TIMEOUT_S[backend], backend=backend)
    release_at_exit()
    if dist.get_rank() == 0:
        logger.info("joined torchrun's job: %d ranks, %s", dist.get_world_size(), backend)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 300.0,
    backend: str = "gloo",
) -> list:
    """Run ``fn(*args)`` on ``world_size`` local ranks and return the results by rank.

    Each rank runs with an initialised default process group. Outside torchrun this
    spawns the ranks, runs ``fn`` once and shuts them down. Under torchrun (see
    ``in_torchrun``) nothing is spawned: this process joins the group (``init_from_env``),
    runs ``fn`` itself and all-gathers every rank's result, so every rank gets the list; the
    group stays for the rest of the script and is destroyed at its normal exit
    (:func:`graphpass.runtime.mesh.release_at_exit`).

    Args:
        fn: Module-level, picklable function.
        world_size: Number of ranks.
        args: Positional arguments for ``fn``, pickled to every rank.
        timeout_s: Limit on the run (not counting start-up) before all ranks are killed;
            ignored under torchrun, which supervises its own ranks.
        backend: Process group backend.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        RankError: A rank raised or died; all ranks were killed.
        TimeoutError: Some ranks did not finish within ``timeout_s``; all were killed.
        ValueError: Under torchrun, ``world_size`` differs from torchrun's ``WORLD_SIZE``.
    """
    if in_torchrun():
        env_world_size = int(os.environ["WORLD_SIZE"])
        if world_size != env_world_size:
            raise ValueError(
                f"launch(world_size={world_size}) under torchrun with WORLD_SIZE="
                f"{env_world_size}: pass world_size={env_world_size} or change "
                "torchrun's --nproc-per-node"
            )
        init_from_env(backend=backend)
        release_at_exit()
        result = fn(*args)
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, result)
        return gathered
    with RankPool(world_size, backend=backend) as pool:
        return pool.run(fn, *args, timeout_s=timeout_s)


class RankPool:
    """A set of live local ranks that run functions on request.

    The ranks start on the first ``run`` (or ``start``) and stay up until ``close``. A
    failure or timeout kills them all; the next ``run`` starts fresh ones. Ranks are killed
    when the pool is garbage collected or the parent exits, and a rank exits on its own if
    its parent dies.

    Args:
        world_size: Number of ranks.
        backend: Process group backend.
        collective_timeout_s: Timeout of the ranks' default process group.
        initializer: a module-level function each rank calls once, after it joined the group
            and before its first task (e.g. state every task on the rank shares); a rank whose
            initializer raises fails the run that started it.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        collective_timeout_s: float = 60.0,
        initializer: Callable[[], Any] | None = None,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"RankPool world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.backend = backend
        self.collective_timeout_s = collective_timeout_s
        self.initializer = initializer
        self._workers: _Workers | None = None
        self._finalizer: multiprocessing.util.Finalize | None = None
        self._lock = threading.Lock()
        self._next_task_id = 0

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pids={self.pids}" if self._workers else "stopped"
        return f"RankPool(world_size={self.world_size}, backend={self.backend!r}, {state})"

    @property
    def pids(self) -> list[int]:
        """Process ids of the live ranks by rank, or ``[]`` when none are running."""
        return [p.pid for p in self._workers.procs] if self._workers else []

    def start(self) -> None:
        """Start the ranks and wait until each has joined the process group.

        Does nothing if they are already running.

        Raises:
            RankError: A rank failed to start or to join the group.
            TimeoutError: The ranks did not all join in time.
        """
        with self._lock:
            self._ensure_started()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0) -> list:
        """Run ``fn(*args)`` on every rank and return the results by rank.

        Args:
            fn: Module-level, picklable function.
            *args: Positional arguments, pickled to every rank.
            timeout_s: Limit on this run (not counting start-up) before all ranks are killed.

        Returns:
            ``[result of rank 0, result of rank 1, ...]``.

        Raises:
            RankError: A rank raised or died; all ranks were killed.
            TimeoutError: Some ranks did not finish within ``timeout_s``; all were killed.
        """
        # Pickle here, not in the queue's feeder thread, so an unpicklable fn or argument
        # raises in the caller instead of being logged by a background thread.
        try:
            payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"RankPool.run: cannot pickle {_describe(fn)} with its arguments for the "
                f"ranks ({exc}); use a module-level function and picklable arguments"
            ) from exc
        with self._lock:
            workers = self._ensure_started()
            task_id = self._next_task_id
            self._next_task_id += 1
            for task_queue in workers.task_queues:
                task_queue.put((task_id, payload))
            try:
                return self._collect(workers, task_id, fn, timeout_s)
            except BaseException:
                # Includes KeyboardInterrupt and pytest-timeout's exception: never leave
                # ranks running behind an exception.
                self._stop(kill=True)
                raise

    def close(self) -> None:
        """Stop the ranks (cleanly if they are idle, otherwise by killing them)."""
        with self._lock:
            self._stop(kill=False)

    # -- internals -----------------------------------------------------------------

    def _ensure_started(self) -> _Workers:
        if self._workers is not None:
            return self._workers
        for attempt in range(_PORT_RETRIES):
            workers = _Workers.spawn(self.world_size, self.backend, self.collective_timeout_s, self.initializer)
            self._workers = workers
            self._finalizer = multiprocessing.util.Finalize(
                self, workers.shutdown, kwargs={"kill": False}, exitpriority=100
            )
            try:
                self._await_ready(workers)
                return workers
            except RankError as exc:
                self._stop(kill=True)
                port_taken = "address already in use" in str(exc).lower()
                if not port_taken or attempt == _PORT_RETRIES - 1:
                    raise
                logger.info("port %d was taken before rendezvous; retrying", workers.port)
            except BaseException:
                self._stop(kill=True)
                raise
        raise AssertionError("unreachable")

    def _await_ready(self, workers: _Workers) -> None:
        limit_s = self.collective_timeout_s + _STARTUP_EXTRA_S
        deadline = time.monotonic() + limit_s
        waiting = set(range(self.world_size))
        while waiting:
            message = workers.poll(deadline)
            if message is None:
                dead = workers.dead_ranks(waiting)
                if dead:
                    rank, code = dead[0]
                    raise RankError(rank, None, exitcode=code)
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"ranks {sorted(waiting)} of {self.world_size} did not join the "
                        f"process group within {limit_s:.0f} s"
                    )
                continue
            kind, rank, _, payload = message
            if kind == _READY:
                waiting.discard(rank)
            elif kind == _INIT_FAILED:
                raise RankError(rank, payload)
        logger.debug("started %d %s ranks on port %d: pids %s",
                     self.world_size, self.backend, workers.port, self.pids)

    def _collect(self, workers: _Workers, task_id: int, fn, timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        results: list = [None] * self.world_size
        pending = set(range(self.world_size))
        while pending:
            message = workers.poll(deadline)
            if message is not None:
                kind, rank, message_task, payload = message
                if message_task != task_id:
                    continue  # a stale report from an earlier run; cannot happen today
                if kind == _DONE:
                    results[rank] = pickle.loads(payload)
                    pending.discard(rank)
                    continue
                raise self._failure(workers, pending, task_id, first=(rank, payload))
            if workers.dead_ranks(pending):
                raise self._failure(workers, pending, task_id, first=None)
            if time.monotonic() >= deadline:
                self._stop(kill=True)
                raise TimeoutError(
                    f"ranks {sorted(pending)} of {self.world_size} did not finish "
                    f"{_describe(fn)} within timeout_s={timeout_s:g} s; all ranks were killed"
                )
        return results

    def _failure(self, workers: _Workers, pending: set[int], task_id: int,
                 first: tuple[int, tuple[str, tuple[int, ...]]] | None) -> RankError:
        """Collect reports for a moment after a failure, kill the ranks, blame one."""
        reports: dict[int, tuple[str, tuple[int, ...]]] = {}  # rank -> (traceback, ranks it names as hung)
        if first is not None:
            reports[first[0]] = first[1]
        settle_until = time.monotonic() + _FAILURE_SETTLE_S
        while time.monotonic() < settle_until:
            unreported = pending - set(reports)
            if all(workers.procs[r].exitcode is not None for r in unreported):
                break
            message = workers.poll(settle_until)
            if message is not None and message[0] == _FAILED and message[2] == task_id:
                reports.setdefault(message[1], message[3])
        # Drain reports that arrived together with a death.
        while (message := workers.poll(0.0)) is not None:
            if message[0] == _FAILED and message[2] == task_id:
                reports.setdefault(message[1], message[3])
        dead = [(r, c) for r, c in workers.dead_ranks(pending) if r not in reports]
        self._stop(kill=True)
        order = sorted(reports, key=lambda r: (first is None or r != first[0], r))  # the first reporter first
        own = [r for r in order if not reports[r][1]]
        reported_by = None
        # A rank that died is the likeliest root cause: its peers' collectives fail after it. Then a
        # rank that raised on its own; last, a rank its peers name as hung (it never reports).
        if dead:
            (rank, code), error = dead[0], None
        elif own:
            rank, code = own[0], None
            error = reports[rank][0]
        else:
            reported_by = order[0]
            rank, code = min(reports[reported_by][1]), None
            error = reports[reported_by][0]
        others = [f"rank {r}: " + (f"waited for rank {', '.join(map(str, hung))}" if hung else _last_line(tb))
                  for r, (tb, hung) in sorted(reports.items()) if r not in (rank, reported_by)]
        others += [f"rank {r}: exited with code {c}" for r, c in dead if r != rank]
        note = ("\n(also failed: " + "; ".join(others) + ")") if others else ""
        return RankError(rank, error, exitcode=code, note=note, reported_by=reported_by)

    def _stop(self, *, kill: bool) -> None:
        workers, self._workers = self._workers, None
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.cancel()
        if workers is not None:
            workers.shutdown(kill=kill)


class _Workers:
    """One generation of rank processes and the queues that talk to them."""

    def __init__(self, procs, task_queues, result_queue, port: int) -> None:
        self.procs = procs
        self.task_queues = task_queues
        self.result_queue = result_queue
        self.port = port

    @classmethod
    def spawn(cls, world_size: int, backend: str, collective_timeout_s: float,
              initializer: Callable[[], Any] | None = None) -> _Workers:
        ctx = _start_context()
        port = free_port()
        result_queue = ctx.Queue()
        task_queues = [ctx.Queue() for _ in range(world_size)]
        procs = []
        for rank in range(world_size):
            proc = ctx.Process(
                target=_rank_main,
                name=f"graphpass-rank{rank}",
                args=(rank, world_size, port, backend, collective_timeout_s, list(sys.path),
                      dict(os.environ), task_queues[rank], result_queue,
                      None if initializer is None else pickle.dumps(initializer)),
            )
            proc.start()
            procs.append(proc)
        return cls(procs, task_queues, result_queue, port)

    def poll(self, deadline: float):
        """Return the next report, or ``None`` after at most one poll period."""
        wait_s = min(_POLL_S, max(0.0, deadline - time.monotonic()))
        try:
            if wait_s <= 0:
                return self.result_queue.get_nowait()
            return self.result_queue.get(timeout=wait_s)
        except queue.Empty:
            return None

    def dead_ranks(self, ranks) -> list[tuple[int, int]]:
        """``(rank, exit code)`` of the given ranks whose process has exited."""
        return [(r, self.procs[r].exitcode) for r in sorted(ranks)
                if self.procs[r].exitcode is not None]

    def shutdown(self, *, kill: bool) -> None:
        """Stop every rank: ask idle ranks to leave, terminate, then kill what remains."""
        if not kill:
            for task_queue in self.task_queues:
                try:
                    task_queue.put(None)
                except (OSError, ValueError):
                    pass  # queue already closed: the rank is gone; terminate below covers it
            deadline = time.monotonic() + _SHUTDOWN_GRACE_S
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()
        deadline = time.monotonic() + _TERMINATE_GRACE_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:
                logger.warning("rank process %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.join()
        for q in (*self.task_queues, self.result_queue):
            # The feeder thread may hold undelivered data for a dead rank: do not let it
            # block interpreter exit.
            q.cancel_join_thread()
            q.close()
        for proc in self.procs:
            proc.close()
        logger.debug("stopped ranks on port %d (kill=%s)", self.port, kill)


# -- the rank side -------------------------------------------------------------------


#: what the fork server imports before it forks any rank: torch, graphpass's compile path (its
#: pipeline runtime imports torch.distributed.pipelining), what torch.export imports at its first
#: call; 3 s of imports on this machine that no rank then repeats.
_PRELOAD = ["torch", "torch.distributed", "torch.export._trace", "graphpass.api", __name__]


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too before it forks ranks, so that every rank
    starts with them imported (the model libraries a test suite's ranks all import: each rank
    would import them again). Takes effect only before this process's first launch; a module that
    fails to import is left to the ranks."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _start_context() -> multiprocessing.context.BaseContext:
    """How ranks start: forked from a fork server that has imported torch once (a rank then
    starts in a fraction of a second instead of importing torch itself, and leaves with
    ``os._exit`` after multiprocessing's own clean-up, without the interpreter's teardown of
    torch), or spawned where there is no fork server. Never forked from the caller: it may already have run
    multi-threaded torch ops, and forked children of such a process deadlock."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))  # no effect once it runs
    return ctx


def _rank_main(rank: int, world_size: int, port: int, backend: str, collective_timeout_s: float,
               sys_path: list[str], environ: dict[str, str], task_queue, result_queue,
               initializer: bytes | None = None) -> None:
    """Entry point of a rank: join the group, then run tasks until told to stop.

    The rank takes the caller's ``sys.path`` and environment as they are now (a fork server
    started earlier has older ones)."""
    sys.path[:] = sys_path
    os.environ.clear()
    os.environ.update(environ)
    # The parent decides when ranks stop; Ctrl-C reaches it and it kills the ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_when_parent_dies()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    os.environ.update(
        MASTER_ADDR=_LOOPBACK, MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    pin_gloo_to_loopback()
    if backend == "nccl":  # one GPU per rank, as torchrun's LOCAL_RANK convention
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://{_LOOPBACK}:{port}", rank=rank,
            world_size=world_size, timeout=timedelta(seconds=collective_timeout_s),
        )
        if initializer is not None:  # unpickled here, where the caller's sys.path holds
            pickle.loads(initializer)()
    except BaseException:
        result_queue.put((_INIT_FAILED, rank, -1, traceback.format_exc()))
        return
    result_queue.put((_READY, rank, -1, None))
    while True:
        item = task_queue.get()
        if item is None:
            break
        task_id, payload = item
        try:
            fn, args = pickle.loads(payload)
            result = fn(*args)
        except BaseException as exc:  # SystemExit from fn is a failure to report too
            # Skip this frame: the traceback should start in the user's code.
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
            result_queue.put((_FAILED, rank, task_id, (text, _hung_ranks(exc))))
            continue
        try:
            data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            text = (f"the result of {_describe(fn)} ({type(result).__name__}) cannot be "
                    f"pickled back to the parent: {type(exc).__name__}: {exc}")
            result_queue.put((_FAILED, rank, task_id, (text, ())))
            continue
        result_queue.put((_DONE, rank, task_id, data))
    dist.destroy_process_group()


def _hung_ranks(exc: BaseException) -> tuple[int, ...]:
    """The ranks a :class:`HungRankError` in ``exc``'s chain names (the rank's collective timed
    out waiting for them), else ``()``."""
    for _ in range(8):
        if exc is None:
            break
        if isinstance(exc, HungRankError):
            return tuple(exc.ranks)
        exc = exc.__cause__ or exc.__context__
    return ()


def _exit_when_parent_dies() -> None:
    parent = multiprocessing.parent_process()
    parent_pid = os.getppid()

    def watch() -> None:
        if parent is not None:
            multiprocessing.connection.wait([parent.sentinel])
        else:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="graphpass-parent-watch", daemon=True).start()


def pin_gloo_to_loopback() -> None:
    """Make gloo use the loopback interface unless the user chose one."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    names = {name for _, name in socket.if_nameindex()}
    for candidate in ("lo", "lo0"):
        if candidate in names:
            os.environ["GLOO_SOCKET_IFNAME"] = candidate
            return


def _describe(fn) -> str:
    module = getattr(fn, "__module__", "?")
    if module == "__mp_main__":  # the parent's __main__ as re-imported by a spawned rank
        module = "__main__"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
