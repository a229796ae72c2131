"""graphpass: an automatic-parallelism compiler for PyTorch training.

    import graphpass as gp
    dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=(idx, targets))
    loss = dmodel.train_step(idx, targets)

See README.md for the concepts, the API and how to read the dumps.
"""

import importlib
from typing import Any

# The names below load on first use (PEP 562), so that importing one module of the package
# (``graphpass.runtime.zero`` on a rank, ``graphpass.plan`` in a tool) does not load the planner,
# the solver and OR-Tools. Two names are also modules of the package (``graphpass.plan`` the data
# types, ``graphpass.capture`` the capture): those modules are imported here, before the names are
# bound to the functions, so that the package attribute is the function, as users expect, and no
# later import rebinds it.
from graphpass.capture import CaptureError, capture, reusing_captures
from graphpass.layout import ActivationPlan, Jagged, Split, TensorPlan, Tiers
from graphpass.plan import Plan, Strategy
from graphpass.plan_report import PlanReport
from graphpass.tables import SparseOptimizer, TableSharding
from graphpass.compression import GradCompression
from graphpass.diloco import DiLoCo


def plan(*args: Any, **kwargs: Any):
    """Plan a model on a cluster: :func:`graphpass.planner.plan` (loads the planner on first use)."""
    from graphpass.planner import plan as plan_

    return plan_(*args, **kwargs)


_LAZY = {
    "compile": "graphpass.api", "verify": "graphpass.api",
    "Cluster": "graphpass.cluster", "DeviceSpec": "graphpass.cluster", "HostSpec": "graphpass.cluster",
    "LinkSpec": "graphpass.cluster", "Link": "graphpass.sites",
    "presets": "graphpass.cluster",
    "PassError": "graphpass.pass_manager", "PassRecord": "graphpass.pass_manager",
    "profile": "graphpass.cost.profiler",
    "CheckpointError": "graphpass.runtime.checkpoint", "SavedDataclass": "graphpass.runtime.checkpoint",
    "load": "graphpass.runtime.checkpoint", "load_into": "graphpass.runtime.checkpoint",
    "save": "graphpass.runtime.checkpoint",
    "ExpertPlacement": "graphpass.runtime.expert_placement",
    "RankError": "graphpass.runtime.launch", "launch": "graphpass.runtime.launch",
    "DistributedModule": "graphpass.runtime.module",
    "HungRankError": "graphpass.runtime.rank_progress",
    "VerificationError": "graphpass.runtime.verifier",
}


def __getattr__(name: str) -> Any:
    if name == "nn":
        return importlib.import_module("graphpass.nn")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'graphpass' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "ActivationPlan",
    "CaptureError",
    "CheckpointError",
    "Cluster",
    "DeviceSpec",
    "DiLoCo",
    "DistributedModule",
    "GradCompression",
    "ExpertPlacement",
    "HungRankError",
    "HostSpec",
    "Jagged",
    "Link",
    "LinkSpec",
    "PassError",
    "PassRecord",
    "Plan",
    "PlanReport",
    "RankError",
    "SavedDataclass",
    "Split",
    "SparseOptimizer",
    "Strategy",
    "TableSharding",
    "TensorPlan",
    "Tiers",
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
