"""Strategy and Plan: validation, JSON round trip, explain and diff."""

from __future__ import annotations

import pytest
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

import graphpass as gp
from graphpass.plan import placement_from_str, placement_to_str


def test_strategy_degrees_must_multiply_to_world_size():
    with pytest.raises(ValueError, match=r"dp=2 x tp=1 x pp=1 = 2 devices, but the cluster has world_size=4.*Strategy\(dp=4\)"):
        gp.Strategy(dp=2).check(4)
    gp.Strategy(dp=4).check(4)


def test_unbuilt_strategy_fields_raise_not_implemented_naming_the_field():
    with pytest.raises(NotImplementedError, match=r"Strategy\.schedule='zero_bubble' with Strategy\.dp=2 is not "
                                                  r"implemented yet: the engine's split weight backward bypasses"):
        gp.Strategy(pp=2, dp=2, microbatches=2, schedule="zero_bubble").check(4)
    gp.Strategy(pp=2, tp=2, microbatches=2, schedule="zero_bubble").check(4)
    gp.Strategy(pp=2, tp=2, microbatches=2, recompute=True).check(4)  # pipelines compose with the rest
    gp.Strategy(microbatches=4).check(1)  # gradient accumulation runs


@pytest.mark.parametrize(
    "kwargs, message",
    [({"dp": 0}, "Strategy.dp must be a positive int"), ({"zero": 4}, "Strategy.zero must be 0, 1, 2 or 3"),
     ({"schedule": "bogus"}, "Strategy.schedule must be one of"), ({"tp": 1.5}, "Strategy.tp"),
     ({"virtual_stages": 0}, "Strategy.virtual_stages must be a positive int")],
)
def test_strategy_rejects_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gp.Strategy(**kwargs)


def test_plan_json_round_trip_and_explain():
    plan = gp.Plan(
        mesh={"dp": 4},
        placements={"idx": {"dp": "Shard(0)"}, "wte_weight": {"dp": "Replicate()"}, "loss": {"dp": "Partial(avg)"}},
        strategy=gp.Strategy(dp=4),
        predicted_step_time_s=0.0125,
        reasons=("because",),
    )
    again = gp.Plan.from_json(plan.to_json())
    assert again == plan
    assert again.diff(plan) == []
    text = plan.explain()
    assert "mesh: dp=4 (4 devices)" in text and "12.50 ms" in text and "why: because" in text
    assert plan.placement("idx", "dp") == Shard(0)
    assert plan.placement("unmentioned", "dp") == Replicate()


def test_plan_diff_names_changed_nodes():
    a = gp.Plan(mesh={"dp": 2}, placements={"x": {"dp": "Shard(0)"}})
    b = gp.Plan(mesh={"dp": 2}, placements={"x": {"dp": "Replicate()"}})
    assert a.diff(b) == ["x: {'dp': 'Shard(0)'} -> {'dp': 'Replicate()'}"]


def test_plan_rejects_unknown_axes_fields_and_placements():
    with pytest.raises(ValueError, match=r"Plan.placements\['x'\] uses mesh axis 'tp'"):
        gp.Plan(mesh={"dp": 2}, placements={"x": {"tp": "Shard(0)"}})
    with pytest.raises(ValueError, match="unknown placement 'Sharded'"):
        gp.Plan(mesh={"dp": 2}, placements={"x": {"dp": "Sharded"}})
    with pytest.raises(ValueError, match=r"unknown Plan fields \['meshes'\]"):
        gp.Plan.from_dict({"mesh": {"dp": 1}, "meshes": 1})


@pytest.mark.parametrize("placement", [Shard(0), Shard(2), Replicate(), Partial(), Partial("avg")])
def test_placement_strings_round_trip(placement):
    assert placement_from_str(placement_to_str(placement)) == placement


def test_mesh_lays_ranks_out_as_device_mesh_does():
    """Coordinates and groups follow DeviceMesh's row-major layout (``arange(world).view(shape)``),
    so the passes, the cost model and the process groups agree on which ranks share an axis."""
    import torch

    from graphpass.mesh import Mesh

    mesh = Mesh.of(pp=2, dp=3, tp=2)
    assert list(mesh) == ["pp", "dp", "tp"] and mesh.world_size == 12 and mesh.size("dp,tp") == 6
    grid = torch.arange(12).view(2, 3, 2)
    for rank in range(12):
        p, d, t = (int(i) for i in (grid == rank).nonzero()[0])
        assert (mesh.coordinate(rank, "pp"), mesh.coordinate(rank, "dp"), mesh.coordinate(rank, "tp")) == (p, d, t)
        assert mesh.group_ranks("dp", rank) == grid[p, :, t].tolist()
        assert mesh.group_ranks("tp", rank) == grid[p, d, :].tolist()
        assert mesh.group_ranks("pp", rank) == grid[:, d, t].tolist()
    assert Mesh.of(dp=4) == {"dp": 4} and gp.Plan(mesh={"dp": 2, "tp": 2}).mesh == Mesh.of(dp=2, tp=2)
    assert gp.Plan.from_json(gp.Plan(mesh=Mesh.of(dp=2, tp=2)).to_json()).mesh == Mesh.of(dp=2, tp=2)
    with pytest.raises(ValueError, match=r"Plan.mesh: mesh\['dp'\] must be a positive int"):
        gp.Plan(mesh={"dp": 0})
