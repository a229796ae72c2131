"""Expert parallelism on 2 and 4 gloo ranks.

The token exchange (runtime/expert_parallel.py): rows sorted by expert go to the ranks that hold
their experts, are multiplied there by the local experts' weights, and come back; outputs, the
rows' gradients and the local experts' weight gradients equal the grouped product with every
expert on one rank. Tolerances: the same products in the same per-expert order, only the weight
gradients summed over ranks in another order (fp64 here), so 1e-12 catches a row sent to a wrong
rank or expert.

The pass (passes/expert_parallel.py) end to end: Mixture-of-Experts decoders trained under
``Strategy(ep=...)`` equal one process. Tolerances (rtol 1e-5, atol 1e-6, as test_moe.py): the
same fp32 products, with the gradients summed over ranks in another order (~1e-7 relative); an
expert gradient divided by the wrong degree is off by 2x, a misrouted row by O(1).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import graphpass as gp
import zoo
from graphpass.testing import full_grads

from graphpass.mesh import Mesh
from graphpass.nn import grouped_mm
from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime.expert_parallel import ep_combine, ep_counts, ep_dispatch

LOCAL, D, F = 2, 4, 3  # experts per rank, features in and out
RTOL, ATOL = 1e-5, 1e-6


def _rank_data(rank: int, num_experts: int):
    """Rank ``rank``'s rows sorted by expert (some experts get none, the last 3 rows dropped),
    their running counts and the output gradient."""
    g = torch.Generator().manual_seed(100 + rank)
    counts = torch.randint(0, 4, (num_experts,), generator=g)
    counts[rank % num_experts] = 0  # an empty group on every rank
    offs = counts.cumsum(0)
    rows = torch.randn(int(offs[-1]) + 3, D, generator=g, dtype=torch.float64)
    return rows, offs, torch.randn(rows.shape[0], F, generator=g, dtype=torch.float64)


def _exchange(world: int):
    import torch.distributed as dist

    from graphpass.runtime.mesh import ProcessMesh

    rank, num_experts = dist.get_rank(), LOCAL * world
    weight = torch.randn(num_experts, D, F, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    local_w = weight[rank * LOCAL:(rank + 1) * LOCAL].clone().requires_grad_()
    rows, offs, grad = _rank_data(rank, num_experts)
    rows.requires_grad_()
    with mesh_lib.active(ProcessMesh(Mesh.of(dp=world, ep=world))):
        splits = ep_counts(offs, "ep", world)
        local_rows, local_offs = ep_dispatch(rows, splits, "ep")
        out = ep_combine(grouped_mm(local_rows, local_w, local_offs), splits, rows.shape[0], "ep")
    (out * grad).sum().backward()
    # One process with every expert: each rank's rows against the full weights.
    ref_rows = rows.detach().clone().requires_grad_()
    full_w = weight.clone().requires_grad_()
    ref = grouped_mm(ref_rows, full_w, offs)
    (ref * grad).sum().backward()
    for other in range(world):  # the local experts' gradient sums every rank's rows
        if other != rank:
            o_rows, o_offs, o_grad = _rank_data(other, num_experts)
            (grouped_mm(o_rows, full_w, o_offs) * o_grad).sum().backward()
    received = int(local_offs[-1]) if local_offs.numel() else 0
    return {
        "out": (out - ref).abs().max().item(),
        "rows_grad": (rows.grad - ref_rows.grad).abs().max().item(),
        "w_grad": (local_w.grad - full_w.grad[rank * LOCAL:(rank + 1) * LOCAL]).abs().max().item(),
        "received": received,
        "expected": int(sum(_rank_data(s, num_experts)[1].diff(prepend=torch.zeros(1, dtype=torch.long))
                            [rank * LOCAL:(rank + 1) * LOCAL].sum() for s in range(world))),
    }


def _flat_and_two_level():
    """The exchange on 4 ranks declared as 2 nodes of 2: flat and two-level, the same rows in
    the same order, and the same gradients (all bitwise)."""
    import torch.distributed as dist

    from graphpass.runtime.mesh import ProcessMesh

    world, rank = dist.get_world_size(), dist.get_rank()
    num_experts = LOCAL * world
    rows, offs, _ = _rank_data(rank, num_experts)
    mesh = ProcessMesh(Mesh.of(dp=world, ep=world), node_size=2)
    out = {}
    for algorithm in ("flat", "hierarchical"):
        x = rows.detach().clone().requires_grad_()
        with mesh_lib.active(mesh):
            splits = ep_counts(offs, "ep", world)
            local_rows, local_offs = ep_dispatch(x, splits, "ep", algorithm=algorithm)
            back = ep_combine(local_rows * 2, splits, rows.shape[0], "ep", algorithm=algorithm)
        (back * x.detach().cos()).sum().backward()  # any weights of the returned rows
        out[algorithm] = (local_rows.detach(), back.detach(), x.grad)
    return [torch.equal(a, b) for a, b in zip(out["flat"], out["hierarchical"])], mesh.two_level("ep") is not None


@pytest.mark.timeout(120)
def test_the_two_level_exchange_moves_the_rows_the_flat_one_does(rank_pool):
    for rank, (equal, two_level) in enumerate(rank_pool(4).run(_flat_and_two_level, timeout_s=60)):
        assert two_level, f"rank {rank}: no two-level groups for 2 nodes of 2"
        assert equal == [True, True, True], f"rank {rank}: received rows, returned rows, gradients: {equal}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_rows_go_to_their_experts_ranks_and_come_back_with_exact_gradients(rank_pool, world_size):
    for rank, r in enumerate(rank_pool(world_size).run(_exchange, world_size, timeout_s=120)):
        assert r["received"] == r["expected"], f"rank {rank} received {r['received']} rows, not {r['expected']}"
        for key in ("out", "rows_grad", "w_grad"):
            assert r[key] < 1e-12, f"rank {rank}: {key} differs by {r[key]:.3g}"


def test_under_fake_tensors_the_exchange_returns_the_balanced_shapes():
    with FakeTensorMode():
        rows, offs = torch.empty(12, D), torch.empty(8, dtype=torch.long)
        splits = ep_counts(offs, "ep", 4)
        local_rows, local_offs = ep_dispatch(rows, splits, "ep")
        assert (local_rows.shape, local_offs.shape, splits.shape) == ((12, D), (2,), (2, 4, 2))
        assert ep_combine(torch.empty(12, F), splits, 12, "ep").shape == (12, F)
    with pytest.raises(ValueError, match="8 experts do not divide over the 3 ranks"):
        ep_counts(torch.zeros(8, dtype=torch.long), "ep", 3)


# ------------------------------------------------------------------------------ the pass, end to end


def _train(name: str, strategy_kwargs: dict, steps: int = 3, batch: int = 8):
    dmodel, data = zoo.compile_on_ranks(name, strategy_kwargs, steps, batch)
    grads: dict = {}
    losses = zoo.train_compiled(dmodel, data, on_first_step=lambda m: grads.update(full_grads(m)))
    return losses, dmodel.full_state_dict(), grads


#: (model, Strategy fields besides dp = world size): every deterministic gate, dropless and
#: capacity (by position and by score), ZeRO of the experts over edp and of the dense weights
#: over dp, Hugging Face's Mixtral and Qwen2-MoE, a torchtitan-style layer (experts as a loop
#: over tolist() counts), tp (with sequence parallelism) and pp.
CASES = {
    2: [("moe_topk", {"ep": 2}), ("moe_topk_capacity", {"ep": 2, "zero": 3}), ("moe_switch_score", {"ep": 2, "zero": 1}),
        ("moe_expert_choice", {"ep": 2}), ("moe_hash", {"ep": 2, "zero": 2}), ("hf_qwen2_moe", {"ep": 2}),
        ("tt_moe", {"ep": 2, "zero": 3})],
    # 4 ranks: ep 4 = dp (dropless and capacity), ep 2 inside dp 4 (experts ZeRO-sharded over
    # edp 2; dropless ep 2 x dp 4 is the placement test's), and with tp / pp; the other gates are
    # the 2-rank run's (their routing does not depend on the layout)
    4: [("moe_topk", {"ep": 4}), ("moe_switch_score", {"ep": 4, "zero": 1}), ("moe_topk_capacity", {"ep": 2, "zero": 3}),
        ("moe_topk", {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True}), ("hf_mixtral", {"dp": 2, "tp": 2, "ep": 2}),
        ("moe_topk_capacity", {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2})],
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_training_equals_one_process(rank_pool, world_size):
    """Loss, every gradient (put together from every rank's experts and shards) and the full
    state after 3 SGD-momentum steps equal one process on the whole batch. Tolerances as
    test_moe.py's: the same products, reduced in another order."""
    pool = rank_pool(world_size)
    for name, kwargs in CASES[world_size]:
        ref_losses, ref_state, ref_grads = zoo.train_reference(name, steps=3, batch=8)
        for rank, (losses, state, grads) in enumerate(pool.run(_train, name, kwargs, timeout_s=300)):
            assert set(grads) == set(ref_grads), f"{name} {kwargs}: gradients of {set(ref_grads) ^ set(grads)}"
            zoo.assert_matches_reference(f"{name} {kwargs} rank {rank} of {world_size}", losses, state, ref_losses,
                                         ref_state, grads, ref_grads, rtol=RTOL, atol=ATOL)


def _phases(phases: tuple[int, ...], strategy_kwargs: dict | None, batch: int = 8):
    """One training step at each annealing phase of the dense-to-sparse gates (temperature 2.0
    at step 0 to 0.02 at step 100): the losses, and in one process the share of assignments kept."""
    import torch.distributed as dist

    model = zoo.build("moe_dense_to_sparse")
    for block in model.h:
        block.moe.gate.start, block.moe.gate.end, block.moe.gate.anneal_steps = 2.0, 0.02, 100
    gp.nn.anneal(model, phases[0])
    data = zoo.batches("moe_dense_to_sparse", len(phases), batch)
    kept: list[float] = []
    if strategy_kwargs is None:
        model.h[0].moe.gate.register_forward_hook(lambda gate, args, routing: kept.append(routing.kept.float().mean().item()))
        step, params = model, model.parameters()
    else:
        dmodel = zoo.compile(model, data[0], gp.Strategy(**{"dp": dist.get_world_size(), **strategy_kwargs}))
        step, params = dmodel.train_step, dmodel.parameters()
    opt = torch.optim.SGD(params, lr=0.05)
    losses = []
    for phase, b in zip(phases, data):
        gp.nn.anneal(model, phase)  # a compiled program reads the model's temperature buffers
        loss = step(*b)
        if strategy_kwargs is None:
            loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return losses, kept


@pytest.mark.timeout(300)
def test_dense_to_sparse_routing_thins_on_schedule_and_expert_parallel_follows_each_phase(rank_pool):
    phases = (0, 50, 100)
    ref, kept = _phases(phases, None)
    assert kept[0] == 1.0 and kept[0] > kept[1] > kept[2], kept  # dense, then sparser as it anneals
    for losses, _ in rank_pool(2).run(_phases, phases, {"ep": 2}, timeout_s=120):
        torch.testing.assert_close(losses, ref, rtol=RTOL, atol=0)


# ------------------------------------------------------------------------------ dynamic placement


def _train_moving(name: str, strategy_kwargs: dict, path: str, steps: int = 4, batch: int = 8):
    """Train with ExpertPlacement deciding after every step (forced: the tiny model's cost model
    would not move); the losses, full state, first step's gradients and the placements used.
    Then save (experts moved) and load into a fresh program (experts in order): the state must
    come back whole."""
    dmodel, data = zoo.compile_on_ranks(name, strategy_kwargs, steps, batch)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.05, momentum=0.9)
    placement = gp.ExpertPlacement(dmodel, opt, every=1, force=True)
    losses, grads, moves = [], {}, []
    for step, b in enumerate(data):
        losses.append(dmodel.train_step(*b).item())
        if step == 1:  # after the first move: gradients put together through the moved layout
            grads = full_grads(dmodel)
        opt.step()
        opt.zero_grad()
        moves += [(m.layer, m.moved, round(max(m.before), 4), round(max(m.after), 4)) for m in placement.step()]
    placements = [dmodel._attr(name).tolist() for name, _, _ in placement.layers]
    state = dmodel.full_state_dict()
    gp.save(dmodel, opt, path)
    fresh, _ = zoo.compile_on_ranks(name, strategy_kwargs, steps, batch)
    gp.load(fresh, torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9), path)
    reloaded = fresh.full_state_dict()
    assert all(torch.equal(reloaded[k], state[k]) for k in state), "the checkpoint of moved experts did not reload"
    return losses, state, grads, moves, placements


def _reference_grads_at(name: str, step: int, steps: int = 4, batch: int = 8):
    model = zoo.build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i, b in enumerate(zoo.batches(name, steps, batch)):
        model(*b).backward()
        if i == step:
            return {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size, kwargs", [(2, {"ep": 2}), (4, {"ep": 2})])
def test_moving_hot_experts_changes_where_they_run_not_what_they_compute(rank_pool, tmp_path, world_size, kwargs):
    """Routing skewed towards experts 0 and 1 (contiguous placement puts them on one rank): the
    greedy placement splits them up, weights and momentum move with them, and losses, gradients
    and the full state stay those of one process (tolerances as above); a checkpoint of the
    moved experts reloads exactly into a program with them in order."""
    ref_losses, ref_state, _ = zoo.train_reference("moe_skewed", steps=4, batch=8)
    ref_grads = _reference_grads_at("moe_skewed", 1)
    for rank, (losses, state, grads, moves, placements) in enumerate(
            rank_pool(world_size).run(_train_moving, "moe_skewed", kwargs, str(tmp_path / "ck"), timeout_s=300)):
        assert any(moved and after < before for _, moved, before, after in moves), moves
        assert all(p != list(range(8)) for p in placements), placements  # every layer moved
        zoo.assert_matches_reference(f"moe_skewed {kwargs} rank {rank}", losses, state, ref_losses, ref_state,
                                     grads, ref_grads, rtol=RTOL, atol=ATOL)


def test_greedy_placement_spreads_the_hot_experts_and_keeps_the_rest_in_place():
    from graphpass.runtime.expert_placement import greedy_placement, rank_shares

    loads = [40.0, 30.0, 10.0, 10.0, 5.0, 5.0]
    new = greedy_placement(loads, 3, list(range(6)))
    assert rank_shares(loads, list(range(6)), 3) == pytest.approx([0.7, 0.2, 0.1])
    # two slots a rank: expert 0 (40) shares a rank with a 5 at best, so 0.45 is the optimum
    assert max(rank_shares(loads, new, 3)) == pytest.approx(0.45)
    assert sorted(new) == list(range(6)) and new[:1] == [0]  # expert 0 stays in slot 0
    assert greedy_placement([1.0] * 4, 2, [0, 1, 2, 3]) == [0, 1, 2, 3]  # balanced: nothing moves


def _train_two_level(name: str, steps: int = 3, batch: int = 8):
    """ep 4 on 4 ranks declared as 2 nodes of 2, the exchanges two-level; the losses, full
    state, first gradients and whether the program's exchanges ran two-level."""
    import dataclasses

    import torch.distributed as dist

    from graphpass.capture import capture
    from graphpass.plan_builder import plan_from_strategy

    model, data = zoo.build(name), zoo.batches(name, steps, batch)
    world = dist.get_world_size()
    cluster = dataclasses.replace(gp.Cluster.local(), num_nodes=2, devices_per_node=world // 2)
    gm = capture(zoo.build(name), tuple(t[: batch // world] for t in data[0])).gm
    plan = dataclasses.replace(plan_from_strategy(gm, gp.Strategy(dp=world, ep=world), ["test"]),
                               ep_all_to_all="hierarchical")
    dmodel = gp.compile(model, cluster, example_inputs=data[0], strategy=plan)
    grads: dict = {}
    losses = zoo.train_compiled(dmodel, data, on_first_step=lambda m: grads.update(full_grads(m)))
    return losses, dmodel.full_state_dict(), grads, dmodel._mesh.two_level("ep") is not None


@pytest.mark.timeout(300)
def test_two_level_exchanges_train_as_one_process(rank_pool):
    ref_losses, ref_state, ref_grads = zoo.train_reference("hf_mixtral", steps=3, batch=8)
    for rank, (losses, state, grads, two_level) in enumerate(rank_pool(4).run(_train_two_level, "hf_mixtral",
                                                                              timeout_s=200)):
        assert two_level, f"rank {rank}: the program's ep group has no two-level route"
        zoo.assert_matches_reference(f"hf_mixtral two-level rank {rank}", losses, state, ref_losses, ref_state,
                                     grads, ref_grads, rtol=RTOL, atol=ATOL)
