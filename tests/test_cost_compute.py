"""FLOPs, bytes and roofline times of ``graphpass.cost.compute`` against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from gpt import GPT, GPTConfig
from graphpass.capture import capture
from graphpass.cluster import Cluster
from graphpass.cost.compute import (
    DEFAULT_EFFICIENCY,
    DEFAULT_MEMORY_EFFICIENCY,
    graph_compute,
    node_bytes,
    node_flops,
    roofline_time_s,
    total_flops,
)

aten = torch.ops.aten
A100 = Cluster.preset("a100-80g").device


def one_op(target, shapes, *extra, dtype=torch.float32, **kwargs) -> fx.Node:
    """A graph ``placeholders -> target(*placeholders, *extra, **kwargs)`` with fake values."""
    graph = fx.Graph()
    mode = FakeTensorMode()
    with mode:
        vals = [torch.empty(s, dtype=dtype) for s in shapes]
    inputs = []
    for i, val in enumerate(vals):
        node = graph.placeholder(f"x{i}")
        node.meta["val"] = val
        inputs.append(node)
    node = graph.call_function(target, (*inputs, *extra), kwargs)
    with mode:
        node.meta["val"] = target(*vals, *extra, **kwargs)
    return node


def test_linear_flops_are_two_m_n_k_forward_and_twice_that_backward():
    M, K, N = 6, 32, 48
    node = one_op(aten.linear.default, [(2, 3, K), (N, K)])
    assert node_flops(node) == (2 * M * N * K, 2 * 2 * M * N * K)
    # The bias adds one FLOP per output element.
    with_bias = one_op(aten.linear.default, [(2, 3, K), (N, K), (N,)])
    assert node_flops(with_bias)[0] == 2 * M * N * K + M * N
    # fp32: inputs (M·K + N·K) and output (M·N) at 4 bytes each.
    assert node_bytes(node) == 4 * (M * K + N * K + M * N)


def test_first_linear_has_no_input_gradient_in_a_captured_graph():
    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 8, bias=False)

        def forward(self, x):
            return self.fc(x).sum()

    gm = capture(Probe(), (torch.randn(4, 16),)).gm
    linear = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
    forward, backward = total_flops(gm)
    # x is data: backward computes only dW = dYᵀ·X, one matmul of the forward's size; the sum
    # costs 1 FLOP per summed element each way.
    assert node_flops(linear)[0] == 2 * 4 * 8 * 16
    assert forward == 2 * 4 * 8 * 16 + 4 * 8
    assert backward == 2 * 4 * 8 * 16 + 4 * 8


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_flops_are_four_b_h_sq_sk_d_halved_when_causal(is_causal):
    B, H, S, D = 2, 4, 128, 64
    node = one_op(
        aten.scaled_dot_product_attention.default, [(B, H, S, D)] * 3, None, 0.0, is_causal
    )
    expected = 4 * B * H * S * S * D / (2 if is_causal else 1)
    assert node_flops(node) == (expected, 2 * expected)
    as_kwarg = one_op(aten.scaled_dot_product_attention.default, [(B, H, S, D)] * 3, is_causal=is_causal)
    assert node_flops(as_kwarg)[0] == expected


def test_mm_uses_torch_flop_formula():
    node = one_op(aten.mm.default, [(64, 32), (32, 16)])
    assert node_flops(node) == (2 * 64 * 32 * 16, 2 * 2 * 64 * 32 * 16)


def test_embedding_has_no_forward_flops_and_reads_only_gathered_rows():
    graph = fx.Graph()
    with FakeTensorMode():
        weight, idx = torch.empty(50_000, 64), torch.zeros(8, dtype=torch.long)
        out = aten.embedding.default(weight, idx)
    w, i = graph.placeholder("w"), graph.placeholder("i")
    w.meta["val"], i.meta["val"] = weight, idx
    node = graph.call_function(aten.embedding.default, (w, i))
    node.meta["val"] = out
    assert node_flops(node)[0] == 0
    # Indices (8 int64) + rows read (8·64 fp32) + output written (8·64 fp32), not the table.
    assert node_bytes(node) == 8 * 8 + 2 * 8 * 64 * 4


def gpt_flops_reference(model: GPT, cfg: GPTConfig, batch: int, seq: int) -> tuple[float, float]:
    """(2·N·D, attention) forward FLOPs: N = parameters that multiply (all but the position
    table, which is only gathered; the tied wte counts once, as the LM head), D = tokens."""
    params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    # Causal attention per layer: 4·B·H·T·T·(C/H) / 2 = 2·B·T²·C.
    attention = cfg.n_layer * 2 * batch * seq * seq * cfg.n_embd
    return 2 * params * batch * seq, attention


def test_gpt_forward_flops_match_two_n_d_plus_attention():
    cfg = GPTConfig()
    model = GPT(cfg)
    B, T = 2, cfg.block_size
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    forward, backward = total_flops(capture(model, (idx, idx)).gm)
    dense, attention = gpt_flops_reference(model, cfg, B, T)
    # Within 3%: the reference counts biases and LayerNorm weights as 2 FLOPs per token
    # (really ~1-2) and leaves out LayerNorm, GELU, residual adds and the loss, a few FLOPs per
    # element each (1% of this 128-wide model, less for wider ones).
    assert forward == pytest.approx(dense + attention, rel=0.03)
    # The 6·N·D rule of thumb counts forward (2ND) plus backward (4ND: dX and dW per matmul);
    # every matmul here has both (its input comes from an embedding, not data), so backward ≈ 2x.
    assert forward + backward == pytest.approx(3 * (dense + attention), rel=0.03)


def test_roofline_picks_memory_bound_for_pointwise_and_compute_bound_for_big_matmul():
    add = one_op(aten.add.Tensor, [(4096, 4096), (4096, 4096)], dtype=torch.bfloat16)
    flops, bytes_moved = node_flops(add)[0], node_bytes(add)
    assert bytes_moved == 3 * 4096 * 4096 * 2
    memory_s = bytes_moved / (A100.memory_bandwidth_gbps * 1e9 * DEFAULT_MEMORY_EFFICIENCY)
    assert roofline_time_s(flops, bytes_moved, A100) == pytest.approx(memory_s)

    mm = one_op(aten.mm.default, [(4096, 4096), (4096, 4096)], dtype=torch.bfloat16)
    flops, bytes_moved = node_flops(mm)[0], node_bytes(mm)
    compute_s = 2 * 4096**3 / (312e12 * DEFAULT_EFFICIENCY)
    assert roofline_time_s(flops, bytes_moved, A100) == pytest.approx(compute_s)
    # fp32 without tensor cores is 16x slower at peak.
    assert roofline_time_s(flops, bytes_moved, A100, "fp32") == pytest.approx(compute_s * 312 / 19.5)


def test_roofline_rejects_unknown_dtype_and_bad_efficiency():
    with pytest.raises(ValueError, match="int8"):
        roofline_time_s(1.0, 1.0, A100, "int8")
    with pytest.raises(ValueError, match="efficiency"):
        roofline_time_s(1.0, 1.0, A100, efficiency=1.5)


def test_graph_compute_works_on_a_meta_device_capture_and_takes_measured_times():
    cfg = GPTConfig(n_layer=2)
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.zeros(2, cfg.block_size, dtype=torch.long, device="meta")
    gm = capture(model, (idx, idx)).gm
    assert all(p.device.type == "meta" for p in gm.parameters())
    costs = graph_compute(gm, A100, "bf16", measured={"linear": (1e-3, 2e-3)})
    assert set(costs) == {n.name for n in gm.graph.nodes if n.op == "call_function"}
    assert (costs["linear"].forward_s, costs["linear"].backward_s) == (1e-3, 2e-3)
    assert costs["linear"].forward_flops > 0
    sdpa = next(n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
    assert costs[sdpa.name].forward_flops == 2 * 2 * cfg.block_size**2 * cfg.n_embd
    # The same model on CPU prices identically: only shapes matter.
    cpu_idx = torch.zeros(2, cfg.block_size, dtype=torch.long)
    cpu_gm = capture(GPT(cfg), (cpu_idx, cpu_idx)).gm
    assert total_flops(gm) == total_flops(cpu_gm)
    with pytest.raises(ValueError, match="no_such_node"):
        graph_compute(gm, A100, measured={"no_such_node": (1.0, 1.0)})
