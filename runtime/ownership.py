"""Who owns the user's parameters after ``compile``: the rank's program does, through the very
``nn.Parameter`` objects the user's model holds.

DDP users build the optimizer first (``opt = SGD(model.parameters()); dmodel = compile(model)``).
Passes replace a sharded parameter by a new tensor (a ZeRO shard, a tensor-parallel chunk); an
optimizer holding the model's objects would then step tensors the program no longer reads, and
training would go silently wrong. So, after the passes:

- a parameter replaced by one new parameter (ZeRO shard, tensor-parallel chunk, both) is
  *adopted*: the user's ``nn.Parameter`` takes the new tensor's data (``p.data = shard``) and
  the program reads the user's object itself. An optimizer built before or after ``compile``,
  from ``model.parameters()`` or ``dmodel.parameters()``, then steps the same tensors; its state
  is created at its first step, so it takes the shard's shape;
- a parameter the program replaced by several (an OSDP split into slices) cannot be adopted:
  its storage is released (as FSDP2 does) and it is *retired*; an optimizer that holds it raises
  at its first ``step()``, naming the parameter and the fix. A parameter that another pipeline
  stage holds is released too, but stepping it is harmless (it gets no gradient here), so it is
  not retired;
- a parameter whose optimizer lives in host memory (offload) is the program's device *compute
  copy*; the optimizer must step its master copy (``dmodel.parameters()``). An optimizer that
  holds the compute copy (built from ``model.parameters()``) raises at its first ``step()``;
- an optimizer whose state was made before ``compile`` (it stepped the full tensors) and now
  holds an adopted parameter raises at its next step: its state no longer fits the shard.

The check runs in a global optimizer step pre-hook (``torch.optim.Optimizer``'s), once per
optimizer, parameter count and compile in the process, so it costs nothing per step after the
first.
"""

from __future__ import annotations

import weakref
from typing import Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

# A retired parameter -> why (its state keys and what replaced it). Weak: dies with the model.
_RETIRED: WeakIdKeyDictionary = WeakIdKeyDictionary()
# An adopted parameter -> its shape before compile (an optimizer state of that shape is stale).
_ADOPTED: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Optimizers already checked, with the compile count and their parameter count then.
_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]]" = weakref.WeakKeyDictionary()
_COMPILES = 0
_HOOK = None


def attr(gm: fx.GraphModule, target: str) -> torch.Tensor:
    module_path, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(module_path), name)


def release(tensor: torch.Tensor | nn.Module) -> None:
    """Free ``tensor``'s storage (it keeps its dtype and device, with no elements); a module
    attribute (a recompute region) holds no tensors of its own."""
    if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def adopt_replaced(gm: fx.GraphModule, originals: Mapping[str, torch.Tensor]) -> None:
    """Make the program read the user's parameter objects wherever a pass replaced one by one new
    parameter; release the full tensors of the others (see the module docstring).

    Args:
        gm: the program after the passes (its attributes are the rank's tensors).
        originals: each ``get_attr`` target's tensor before the passes (the user's objects).
    """
    global _COMPILES
    _COMPILES += 1  # optimizers checked before this compile are checked again
    targets = {n.target: n for n in gm.graph.nodes if n.op == "get_attr"}
    for target, original in originals.items():
        node = targets.get(target)
        now = attr(gm, target) if node is not None else None
        if now is original:
            continue
        if (node is not None and isinstance(now, nn.Parameter) and isinstance(original, nn.Parameter)
                and now.requires_grad == original.requires_grad and now.dtype == original.dtype
                and now.device == original.device):
            _ADOPTED[original] = tuple(original.shape)
            original.grad = None  # a gradient of the full tensor (a backward before compile)
            original.data = now.data
            module_path, _, name = target.rpartition(".")
            setattr(gm.get_submodule(module_path), name, original)
            continue
        release(original)
        if isinstance(original, nn.Parameter) and node is None:
            _retire(original, target, gm)
    _install_hook()


def _retire(param: nn.Parameter, target: str, gm: fx.GraphModule) -> None:
    from graphpass import meta

    slices = [n.target for n in gm.graph.nodes
              if n.op == "get_attr" and getattr(meta.slice_of(n), "target", None) == target]
    if not slices:  # not replaced on this rank (it is no longer read here): harmless
        return
    _RETIRED[param] = f"{target!r} (now {len(slices)} slices: {', '.join(slices[:4])})"


def compute_copy(param: nn.Parameter, target: str) -> None:
    """Mark ``param`` as the device compute copy of offloaded parameter ``target``: an optimizer
    stepping it raises (it must step the master copy, from ``dmodel.parameters()``)."""
    _RETIRED[param] = (f"{target!r} as the device copy it computes with; that parameter's master copy and "
                       "optimizer state live in host memory (offload), and dmodel.parameters() hands out the master")
    _install_hook()


def _install_hook() -> None:
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if _CHECKED.get(optimizer) == (_COMPILES, len(params)):
        return
    for p in params:
        why = _RETIRED.get(p)
        if why is not None:
            raise ValueError(
                f"{type(optimizer).__name__} steps the model's parameter {why}, which graphpass.compile "
                "replaced: the compiled program trains other tensors. Build the optimizer after compile "
                "from dmodel.parameters(): opt = torch.optim.AdamW(dmodel.parameters(), ...)"
            )
        shape = _ADOPTED.get(p)
        if shape is not None:
            stale = [k for k, v in optimizer.state.get(p, {}).items()
                     if isinstance(v, torch.Tensor) and v.dim() and v.shape != p.shape]
            if stale:
                raise ValueError(
                    f"{type(optimizer).__name__} has state {stale} of shape {tuple(shape)} for a parameter "
                    f"that graphpass.compile sharded to {tuple(p.shape)}: the optimizer stepped before "
                    "compile. Build it after compile (or load its state with graphpass.load)"
                )
    _CHECKED[optimizer] = (_COMPILES, len(params))


__all__ = ["adopt_replaced", "attr", "compute_copy", "release"]
