"""The graphpass command line: presets, explain a saved plan, summarise a dump directory."""

from __future__ import annotations

import graphpass as gp
from graphpass.plan_builder import plan_from_strategy
from graphpass.capture import capture
from graphpass.cli import main
from graphpass.dump import Dumper
from graphpass.pass_manager import PassContext, run_passes
from graphpass.passes import PIPELINE

import zoo


def test_presets_lists_every_preset(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in gp.presets():
        assert name in out
    assert "312.0 TFLOP/s" in out  # A100 dense bf16


def test_explain_and_dumps_read_what_compile_wrote(tmp_path, capsys):
    batch = zoo.batches("gpt", 1, 4)[0]
    gm = capture(zoo.build("gpt"), batch).gm
    plan = plan_from_strategy(gm, gp.Strategy(dp=2, tp=2, zero=3), ["test"])
    dumper = Dumper(tmp_path, rank=0)
    gm, records = run_passes(gm, plan, PassContext(0, 4, batch), PIPELINE, on_record=dumper.record)
    dumper.finish(plan, "export", 0.1, records)

    assert main(["explain", str(tmp_path / "plan.json")]) == 0
    assert "mesh: dp=2 x tp=2 (4 devices)" in capsys.readouterr().out

    assert main(["dumps", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "capture via export" in out
    line = next(l for l in out.splitlines() if l.startswith("rank0:"))
    # The final graph's collectives, in order: ZeRO gathers, tensor-parallel ops, the loss.
    assert line.split("collectives in order: ")[1].startswith("grad_sync_begin, all_gather_params, tp_all_reduce")
    assert "vocab_parallel_cross_entropy" in line and "tp_copy" in line


def test_missing_files_are_reported(tmp_path, capsys):
    assert main(["explain", str(tmp_path / "nope.json")]) == 2
    assert main(["dumps", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no such plan file" in err and "has no summary.txt" in err


def test_profile_writes_a_cluster_json_and_prints_its_figures(tmp_path, capsys):
    out = tmp_path / "cpu-1.json"
    assert main(["profile", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    cluster = gp.Cluster.from_json(out.read_text())
    assert cluster.world_size == 1 and cluster.device.compute_efficiency == 1.0
    assert "TFLOP/s" in printed and "GB/s" in printed and str(out) in printed
    assert main(["profile", "--world-size", "999"]) == 2  # more ranks than cores: a clear error
    assert "world_size=999" in capsys.readouterr().err
