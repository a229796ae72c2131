"""The planner's fake-tensor figures on the graph with each run of identical layers cut to three
(`graphpass.repeats`) against the same figures on the whole graph, and the runs it must not cut."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import zoo
from graphpass.planner import Planner, measure
from graphpass.repeats import condense

CLUSTER = "h100-80g:1x8"


def _deep(name: str) -> nn.Module:
    """``name`` from the test zoo with 6 layers (the zoo's have 2, which leave nothing to cut)."""
    torch.manual_seed(0)
    if name == "gpt":
        return zoo.GPT(zoo.GPTConfig(vocab_size=zoo.VOCAB, block_size=zoo.SEQ, n_layer=6, n_head=4, n_embd=64))
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=zoo.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=zoo.SEQ,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return zoo.HFCausalLM(LlamaForCausalLM(config))


def _figures(profile) -> dict:
    costs = {(tp, sp): [dataclasses.asdict(b) for b in profile.block_costs(tp, sp, [8, 4])]
             for tp in (2, 4) for sp in (False, True)}
    return {"saved": profile.saved, "backward": profile.backward_bytes, "blocks": costs}


@pytest.mark.parametrize("name,data", [("gpt", "gpt"), ("hf_llama", "hf_llama")])
def test_cut_graph_gives_the_whole_graphs_figures(name, data, monkeypatch):
    """Layers 2..4 of 6 are cut (layer 1 stands in for them); the bytes saved per node, each
    block's backward working set and every block's cost at tp 2 and 4, with and without sequence
    parallelism, equal the whole graph's exactly: the cut layers' figures are copies."""
    model, batch = _deep(name), zoo.batches(data, 1, 8)[0]
    profile = Planner(model, CLUSTER, batch).profile
    assert profile.condensed is not None
    layers = [i for i, b in enumerate(profile.blocks) if b.layer is not None]
    assert profile.condensed.stand_in == {layers[j]: layers[1] for j in (2, 3, 4)}
    kept = {n for n in profile.condensed.gm.graph.nodes if n.op == "call_function"}
    assert len(kept) < len([n for n in profile.gm.graph.nodes if n.op == "call_function"])
    cut = _figures(profile)

    monkeypatch.setattr(measure, "condense", lambda *args: None)  # where GraphProfile looks it up
    whole = Planner(model, CLUSTER, batch).profile
    assert whole.condensed is None
    assert cut == _figures(whole)
    assert cut["backward"]["layer 3"] > 0 and sum(cut["saved"].values()) > 0


class _Layer(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.scale = scale

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.relu(self.fc(x)) * self.scale
        return y if skip is None else y + skip


class _Stack(nn.Module):
    """Six alike layers; ``skip``: each also adds the output of the layer two back;
    ``scales``: each multiplies by its own constant."""

    def __init__(self, skip: bool = False, scales: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(float(i + 1) if scales else 1.0) for i in range(6))
        self.skip = skip

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        outs = [x, x]
        for layer in self.layers:
            outs.append(layer(outs[-1], outs[-2] if self.skip else None))
        return torch.nn.functional.mse_loss(outs[-1], y)


@pytest.mark.parametrize("kind", ["plain", "skip", "scales"])
def test_only_layers_wired_alike_are_cut(kind):
    """A plain stack is cut; one whose layers read the layer two back, or whose layers differ
    only in a constant (same ops, same shapes, so the same signature), is kept whole."""
    model = _Stack(skip=kind == "skip", scales=kind == "scales")
    profile = Planner(model, CLUSTER, (torch.randn(8, 16), torch.randn(8, 16))).profile
    signatures = {b.signature for b in profile.blocks if b.layer is not None}
    assert len(signatures) == 1 or kind == "skip"
    blocks = [b.nodes for b in profile.blocks]
    condensed = condense(profile.gm, blocks, [b.signature for b in profile.blocks])
    if kind == "plain":
        assert condensed is not None and len(condensed.stand_in) == 3
    else:
        assert condensed is None
