"""torch elastic's error files, written so that torchrun's root cause is the rank that failed first.

torchrun (its elastic agent) gives each rank a file, ``TORCHELASTIC_ERROR_FILE``, and reports as the
job's *root cause* the failure with the smallest timestamp: the one in the rank's error file, or,
for a rank that left none, the time the agent noticed the exit. Timestamps are whole seconds and
ties go to the lowest rank. Left alone, a rank whose collective broke *because* a peer died (gloo:
"Connection closed by peer") often exits in the same second as that peer, or records its own
error first, and is blamed instead of it (issue 37).

:func:`record_uncaught_errors` installs, once per torchrun rank, a ``sys.excepthook`` that prints
the traceback as usual and then:

- *a failure of its own* (any exception that is not a peer's): writes the error file at once,
  stamped now, as torch's ``@record`` does;
- *a peer's failure seen through a collective* (the connection to a peer closed or reset): writes
  nothing yet and waits, up to :data:`PEER_FAILURE_WAIT_S`, for the agent, which notices the failed
  peer first and stops this rank with SIGTERM; only then is the error file written, stamped with
  that moment, later than the peer's. A rank that is never stopped writes it when the wait ends;
- a :class:`~graphpass.runtime.rank_progress.HungRankError` (a collective timed out and the rank
  named the ranks that did not arrive): written at once; the hung rank has already written its
  own file, stamped with the time it was last seen, which is earlier
  (:mod:`graphpass.runtime.rank_progress`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback

__all__ = ["error_file", "is_peer_failure", "record_uncaught_errors", "write_error_file"]

logger = logging.getLogger(__name__)

#: How long a rank whose collective failed because of a peer waits to be stopped by torchrun's
#: agent before it records its error anyway. The agent polls its workers every
#: ``--monitor-interval`` (0.1 s by default) and stops the others at once, so this is reached only
#: when no peer failed on this node (a broken network, a peer on another node whose agent is slow).
PEER_FAILURE_WAIT_S = 30.0

# What gloo and NCCL say when the peer at the other end of a collective went away.
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "nccl communicator was aborted", "socket closed")

_INSTALLED: list[bool] = []


def error_file() -> str | None:
    """The error file torchrun's agent gave this rank, or None outside torchrun."""
    return os.environ.get("TORCHELASTIC_ERROR_FILE") or None


def write_error_file(message: str, callstack: str, timestamp: float) -> bool:
    """Write torch elastic's error file (``{"message": {"message", "extraInfo": {"py_callstack",
    "timestamp"}}}``, as ``ErrorHandler.record_exception`` writes it) atomically.

    Args:
        message: the one-line error, ``"ValueError: ..."``.
        callstack: the traceback text torchrun prints under the root cause.
        timestamp: when the failure happened (seconds since the epoch; torch keeps whole seconds).

    Returns:
        Whether a file was written (False outside torchrun or when it cannot be written).
    """
    path = error_file()
    if path is None:
        return False
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": callstack, "timestamp": str(int(timestamp))}}}
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not write torch elastic's error file %s: %s", path, exc)
        return False
    return True


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a collective failing because the
    peer at its other end went away."""
    return any(isinstance(e, RuntimeError) and any(s in str(e).lower() for s in _PEER_GONE)
               for e in _chain(exc))


def _is_diagnosed_hang(exc: BaseException) -> bool:
    return any(type(e).__name__ == "HungRankError" for e in _chain(exc))


def record_uncaught_errors() -> None:
    """Under torchrun's agent, record an uncaught exception in the rank's error file so that the
    rank that failed first is torchrun's root cause (see the module docstring). Installed once;
    the previous ``sys.excepthook`` still prints the traceback. Does nothing outside torchrun."""
    if _INSTALLED or error_file() is None:
        return
    _INSTALLED.append(True)
    previous = sys.excepthook

    def hook(exc_type, exc, tb) -> None:
        previous(exc_type, exc, tb)
        try:
            _record(exc)
        except Exception:  # recording must never hide the error itself
            logger.debug("recording the error for torchrun failed", exc_info=True)

    sys.excepthook = hook


def _record(exc: BaseException) -> None:
    message = f"{type(exc).__name__}: {exc}"
    callstack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if _is_diagnosed_hang(exc) or not is_peer_failure(exc):
        write_error_file(message, callstack, time.time())
        return
    # A peer's failure: an error file written now could carry an earlier second than the agent
    # gives that peer. Remove one torch's own @record may have written, wait to be stopped.
    path = error_file()
    if path and os.path.exists(path):
        os.remove(path)

    def stopped(signum, frame) -> None:
        write_error_file(message, callstack, time.time())
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, stopped)
    logger.info("a collective failed because a peer did; waiting up to %.0f s for torchrun to stop "
                "this rank so that the peer is reported as the root cause", PEER_FAILURE_WAIT_S)
    time.sleep(PEER_FAILURE_WAIT_S)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    write_error_file(message, callstack, time.time())
