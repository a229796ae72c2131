"""graphpass.nn's Mixture-of-Experts layer and gates: each gate's routing against its definition,
the layer against a per-token loop, capacity's drop rules, capture as a static graph, and
data-parallel training on 2 and 4 gloo ranks against one process.

Tolerances: the layer and the loop differ only in the order of fp32 additions (a token's
experts summed by index_add vs one by one), ~1e-7 relative, so rtol 1e-5 / atol 1e-6 catch a
wrong expert, weight or dropped assignment (each an O(1) relative change of some row).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import graphpass as gp
import zoo
from graphpass.capture import capture
from graphpass.nn import MoE, grouped_mm
from graphpass.nn.gates import DenseToSparseGate, ExpertChoiceGate, HashGate, SwitchGate, TopKGate
from graphpass.ops import op_name

RTOL, ATOL = 1e-5, 1e-6


# ------------------------------------------------------------------------------ grouped_mm


def test_grouped_mm_multiplies_each_experts_rows_and_leaves_the_rest_zero():
    torch.manual_seed(0)
    x = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([3, 3, 8])  # expert 1 gets nothing; rows 8, 9 are dropped
    y = grouped_mm(x, w, offs)
    expected = torch.cat([x[:3] @ w[0], x[3:8] @ w[2], x.new_zeros(2, 5)])
    torch.testing.assert_close(y, expected)
    torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, offs), (x, w))
    with pytest.raises(ValueError, match="offs has 2 groups for 3 experts"):
        grouped_mm(x, w, torch.tensor([3, 8]))


# ------------------------------------------------------------------------------ gates


def _router(gate, logits_of):
    """Set ``gate``'s router so that a token x gets logits ``x @ logits_of``."""
    with torch.no_grad():
        gate.router.weight.copy_(logits_of.t())


def test_top2_gate_takes_the_two_most_probable_experts_with_renormalised_weights_and_gshard_losses():
    gate = TopKGate(3, 4, k=2)
    _router(gate, torch.eye(3, 4))
    x = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 0.5, 3.0]]])  # one group of 2 tokens
    r = gate(x)
    probs = F.softmax(x @ torch.eye(3, 4), dim=-1)[0]
    # choice-major: both tokens' first choices, then both second choices
    assert r.expert.tolist() == [[0, 2, 1, 1]] and r.token.tolist() == [[0, 1, 0, 1]]
    top = probs.topk(2).values
    torch.testing.assert_close(r.weight[0], torch.cat([top[:, 0], top[:, 1]]) / top.sum(-1).repeat(2))
    share = torch.tensor([1, 2, 1, 0]) / 4.0
    torch.testing.assert_close(r.balance_loss, 4 * (share * probs.mean(0)).sum())
    torch.testing.assert_close(r.z_loss, torch.logsumexp(x @ torch.eye(3, 4), -1).pow(2).mean())


def test_switch_gate_keeps_the_top_probability_as_its_weight():
    gate = SwitchGate(3, 4)
    _router(gate, torch.eye(3, 4))
    x = torch.tensor([[[2.0, 1.0, 0.0]]])
    r = gate(x)
    assert r.expert.tolist() == [[0]]
    torch.testing.assert_close(r.weight[0, 0], F.softmax(x @ torch.eye(3, 4), -1)[0, 0, 0])


def test_expert_choice_gives_every_expert_its_best_tokens():
    gate = ExpertChoiceGate(2, 2, capacity_factor=1.0)  # C = ceil(4 * 1 / 2) = 2 tokens per expert
    _router(gate, torch.eye(2))
    x = torch.tensor([[[3.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.0, 4.0]]])
    r = gate(x)
    assert r.expert.tolist() == [[0, 0, 1, 1]]
    assert r.token.tolist() == [[0, 1, 3, 2]]
    assert float(r.balance_loss) == 0.0


def test_hash_gate_routes_by_token_id_and_balances_the_vocabulary():
    gate = HashGate(4, vocab_size=64)
    assert torch.bincount(gate.table, minlength=4).tolist() == [16] * 4
    ids = torch.tensor([[5, 9, 5]])
    r = gate(torch.zeros(1, 3, 8), ids)
    assert r.expert.tolist() == [gate.table[ids].tolist()[0]] and r.expert[0, 0] == r.expert[0, 2]
    with pytest.raises(ValueError, match="token_ids"):
        gate(torch.zeros(1, 3, 8))


def test_dense_to_sparse_gate_starts_dense_and_gets_sparser_as_it_anneals():
    torch.manual_seed(0)
    gate = DenseToSparseGate(16, 8, temperature=(2.0, 0.05), anneal_steps=100, threshold=0.01, noise=False)
    x = torch.randn(2, 32, 16)
    dense = gate(x).kept.float().mean()
    gate.anneal(100)
    assert gate.temperature.item() == pytest.approx(0.05)
    sparse = gate(x).kept.float().mean()
    assert dense.item() == 1.0 and sparse.item() < 0.5
    r = gate(x)
    assert torch.all(r.weight[~r.kept] == 0)


# ------------------------------------------------------------------------------ the layer


def _loop(moe: MoE, x: torch.Tensor, token_ids=None) -> torch.Tensor:
    """The layer by hand: per group, the gate's assignments in priority order (or by weight),
    each expert keeping its first ``capacity``; each kept assignment adds weight * expert(x)."""
    groups = x.reshape(-1, x.shape[-2], x.shape[-1])
    r = moe.gate(groups, None if token_ids is None else token_ids.reshape(groups.shape[:2]))
    out = torch.zeros_like(groups)
    w_in, w_out = moe.experts.w_in, moe.experts.w_out
    for g in range(groups.shape[0]):
        order = list(range(r.expert.shape[1]))
        if moe.drop_policy == "score":
            order.sort(key=lambda a: -float(r.weight[g, a].detach()))
        taken = [0] * moe.num_experts
        capacity = (moe.capacity(r.expert.shape[1]) if moe.capacity_factor is not None and moe.gate.token_choice
                    else math.inf)
        for a in order:
            e, t = int(r.expert[g, a]), int(r.token[g, a])
            if not r.kept[g, a]:
                continue
            taken[e] += 1
            if taken[e] > capacity:
                continue
            h = groups[g, t] @ w_in[e]
            if moe.experts.activation == "swiglu":
                gate_h, up = h.chunk(2)
                h = F.silu(gate_h) * up
            else:
                h = getattr(F, moe.experts.activation)(h)
            out[g, t] += r.weight[g, a] * (h @ w_out[e])
    return out.reshape(x.shape)


@pytest.mark.parametrize("gate, options", [
    ("topk", dict(k=2)),
    ("topk", dict(k=2, capacity_factor=0.5)),
    ("topk", dict(k=1, capacity_factor=1.0, drop_policy="score", activation="gelu")),
    ("switch", dict(capacity_factor=0.75)),
    ("expert_choice", dict(capacity_factor=1.5, activation="relu")),
    ("hash", dict(vocab_size=50)),
    ("dense_to_sparse", dict(noise=False, threshold=0.15)),
    # the gate's own drops take no capacity (a capacity well under the kept assignments)
    ("dense_to_sparse", dict(noise=False, threshold=0.2, capacity_factor=0.25, temperature=(0.05, 0.05))),
])
def test_moe_layer_equals_the_per_token_loop(gate, options):
    torch.manual_seed(0)
    moe = MoE(16, 24, 4, gate, **options)
    x = torch.randn(3, 10, 16)
    ids = torch.randint(0, 50, (3, 10))
    y, aux = moe(x, token_ids=ids)
    torch.testing.assert_close(y, _loop(moe, x, ids), rtol=RTOL, atol=ATOL)
    assert aux.shape == () and torch.isfinite(aux)


def test_capacity_by_position_keeps_first_choices_in_token_order_before_second_choices():
    moe = MoE(2, 4, 2, "topk", k=2, capacity_factor=0.5)  # C = ceil(2 * 3 / 2 * 0.5) = 2 per expert
    _router(moe.gate, torch.tensor([[4.0, 0.0], [0.0, 0.0]]))
    x = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]])  # every token: expert 0 first, 1 second
    r = moe.gate(x)
    keep = moe._within_capacity(r.expert, r.weight, r.kept)
    # tokens 0, 1 keep expert 0 (its capacity), token 2 loses it; expert 1 takes tokens 0 and 1
    assert r.expert.tolist() == [[0, 0, 0, 1, 1, 1]]
    assert keep.tolist() == [[True, True, False, True, True, False]]


def test_capacity_by_score_keeps_the_heaviest_assignments():
    moe = MoE(2, 4, 2, "switch", capacity_factor=1.0, drop_policy="score")  # C = ceil(3 / 2) = 2
    _router(moe.gate, torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    x = torch.tensor([[[1.0, 0.0], [3.0, 0.0], [2.0, 0.0]]])  # all pick expert 0; weights rise with x
    r = moe.gate(x)
    assert moe._within_capacity(r.expert, r.weight, r.kept).tolist() == [[False, True, True]]


def test_the_router_runs_in_float32_for_low_precision_inputs():
    torch.manual_seed(0)
    moe = MoE(16, 24, 4)
    x = torch.randn(2, 8, 16)
    y32, _ = moe(x)
    y16, aux = moe(x.bfloat16())
    assert y16.dtype == torch.bfloat16 and aux.dtype == torch.float32
    torch.testing.assert_close(y16.float(), y32, rtol=0.05, atol=0.02)  # bf16 experts: ~3 significant digits


def test_bad_moe_arguments_name_the_field():
    with pytest.raises(ValueError, match="gate must be one of"):
        MoE(8, 8, 4, "top3")
    with pytest.raises(ValueError, match="k must be between 1 and num_experts=4"):
        MoE(8, 8, 4, "topk", k=5)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        MoE(8, 8, 4, capacity_factor=0)
    with pytest.raises(ValueError, match="drop_policy must be one of"):
        MoE(8, 8, 4, drop_policy="random")
    with pytest.raises(ValueError, match="activation must be one of"):
        MoE(8, 8, 4, activation="tanh")
    with pytest.raises(ValueError, match=r"must be \[\.\.\., L, d\]"):
        MoE(8, 8, 4)(torch.zeros(5, 8))
    assert MoE(8, 8, 4, "expert_choice", capacity_factor=1.5).gate.capacity_factor == 1.5


# ------------------------------------------------------------------------------ capture


def test_an_moe_decoder_captures_as_a_static_graph_with_grouped_products():
    model = zoo.build("moe_topk_capacity")
    batch = zoo.batches("moe_topk_capacity", 1, 4)[0]
    captured = capture(model, batch)
    names = [op_name(n) for n in captured.gm.graph.nodes if n.op == "call_function"]
    assert names.count("graphpass.grouped_mm") == 4  # 2 layers x (in, out)
    for node in captured.gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert all(isinstance(d, int) for d in val.shape), f"{node.name} has a symbolic shape {val.shape}"
    torch.testing.assert_close(captured.gm(*batch)[0], model(*batch), rtol=RTOL, atol=ATOL)


def test_a_torchtitan_style_expert_loop_captures_as_grouped_products_and_the_model_is_untouched():
    """torchtitan's experts loop over tolist() counts (no route captures that); capture runs them
    through graphpass.nn.grouped_experts' grouped forward, which computes the same outputs, and
    leaves the user's modules as they were."""
    model = zoo.build("tt_moe")
    batch = zoo.batches("tt_moe", 1, 4)[0]
    captured = capture(model, batch)
    names = [op_name(n) for n in captured.gm.graph.nodes if n.op == "call_function"]
    assert captured.route == "export" and names.count("graphpass.grouped_mm") == 6  # 2 layers x (w1, w3, w2)
    assert all("forward" not in vars(m) for m in model.modules())
    torch.testing.assert_close(captured.gm(*batch)[0], model(*batch), rtol=RTOL, atol=ATOL)


class _OtherExperts(torch.nn.Module):
    """Experts under other names, written as a loop (a user's own module)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Parameter(torch.randn(3, 4, 5))
        self.down = torch.nn.Parameter(torch.randn(3, 5, 4))

    def forward(self, rows, counts):
        pieces = torch.split(rows, [int(c) for c in counts.tolist()])
        return torch.cat([F.relu(p @ self.up[e]) @ self.down[e] for e, p in enumerate(pieces)])


class _OtherMoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = _OtherExperts()

    def forward(self, x):
        expert = (x.sum(-1) > 0).long() + (x[:, 0] > 1).long()  # 0, 1 or 2 per row
        order = expert.argsort(stable=True)
        counts = (expert.unsqueeze(-1) == torch.arange(3)).sum(0)
        out = self.experts(x[order], counts)
        return torch.zeros_like(out).index_copy(0, order, out).pow(2).mean()


def test_a_registered_expert_module_captures_through_its_grouped_forward():
    from graphpass.nn import register_grouped_experts
    from graphpass.nn.grouped_experts import _REGISTRY

    x = torch.randn(16, 4)
    model = _OtherMoE()
    with pytest.raises(gp.CaptureError):
        capture(model, (x,))
    register_grouped_experts(_OtherExperts, lambda m, rows, counts: grouped_mm(
        F.relu(grouped_mm(rows, m.up, counts.cumsum(0))), m.down, counts.cumsum(0)))
    try:
        captured = capture(model, (x,))
    finally:
        del _REGISTRY[_OtherExperts]
    assert [op_name(n) for n in captured.gm.graph.nodes].count("graphpass.grouped_mm") == 2
    torch.testing.assert_close(captured.gm(x)[0], model(x), rtol=RTOL, atol=ATOL)
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_grouped_experts(int, print)


# ------------------------------------------------------------------------------ data parallel


def _train(name: str, strategy_kwargs: dict, steps: int = 3, batch: int = 8):
    dmodel, data = zoo.compile_on_ranks(name, strategy_kwargs, steps, batch)
    return zoo.train_compiled(dmodel, data), dmodel.full_state_dict()


@pytest.mark.timeout(900)
def test_moe_decoders_train_data_parallel_as_one_process(rank_pool):
    """Routing, capacity and the auxiliary losses are per sequence, so any batch split routes
    and drops alike and the losses average exactly: every gate, ZeRO stage and mode equals one
    process on the whole batch (tolerances as in test_zero.py). test_expert_parallel trains every
    gate with its experts sharded (and the dense weights data parallel) on 2 and 4 ranks."""
    pool = rank_pool(2)
    cases = [("moe_topk", {}), ("moe_topk_capacity", {"zero": 3}), ("moe_dense_to_sparse", {"microbatches": 2})]
    for name, kwargs in cases:
        ref_losses, ref_state, _ = zoo.train_reference(name, steps=3, batch=8)
        for rank, (losses, state) in enumerate(pool.run(_train, name, kwargs, timeout_s=300)):
            zoo.assert_matches_reference(f"{name} {kwargs} rank {rank}", losses, state,
                                         ref_losses, ref_state, rtol=RTOL, atol=ATOL)


@pytest.mark.timeout(600)
def test_hugging_face_moe_decoders_capture_statically_and_train_sharded_as_one_process(rank_pool):
    """Mixtral and Qwen2-MoE (random-init configs) capture into the same static form as
    graphpass's layer (tokens sorted by expert, counts by histc, Hugging Face's grouped product
    op with the counts as offsets) and train under ZeRO as one process does (and with their
    experts sharded: test_expert_parallel)."""
    for name in ("hf_mixtral", "hf_qwen2_moe"):
        batch = zoo.batches(name, 1, 4)[0]
        names = [op_name(n) for n in capture(zoo.build(name), batch).gm.graph.nodes if n.op == "call_function"]
        assert names.count("transformers.grouped_mm_fallback") == 4, name
    ref_losses, ref_state, _ = zoo.train_reference("hf_mixtral", steps=3, batch=8)
    for rank, (losses, state) in enumerate(rank_pool(2).run(_train, "hf_mixtral", {"zero": 3}, timeout_s=300)):
        zoo.assert_matches_reference(f"hf_mixtral zero-3 rank {rank}", losses, state, ref_losses, ref_state,
                                     rtol=RTOL, atol=ATOL)


def _train_capacity_from_plan(steps: int = 3, batch: int = 8):
    """The dropless top-k decoder compiled with a plan that sets capacity factor 1.0."""
    import dataclasses

    dmodel, data = zoo.compile_on_ranks("moe_topk", {"ep": 2}, steps, batch,
                                        plan_edit=lambda plan: dataclasses.replace(plan, capacity_factor=1.0))
    return zoo.train_compiled(dmodel, data), dmodel.full_state_dict()


@pytest.mark.timeout(300)
def test_a_plans_capacity_factor_is_what_the_compiled_layers_run(rank_pool):
    """compile gives the plan's capacity factor to every graphpass.nn.MoE layer: the dropless
    decoder then trains as its capacity-1.0 twin (same weights) does in one process."""
    ref_losses, ref_state, _ = zoo.train_reference("moe_topk_capacity", steps=3, batch=8)
    dropless, _, _ = zoo.train_reference("moe_topk", steps=3, batch=8)
    assert dropless != pytest.approx(ref_losses, rel=1e-6)  # the capacity drops something
    for rank, (losses, state) in enumerate(rank_pool(2).run(_train_capacity_from_plan, timeout_s=120)):
        zoo.assert_matches_reference(f"moe_topk capacity 1.0 from the plan, rank {rank}", losses, state,
                                     ref_losses, ref_state, rtol=RTOL, atol=ATOL)


def _annealed(name: str, step: int, steps: int = 2, batch: int = 8):
    """Train ``name``'s dense-to-sparse gates annealed to ``step`` after compile; the losses."""
    import torch.distributed as dist

    model = zoo.build(name)
    for block in model.h:  # from dense (2.0) towards sparse (0.02) over 100 steps
        block.moe.gate.start, block.moe.gate.end, block.moe.gate.anneal_steps = 2.0, 0.02, 100
    gp.nn.anneal(model, 0)
    data = zoo.batches(name, steps, batch)
    if not dist.is_initialized():
        gp.nn.anneal(model, step)
        return [float(model(*b).detach()) for b in data]
    dmodel = zoo.compile(model, data[0], gp.Strategy(dp=dist.get_world_size()))
    gp.nn.anneal(model, step)  # after compile: the program reads the model's temperature buffers
    return [float(dmodel.train_step(*b)) for b in data]


@pytest.mark.timeout(300)
def test_annealing_the_compiled_models_gates_moves_its_program(rank_pool):
    ref = _annealed("moe_dense_to_sparse", 100)
    assert ref != pytest.approx(_annealed("moe_dense_to_sparse", 0), rel=1e-3)  # annealing changes the loss
    for losses in rank_pool(2).run(_annealed, "moe_dense_to_sparse", 100, timeout_s=120):
        assert losses == pytest.approx(ref, rel=1e-5)
    with pytest.raises(ValueError, match="no DenseToSparseGate"):
        gp.nn.anneal(zoo.build("moe_topk"), 1)
