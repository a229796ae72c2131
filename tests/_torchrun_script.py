"""Run by test_launch under torchrun: launch() must join torchrun's group, not spawn.

Rank 0 prints ``RESULTS <list>``; the test asserts on that line.
"""

import os
import sys

import torch
import torch.distributed as dist

from graphpass.runtime.launch import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # zoo
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def rank_sum_and_pid(tag):
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), t.item(), tag, os.getpid()


def compile_and_train():
    """graphpass.compile under torchrun: Cluster.local() describes torchrun's group."""
    import graphpass as gp
    import zoo

    model = zoo.build("gpt")
    data = zoo.batches("gpt", 2, 4)
    dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=data[0])
    return dict(dmodel.plan.mesh), zoo.train_compiled(dmodel, data)


if __name__ == "__main__":
    results = launch(rank_sum_and_pid, 2, ("hello",))
    if dist.get_rank() == 0:
        print("RESULTS", [r[:3] for r in results], flush=True)
        print("PIDS", [r[3] for r in results], os.getpid(), flush=True)
    trained = launch(compile_and_train, 2)
    if dist.get_rank() == 0:
        print("TRAINED", repr(trained), flush=True)
    dist.destroy_process_group()
