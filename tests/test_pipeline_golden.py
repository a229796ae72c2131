"""Golden files of each pipeline stage's program: what it receives, the collectives it runs in
order, and what it sends.

The passes run in this process on rank 0's program (tp, ZeRO and dp collectives name their
axis; shapes are rank 0's local ones), then the graph is cut as ``compile`` cuts it. A change in
the passes, the cut, torch or transformers that moves, adds or drops a collective or changes
what crosses a stage boundary changes the text and fails here with a diff; when the change is
intended, rewrite the files with ``GRAPHPASS_UPDATE_GOLDEN=1 pytest tests/test_pipeline_golden.py``
and review the diff of ``tests/golden/`` like code.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import graphpass as gp
import zoo
from graphpass import meta
from graphpass.capture import capture
from graphpass.ops import op_name
from graphpass.pass_manager import PassContext, run_passes
from graphpass.passes import passes_for
from graphpass.passes.collectives import is_collective
from graphpass.passes.partition_stages import cut_stages
from graphpass.plan import pipeline_rank
from graphpass.plan_builder import plan_from_strategy

GOLDEN = Path(__file__).parent / "golden"

# (file stem, model, Strategy fields, world size): tied weights with ZeRO-3 across two stages,
# Megatron tp with sequence parallelism inside stages, interleaved stages (two per rank).
CASES = [
    ("gpt_pp2_dp2_zero3", "gpt", dict(pp=2, dp=2, zero=3, microbatches=2), 4),
    ("hf_llama_pp2_tp2_sp", "hf_llama", dict(pp=2, tp=2, sequence_parallel=True, microbatches=2), 4),
    ("gpt_deep_pp2_interleaved", "gpt_deep", dict(pp=2, microbatches=2, schedule="interleaved_1f1b",
                                                  virtual_stages=2), 2),
]


def _tensor(val) -> str:
    return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}" if isinstance(val, torch.Tensor) else "-"


def _value(node: fx.Node) -> str:
    val = node.meta.get(meta.VAL)
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(_tensor(v) for v in val) + ")"
    return _tensor(val) + (" (grad)" if node.meta.get(meta.REQUIRES_GRAD) else "")


def _collective(node: fx.Node) -> str:
    """The op, its axis, the parameters it moves (by name) or the value it moves, its result."""
    axis = node.meta.get(meta.AXIS)
    params = [a.target for a in node.all_input_nodes if a.op == "get_attr"]
    moved = ", ".join(params) if params else ", ".join(_value(a) for a in node.all_input_nodes)
    return f"  {op_name(node)}" + (f" over {axis}" if axis else "") + f" ({moved}) -> {_value(node)}"


def _describe(stage: fx.GraphModule, index: int, pp: int, last: bool) -> list[str]:
    lines = [f"stage {index} (pp rank {pipeline_rank(index, pp)})"]
    lines += [f"  receives {n.name}: {_value(n)}" for n in stage.graph.nodes if n.op == "placeholder"]
    lines += [_collective(n) for n in stage.graph.nodes if is_collective(n)]
    output = stage.graph.find_nodes(op="output")[0]
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    for value in returned:
        if isinstance(value, fx.Node):
            lines.append(f"  {'returns' if last else 'sends'} {value.name}: {_value(value)}")
    return lines


def _program_text(name: str, fields: dict, world: int) -> str:
    model = zoo.build(name)
    batch = zoo.batches(name, 1, 8)[0]
    strategy = gp.Strategy(**fields)
    rows = 8 // (strategy.dp * strategy.microbatches)
    local = tuple(t.narrow(0, 0, rows) for t in batch)  # one microbatch of rank 0's share
    gm = capture(model, local).gm
    plan = plan_from_strategy(gm, strategy, ["golden"])
    gm, _ = run_passes(gm, plan, PassContext(rank=0, world_size=world, example_inputs=local), passes_for(plan))
    stages = cut_stages(gm, plan.stages)
    lines = [f"{name} {strategy!r}", f"stages start at {list(plan.stages)}"]
    for s, stage in enumerate(stages):
        lines += _describe(stage, s, strategy.pp, s == len(stages) - 1)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("stem,name,fields,world", CASES, ids=[c[0] for c in CASES])
def test_each_stage_program_matches_its_golden_file(stem, name, fields, world):
    text = _program_text(name, fields, world)
    path = GOLDEN / f"{stem}.txt"
    if os.environ.get("GRAPHPASS_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing; write it with GRAPHPASS_UPDATE_GOLDEN=1"
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "now"))
        pytest.fail(f"the stage programs changed (rewrite with GRAPHPASS_UPDATE_GOLDEN=1 if intended):\n{diff}")
