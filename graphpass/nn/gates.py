"""Gates of a Mixture-of-Experts layer: which experts each token's hidden state goes to, and with
what weight, as a fixed number of *assignments* per routing group.

A routing group is one sequence (``x`` of shape ``[G, L, d]``: ``G`` groups of ``L`` tokens); a
gate returns a :class:`Routing` with ``A`` assignments per group, each a token of the group, an
expert and a weight, in priority order (a capacity keeps the earlier ones), plus a mask of the
assignments the gate itself keeps and its auxiliary losses. ``A`` depends only on shapes
(``k L`` for token choice, ``E C`` for expert choice, ``E L`` for the dense-to-sparse gate), so
routing captures as a static graph; which expert gets how many tokens is data.

Routing per sequence is what makes the layer's numerics independent of how the batch is split
over data-parallel ranks: every statistic (capacity, the load-balancing loss) is a sequence's
own, and the losses are means over sequences, which data parallelism averages exactly.

The gates:

- :class:`TopKGate` — softmax over the experts, the ``k`` largest (GShard's top-2 by default:
  weights renormalised over the chosen; Mixtral's router is the same), with the load-balancing
  loss ``E * sum_e f_e P_e`` (``f_e`` the share of the group's assignments, all ``k`` choices,
  on expert ``e`` — Mixtral's form; GShard and Switch count first choices, the same for
  ``k = 1`` — and ``P_e`` its mean router probability) and the router z-loss
  ``mean(logsumexp(logits)^2)`` (ST-MoE).
- :class:`SwitchGate` — top-1, the chosen probability as the weight (Switch Transformer).
- :class:`ExpertChoiceGate` — each expert takes the ``C = ceil(L * capacity_factor / E)`` tokens
  that score it highest (Zhou et al. 2022): balanced by construction, a token may get no expert
  or several. It sees the whole sequence, so in a causal model a token's routing depends on
  later tokens (as in the paper).
- :class:`HashGate` — a fixed, balanced hash of the token id (Roller et al. 2021's hash layers):
  no router, no auxiliary loss; the layer needs ``token_ids``.
- :class:`DenseToSparseGate` — EvoMoE's: a Gumbel-softmax over all experts with a temperature
  annealed from ``temperature[0]`` to ``temperature[1]`` over ``anneal_steps``; assignments whose
  weight is below ``threshold`` are dropped, so routing starts dense (every expert) and gets
  sparser as the softmax sharpens. The temperature is a buffer: :meth:`DenseToSparseGate.anneal`
  (or :func:`graphpass.nn.anneal` on a compiled model) moves it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Routing:
    """One gate's decision for ``G`` groups, ``A`` assignments each (see the module docstring).

    Attributes:
        token: ``[G, A]`` int64, each assignment's token within its group.
        expert: ``[G, A]`` int64, its expert.
        weight: ``[G, A]`` its combine weight (differentiable: the router learns through it).
        kept: ``[G, A]`` bool, the assignments the gate keeps (a capacity may drop more).
        balance_loss: the load-balancing loss, a mean over groups (0 where the gate needs none).
        z_loss: the router z-loss, a mean over tokens (0 without a router).
    """

    token: torch.Tensor
    expert: torch.Tensor
    weight: torch.Tensor
    kept: torch.Tensor
    balance_loss: torch.Tensor
    z_loss: torch.Tensor


class Gate(nn.Module):
    """A router ``Linear(d_model, num_experts)`` without bias, computed in float32.

    ``token_choice``: whether every token picks its experts (a layer's capacity then drops the
    assignments past an expert's capacity) rather than experts picking tokens.
    """

    token_choice = True

    def __init__(self, d_model: int, num_experts: int):
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.num_experts = num_experts
        self.router = nn.Linear(d_model, num_experts, bias=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.router.weight.float())

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> Routing:
        raise NotImplementedError(f"{type(self).__name__} must define forward")


def _z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


def _balance_loss(probs: torch.Tensor, expert: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """GShard / Switch: ``E * sum_e f_e P_e`` per group, averaged over groups; ``f_e`` the share
    of the group's kept assignments on expert ``e`` (no gradient, as in Switch), ``P_e`` the
    mean router probability of ``e``."""
    num_experts = probs.shape[-1]
    chosen = (expert.unsqueeze(-1) == torch.arange(num_experts, device=expert.device)) & kept.unsqueeze(-1)
    counts = chosen.to(probs.dtype).sum(dim=1)  # [G, E]
    share = counts / counts.sum(dim=-1, keepdim=True).clamp_min(1.0)
    return (num_experts * (share * probs.mean(dim=1)).sum(dim=-1)).mean()


def _choice_major(values: torch.Tensor) -> torch.Tensor:
    """``[G, L, k]`` → ``[G, k L]``: every token's first choice, then every second choice (the
    priority GShard's capacity uses)."""
    return values.transpose(1, 2).reshape(values.shape[0], -1)


def _tokens(groups: int, length: int, k: int, device: torch.device) -> torch.Tensor:
    return torch.arange(length, device=device).repeat(k).expand(groups, k * length)


class TopKGate(Gate):
    """The ``k`` most probable experts per token (see the module docstring).

    Args:
        d_model, num_experts: the router's shape.
        k: experts per token (``1 <= k <= num_experts``).
        normalize: renormalise the chosen probabilities to sum to 1 (GShard top-2, Mixtral);
            False keeps them as they are (Switch).
    """

    def __init__(self, d_model: int, num_experts: int, k: int = 2, normalize: bool = True):
        super().__init__(d_model, num_experts)
        if not 1 <= k <= num_experts:
            raise ValueError(f"k must be between 1 and num_experts={num_experts}, got {k}")
        self.k, self.normalize = k, normalize

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> Routing:
        logits = self.logits(x)
        probs = logits.softmax(dim=-1)
        weight, expert = probs.topk(self.k, dim=-1)
        if self.normalize:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        groups, length = x.shape[0], x.shape[1]
        expert, weight = _choice_major(expert), _choice_major(weight)
        kept = torch.ones_like(expert, dtype=torch.bool)
        return Routing(_tokens(groups, length, self.k, x.device), expert, weight, kept,
                       _balance_loss(probs, expert, kept), _z_loss(logits))


class SwitchGate(TopKGate):
    """Top-1 routing with the chosen probability as the weight (Switch Transformer)."""

    def __init__(self, d_model: int, num_experts: int):
        super().__init__(d_model, num_experts, k=1, normalize=False)


class ExpertChoiceGate(Gate):
    """Every expert takes its ``ceil(L * capacity_factor / E)`` highest-scoring tokens of the
    group (see the module docstring); ``capacity_factor`` is the average number of experts per
    token (Zhou et al.'s ``c``)."""

    token_choice = False

    def __init__(self, d_model: int, num_experts: int, capacity_factor: float = 2.0):
        super().__init__(d_model, num_experts)
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        self.capacity_factor = capacity_factor

    def capacity(self, length: int) -> int:
        return min(length, math.ceil(length * self.capacity_factor / self.num_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> Routing:
        logits = self.logits(x)
        probs = logits.softmax(dim=-1)  # [G, L, E]
        weight, token = probs.transpose(1, 2).topk(self.capacity(x.shape[1]), dim=-1)  # [G, E, C]
        groups, capacity = x.shape[0], weight.shape[-1]
        expert = torch.arange(self.num_experts, device=x.device).repeat_interleave(capacity).expand(groups, -1)
        token, weight = token.reshape(groups, -1), weight.reshape(groups, -1)
        zero = logits.new_zeros(())
        return Routing(token, expert, weight, torch.ones_like(token, dtype=torch.bool), zero, _z_loss(logits))


class HashGate(nn.Module):
    """Routes each token by a fixed, balanced hash of its id (``vocab_size`` ids; each expert
    gets ``vocab_size / E`` of them, drawn with ``seed``); weight 1, no router."""

    token_choice = True

    def __init__(self, num_experts: int, vocab_size: int, seed: int = 0):
        super().__init__()
        if num_experts < 1 or vocab_size < 1:
            raise ValueError(f"num_experts and vocab_size must be >= 1, got {num_experts} and {vocab_size}")
        self.num_experts = num_experts
        order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
        self.register_buffer("table", order % num_experts, persistent=True)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> Routing:
        if token_ids is None:
            raise ValueError("HashGate routes by token id: call the MoE layer as moe(x, token_ids=ids), "
                             "ids of shape x.shape[:-1]")
        groups, length = x.shape[0], x.shape[1]
        expert = self.table[token_ids.reshape(groups, length)]
        weight = torch.ones(groups, length, dtype=x.dtype, device=x.device)
        zero = x.new_zeros((), dtype=torch.float32)
        return Routing(_tokens(groups, length, 1, x.device), expert, weight,
                       torch.ones_like(expert, dtype=torch.bool), zero, zero)


class DenseToSparseGate(Gate):
    """EvoMoE's dense-to-sparse gate (see the module docstring).

    Args:
        d_model, num_experts: the router's shape.
        temperature: ``(start, end)`` of the Gumbel-softmax temperature.
        anneal_steps: steps over which :meth:`anneal` moves it from start to end (geometrically).
        threshold: assignments whose weight is below this are dropped.
        noise: add Gumbel noise in training (each data-parallel rank draws its own, as dropout).
            Whether it is added is decided when the model is captured (``self.training`` then),
            as for dropout: capture in eval mode for a noiseless compiled program.
    """

    def __init__(self, d_model: int, num_experts: int, temperature: tuple[float, float] = (2.0, 0.3),
                 anneal_steps: int = 10_000, threshold: float = 1e-3, noise: bool = True):
        super().__init__(d_model, num_experts)
        start, end = temperature
        if not (start > 0 and end > 0):
            raise ValueError(f"temperature must be two positive numbers (start, end), got {temperature!r}")
        if anneal_steps < 1 or not 0 <= threshold < 1:
            raise ValueError(f"anneal_steps must be >= 1 and threshold in [0, 1), got {anneal_steps} and {threshold}")
        self.start, self.end, self.anneal_steps = float(start), float(end), anneal_steps
        self.threshold, self.noise = threshold, noise
        self.register_buffer("temperature", torch.tensor(self.start), persistent=True)

    def anneal(self, step: int) -> None:
        """Set the temperature for training step ``step`` (in place, so compiled copies that
        share the buffer follow)."""
        frac = min(max(step, 0), self.anneal_steps) / self.anneal_steps
        self.temperature.fill_(self.start * (self.end / self.start) ** frac)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> Routing:
        logits = self.logits(x)
        scores = logits
        if self.training and self.noise:
            uniform = torch.rand_like(logits).clamp(1e-9, 1 - 1e-9)
            scores = logits - torch.log(-torch.log(uniform))
        weight = (scores / self.temperature).softmax(dim=-1)  # [G, L, E]
        groups, length = x.shape[0], x.shape[1]
        expert = torch.arange(self.num_experts, device=x.device).expand(groups, length, -1)
        expert, weight = _choice_major(expert), _choice_major(weight)
        kept = weight >= self.threshold
        return Routing(_tokens(groups, length, self.num_experts, x.device), expert, weight * kept, kept,
                       _balance_loss(logits.softmax(dim=-1), expert, kept), _z_loss(logits))


__all__ = ["Routing", "Gate", "TopKGate", "SwitchGate", "ExpertChoiceGate", "HashGate", "DenseToSparseGate"]
