"""Tensor parallelism on the layouts public models use, not only the zoo GPT's separate q/k/v:

- ``fused_gpt``: nanoGPT's one ``c_attn`` for q, k and v, ``split(n_embd, dim=2)``;
- ``hf_neox``: GPT-NeoX's fused q/k/v with heads interleaved (``view(B, T, H, 3 * hd)``, chunk);
- ``hf_phi3``: Phi-3's fused q/k/v cut by slicing and fused gate/up cut by ``chunk(2, -1)``;
- ``hf_t5``: T5's encoder-decoder with eager attention (``matmul``) and a relative position bias;
- ``hf_mixtral``: a Mixture-of-Experts decoder (its experts stay replicated for now; attention
  and the embedding are sharded);
- ``hf_gpt2``: GPT-2's ``Conv1D`` projections (``addmm(bias, x.view(-1, in), W)`` with ``W``
  stored ``[in, out]``), its fused ``c_attn`` viewed back to ``[B, T, 3 * n_embd]`` and split;
- ``encoder``: ``nn.TransformerEncoder``, whose ``nn.MultiheadAttention`` packs q, k and v in one
  ``in_proj_weight`` cut by ``unflatten(-1, (3, E))`` and merges batch and heads in a view
  (``view(T, B * heads, head_dim)``): sharded by heads through that merged dim.

Each is checked twice: the graph after the passes keeps attention sharded by heads (no q/k/v
all-gather: without sequence parallelism nothing is all-gathered at all; with it, only the
norm outputs feeding column-parallel linears are), and 3 SGD-momentum steps on 2 and 4 gloo
ranks match one process. Tolerances as in test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

import graphpass as gp
import zoo
from graphpass.capture import capture
from graphpass.pass_manager import PassContext, run_passes
from graphpass.ops import op_name
from graphpass.passes import PIPELINE
from graphpass.plan_builder import plan_from_strategy

RTOL, ATOL = 1e-5, 1e-6
LAYOUTS = ("fused_gpt", "hf_neox", "hf_phi3", "hf_t5", "hf_mixtral", "hf_gpt2", "encoder")
aten = torch.ops.aten


def _passes(name: str, **kwargs):
    model = zoo.build(name)
    batch = zoo.batches(name, 1, 4)[0]
    gm = capture(model, batch).gm
    plan = plan_from_strategy(gm, gp.Strategy(tp=2, **kwargs), [])
    return run_passes(gm, plan, PassContext(0, 2, batch), PIPELINE)[0], plan


def _attention_heads(gm) -> list[int]:
    """Head counts (dim 1) of the query of every attention in the final graph."""
    heads = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == aten.scaled_dot_product_attention.default:
            heads.append(node.args[0].meta["val"].shape[1])
        elif node.target == aten.matmul.default and node.args[0].meta["val"].dim() == 4:
            heads.append(node.args[0].meta["val"].shape[1])
    return heads


@pytest.mark.parametrize("name", LAYOUTS)
def test_attention_stays_sharded_by_heads_without_gathering_q_k_v(name):
    gm, plan = _passes(name)
    ops = [op_name(n) for n in gm.graph.nodes]
    assert "tp_all_gather" not in ops, name
    heads = _attention_heads(gm)
    assert heads and set(heads) == {2}, (name, heads)  # 4 heads, 2 per rank
    if name in ("fused_gpt", "hf_phi3", "hf_gpt2"):
        assert plan.tp_parts, "the fused projection is sharded part by part"


def _consumers(node):
    """The users of ``node``, looking through the views the pass inserts around a gather."""
    out = []
    for user in node.users:
        if user.target == aten.reshape.default and user.meta.get("gp.created_by") == "tensor_parallel":
            out.extend(_consumers(user))
        else:
            out.append(user)
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_sequence_parallel_gathers_only_the_inputs_of_column_linears(name):
    gm, _ = _passes(name, sequence_parallel=True)
    gathers = [n for n in gm.graph.nodes if op_name(n) == "tp_all_gather"]
    if name == "hf_mixtral":
        # Its experts are not tensor-parallel yet: the router and experts see every token, so
        # the MoE block's input is gathered whole (a sequence-parallel gather, like a column
        # linear's, but into replicated compute).
        gathers = [n for n in gathers if not all(".mlp" in u.meta["gp.module_path"] for u in _consumers(n))]
    assert gathers
    for node in gathers:
        assert {u.target for u in _consumers(node)} <= {aten.linear.default, aten.addmm.default}, (
            name, node.name, list(node.users))
        assert node.kwargs["grad"] == "reduce_scatter"
    assert set(_attention_heads(gm)) == {2}


def _train(name: str, kwargs: dict):
    data = zoo.batches(name, 3, 8)
    dmodel = zoo.compile(zoo.build(name), data[0], gp.Strategy(**kwargs))
    return zoo.train_compiled(dmodel, data), dmodel.full_state_dict()


CASES = {
    2: ({"tp": 2}, {"tp": 2, "sequence_parallel": True}),
    4: ({"dp": 2, "tp": 2}, {"dp": 2, "tp": 2, "sequence_parallel": True}),
}


def _assert_parity(pool, world_size: int, name: str, strategies) -> None:
    """Every rank's losses and full state after 3 steps of each strategy match one process."""
    ref_losses, ref_state = zoo.train_reference(name, steps=3, batch=8)[:2]
    for kwargs in strategies:
        for rank, (losses, state) in enumerate(pool.run(_train, name, kwargs, timeout_s=300)):
            zoo.assert_matches_reference(f"{name} {kwargs} rank {rank}/{world_size}", losses, state,
                                         ref_losses, ref_state, rtol=RTOL, atol=ATOL)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", [2, 4])
def test_layouts_train_like_one_process(rank_pool, world_size):
    """Each layout with one of the world size's two strategies, alternating over layouts and
    flipped between world sizes: every layout runs with and without sequence parallelism, and
    each strategy on half the layouts (all pairs cost a minute and a half more per run)."""
    pool = rank_pool(world_size)
    for i, name in enumerate(LAYOUTS):
        _assert_parity(pool, world_size, name, [CASES[world_size][(i + world_size // 4) % 2]])


# ------------------------------------------------------------- kv heads fewer than tp (GQA/MQA)

#: (model, tp): Llama with 2 kv heads on tp 4 (sdpa attention), with 1 kv head on tp 2 (eager
#: matmul attention).
FEW_KV = (("hf_llama", 4), ("hf_llama_mqa", 2))


@pytest.mark.parametrize("name, tp", FEW_KV)
def test_kv_heads_fewer_than_tp_are_replicated_and_attention_stays_sharded(name, tp):
    """As Megatron-LM and vLLM do: k and v projections replicated (every rank computes all kv
    heads), queries sharded by heads; the repeated keys and values are narrowed to the rank's
    heads (a local slice), so attention runs on 4 / tp heads and nothing is all-gathered."""
    model = zoo.build(name)
    batch = zoo.batches(name, 1, 4)[0]
    gm = capture(model, batch).gm
    plan = plan_from_strategy(gm, gp.Strategy(tp=tp), [])
    out = run_passes(gm, plan, PassContext(0, tp, batch), PIPELINE)[0]
    shapes = {k: tuple(p.shape) for k, p in out.named_parameters()}
    kv_rows = 16 * {"hf_llama": 2, "hf_llama_mqa": 1}[name]
    assert shapes["model.model.layers.0.self_attn.k_proj.weight"] == (kv_rows, 64)  # whole
    assert shapes["model.model.layers.0.self_attn.q_proj.weight"] == (64 // tp, 64)
    ops = [op_name(n) for n in out.graph.nodes]
    assert "tp_all_gather" not in ops and ops.count("tp_scatter") >= 2 * 2  # k and v of 2 layers
    assert set(_attention_heads(out)) == {4 // tp}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", [2, 4])
def test_kv_heads_fewer_than_tp_train_like_one_process(rank_pool, world_size):
    pool = rank_pool(world_size)
    for name, tp in FEW_KV:
        if tp == world_size:
            _assert_parity(pool, world_size, name, ({"tp": tp}, {"tp": tp, "sequence_parallel": True}))


# ---------------------------------------------------------- torch.nn.MultiheadAttention variants

#: nn.Transformer (cross-attention splits in_proj_weight in the graph) and nn.MultiheadAttention
#: returning its weights (the bmm path); the encoder of LAYOUTS is the fused-attention path.
MHA = ("transformer", "mha_weights")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", [2, 4])
def test_multihead_attention_variants_train_like_one_process(rank_pool, world_size):
    pool = rank_pool(world_size)
    for name in MHA:
        _assert_parity(pool, world_size, name,
                       ({"tp": world_size}, {"dp": world_size // 2, "tp": 2, "sequence_parallel": True}))
