"""Tests of graphpass.runtime.rank_progress (which rank a timed-out collective waited for) and
graphpass.runtime.elastic_errors (torchrun's root cause is the rank that failed first).

The compiled-job cases (a rank sleeping inside step 2, on 2 and 4 ranks and under torchrun) are in
test_fail_fast.py; here the diagnosis runs on two bare ranks, one of which has entered fewer ops.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

import graphpass as gp
from graphpass.runtime import elastic_errors, rank_progress
from graphpass.runtime.launch import RankError, launch

_TIMEOUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms for recv operation")


# -- functions run on the ranks ---------------------------------------------------------------


def _store():
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore("graphpass/progress/", _get_default_store())


def _published_count(store, rank: int) -> int:
    key = f"rank/{rank}"
    return json.loads(store.get(key))["count"] if store.check([key]) else -1


def diagnose_a_timeout_on_rank_0(ops_on_rank_1: int):
    """Both ranks run step 3; rank 0 enters three ops, rank 1 ``ops_on_rank_1``. Rank 1 then
    waits (its main thread asleep, as a hung rank's) until rank 0 has diagnosed a timeout."""
    rank, store = dist.get_rank(), _store()
    start = rank_progress._count  # ops entered by earlier functions on these ranks
    with rank_progress.watching(3):
        for i in range(3 if rank == 0 else ops_on_rank_1):
            rank_progress.enter("all_reduce_grads bucket", i)
        if rank == 1:
            while not store.check(["test/done"]):
                time.sleep(0.05)
            return None
        deadline = time.monotonic() + 60  # rank 1's thread publishes within PUBLISH_PERIOD_S
        while _published_count(store, 1) < start + ops_on_rank_1 and time.monotonic() < deadline:
            time.sleep(0.05)
        exc = RuntimeError(str(_TIMEOUT))
        hung = rank_progress.diagnose(exc)
        store.set("test/done", "1")
        if hung is None:
            return None, getattr(exc, "__notes__", [])
        return str(hung), hung.ranks, hung.collective, pickle.loads(pickle.dumps(hung)).ranks


# -- tests -----------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_timed_out_rank_names_the_rank_behind_it_the_op_it_missed_and_where_it_is():
    text, ranks, collective, unpickled = launch(diagnose_a_timeout_on_rank_0, 2, (1,))[0]
    assert ranks == unpickled == [1]
    assert collective == {1: "all_reduce_grads bucket 1 of step 3"}  # the op after its last one
    assert text.startswith("rank 1 did not reach all_reduce_grads bucket 1 of step 3 (last seen "), text
    assert " s ago: all_reduce_grads bucket 0 of step 3); rank 0 waited " in text, text
    # Rank 1's thread answered with its main thread's stack: the loop it sleeps in.
    assert "Rank 1 is at:" in text and "in diagnose_a_timeout_on_rank_0\n    time.sleep(0.05)" in text, text


@pytest.mark.timeout(120)
def test_a_timeout_that_no_rank_is_behind_for_is_left_as_it_was_with_a_note():
    hung, notes = launch(diagnose_a_timeout_on_rank_0, 2, (3,))[0]
    assert hung is None
    assert notes and notes[0].startswith("every rank had reached all_reduce_grads bucket 2 of step 3"), notes


def test_progress_labels_say_the_op_and_the_step():
    assert rank_progress.label((5, "all_reduce_grads bucket", 0, 2, True, 0.0)) == "all_reduce_grads bucket 0 of step 2"
    assert rank_progress.label((5, "tp_all_reduce", None, 2, False, 0.0)) == "tp_all_reduce after step 2"
    assert rank_progress.label((5, "all_gather_params group", 1, 0, False, 0.0)) == "all_gather_params group 1"
    assert rank_progress.label((5, rank_progress._STEP_STARTED, None, 2, True, 0.0)) == "the start of step 2"
    assert rank_progress.label((0, None, None, 0, False, 0.0)) == "no collective yet"


def test_only_timeouts_are_diagnosed():
    assert rank_progress._timed_out(_TIMEOUT)
    assert not rank_progress._timed_out(ValueError("Timed out"))  # a user's error, not a collective's
    assert not rank_progress._timed_out(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = _TIMEOUT
    assert rank_progress._timed_out(wrapped)
    assert rank_progress.diagnose(_TIMEOUT) is None  # no process group here: nothing to ask


def test_hung_rank_error_is_exported_and_names_each_rank():
    error = gp.HungRankError([3, 1], {1: "a of step 2", 3: "b of step 2"}, {1: ("x", 7.0), 3: ("y", 6.5)},
                             {3: '  File "t.py", line 1, in f\n    g()\n'}, 0, 6.0)
    assert str(error) == ("rank 1 did not reach a of step 2 (last seen 7.0 s ago: x); rank 3 did not reach "
                          "b of step 2 (last seen 6.5 s ago: y); rank 0 waited 6.0 s for them.\n"
                          'Rank 3 is at:\n  File "t.py", line 1, in f\n    g()')
    assert str(pickle.loads(pickle.dumps(error))) == str(error)
    assert isinstance(error, Exception)


def test_rank_error_of_a_hung_rank_says_who_reported_it():
    error = pickle.loads(pickle.dumps(RankError(1, "Traceback ...\nHungRankError: rank 1 did not reach x",
                                                reported_by=0)))
    assert (error.rank, error.reported_by) == (1, 0)
    assert str(error).startswith("rank 1 hung (reported by rank 0):\nTraceback")


# -- torch elastic's error files ---------------------------------------------------------------------

_FAIL = textwrap.dedent("""
    import sys, time
    from graphpass.runtime import elastic_errors
    elastic_errors.PEER_FAILURE_WAIT_S = float(sys.argv[2])
    elastic_errors.record_uncaught_errors()
    print("READY", flush=True)
    if sys.argv[1] == "own":
        raise ValueError("bad batch")
    if sys.argv[1] == "peer":
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8577")
    from graphpass.runtime.rank_progress import HungRankError
    raise HungRankError([1], {1: "x of step 2"}, {1: ("y", 9.0)}, {}, 0, 9.0)
""")


def _fail(tmp_path, kind: str, wait_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    path = str(tmp_path / "error.json")
    proc = subprocess.Popen([sys.executable, "-c", _FAIL, kind, str(wait_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "TORCHELASTIC_ERROR_FILE": path})
    assert proc.stdout.readline().strip() == "READY"
    return proc, path


def _output(proc: subprocess.Popen) -> str:
    """The rest of its output once it has exited (``communicate`` would skip what ``readline``
    buffered)."""
    proc.wait(timeout=60)
    return proc.stdout.read()


def _recorded(path: str) -> tuple[str, int]:
    with open(path) as f:
        message = json.load(f)["message"]
    return message["message"], int(message["extraInfo"]["timestamp"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind, says", [("own", "ValueError: bad batch"), ("hang", "HungRankError: rank 1 did not")])
def test_a_ranks_own_error_is_recorded_for_torchrun_at_once(tmp_path, kind, says):
    before = int(time.time())
    proc, path = _fail(tmp_path, kind)
    out = _output(proc)
    assert proc.returncode == 1, out
    assert says in out  # the traceback is printed as usual
    message, stamp = _recorded(path)
    assert message.startswith(says) and before <= stamp <= time.time(), (message, stamp)


@pytest.mark.timeout(120)
def test_a_peers_failure_is_recorded_only_once_torchrun_stops_the_rank(tmp_path):
    """A rank whose collective failed because its peer died waits for torchrun's agent, which stops
    it after noticing the peer: the error file it then writes is stamped later than the peer's
    failure (a tie goes to the peer, noticed first)."""
    proc, path = _fail(tmp_path, "peer")
    time.sleep(1.0)  # it prints its traceback, then waits; nothing recorded yet (any time: a bound)
    assert proc.poll() is None and not os.path.exists(path)
    stopped = int(time.time())
    proc.send_signal(signal.SIGTERM)
    out = _output(proc)
    assert proc.returncode == -signal.SIGTERM, out
    assert "Connection closed by peer" in out
    message, stamp = _recorded(path)
    assert message.startswith("RuntimeError: [gloo") and stamp >= stopped, (message, stamp, stopped)


@pytest.mark.timeout(120)
def test_a_peers_failure_is_recorded_when_nobody_stops_the_rank(tmp_path):
    proc, path = _fail(tmp_path, "peer", wait_s=0.5)
    out = _output(proc)
    assert proc.returncode == 1, out
    assert _recorded(path)[0].startswith("RuntimeError: [gloo")


def test_errors_are_not_recorded_outside_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    hook = sys.excepthook
    elastic_errors.record_uncaught_errors()
    assert sys.excepthook is hook
    assert not elastic_errors.write_error_file("x", "y", 0)
