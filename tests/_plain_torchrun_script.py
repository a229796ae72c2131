"""A plain torchrun training script: ``gp.compile`` without ``gp.launch`` joins torchrun's job.

Run by test_launch: ``torchrun --nproc-per-node 2 _plain_torchrun_script.py OUT_DIR``. Nothing here
initialises a process group; rank 0 saves the losses and the trained full state (and the job's
backend and world size, as compile found them) to ``OUT_DIR/trained.pt``.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # zoo
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import graphpass as gp  # noqa: E402
import zoo  # noqa: E402

if __name__ == "__main__":
    data = zoo.batches("gpt", 2, 4)
    dmodel = gp.compile(zoo.build("gpt"), gp.Cluster.local(), example_inputs=data[0])
    losses = zoo.train_compiled(dmodel, data)
    state = dmodel.full_state_dict()
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "state": state, "backend": dist.get_backend(),
                    "world_size": dist.get_world_size(), "mesh": dict(dmodel.plan.mesh)},
                   os.path.join(sys.argv[1], "trained.pt"))
