"""The graphpass command line: presets, explain a saved plan, summarise a dump directory, plan a
model from a factory (what a person sees: one-line errors, files written before the report,
progress on a terminal), run a script through torchrun."""

from __future__ import annotations

import io
import pathlib
import sys
import textwrap

import pytest

import graphpass as gp
from graphpass.plan_builder import plan_from_strategy
from graphpass.capture import capture
from graphpass.cli import _count, main
from graphpass.progress import Progress
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
    assert plan.world_size == 1024 and plan.report.memory_budget_bytes == 70 * 2**30
    assert plan.report.predicted_peak_memory_bytes <= 70 * 2**30 and plan.report.devices_per_node == 8
    assert f"{plan.report.predicted_step_time_s * 1e3:.2f} ms" in out
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
    (["plan", "configs:build", "--arg", "gpt3-1.3b", "--cluster", "h100-80g:1x8", "--batch", "8x2048",
      "--strategy", "dp=8,tpp=2"], "--strategy: unknown key 'tpp'"),
    (["plan", "configs:build", "--arg", "gpt3-1.3b", "--cluster", "h100-80g:1x8", "--batch", "8x2048",
      "--strategy", "tp=two"], "--strategy: tp='two' must be a whole number"),
    (["plan", "configs:build", "--arg", "gpt3-1.3b", "--cluster", "h100-80g:1x8", "--batch", "8x2048",
      "--strategy", "dp=3"], "--strategy: Strategy dp=3 x tp=1 x pp=1 = 3 devices, but the cluster has world_size=8"),
    (["plan", "configs:build", "--arg", "gpt3-1.3b", "--cluster", "h100-80g:1x8", "--batch", "8x2048",
      "--strategy", "tp=2,recompute=maybe"], "--strategy: recompute='maybe' must be true or false"),
    (["plan", "configs:build", "--arg", "gpt3-1.3b", "--cluster", "no_such_cluster.json", "--batch", "8x2048"],
     "--cluster: no such cluster file no_such_cluster.json"),
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
    # Both torchrun workers trained; rank 0 alone trained the one-process reference and reported.
    assert done.stdout.count("(all ranks agree: True)") == 1, done.stdout
    assert done.stdout.count("GPT 0.") == 1 and done.stdout.count("plan (2 gloo ranks)") == 1, done.stdout
    assert (tmp_path / "dumps" / "plan.html").is_file() and (tmp_path / "dumps" / "rank1").is_dir()


# ------------------------------------------------------------------ graphpass plan: what a person sees

_FACTORIES = textwrap.dedent('''
    import torch
    from torch import nn

    class Tiny(nn.Module):
        """Four equal blocks between an embedding and a head: 8.38K parameters."""

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
            self.head = nn.Linear(32, 64)

        def forward(self, idx, targets):
            x = self.emb(idx)
            for block in self.blocks:
                x = torch.relu(block(x))
            return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

    class Branchy(Tiny):
        def forward(self, idx, targets):
            if idx.sum() > 0:  # data-dependent control flow: neither capture route takes it
                return super().forward(idx, targets)
            return super().forward(targets, idx)

    def tiny():
        return Tiny()

    def branchy():
        return Branchy()

    def raises():
        raise RuntimeError("no GPU here")

    def never():
        raise AssertionError("the factory ran although an argument was bad")
''')


@pytest.fixture
def factories(tmp_path) -> str:
    path = tmp_path / "cli_factories.py"
    path.write_text(_FACTORIES)
    return str(path)


def _plan_tiny(factories: str, *extra: str, factory: str = "tiny", cluster: str = "h100-80g:1x2") -> int:
    return main(["plan", f"{factories}:{factory}", "--cluster", cluster, "--batch", "4x8", *extra])


def test_a_factory_that_raises_or_a_model_that_cannot_be_captured_is_one_line_and_status_2(factories, capsys):
    assert _plan_tiny(factories, factory="raises") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "raises() raised RuntimeError: no GPU here (at " in err, err
    assert "cli_factories.py:" in err  # the line of the user's code that raised

    assert _plan_tiny(factories, factory="branchy") == 2
    err = capsys.readouterr().err  # torch.export's partial graph and warnings are not shown either
    assert err.count("\n") == 1 and err.startswith("graphpass plan: error: could not capture Branchy: export: "), err
    assert "; symbolic_trace: " in err


def test_output_paths_are_checked_before_planning_and_missing_directories_made(factories, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    assert _plan_tiny(factories, "--json", str(tmp_path / "a_file" / "plan.json"), factory="never") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--json" in err and "a_file is not a directory" in err, err
    assert _plan_tiny(factories, "--html", str(tmp_path), factory="never") == 2
    assert "is a directory; give a file path" in capsys.readouterr().err

    out_json = tmp_path / "new" / "dir" / "plan.json"
    assert _plan_tiny(factories, "--json", str(out_json)) == 0
    assert gp.Plan.from_json(out_json.read_text()).world_size == 2
    assert f"plan: {out_json}" in capsys.readouterr().out


class _ClosedPipe(io.StringIO):
    """stdout of ``graphpass plan ... | head -1`` after head has exited."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_pipe_ends_quietly_after_the_files_are_written(factories, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert _plan_tiny(factories, "--json", str(tmp_path / "plan.json"), "--html", str(tmp_path / "plan.html")) == 0
    assert (tmp_path / "plan.json").is_file() and (tmp_path / "plan.html").is_file()
    assert capsys.readouterr().err == ""


def test_cluster_takes_the_json_that_profile_writes(factories, tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(gp.Cluster.preset("a100-80g", nodes=1, gpus_per_node=2).to_json())
    assert _plan_tiny(factories, cluster=str(path)) == 0
    assert "on 2 x a100-80g (1 node x 2)" in capsys.readouterr().out
    path.write_text("{not json")
    assert _plan_tiny(factories, cluster=str(path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a cluster JSON (graphpass profile writes one)" in err, err


def test_cluster_takes_sites_joined_by_a_wide_area_link(factories, capsys):
    assert _plan_tiny(factories, cluster="h100-80g:1x2+a100-80g:1x2@1Gbit/s,20ms") == 0
    out = capsys.readouterr().out
    assert "joined by 1Gbit/s,20ms (1 Gbit/s shared, 20 ms); axes crossing it:" in out, out
    assert _plan_tiny(factories, cluster="h100-80g:1x2+a100-80g:1x2@1Gbit/s,-20ms") == 2
    assert "Link.latency='-20ms'" in capsys.readouterr().err


def test_strategy_prices_the_given_strategy_and_dp_takes_the_rest(factories, capsys):
    assert _plan_tiny(factories, "--strategy", "pp=2,microbatches=2,zero=1", cluster="h100-80g:1x4") == 0
    out = capsys.readouterr().out
    assert "strategy: Strategy(dp=2, tp=1, pp=2, zero=1, split=1, microbatches=2" in out
    assert "why: uniform strategy priced as given" in out


def test_parameter_counts_read_as_people_write_them(factories, capsys):
    assert [_count(n) for n in (512, 867_000, 8_384, 12_345_678, 1.3e9, 174.6e9)] == [
        "512", "867K", "8.38K", "12.3M", "1.3B", "175B"]
    assert _plan_tiny(factories) == 0
    assert ": 8.38K parameters, bf16, batch 4x8 on" in capsys.readouterr().out


def test_the_plan_page_names_stages_by_layer_and_collapses_equal_blocks(factories, tmp_path, capsys):
    page = tmp_path / "plan.html"
    assert _plan_tiny(factories, "--strategy", "pp=2,microbatches=2", "--html", str(page)) == 0
    text = page.read_text()
    # stage 1 starts at the third block (layer 2), named as the breakdown names it
    assert "stage 1 (pp rank 1) starts at <b>layer 2</b> (node <code>" in text
    # pre, 4 layers, post on 2 stages: two rows of equal blocks, each block's own row folded below
    assert text.count("<tr data-run=") == 2 and "pre .. layer 1 (3)" in text and "layer 2 .. post (3)" in text
    assert text.count("<tr data-block=") == 6 and "<details><summary>every block (6)</summary>" in text
    assert '<p id="rendered" hidden></p>' in text  # the browser test's marker shows nothing


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plan_shows_its_capture_and_search_phases_on_a_terminal(factories, capsys, monkeypatch):
    import graphpass.progress

    monkeypatch.delenv("GRAPHPASS_QUIET", raising=False)
    monkeypatch.setattr(graphpass.progress, "PHASE_DELAY_S", 0.0)  # every phase draws at once
    monkeypatch.setattr(Progress, "MIN_INTERVAL_S", 0.0)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert _plan_tiny(factories) == 0
    drawn = terminal.getvalue()
    for phase in ("building ", "capturing Tiny and pricing its ops", "searching meshes for Tiny on 2 devices",
                  "solving mesh 1/"):
        assert phase in drawn, drawn
