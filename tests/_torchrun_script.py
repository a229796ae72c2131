"""Run by test_launch under torchrun: launch() must join torchrun's group, not spawn.

Rank 0 prints ``RESULTS <list>``; the test asserts on that line.
"""

import os

import torch
import torch.distributed as dist

from graphpass.runtime.launch import launch


def rank_sum_and_pid(tag):
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), t.item(), tag, os.getpid()


if __name__ == "__main__":
    results = launch(rank_sum_and_pid, 2, ("hello",))
    if dist.get_rank() == 0:
        print("RESULTS", [r[:3] for r in results], flush=True)
        print("PIDS", [r[3] for r in results], os.getpid(), flush=True)
    dist.destroy_process_group()
