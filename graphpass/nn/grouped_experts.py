"""Expert modules graphpass captures in its grouped form.

Some Mixture-of-Experts code runs its experts as a Python loop over the per-expert token counts
(torchtitan's ``GroupedExperts`` without grouped GEMMs: ``num_tokens_per_expert.tolist()``,
``torch.split`` and one matmul per expert). That loop cannot be captured: the counts are data,
and a loop over them has a data-dependent length. The same computation written with
:func:`~graphpass.nn.grouped_mm.grouped_mm` is static, and is what ``expert_parallel`` shards.
So, while capturing, graphpass runs such modules through a grouped forward that computes the
same function (:func:`substituted`); the module's parameters are read as they are, so the state
dict, checkpoints and the user's model are untouched.

Recognised without registration: torchtitan's form, a module with stacked parameters ``w1``
``[E, h, d]``, ``w2`` ``[E, d, h]``, ``w3`` ``[E, h, d]`` and ``forward(x, num_tokens_per_expert)``
computing ``(silu(x w1[e]^T) * (x w3[e]^T)) w2[e]^T`` on each expert's rows, rows past the counts'
sum zero. Other expert modules register theirs: ``register_grouped_experts(cls, forward)``,
``forward(module, *args)`` computing the module's output with ``grouped_mm``.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from graphpass.nn.grouped_mm import grouped_mm

_REGISTRY: dict[type, Callable] = {}


def register_grouped_experts(cls: type, forward: Callable) -> None:
    """Capture every ``cls`` module through ``forward(module, *args, **kwargs)``, which must
    compute what ``cls.forward`` does with :func:`~graphpass.nn.grouped_mm.grouped_mm`.

    Raises:
        TypeError: ``cls`` is not an ``nn.Module`` subclass or ``forward`` is not callable.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)) or not callable(forward):
        raise TypeError("register_grouped_experts(cls, forward) takes an nn.Module subclass and a callable")
    _REGISTRY[cls] = forward


def _titan_forward(module: nn.Module, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """torchtitan's expert computation with grouped products (the loop's numerics: each
    expert's rows in order, rows past the counts' sum zero). A module of the same parameters
    called otherwise (gpt-fast's experts take ``[tokens, k]`` expert indices) runs its own
    forward."""
    if not (isinstance(num_tokens_per_expert, torch.Tensor) and num_tokens_per_expert.dim() == 1
            and num_tokens_per_expert.shape[0] == module.w1.shape[0] and x.dim() == 2):
        return type(module).forward(module, x, num_tokens_per_expert)
    offs = num_tokens_per_expert.cumsum(0).to(torch.long)
    w1, w2, w3 = (w.to(x.dtype).transpose(-2, -1) for w in (module.w1, module.w2, module.w3))
    h = F.silu(grouped_mm(x, w1, offs)) * grouped_mm(x, w3, offs)
    return grouped_mm(h, w2, offs)


def _titan_form(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"w1", "w2", "w3"} or any(p.dim() != 3 for p in params.values()):
        return False
    e, h, d = params["w1"].shape
    if params["w3"].shape != (e, h, d) or params["w2"].shape != (e, d, h):
        return False
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(names) == 2


def grouped_forward(module: nn.Module) -> Callable | None:
    """The grouped forward graphpass captures ``module`` through, or None (captured as it is)."""
    for cls in type(module).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    return _titan_forward if _titan_form(module) else None


@contextlib.contextmanager
def substituted(model: nn.Module) -> Iterator[list[str]]:
    """Run every recognised expert module of ``model`` through its grouped forward inside the
    block; yields their module paths. The instances' ``forward`` is restored on exit."""
    replaced = []
    try:
        for path, module in model.named_modules():
            forward = grouped_forward(module)
            if forward is not None and "forward" not in vars(module):
                module.forward = types.MethodType(forward, module)
                replaced.append((path, module))
        yield [path for path, _ in replaced]
    finally:
        for _, module in replaced:
            del module.forward


__all__ = ["register_grouped_experts", "grouped_forward", "substituted"]
