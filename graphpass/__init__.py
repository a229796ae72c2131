"""graphpass: an automatic-parallelism compiler for PyTorch training.

    import graphpass as gp
    dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=(idx, targets))
    loss = dmodel.train_step(idx, targets)

See README.md for the concepts, the API and how to read the dumps.
"""

from graphpass.api import compile, verify
from graphpass.capture import CaptureError, capture, reusing_captures
from graphpass.cluster import Cluster, DeviceSpec, LinkSpec, presets
from graphpass.pass_manager import PassError, PassRecord
from graphpass.plan import Plan, Strategy
from graphpass.cost.profiler import profile
from graphpass.planner import plan
from graphpass.runtime.checkpoint import CheckpointError, SavedDataclass, load, load_into, save
from graphpass.runtime.expert_placement import ExpertPlacement
from graphpass.runtime.launch import RankError, launch
from graphpass.runtime.module import DistributedModule
from graphpass.runtime.rank_progress import HungRankError
from graphpass.runtime.verifier import VerificationError
from graphpass import nn

__all__ = [
    "CaptureError",
    "CheckpointError",
    "Cluster",
    "DeviceSpec",
    "DistributedModule",
    "ExpertPlacement",
    "HungRankError",
    "LinkSpec",
    "PassError",
    "PassRecord",
    "Plan",
    "RankError",
    "SavedDataclass",
    "Strategy",
    "VerificationError",
    "capture",
    "compile",
    "launch",
    "load",
    "load_into",
    "nn",
    "plan",
    "presets",
    "profile",
    "reusing_captures",
    "save",
    "verify",
]

__version__ = "0.1.0"
