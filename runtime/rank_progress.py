"""Where each rank is in training, so that a collective that times out names the rank it waited for.

Every rank keeps one record of its progress: the step it runs and the collective op it entered
last (``all_reduce_grads bucket 0 of step 2``), with a count of the ops entered so far. The
runtime's collective ops call :func:`enter` (a tuple assignment: no communication), the step
program wraps each step in :func:`watching`. A daemon thread publishes the record to the job's
store (the default process group's c10d store, over a connection of its own) when it has changed,
at most every :data:`PUBLISH_PERIOD_S`, so a step makes no store round trip.

When a collective raises the backend's timeout inside a step, the rank reads every rank's record
and names the ranks whose count is behind its own: every rank runs the same program, so they did
not reach the op it waits in. It leaves each of them a notice in the store; the named rank's
thread (alive while its main thread sleeps or waits) answers with its main thread's stack, logs
it and, under torchrun, writes it to torch elastic's error file stamped with the time the rank
was last seen, so that torchrun's root cause is the hung rank
(:mod:`graphpass.runtime.elastic_errors`). The waiting rank then raises :class:`HungRankError`::

    rank 1 did not reach all_gather_params group 0 of step 2 (last seen 6.4 s ago: the start of
    step 2); rank 0 waited 6.0 s for it. Rank 1 is at:
      File "train.py", line 35, in load_batch
        time.sleep(10_000)

Under ``gp.launch`` the :class:`~graphpass.runtime.launch.RankError` then names the hung rank.

Pipeline stages run different programs on different ranks, so their op counts do not compare:
a pipeline step is watched with ``by_ops=False`` and ranks are compared by step (a rank that has
not started the step another waits in is named; two ranks inside the same step are not told
apart, and the timeout then propagates with every rank's last record in a note).

Limits: a rank whose main thread holds the GIL forever cannot answer (its last record still
names it); NCCL's watchdog may end the process before Python
sees its timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING``). Ranks on different machines compare
wall clocks for "last seen".
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Iterator

import torch
import torch.distributed as dist

from graphpass.runtime.elastic_errors import write_error_file

__all__ = ["HungRankError", "diagnose", "enter", "label", "watching"]

logger = logging.getLogger(__name__)

#: Longest time a changed record waits to be published. Every rank that a timeout names has been
#: stuck for the whole collective timeout, so its record is current by then.
PUBLISH_PERIOD_S = 0.5
#: How long a rank whose collective timed out waits for the named ranks' stacks (each answers
#: within a publishing period when its thread runs).
ANSWER_WAIT_S = 5.0
_STACK_FRAMES = 6
_TORCH_DIR = os.path.dirname(torch.__file__)
_PREFIX = "graphpass/progress/"
_RECENT_OPS = 1024  # ops remembered, to name the one a rank behind did not reach

_STEP_STARTED, _STEP_DONE = "the start of step", "the end of step"

# The record: (ops entered, op, index, step, inside the step, wall time). Replaced whole, so the
# publishing thread reads a consistent one without a lock.
_count = 0
_step = 0
_in_step = False
_last: tuple = (0, None, None, 0, False, time.time())
_by_ops = True  # whether the step running (or last run) compares ranks by ops entered
_step_started_at = time.time()
_recent: collections.deque = collections.deque(maxlen=_RECENT_OPS)
_publisher: list = [None, None]  # [thread, pid that started it]
_stop = threading.Event()


class HungRankError(RuntimeError):
    """A collective timed out, and these ranks had not reached it.

    Attributes:
        ranks: the ranks that did not reach the collective.
        collective: per rank of ``ranks``, the op it did not reach (``"all_reduce_grads bucket 0
            of step 2"``).
        last_seen: per rank of ``ranks``, ``(what it entered last, seconds since)``.
        stacks: per rank that answered, its main thread's stack.
        reported_by: the rank whose collective timed out.
        waited_s: how long that rank waited.
    """

    def __init__(self, ranks, collective, last_seen, stacks, reported_by, waited_s):
        self.ranks = sorted(ranks)
        self.collective = dict(collective)
        self.last_seen = dict(last_seen)
        self.stacks = dict(stacks)
        self.reported_by = reported_by
        self.waited_s = waited_s
        parts = [f"rank {r} did not reach {self.collective[r]} (last seen {self.last_seen[r][1]:.1f} s ago: "
                 f"{self.last_seen[r][0]})" for r in self.ranks]
        them = "it" if len(self.ranks) == 1 else "them"
        text = "; ".join(parts) + f"; rank {reported_by} waited {waited_s:.1f} s for {them}."
        for r in self.ranks:
            if r in self.stacks:
                text += f"\nRank {r} is at:\n{self.stacks[r].rstrip()}"
        super().__init__(text)

    def __reduce__(self):
        return (HungRankError, (self.ranks, self.collective, self.last_seen, self.stacks, self.reported_by,
                                self.waited_s))


def label(record: tuple) -> str:
    """What a progress record says, in words: ``"all_gather_params group 0 of step 2"``."""
    _, op, index, step, in_step, _ = record
    if op is None:
        return "no collective yet"
    if op in (_STEP_STARTED, _STEP_DONE):
        return f"{op} {step}"
    name = op if index is None else f"{op} {index}"
    if in_step:
        return f"{name} of step {step}"
    return f"{name} after step {step}" if step else name


def enter(op: str, index: int | None = None) -> None:
    """Record that this rank enters the collective ``op`` (its ``index``: bucket, group).

    Called by the runtime's collective ops where they launch their communication, on every rank
    alike (the counts must agree across ranks running the same program)."""
    global _count, _last
    _count += 1
    _last = record = (_count, op, index, _step, _in_step, time.time())
    _recent.append(record)


@contextlib.contextmanager
def watching(step: int, by_ops: bool = True) -> Iterator[None]:
    """Run a training step as step number ``step``: its collectives are labelled with it, and a
    collective timeout inside it raises :class:`HungRankError` naming the ranks that did not
    arrive (when some are behind; otherwise the timeout propagates unchanged).

    ``by_ops=False`` where ranks run different programs (pipeline stages): ranks are then
    compared by step only."""
    global _step, _in_step, _last, _by_ops, _step_started_at
    _step, _in_step, _by_ops = step, True, by_ops
    _step_started_at = time.time()
    _last = (_count, _STEP_STARTED, None, step, True, _step_started_at)
    _start_publisher()
    try:
        yield
    except Exception as exc:
        hung = diagnose(exc)
        if hung is not None:
            raise hung from exc
        raise
    finally:
        _in_step = False
    _last = (_count, _STEP_DONE, None, step, False, time.time())


# -- publishing --------------------------------------------------------------------------------


def _start_publisher() -> None:
    thread, pid = _publisher
    if (thread is not None and pid == os.getpid()) or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    thread = threading.Thread(target=_publish_loop, name="graphpass-rank-progress", daemon=True)
    _publisher[:] = [thread, os.getpid()]
    _stop.clear()
    thread.start()
    atexit.register(_stop_publisher, thread)


def _stop_publisher(thread: threading.Thread) -> None:
    """Stop the thread at exit, while the interpreter is whole: a daemon thread caught inside a
    store call when the interpreter finalizes is ended in C++ code, which aborts the process (the
    failure :func:`graphpass.runtime.mesh.release_at_exit` describes)."""
    _stop.set()
    thread.join(timeout=5.0)


def _key(kind: str, rank: int) -> str:
    return f"{kind}/{rank}"


def _encode(record: tuple) -> str:
    return json.dumps({"count": record[0], "label": label(record), "time": record[5],
                       "position": _position(record)})


def _position(record: tuple) -> tuple[int, int]:
    """Where a record stands by steps alone: (step, 1) inside it, (step, 2) after it."""
    return (record[3], 1 if record[4] else 2)


def _store() -> dist.Store:
    """A new connection to the default group's store, under graphpass's prefix."""
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore(_PREFIX, _get_default_store().clone())


def _publish_loop() -> None:
    group, store, sent, answered = None, None, None, False
    while not _stop.wait(PUBLISH_PERIOD_S):
        try:
            if not dist.is_initialized():
                group = store = None
                continue
            if group is not dist.group.WORLD:  # a new default group (one process, several jobs)
                group, store, sent, answered = dist.group.WORLD, _store(), None, False
            rank = dist.get_rank()
            record = _last
            if record is not sent:
                store.set(_key("rank", rank), _encode(record))
                sent = record
            if not answered and store.check([_key("notice", rank)]):
                _answer(store, rank, json.loads(store.get(_key("notice", rank))))
                answered = True
        except Exception:  # the store went away (its host rank died, the group was destroyed)
            logger.debug("publishing this rank's progress failed", exc_info=True)
            group = store = None
            _stop.wait(5 * PUBLISH_PERIOD_S)


def _main_stack() -> str:
    """The innermost frames of the main thread, torch's own left out but for the innermost (a
    rank blocked in a torch call shows that call and the user code around it)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "  (its main thread has ended)\n"
    frames = traceback.extract_stack(frame)
    kept = [f for f in frames[:-1] if not f.filename.startswith(_TORCH_DIR)][-_STACK_FRAMES:] + frames[-1:]
    return "".join(traceback.format_list(kept))


def _answer(store: dist.Store, rank: int, notice: dict) -> None:
    """This rank was named as hung: say where it is, in the log, torchrun's error file and the store."""
    record = _last
    stack = _main_stack()
    headline = (f"rank {rank} did not reach {notice['missed']}: rank {notice['by']} waited for it; it was last "
                f"seen {time.time() - record[5]:.1f} s ago at {label(record)}")
    logger.error("%s and is at:\n%s", headline, stack)
    # Stamped with the time the rank was last seen: earlier than the waiting ranks' own errors,
    # so torchrun reports this rank as the root cause (torchrun prints the callstack).
    write_error_file(f"HungRankError: {headline}", f"HungRankError: {headline}; it is at:\n{stack}", record[5])
    store.set(_key("answer", rank), stack)


# -- diagnosis -----------------------------------------------------------------------------------


def _timed_out(exc: BaseException) -> bool:
    seen = 0
    while exc is not None and seen < 8:
        text = str(exc).lower()
        if isinstance(exc, RuntimeError) and ("timed out" in text or "timing out" in text or "timeout" in text):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def diagnose(exc: BaseException) -> HungRankError | None:
    """If ``exc`` is a collective timeout and some ranks are behind this one, the
    :class:`HungRankError` naming them (after collecting their stacks); else None."""
    if not _timed_out(exc) or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    try:
        return _diagnose(exc)
    except Exception:  # a diagnosis that fails must not hide the timeout itself
        logger.warning("could not find which rank the timed-out collective waited for", exc_info=True)
        return None


def _diagnose(exc: BaseException) -> HungRankError | None:
    me, world = dist.get_rank(), dist.get_world_size()
    mine = _last
    store = _store()
    store.set(_key("rank", me), _encode(mine))
    now = time.time()
    records = {}
    for r in range(world):
        if r != me and store.check([_key("rank", r)]):
            records[r] = json.loads(store.get(_key("rank", r)))
    if _by_ops:
        behind = [r for r in range(world) if r != me and records.get(r, {"count": -1})["count"] < mine[0]]
    else:  # pipeline stages: by step
        behind = [r for r in range(world) if r != me and r in records
                  and tuple(records[r]["position"]) < _position(mine)]
    if not behind:
        seen = "; ".join(f"rank {r}: {records[r]['label']}" for r in sorted(records))
        exc.add_note(f"every rank had reached {label(mine)} or beyond (last seen: {seen})")
        return None
    ops = {record[0]: record for record in _recent}
    missed, waited_s = {}, 0.0
    for r in behind:  # the op after its last one; a rank never seen missed (at least) this one's
        if _by_ops:
            op = ops.get(records[r]["count"] + 1, mine) if r in records else mine
            missed[r] = label(op)
            waited_s = max(waited_s, now - op[5])
        else:  # the step this rank is in, which the other has not started
            missed[r] = f"{_STEP_STARTED} {mine[3]} (a pipeline step)"
            waited_s = max(waited_s, now - _step_started_at)
    last_seen = {r: ((records[r]["label"], now - records[r]["time"]) if r in records else ("nothing yet", 0.0))
                 for r in behind}
    for r in behind:
        store.set(_key("notice", r), json.dumps({"by": me, "missed": missed[r]}))
    stacks: dict[int, str] = {}
    deadline = time.monotonic() + ANSWER_WAIT_S
    while len(stacks) < len(behind) and time.monotonic() < deadline:
        for r in behind:
            if r not in stacks and store.check([_key("answer", r)]):
                stacks[r] = store.get(_key("answer", r)).decode()
        time.sleep(0.05)
    return HungRankError(behind, missed, last_seen, stacks, me, waited_s)
