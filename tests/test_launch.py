"""Tests of graphpass.runtime.launch: spawning ranks, reusing them, and failing fast.

Functions run on ranks are module-level so that they pickle.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from graphpass.runtime.launch import RankError, RankPool, free_port, in_torchrun, launch

_TESTS_DIR = pathlib.Path(__file__).resolve().parent
_REPO_ROOT = _TESTS_DIR.parent
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


# -- functions run on the ranks ---------------------------------------------------------


def rank_and_sum(offset):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item() + offset


def rank_and_pid():
    return dist.get_rank(), os.getpid()


def gather_ranks():
    out = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.tensor([dist.get_rank()]))
    return out


def env_and_threads():
    return (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"],
            torch.get_num_threads(), in_torchrun())


def raise_on_rank_2_while_others_all_reduce():
    if dist.get_rank() == 2:
        raise ValueError("bad shape on rank two")
    dist.all_reduce(torch.ones(4))  # blocks: rank 2 never joins
    return "unreachable"


def exit_3_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(4))
    return "unreachable"


def sleep_forever_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(10_000)
    return dist.get_rank()


def _assert_dead(pids):
    alive_children = {p.pid for p in multiprocessing.active_children()}
    for pid in pids:
        assert pid not in alive_children, f"rank process {pid} is still a live child"
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# -- tests -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_launch_returns_results_by_rank():
    results = launch(rank_and_sum, 2, (10.0,))
    assert results == [(0, 11.0), (1, 11.0)]


@pytest.mark.timeout(60)
def test_pool_runs_several_functions_on_the_same_ranks(rank_pool):
    pool = rank_pool(4)
    first = pool.run(rank_and_pid)
    assert [rank for rank, _ in first] == [0, 1, 2, 3]
    pids = [pid for _, pid in first]
    assert pids == pool.pids and os.getpid() not in pids

    gathered = pool.run(gather_ranks)
    for tensor in gathered:
        assert torch.equal(tensor, torch.arange(4))
    # 2 cores / 4 ranks -> 1 thread each; the ranks look like torchrun ranks.
    expected_threads = max(1, (os.cpu_count() or 1) // 4)
    assert pool.run(env_and_threads) == [
        (str(r), "4", "127.0.0.1", expected_threads, True) for r in range(4)
    ]
    assert [pid for _, pid in pool.run(rank_and_pid)] == pids


@pytest.mark.timeout(90)
def test_rank_error_names_the_rank_and_kills_blocked_peers(rank_pool):
    pool = rank_pool(4)
    old_pids = [pid for _, pid in pool.run(rank_and_pid)]

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        pool.run(raise_on_rank_2_while_others_all_reduce)
    elapsed = time.monotonic() - start

    # The peers block in all_reduce for up to the 60 s collective timeout; the pool must
    # not wait for them.
    assert elapsed < 30, f"failure took {elapsed:.1f} s to surface"
    error = info.value
    assert error.rank == 2
    assert str(error).startswith("rank 2 failed:")
    assert "ValueError: bad shape on rank two" in str(error)
    assert "raise_on_rank_2_while_others_all_reduce" in error.remote_traceback
    _assert_dead(old_pids)
    assert pool.pids == []

    # The same pool object restarts fresh ranks.
    again = pool.run(rank_and_sum, 0.5)
    assert again == [(r, 6.5) for r in range(4)]
    assert set(pool.pids).isdisjoint(old_pids)


@pytest.mark.timeout(60)
def test_rank_that_exits_without_reporting_gives_its_exit_code(rank_pool):
    pool = rank_pool(2)
    with pytest.raises(RankError) as info:
        pool.run(exit_3_on_rank_1)
    assert info.value.rank == 1
    assert info.value.exitcode == 3
    assert str(info.value).startswith("rank 1 failed: process exited with code 3")


@pytest.mark.timeout(60)
def test_timeout_names_the_unfinished_rank_and_kills_all(rank_pool):
    pool = rank_pool(2)
    pids = [pid for _, pid in pool.run(rank_and_pid)]
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not finish .*timeout_s=3 s"):
        pool.run(sleep_forever_on_rank_1, timeout_s=3)
    assert time.monotonic() - start < 15
    _assert_dead(pids)
    assert pool.pids == []  # the next run restarts (covered by the RankError test)


def test_unpicklable_function_is_rejected_before_spawning():
    pool = RankPool(2)
    with pytest.raises(TypeError, match="cannot pickle"):
        pool.run(lambda: 0)
    assert pool.pids == []


_INITIALIZED: list[int] = []


def note_initialized() -> None:
    _INITIALIZED.append(len(_INITIALIZED))


def initializer_fails() -> None:
    raise KeyError("no dataset here")


def times_initialized() -> list[int]:
    return list(_INITIALIZED)


def test_a_pools_initializer_runs_once_on_each_rank_and_its_failure_names_the_rank():
    with RankPool(2, initializer=note_initialized) as pool:
        pool.run(times_initialized)
        assert pool.run(times_initialized) == [[0], [0]]  # once per rank, not per task
    with RankPool(2, initializer=initializer_fails) as pool:
        with pytest.raises(RankError, match=r"rank \d failed:(.|\n)*KeyError: 'no dataset here'"):
            pool.run(times_initialized)


def test_rank_error_survives_pickling():
    error = pickle.loads(pickle.dumps(RankError(3, "Traceback ...\nKeyError: 'x'")))
    assert (error.rank, error.remote_traceback, str(error)) == (
        3, "Traceback ...\nKeyError: 'x'", "rank 3 failed:\nTraceback ...\nKeyError: 'x'")


def test_launch_under_torchrun_rejects_another_world_size(monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    assert in_torchrun()
    with pytest.raises(ValueError, match=r"world_size=2.*WORLD_SIZE=4"):
        launch(rank_and_sum, 2, (0.0,))


def _clean_env():
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV}
    return env


def _run_bounded(cmd, timeout_s, env=None):
    """Run cmd in its own session; on timeout kill the whole session (it may have ranks)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**_clean_env(), **(env or {})}, cwd=_REPO_ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd} did not finish within {timeout_s} s:\n{out}")
    return proc.returncode, out


@pytest.mark.timeout(90)
def test_launch_under_torchrun_joins_its_group_instead_of_spawning():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--local-addr", "127.0.0.1", str(_TESTS_DIR / "_torchrun_script.py")]
    returncode, out = _run_bounded(cmd, timeout_s=75)
    assert returncode == 0, out
    assert "RESULTS [(0, 3.0, 'hello'), (1, 3.0, 'hello')]" in out, out
    # fn ran in torchrun's own worker processes (rank 0's pid is in the list).
    pids_line = next(line for line in out.splitlines() if line.startswith("PIDS"))
    rank_pids, rank0_pid = pids_line.split("]")[0], pids_line.split("]")[1]
    assert rank0_pid.strip() in rank_pids
    # graphpass.compile inside torchrun: the planner's plan over torchrun's 2 ranks (data
    # parallel or pipeline stages), and the loss of each step matches one process (tolerance:
    # fp32 reduction order, see test_dp.py).
    import ast

    import zoo

    trained = ast.literal_eval(next(line for line in out.splitlines() if line.startswith("TRAINED"))[8:])
    ref_losses, _, _ = zoo.train_reference("gpt", steps=2, batch=4)
    for mesh, losses in trained:
        assert math.prod(mesh.values()) == 2, mesh
        assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.timeout(150)
def test_a_plain_torchrun_script_compiles_without_launch_and_matches_one_process(tmp_path):
    """``gp.compile(model, gp.Cluster.local(), ...)`` in a torchrun script that never calls
    ``gp.launch`` nor ``init_process_group`` joins torchrun's job (gloo here, no CUDA) and trains as
    one process does; the unprofiled-cluster warning is printed once for the job, not per rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--local-addr", "127.0.0.1", str(_TESTS_DIR / "_plain_torchrun_script.py"), str(tmp_path)]
    # An empty cache: no profile of this machine, so Cluster.local warns.
    returncode, out = _run_bounded(cmd, timeout_s=135, env={"GRAPHPASS_CACHE_DIR": str(tmp_path / "cache")})
    assert returncode == 0, out
    assert out.count("CPU compute and loopback links are not profiled") == 1, out
    import zoo

    trained = torch.load(tmp_path / "trained.pt")
    assert (trained["backend"], trained["world_size"], math.prod(trained["mesh"].values())) == ("gloo", 2, 2)
    ref_losses, ref_state, _ = zoo.train_reference("gpt", steps=2, batch=4)
    # Tolerances: zoo's parity defaults (fp32 reduction order, see test_dp.py).
    zoo.assert_matches_reference("torchrun without launch", trained["losses"], trained["state"], ref_losses,
                                 ref_state)


def test_cluster_local_warns_about_missing_figures_on_rank_0_only(monkeypatch, tmp_path, caplog):
    import logging

    from graphpass import cluster as cluster_module

    monkeypatch.setenv("GRAPHPASS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    warned = {}
    for rank in ("1", "0"):
        monkeypatch.setattr(cluster_module, "_WARNED_UNPROFILED", set())
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="graphpass.cluster"):
            cluster_module.Cluster.local(2)
        warned[rank] = [r for r in caplog.records if "not profiled" in r.getMessage()]
    assert len(warned["0"]) == 1 and warned["1"] == [], warned


_ABANDON_POOL = textwrap.dedent("""
    import os, sys
    from graphpass.runtime.launch import RankPool
    pool = RankPool(2)
    pool.start()
    with open(sys.argv[1], "w") as f:
        f.write(" ".join(map(str, pool.pids)))
    if sys.argv[2] == "crash":
        os._exit(0)      # no atexit, no finalizers: ranks must notice the parent is gone
    # else: fall off the end without close(): the exit finalizer must stop the ranks
""")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["exit", "crash"])
def test_ranks_do_not_outlive_their_parent(tmp_path, how):
    pid_file = tmp_path / "pids"
    returncode, out = _run_bounded(
        [sys.executable, "-c", _ABANDON_POOL, str(pid_file), how], timeout_s=60)
    assert returncode == 0, out
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 2
    assert_processes_end(pids, f"outlived their parent ({how})")


def assert_processes_end(pids, what: str = "are still running", patience_s: float = 60.0) -> None:
    """Every process of ``pids`` ends (a hang bound: exiting and reaping take a moment; the
    check passes as soon as they are gone)."""
    deadline = time.monotonic() + patience_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _is_running(pid)]
        time.sleep(0.1)
    assert not alive, f"rank processes {alive} {what}"


def _is_running(pid):
    # Orphaned ranks are re-parented to init, so they are not our children: check /proc
    # for a live (non-zombie) process.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


_EXIT_WITH_GROUP = textwrap.dedent("""
    import atexit, sys
    import torch.distributed as dist
    from graphpass.runtime.launch import free_port
    from graphpass.runtime.mesh import release_at_exit
    # registered first, so it runs after graphpass's handler (atexit is last in, first out)
    atexit.register(lambda: print("GROUP AFTER RELEASE", dist.is_initialized(), flush=True))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    release_at_exit()
    release_at_exit()  # once only, however many programs ask
    if sys.argv[1] == "raise":
        raise RuntimeError("the script failed")
""")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["normal", "raise"])
def test_process_groups_are_destroyed_at_a_normal_exit_only(how):
    """Gloo groups left to interpreter finalization can abort the process at exit (SIGABRT after
    correct training): a normal exit destroys them first. After an uncaught exception they stay:
    destroying a group whose threads wait on a failed peer would hold the exit."""
    returncode, out = _run_bounded([sys.executable, "-c", _EXIT_WITH_GROUP, how], timeout_s=60)
    assert returncode == (0 if how == "normal" else 1), out
    assert f"GROUP AFTER RELEASE {how == 'raise'}" in out, out
    assert out.count("GROUP AFTER RELEASE") == 1, out
