"""Layers graphpass offers for models built to be parallelised: a Mixture-of-Experts layer
(:class:`MoE`) with a gating library (:mod:`graphpass.nn.gates`) and its static-shape grouped
matrix product (:func:`grouped_mm`); expert modules of other code that capture through it
(:mod:`graphpass.nn.grouped_experts`)."""

from graphpass.nn.gates import DenseToSparseGate, ExpertChoiceGate, Gate, HashGate, Routing, SwitchGate, TopKGate
from graphpass.nn.grouped_experts import register_grouped_experts
from graphpass.nn.grouped_mm import grouped_mm
from graphpass.nn.moe import ACTIVATIONS, DROP_POLICIES, MoE, Experts, anneal, make_gate

__all__ = ["MoE", "Experts", "make_gate", "anneal", "grouped_mm", "register_grouped_experts", "Gate", "Routing", "TopKGate", "SwitchGate",
           "ExpertChoiceGate", "HashGate", "DenseToSparseGate", "ACTIVATIONS", "DROP_POLICIES"]
