"""A compiled training job in which rank 1 fails in the middle of its second step.

``train_and_fail(mode, timeout_s, pid_dir)``: rank 1 raises (``"raise"``), kills itself with
SIGKILL (``"kill"``) or hangs (``"hang"``) as its second step's forward starts, while the other
ranks are inside that step, blocked in a collective waiting for rank 1. Every rank first writes its
pid to ``pid_dir`` so the test can check that none is left behind; the others raise
:class:`StepFailed` if their collective times out first. test_fail_fast runs it under
``gp.launch`` and, as a script, under ``torchrun``: ``_fail_fast_script.py MODE TIMEOUT_S PID_DIR``.
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # zoo
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import torch.distributed as dist  # noqa: E402

FAILED_RANK = 1


def _fail(mode: str) -> None:
    if mode == "raise":
        raise ValueError("rank 1 found a bad batch in step 2")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        time.sleep(10_000)
    raise AssertionError(f"unknown mode {mode!r}")


class StepFailed(RuntimeError):
    """Rank 0's collective raised: how long it waited, and what it raised."""


def train_and_fail(mode: str, timeout_s: float, pid_dir: str, where: str = "forward") -> None:
    """Never returns: rank 1 fails as ``mode`` says; another rank, if it is still alive when its
    collective raises (the ``hang`` mode), raises :class:`StepFailed` saying how long it waited.

    ``where``: ``"forward"``, as the second step's forward starts (ZeRO-3 data parallelism: its
    peers wait in the step's first all-gather); ``"before_step"``, before it calls its second
    ``train_step`` (a stalled data loader: its peers wait in the step's first collective, the
    count of the loss's targets); ``"pipeline"``, the same with one pipeline stage per rank (rank
    0 waits inside the step for what rank 1 would send)."""
    import graphpass as gp
    import zoo

    rank = dist.get_rank()
    with open(os.path.join(pid_dir, f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    data = zoo.batches("gpt", 2, 4)
    dmodel = gp.compile(zoo.build("gpt"), gp.Cluster.local(), example_inputs=data[0],
                        strategy=gp.Strategy(pp=dist.get_world_size(), microbatches=2) if where == "pipeline"
                        else gp.Strategy(dp=dist.get_world_size(), zero=3), timeout_s=timeout_s)
    dmodel.train_step(*data[0])
    if rank == FAILED_RANK and where != "forward":
        _fail(mode)
    if rank == FAILED_RANK:
        dmodel.graph_module.register_forward_pre_hook(lambda module, args: _fail(mode))
    start = time.monotonic()
    try:
        dmodel.train_step(*data[1])  # the others block in the step's first all-gather
    except Exception as exc:
        if rank == FAILED_RANK:
            raise
        raise StepFailed(f"rank {rank} waited {time.monotonic() - start:.1f} s in step 2: {type(exc).__name__}: "
                         f"{exc}") from exc
    raise AssertionError(f"rank {rank} finished a step its peer {FAILED_RANK} never joined")


if __name__ == "__main__":
    from graphpass.runtime.launch import init_from_env

    init_from_env()
    train_and_fail(sys.argv[1], float(sys.argv[2]), sys.argv[3])
