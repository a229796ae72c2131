"""The graphpass command line: presets, explain a saved plan, summarise a dump directory."""

from __future__ import annotations

import pathlib

import pytest

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


_REPO = pathlib.Path(__file__).resolve().parent.parent


def test_plan_gpt3_175b_on_1024_h100s_prints_the_plan_table(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    assert main(["plan", str(_REPO / "examples" / "configs.py") + ":build", "--arg", "gpt3-175b",
                 "--cluster", "h100-80g:128x8", "--batch", "1536x2048", "--memory", "70GiB", "--time-limit", "3",
                 "--json", str(out_json), "--html", str(tmp_path / "plan.html")]) == 0
    out = capsys.readouterr().out
    assert "175B parameters, bf16, batch 1536x2048 on" in out and "(1024 devices)" in out
    assert "per block (stage | blocks | choice" in out and "predicted step time:" in out
    plan = gp.Plan.from_json(out_json.read_text())
    assert plan.world_size == 1024 and plan.memory_budget_bytes == 70 * 2**30
    assert plan.predicted_peak_memory_bytes <= 70 * 2**30 and plan.devices_per_node == 8
    assert f"{plan.predicted_step_time_s * 1e3:.2f} ms" in out
    assert 'data-budget="75161927680"' in (tmp_path / "plan.html").read_text()


@pytest.mark.parametrize("argv, message", [
    (["plan", "configs:build", "--arg", "gpt3-1.3b", "--cluster", "h100-90g:2x8", "--batch", "8x2048"],
     "unknown cluster preset 'h100-90g'"),
    (["plan", "configs:build", "--arg", "gpt3-1.3b", "--cluster", "h100-80g", "--batch", "8x2048", "--memory", "70GB!"],
     "--memory='70GB!' is not a memory size"),
    (["plan", "configs:no_such_factory", "--cluster", "h100-80g", "--batch", "8x2048"],
     "module 'configs' has no factory 'no_such_factory'"),
    (["plan", "configs:build", "--cluster", "h100-80g", "--batch", "8x2048"], "give the factory's arguments with --arg"),
    (["plan", "configs:build", "--arg", "gpt3-1.3b", "--cluster", "h100-80g", "--batch", "8xx"],
     "--batch '8xx' must be BATCHxSEQ"),
    (["run", "-n", "0", "examples/train_gpt.py"], "-n 0: give the number of local ranks"),
    (["run", "-n", "2", "no_such_script.py"], "no such script no_such_script.py"),
])
def test_bad_input_prints_one_line_and_exits_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_argument_errors_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "configs:build"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "required: --cluster, --batch" in err, err


@pytest.mark.parametrize("command", ["plan", "run", "explain", "dumps", "presets", "profile", "env"])
def test_every_command_has_help_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "example:\n  graphpass " in capsys.readouterr().out


def test_env_prints_what_a_bug_report_needs(capsys):
    import torch

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "torch.distributed backends: gloo" in out
    assert "ortools " in out and "profile cache " in out
    assert ("cuda:0 " in out) if torch.cuda.is_available() else ("devices: cpu only" in out)


@pytest.mark.timeout(240)
def test_run_trains_the_example_on_two_local_ranks_through_torchrun(tmp_path):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "graphpass.cli", "run", "-n", "2", str(_REPO / "examples" / "train_gpt.py"),
           "--world-size", "2", "--steps", "2", "--batch", "8", "--dump-dir", str(tmp_path / "dumps")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Each torchrun worker ran the script: both trained with graphpass as one process does.
    assert done.stdout.count("(all ranks agree: True)") == 2, done.stdout
    assert (tmp_path / "dumps" / "plan.html").is_file() and (tmp_path / "dumps" / "rank1").is_dir()
