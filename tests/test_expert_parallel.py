"""Expert parallelism's token exchange (runtime/expert_parallel.py) on 2 and 4 gloo ranks: rows
sorted by expert go to the ranks that hold their experts, are multiplied there by the local
experts' weights, and come back; outputs, the rows' gradients and the local experts' weight
gradients equal the grouped product with every expert on one rank.

Tolerances: the same products in the same per-expert order, only the weight gradients summed
over ranks in another order (fp64 here), so 1e-12 catches a row sent to a wrong rank or expert.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphpass.mesh import Mesh
from graphpass.nn import grouped_mm
from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime.expert_parallel import ep_combine, ep_counts, ep_dispatch

LOCAL, D, F = 2, 4, 3  # experts per rank, features in and out


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
