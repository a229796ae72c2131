"""Strategy and Plan: validation, JSON round trip, explain and diff."""

from __future__ import annotations

import json

import pytest
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

import graphpass as gp
import zoo
from graphpass.layout import placement_from_str, placement_to_str


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
        tensors={"idx": gp.TensorPlan({"dp": Shard(0)}), "wte_weight": gp.TensorPlan({"dp": Replicate()}, zero=3),
                 "fc_weight": gp.TensorPlan(split=gp.Split("out", 2)), "loss": gp.TensorPlan({"dp": Partial("avg")})},
        strategy=gp.Strategy(dp=4),
        report=gp.PlanReport(predicted_step_time_s=0.0125, reasons=("because",)),
    )
    again = gp.Plan.from_json(plan.to_json())
    assert again == plan and json.loads(plan.to_json())["report"]["reasons"] == ["because"]
    # one entry per tensor, placements as torch's strings, defaults left out
    assert json.loads(plan.to_json())["tensors"] == {
        "idx": {"placements": {"dp": "Shard(0)"}}, "wte_weight": {"placements": {"dp": "Replicate()"}, "zero": 3},
        "fc_weight": {"split": {"dim": "out", "parts": 2}}, "loss": {"placements": {"dp": "Partial(avg)"}}}
    assert (plan.zero, plan.split) == ({"wte_weight": 3}, {"fc_weight": gp.Split("out", 2)})
    with pytest.raises(TypeError):  # the views are read-only: an edit goes through with_tensor
        plan.placements["idx"]["dp"] = Replicate()
    assert plan.with_tensor("idx", placements={"dp": Replicate()}).placement("idx", "dp") == Replicate()
    assert again.diff(plan) == []
    text = plan.explain()
    assert "mesh: dp=4 (4 devices)" in text and "12.50 ms" in text and "why: because" in text
    assert plan.placement("idx", "dp") == Shard(0)
    assert plan.placement("unmentioned", "dp") == Replicate()


def test_each_layers_saved_activations_are_one_value_and_old_recompute_lists_load():
    plan = gp.Plan(mesh={"dp": 2}, activations={3: gp.ActivationPlan(recompute=True), 1: gp.ActivationPlan()})
    assert plan.recompute == (3,) and json.loads(plan.to_json())["activations"] == {"3": {"recompute": True}, "1": {}}
    assert gp.Plan.from_json(plan.to_json()) == plan
    old = gp.Plan.from_dict({"mesh": {"dp": 2}, "placements": {}, "recompute": [2, 0]})
    assert old.recompute == (0, 2) and old.activations == {2: gp.ActivationPlan(True), 0: gp.ActivationPlan(True)}
    for data, message in (({"recompute": [1], "activations": {}}, "gives both 'activations' and 'recompute'"),
                          ({"activations": {"first": {}}}, "its keys are repeated layer indices"),
                          ({"activations": {"1": {"tier": "ssd"}}}, r"Plan.activations\[1\].tier must be one of")):
        with pytest.raises(ValueError, match=message):
            gp.Plan.from_dict({"mesh": {"dp": 2}, "tensors": {}, **data})


def test_a_plan_saved_before_the_report_was_its_own_type_still_loads():
    """Saved plans and golden files keep the predictions at the plan's top level."""
    plan = gp.Plan(mesh={"dp": 2}, tensors={"x": gp.TensorPlan({"dp": Shard(0)})},
                   report=gp.PlanReport(predicted_step_time_s=0.5, predicted_stage_peaks_bytes=(7,),
                                        breakdown=({"block": "pre"},), reasons=("r",)))
    data = plan.to_dict()
    legacy = {**{k: v for k, v in data.items() if k != "report"}, **data["report"]}
    again = gp.Plan.from_json(json.dumps(legacy))
    assert again == plan and again.report.predicted_stage_peaks_bytes == (7,)
    assert gp.Plan.from_dict({"mesh": {"dp": 2}, "placements": {}}).report == gp.PlanReport()


def test_plan_diff_names_changed_nodes():
    a = gp.Plan(mesh={"dp": 2}, tensors={"x": gp.TensorPlan({"dp": Shard(0)})})
    b = gp.Plan(mesh={"dp": 2}, tensors={"x": gp.TensorPlan({"dp": Replicate()}, zero=2)})
    assert a.diff(b) == ["x: {'placements': {'dp': 'Shard(0)'}} -> {'placements': {'dp': 'Replicate()'}, 'zero': 2}"]


def test_a_plan_json_written_before_the_per_tensor_form_loads_into_it():
    """Placements, ZeRO stages, fused parts and splits (keyed by the linear) became one entry per
    tensor; a plan JSON with them as four fields loads, and a split keyed by its linear is that
    linear's (Plan.splits), as one keyed by the linear's weight is."""
    legacy = {"mesh": {"dp": 2, "tp": 2}, "placements": {"w": {"dp": "Replicate()", "tp": "Shard(0)"}},
              "zero": {"w": 3}, "tp_parts": {"w": [4, 4]}, "split": {"linear": {"dim": "in", "parts": 2}}}
    plan = gp.Plan.from_json(json.dumps(legacy))
    assert plan.tensors == {"w": gp.TensorPlan({"dp": Replicate(), "tp": Shard(0)}, 3, (4, 4)),
                            "linear": gp.TensorPlan(split=gp.Split("in", 2))}
    assert gp.Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match=r"gives both 'tensors' and \['zero'\]"):
        gp.Plan.from_dict({**plan.to_dict(), "zero": {}})


def test_plan_rejects_unknown_axes_fields_and_placements():
    with pytest.raises(ValueError, match=r"Plan.placements\['x'\] uses mesh axis 'tp'"):
        gp.Plan(mesh={"dp": 2}, tensors={"x": gp.TensorPlan({"tp": Shard(0)})})
    with pytest.raises(ValueError, match="unknown placement 'Sharded'"):
        gp.Plan.from_dict({"mesh": {"dp": 2}, "tensors": {"x": {"placements": {"dp": "Sharded"}}}})
    with pytest.raises(ValueError, match=r"Plan.placements\['x'\]\['dp'\] must be a torch Shard"):
        gp.Plan(mesh={"dp": 2}, tensors={"x": gp.TensorPlan({"dp": "Shard(0)"})})
    with pytest.raises(ValueError, match=r"Plan.tensors\['x'\] must be an object with some of"):
        gp.Plan.from_dict({"mesh": {"dp": 2}, "tensors": {"x": {"zeros": 1}}})
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


# --------------------------------------------------------------------------- validation (issue 37, point 10)


def test_strategy_split_needs_zero_3_and_no_tp():
    """OSDP splitting lowers the peak of gathered weights because ZeRO-3 gathers each slice right
    before its linear (split_operators' contract; the planner offers split with ZeRO-3 only)."""
    for zero in (0, 1, 2):
        with pytest.raises(ValueError, match=rf"Strategy.split=2 needs Strategy.zero=3 \(got zero={zero}\).*"
                                             r"use Strategy\(zero=3, split=2\)"):
            gp.Strategy(dp=2, zero=zero, split=2)
    gp.Strategy(dp=2, zero=3, split=2).check(2)
    with pytest.raises(NotImplementedError, match=r"Strategy.split=2 with Strategy.tp=2 is not implemented yet"):
        gp.Strategy(dp=2, tp=2, zero=3, split=2).check(4)


def _plan_json(**fields) -> str:
    data = {"mesh": {"dp": 2}, "placements": {"idx": {"dp": "Shard(0)"}, "w": {"dp": "Replicate()"}}}
    data.update(fields)
    return json.dumps({k: v for k, v in data.items() if v is not _DROP})


_DROP = object()


@pytest.mark.parametrize("fields, message", [
    ({"bucket_cap_bytes": -1}, r"Plan.bucket_cap_bytes must be a positive number of bytes, got -1"),
    ({"bucket_cap_bytes": 2.5}, r"Plan.bucket_cap_bytes must be a positive number of bytes, got 2.5"),
    ({"placements": _DROP}, r"the Plan lacks 'tensors': a plan gives its 'mesh' .* and 'tensors'"),
    ({"mesh": _DROP}, r"the Plan lacks 'mesh'"),
    ({"mesh": {"data": 2}, "placements": {}}, r"Plan.mesh has axis 'data', which graphpass does not know"),
    ({"placements": {"w": {"dp": "Shard(-1)"}}}, r"Plan.placements\['w'\]\['dp'\]: Shard\(-1\) counts the dim from "
                                                 r"the end; write it counted from 0"),
    ({"placements": {"w": {"dp": "Partial(max)"}}}, r"Plan.placements\['w'\]\['dp'\]: Partial\(max\) is not a "
                                                    r"reduction graphpass pends; use Partial\(\) \(a sum\) or Partial\(avg\)"),
    ({"placements": {"w": {"dp": 0}}}, r"Plan.placements\['w'\]\['dp'\] must be a placement string"),
    ({"placements": {"w": "Shard(0)"}}, r"Plan.placements\['w'\] must map mesh axes to placements"),
    ({"placements": ["w"]}, r"Plan.placements must map node names to \{axis: placement\}"),
    ({"stages": ["linear"]}, r"Plan.stages must be '\*' \(the graph's start\) followed by the first op"),
    ({"stages": "*"}, r"Plan.stages must be a list, got '\*'"),
    ({"stages": ["*", "linear"]}, r"Plan.stages has 2 stages, but Plan.mesh has no 'pp' axis"),
    ({"strategy": {"dp": 4}}, r"Plan.strategy \(dp=4\) disagrees with Plan.mesh \(dp=2\).*set Plan.strategy to None"),
    ({"strategy": {"dp": 2, "fsdp": True}}, r"Plan.strategy: .*unexpected keyword argument 'fsdp'"),
    ({"strategy": {"dp": 2, "split": 2}}, r"Plan.strategy: Strategy.split=2 needs Strategy.zero=3"),
    ({"zero": {"w": True}}, r"Plan.zero\['w'\] must be 0, 1, 2 or 3, got True"),
    ({"mesh": {"dp": 1}, "zero": {"w": 3}}, r"Plan.zero\['w'\] = 3 shards over the data-parallel ranks, but "
                                            r"Plan.mesh has dp=1.*nothing to shard over"),
    ({"split": {"lin": {"dim": "out", "parts": True}}}, r"Plan.split\['lin'\] must be"),
    ({"sequence_parallel": True}, r"Plan.sequence_parallel=True shards activations over the 'tp' axis, but "
                                  r"Plan.mesh has tp=1"),
    ({"mesh": {"dp": 2, "tp": 2}, "sequence_parallel": "yes"}, r"Plan.sequence_parallel must be true or false"),
    ({"ep_all_to_all": "hierarchical"}, r"Plan.ep_all_to_all='hierarchical' .* no 'ep' axis"),
    ({"recompute": 3}, r"Plan.recompute must be a list, got 3"),
    ({"recompute": [True]}, r"Plan.recompute entries must be layer indices >= 0, got True"),
    ({"report": {"predicted_step_time_s": "fast"}},
     r"Plan.report.predicted_step_time_s must be a number >= 0 or None, got 'fast'"),
    ({"report": {"devices_per_node": 0}}, r"Plan.report.devices_per_node must be a positive int or None, got 0"),
    ({"report": {"time_split_s": {"compute": "1 ms"}}}, r"Plan.report.time_split_s must map parts of the step to seconds"),
    ({"report": {"reasons": [1]}}, r"Plan.report.reasons must be a list of strings"),
    ({"report": {"speed": 1}}, r"unknown Plan.report fields \['speed'\]"),
    # a plan written before the report was its own type: its predictions at the top level
    ({"predicted_step_time_s": "fast"}, r"Plan.report.predicted_step_time_s must be a number >= 0 or None"),
    ({"reasons": ["a"], "report": {}}, r"gives \['reasons'\] both at its top level and in 'report'"),
])
def test_plan_json_is_validated_at_load_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        gp.Plan.from_json(_plan_json(**fields))


def test_plan_json_must_be_an_object_of_fields():
    with pytest.raises(ValueError, match=r"a Plan's JSON must be an object of its fields, got list"):
        gp.Plan.from_json("[]")
    assert gp.Plan.from_json(_plan_json()).placement("idx", "dp") == Shard(0)


@pytest.fixture(scope="module")
def gpt_graph():
    """The zoo GPT captured at a dp=2 rank's share of an 8-row batch, and its dp=2 plan."""
    from graphpass.capture import capture
    from graphpass.plan_builder import plan_from_strategy

    gm = capture(zoo.build("gpt"), zoo.batches("gpt", 1, 4)[0]).gm
    return gm, plan_from_strategy(gm, gp.Strategy(dp=2), []).to_dict()


def _edited(base: dict, mesh=None, **placements) -> gp.Plan:
    tensors = {**base["tensors"], **{node: {**base["tensors"].get(node, {}), "placements": by_axis}
                                     for node, by_axis in placements.items()}}
    edit = {**base, "tensors": tensors, "strategy": None}
    if mesh is not None:
        edit["mesh"] = mesh
    return gp.Plan.from_dict({k: v for k, v in edit.items() if v is not _DROP})


@pytest.mark.parametrize("mesh, placements, message", [
    (None, {"h_0_attn_q_weight": {"dp": "Shard(5)"}},
     r"^Plan.placements\['h_0_attn_q_weight'\]\['dp'\]: Shard\(5\) on a 2-D tensor \(parameter 'h.0.attn.q.weight' "
     r"of shape \[64, 64\]\); use Shard\(d\) with 0 <= d < 2, or Replicate\(\)$"),
    ({"dp": 1, "tp": 2}, {"h_0_mlp_up_weight": {"tp": "Shard(2)"}},
     r"Plan.placements\['h_0_mlp_up_weight'\]\['tp'\]: Shard\(2\) on a 2-D tensor"),
    (None, {"h_0_ln_1_weight": {"dp": "Shard(1)"}}, r"Shard\(1\) on a 1-D tensor"),
    (None, {"h_0_attn_q_weight": {"dp": "Shard(0)"}},
     r"Plan.placements\['h_0_attn_q_weight'\]\['dp'\]: Shard\(0\) on parameter 'h.0.attn.q.weight' .* placements do "
     r"not shard parameters or buffers over dp .*use Replicate\(\), and Plan.zero\['h_0_attn_q_weight'\] = 1, 2 or 3"),
    (None, {"wte_weight": {"dp": "Partial()"}},
     r"Plan.placements\['wte_weight'\]\['dp'\]: Partial\(\) on parameter 'wte.weight' .* never a pending sum"),
    ({"pp": 2, "dp": 1}, {"wte_weight": {"pp": "Shard(0)"}}, r"\['wte_weight'\]\['pp'\]: .*pipeline stages hold whole"),
    ({"dp": 2, "ep": 2}, {"h_0_mlp_up_weight": {"ep": "Shard(1)"}},
     r"\['h_0_mlp_up_weight'\]\['ep'\]: Shard\(1\) .*experts are sharded along dim 0"),
    # the issue's case: the inputs disagree on the batch split (it failed in train_step on a shape)
    (None, {"idx": {"dp": "Replicate()"}},
     r"^Plan.placements\['idx'\]\['dp'\]: Replicate\(\) on input 'idx', but the batch is split over dp=2: compile "
     r"captures every input at its share of the batch, and 'idx' holds its samples along dim 0; use "
     r"'idx': \{'dp': 'Shard\(0\)'\}$"),
    (None, {"idx": {}}, r"Plan.placements\['idx'\] has no 'dp' entry, so input 'idx' is Replicate\(\)"),
    ({"dp": 2, "tp": 2}, {"targets": {"dp": "Shard(0)", "tp": "Shard(0)"}},
     r"Plan.placements\['targets'\]\['tp'\]: Shard\(0\) on input 'targets'.*use Replicate\(\)"),
    (None, {"cross_entropy_loss": {"dp": "Partial()"}},
     r"Plan.placements\['cross_entropy_loss'\]\['dp'\]: Partial\(\) on the loss.*use Partial\(avg\)"),
    ({"dp": 2, "tp": 2}, {"cross_entropy_loss": {"dp": "Partial(avg)", "tp": "Partial()"}},
     r"\['cross_entropy_loss'\]\['tp'\]: Partial\(\) on the loss, but every tp rank ends the step with the whole loss"),
    (None, {"gelu": {"dp": "Replicate()"}},
     r"Plan.placements\['gelu'\]: op 'gelu' \(aten.gelu.default\) is neither an input, a parameter or buffer, nor "
     r"the loss.*would be ignored; leave it out"),
])
def test_plan_placements_are_checked_against_the_captured_graph(gpt_graph, mesh, placements, message):
    gm, base = gpt_graph
    if mesh is not None and mesh.get("pp", 1) > 1:
        base = {**base, "stages": ["*", "linear_6"]}
    plan = _edited(base, mesh, **placements)
    with pytest.raises(ValueError, match=message):
        plan.check_graph(gm)


def test_a_plan_without_input_placements_lists_every_input(gpt_graph):
    gm, base = gpt_graph
    plan = gp.Plan(mesh={"dp": 2})
    with pytest.raises(ValueError, match=r"the Plan does not fit this model's graph \(2 problems\):\n  "
                                         r"Plan.placements\['idx'\] has no 'dp' entry.*\n  "
                                         r"Plan.placements\['targets'\] has no 'dp' entry"):
        plan.check_graph(gm)
    # microbatches split the batch too, without dp
    with pytest.raises(ValueError, match=r"but the batch is split into Plan.microbatches=2"):
        gp.Plan(mesh={"dp": 1}, tensors={"idx": gp.TensorPlan({"dp": Shard(0)})}, microbatches=2).check_graph(gm)
    gp.Plan(mesh={"dp": 1}).check_graph(gm)  # one rank, one microbatch: nothing is split
    with pytest.raises(ValueError, match=r"the Plan places nodes \['no_such_node'\] that are not in the captured"):
        gp.Plan(mesh={"dp": 1}, tensors={"no_such_node": gp.TensorPlan()}).check_graph(gm)


@pytest.mark.parametrize("model, strategy", [
    ("gpt", gp.Strategy(dp=2, zero=3, split=2)), ("gpt", gp.Strategy(dp=2, tp=2, sequence_parallel=True)),
    ("gpt", gp.Strategy(pp=2, microbatches=2)), ("moe_topk", gp.Strategy(dp=2, ep=2, zero=1)),
])
def test_plans_graphpass_makes_pass_the_graph_check(model, strategy):
    from graphpass.capture import capture
    from graphpass.plan_builder import plan_from_strategy

    gm = capture(zoo.build(model), zoo.batches(model, 1, 2)[0]).gm
    plan = gp.Plan.from_json(plan_from_strategy(gm, strategy, []).to_json())
    plan.check_graph(gm)


@pytest.mark.parametrize("model, sharded, experts", [
    ("moe_topk", "wte_weight", r"those are \['h_0_moe_experts_w_in', "),
    ("gpt", "h_0_mlp_up_weight", r"this model has none"),
])
def test_compile_refuses_a_plan_that_shards_other_than_experts_on_ep(model, sharded, experts):
    """Through gp.verify (the expert pass at compile): its gradient would be averaged over ep."""
    from graphpass.capture import capture
    from graphpass.pass_manager import PassError
    from graphpass.plan_builder import plan_from_strategy

    batch = zoo.batches(model, 1, 4)[0]
    gm = capture(zoo.build(model), tuple(t[:2] for t in batch)).gm
    base = plan_from_strategy(gm, gp.Strategy(dp=2, ep=2) if model != "gpt" else gp.Strategy(dp=2), []).to_dict()
    plan = _edited(base, {"dp": 2, "ep": 2}, **{sharded: {"dp": "Replicate()", "ep": "Shard(0)"}})
    cluster = gp.Cluster.preset("h100-80g", nodes=1, gpus_per_node=2)
    with pytest.raises(PassError, match=rf"Plan.placements shards \['{sharded}'\] on 'ep', which are not expert "
                                         rf"weights .*{experts}.*place these Replicate\(\) on 'ep'"):
        gp.verify(zoo.build(model), cluster, example_inputs=batch, strategy=plan)


def test_compile_refuses_a_plan_whose_inputs_split_differently(gpt_graph):
    """Through gp.verify (compile's own capture and checks, every rank in this process)."""
    _, base = gpt_graph
    plan = _edited(base, idx={"dp": "Replicate()"})
    cluster = gp.Cluster.preset("h100-80g", nodes=1, gpus_per_node=2)
    with pytest.raises(ValueError, match=r"Plan.placements\['idx'\]\['dp'\]: Replicate\(\) on input 'idx'"):
        gp.verify(zoo.build("gpt"), cluster, example_inputs=zoo.batches("gpt", 1, 8)[0], strategy=plan)
