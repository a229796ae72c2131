"""A Mixture-of-Experts layer that captures as one static graph.

``MoE(d_model, d_hidden, num_experts, gate=...)`` replaces a transformer's MLP: a gate
(:mod:`graphpass.nn.gates`) routes every token to some experts, each expert is an MLP, and the
token's output is the weighted sum of its experts' outputs. ``moe(x)`` returns ``(y, aux)``:
``y`` shaped like ``x``, ``aux`` the weighted auxiliary losses (``balance_loss_coef`` times the
load-balancing loss plus ``z_loss_coef`` times the router z-loss) for the model to add to its
loss.

How the tokens move (every shape static; the routing is data)::

    x [G, L, d] ─ gate ─▶ A assignments per group (token, expert, weight, kept)
      capacity (token choice, capacity_factor set): per group and expert, the first
          C = ceil(k L / E * capacity_factor) assignments in priority order are kept
      sort the G·A assignments by expert, the dropped ones last; offs = cumsum(kept per expert)
      rows = x[token of each sorted assignment]                       [G·A, d]
      h = act(grouped_mm(rows, w_in, offs)); y = grouped_mm(h, w_out, offs)   (dropped rows: 0)
      out = zeros[G·L, d].index_add(token, y * weight)               [G, L, d]

Modes: ``capacity_factor=None`` is dropless (every assignment the gate keeps is computed);
a number sets the capacity. The drop rule (``drop_policy``): ``"position"`` keeps, per expert,
the assignments in the gate's priority order — every token's first choice in token order, then
every second choice (GShard) — and ``"score"`` the highest-weighted first (batch-prioritised
routing). A dropped assignment contributes nothing (the token keeps its residual). Capacity is
per routing group (one sequence), so a single process and any data-parallel split drop alike.

Experts are stored stacked: ``experts.w_in`` ``[E, d, h]`` (``[E, d, 2h]`` for SwiGLU: gate and
up projections side by side) and ``experts.w_out`` ``[E, h, d]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from graphpass.nn.gates import DenseToSparseGate, ExpertChoiceGate, HashGate, SwitchGate, TopKGate
from graphpass.nn.grouped_mm import grouped_mm

ACTIVATIONS = ("swiglu", "gelu", "relu", "silu")
DROP_POLICIES = ("position", "score")


class Experts(nn.Module):
    """``num_experts`` two-layer MLPs, stacked (see the module docstring)."""

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, activation: str = "swiglu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        width = 2 * d_hidden if activation == "swiglu" else d_hidden
        # nn.Linear's default init, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, width).uniform_(-1, 1) / math.sqrt(d_model))
        self.w_out = nn.Parameter(torch.empty(num_experts, d_hidden, d_model).uniform_(-1, 1) / math.sqrt(d_hidden))

    def forward(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        h = grouped_mm(rows, self.w_in.to(rows.dtype), offs)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[self.activation](h)
        return grouped_mm(h, self.w_out.to(rows.dtype), offs)


def make_gate(gate: str | nn.Module, d_model: int, num_experts: int, k: int, **options) -> nn.Module:
    """A gate by name: ``"topk"`` (``k`` experts, GShard top-2 by default), ``"switch"`` (top-1),
    ``"expert_choice"``, ``"hash"`` (needs ``vocab_size=``), ``"dense_to_sparse"``; a module is
    taken as it is. ``options`` go to the gate's constructor."""
    if isinstance(gate, nn.Module):
        return gate
    makers = {
        "topk": lambda: TopKGate(d_model, num_experts, k=k, **options),
        "switch": lambda: SwitchGate(d_model, num_experts, **options),
        "expert_choice": lambda: ExpertChoiceGate(d_model, num_experts, **options),
        "hash": lambda: HashGate(num_experts, **options),
        "dense_to_sparse": lambda: DenseToSparseGate(d_model, num_experts, **options),
    }
    if gate not in makers:
        raise ValueError(f"gate must be one of {sorted(makers)} or a gate module, got {gate!r}")
    return makers[gate]()


class MoE(nn.Module):
    """A Mixture-of-Experts MLP (see the module docstring).

    Args:
        d_model: the hidden size.
        d_hidden: each expert's inner size.
        num_experts: experts in the layer.
        gate: a gate name for :func:`make_gate` or a gate module.
        k: experts per token for ``"topk"``.
        capacity_factor: None for dropless; else the capacity per expert and sequence is
            ``ceil(k * L / E * capacity_factor)`` (token-choice gates; for ``"expert_choice"``
            it is the gate's ``capacity_factor``, each expert's ``ceil(L * cf / E)`` tokens).
        drop_policy: ``"position"`` or ``"score"`` (see the module docstring).
        activation: ``"swiglu"``, ``"gelu"``, ``"relu"`` or ``"silu"``.
        balance_loss_coef, z_loss_coef: weights of the auxiliary losses in ``aux``.
        gate_options: passed to the gate's constructor (``vocab_size`` for ``"hash"``, ...).
    """

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, gate: str | nn.Module = "topk", *,
                 k: int = 2, capacity_factor: float | None = None, drop_policy: str = "position",
                 activation: str = "swiglu", balance_loss_coef: float = 1e-2, z_loss_coef: float = 1e-3,
                 **gate_options):
        super().__init__()
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 or None (dropless), got {capacity_factor}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
        self.num_experts = num_experts
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.balance_loss_coef, self.z_loss_coef = balance_loss_coef, z_loss_coef
        if gate == "expert_choice" and capacity_factor is not None:  # the gate's own capacity
            gate_options.setdefault("capacity_factor", capacity_factor)
        self.gate = make_gate(gate, d_model, num_experts, k, **gate_options)
        self.experts = Experts(d_model, d_hidden, num_experts, activation)

    def capacity(self, assignments: int) -> int:
        """Assignments one expert keeps per group of ``assignments`` (``k L``)."""
        return math.ceil(assignments / self.num_experts * self.capacity_factor)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        if x.dim() < 3:
            raise ValueError(f"MoE input must be [..., L, d] (a routing group is one sequence of L tokens), got "
                             f"shape {tuple(shape)}; a flat [tokens, d] input would make capacity and the balance "
                             "loss depend on how the batch is split")
        groups = x.reshape(-1, shape[-2], shape[-1])
        if token_ids is not None:
            token_ids = token_ids.reshape(groups.shape[0], groups.shape[1])
        routing = self.gate(groups, token_ids)
        kept = routing.kept
        if self.capacity_factor is not None and getattr(self.gate, "token_choice", True):
            kept = kept & self._within_capacity(routing.expert, routing.weight, kept)
        out = self._dispatch(groups, routing.token, routing.expert, routing.weight, kept)
        aux = self.balance_loss_coef * routing.balance_loss + self.z_loss_coef * routing.z_loss
        return out.reshape(shape), aux

    def _within_capacity(self, expert: torch.Tensor, weight: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """Per group, whether each assignment is among the first ``capacity`` of its expert in
        the drop policy's order (assignments the gate dropped take no place)."""
        capacity = self.capacity(expert.shape[1])
        order = None
        if self.drop_policy == "score":
            order = weight.detach().argsort(dim=1, descending=True, stable=True)
            expert, kept = expert.gather(1, order), kept.gather(1, order)
        onehot = ((expert.unsqueeze(-1) == torch.arange(self.num_experts, device=expert.device))
                  & kept.unsqueeze(-1)).to(torch.int32)
        position = (onehot.cumsum(dim=1) * onehot).sum(dim=-1) - 1
        keep = position < capacity
        if order is not None:
            keep = torch.empty_like(keep).scatter(1, order, keep)
        return keep

    def _dispatch(self, groups: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor,
                  kept: torch.Tensor) -> torch.Tensor:
        num_groups, length, d_model = groups.shape
        flat = groups.reshape(num_groups * length, d_model)
        offset = (torch.arange(num_groups, device=token.device) * length).unsqueeze(-1)
        token, expert = (token + offset).reshape(-1), expert.reshape(-1)
        weight, kept = weight.reshape(-1), kept.reshape(-1)
        # Sorted by expert, the dropped assignments after every kept one: grouped_mm computes
        # rows up to offs[-1] only.
        order = (expert + self.num_experts * (~kept).to(expert.dtype)).argsort(stable=True)
        counts = ((expert.unsqueeze(-1) == torch.arange(self.num_experts, device=expert.device))
                  & kept.unsqueeze(-1)).sum(dim=0)
        offs = counts.cumsum(dim=0)
        rows = flat[token[order]]
        y = self.experts(rows, offs)
        y = y * (weight * kept).to(y.dtype)[order].unsqueeze(-1)
        return torch.zeros_like(flat).index_add(0, token[order], y)


def anneal(model: nn.Module, step: int) -> None:
    """Call ``anneal(step)`` on every :class:`~graphpass.nn.gates.DenseToSparseGate` of
    ``model``: the model you passed to ``graphpass.compile``, whose compiled program reads the
    same temperature buffers.

    Raises:
        ValueError: ``model`` has no such gate (a compiled ``DistributedModule`` holds graphs,
            not gates: anneal the model it was compiled from).
    """
    gates = [sub for sub in model.modules() if isinstance(sub, DenseToSparseGate)]
    if not gates:
        raise ValueError(f"{type(model).__name__} has no DenseToSparseGate to anneal; pass the model given to "
                         "graphpass.compile (its compiled program shares the gates' temperature buffers)")
    for gate in gates:
        gate.anneal(step)


__all__ = ["MoE", "Experts", "make_gate", "anneal", "ACTIVATIONS", "DROP_POLICIES"]
