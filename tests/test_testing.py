"""graphpass.testing, the harness users run in their CI: parity failures read well, golden files
catch a changed program and the update flag rewrites them, bad arguments are named."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

import graphpass as gp
import graphpass.api
from graphpass.pass_manager import graph_pass
from graphpass.passes import passes_for
from graphpass.runtime.grad_sync import all_reduce_grads
from graphpass.testing import GoldenMismatch, ParityError, assert_golden, assert_parity, program_text
from graphpass.testing.golden import explain_diff
from graphpass.testing.parity import compare, describe, fit_strategy, train_reference

from test_gpt_parity import build_model, make_batches


@graph_pass("drop_one_all_reduce")
def _drop_one_all_reduce(gm, plan, ctx):
    """Test-only: the first gradient bucket is not all-reduced (its parameters' local gradients
    stay as they are on each rank)."""
    bucket = next(n for n in gm.graph.nodes if n.target is all_reduce_grads)
    grads = bucket.args[1:]
    for user in list(bucket.users):
        user.replace_all_uses_with(grads[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(bucket)
    gm.recompile()
    return gm


def _broken_compile(model, example_inputs, strategy):
    with mock.patch.object(graphpass.api, "passes_for", lambda plan: (*passes_for(plan), _drop_one_all_reduce)):
        return gp.compile(model, gp.Cluster.local(), example_inputs=example_inputs, strategy=strategy)


def test_a_dropped_gradient_all_reduce_fails_naming_the_worst_parameter(graphpass_ranks):
    with pytest.raises(ParityError) as info:
        assert_parity(build_model, make_batches, [gp.Strategy()], world_sizes=(2,), ranks=graphpass_ranks,
                      compile_fn=_broken_compile)
    message = str(info.value)
    print(message)
    assert "1 of 1 runs differ from one process" in message
    assert "dp2-tp1-pp1 on 2 ranks: FAILED; worst " in message
    assert "rtol=1e-05, atol=1e-06" in message
    # The worst tensor is one of the dropped bucket's parameters: the first all_reduce_grads of
    # the program's golden text lists them.
    text = program_text(build_model(), make_batches()[0], gp.Strategy(dp=2), 2)
    first = next(line for line in text.splitlines() if "all_reduce_grads over dp" in line)
    dropped = first.split("(", 1)[1].split(")", 1)[0].split(", ")
    worst = message.split("worst ")[1]
    assert any(worst.startswith((f"gradient of {p} ", f"{p} after")) for p in dropped), (worst, dropped)
    excess = float(worst.split(", ")[-1].split("x the tolerance")[0])
    assert excess > 100, worst  # a gradient of half the batch is off by far more than rounding


def test_results_name_each_strategy_and_its_worst_error(graphpass_ranks):
    results = assert_parity(build_model, make_batches, [gp.Strategy(zero=2)], world_sizes=(2,),
                            ranks=graphpass_ranks)
    (result,) = results
    assert result.passed and result.strategy == "dp2-tp1-pp1-zero2" and result.world_size == 2
    assert 0 <= result.worst.excess <= 1 and result.worst.error < 1e-5


def test_compare_reports_the_largest_error_over_its_tolerance():
    batches = [tuple(t[:4] for t in b) for b in make_batches()]
    ref = train_reference(build_model, batches)
    assert compare(ref, ref).excess == 0
    state = dict(ref.state)
    state["ln_f.weight"] = state["ln_f.weight"].clone()
    state["ln_f.weight"][5] += 1e-3
    worst = compare(dataclasses.replace(ref, state=state), ref)
    assert worst.what == "ln_f.weight after 3 steps" and worst.index == (5,)
    assert worst.error == pytest.approx(1e-3, rel=1e-3)
    assert worst.excess == pytest.approx(1e-3 / (1e-6 + 1e-5 * abs(worst.reference)), rel=1e-3)
    missing = dataclasses.replace(ref, grads={k: v for k, v in ref.grads.items() if k != "wte.weight"})
    assert "gradient of wte.weight (missing" in compare(missing, ref).what


def test_equal_infinities_and_exact_zeros_agree_and_one_sided_nans_do_not():
    from graphpass.testing.parity import Trace

    ref = Trace([1.0], {}, {"mask": torch.tensor([float("-inf"), 0.0, 2.0])})
    assert compare(ref, ref, rtol=0, atol=0).excess == 0
    nan = Trace([1.0], {}, {"mask": torch.tensor([float("-inf"), float("nan"), 2.0])})
    worst = compare(nan, ref)
    assert worst.what == "mask after 1 steps" and worst.index == (1,) and worst.excess == float("inf")
    ints = Trace([1.0], {}, {"count": torch.tensor([3, 4])})
    assert compare(dataclasses.replace(ints, state={"count": torch.tensor([3, 5])}), ints).index == (1,)


def test_moves_and_net_drops_of_repeated_lines_are_both_reported():
    old = "a\n  [p] x\n  [p] x\nb\n"
    new = "  [p] x\na\nb\n"
    changes = explain_diff(old, new)
    assert sum(c.startswith("moved") for c in changes) == 1 and sum(c.startswith("dropped") for c in changes) == 1


def test_strategies_fill_each_world_size_or_are_refused():
    assert fit_strategy(gp.Strategy(tp=2), 4) == gp.Strategy(dp=2, tp=2)
    assert fit_strategy(gp.Strategy(zero=3), 2) == gp.Strategy(dp=2, zero=3)
    assert describe(fit_strategy(gp.Strategy(tp=2, sequence_parallel=True), 4)) == "dp2-tp2-pp1-sequence_parallel"
    with pytest.raises(ValueError, match="uses 4 ranks, which does not divide world size 2"):
        fit_strategy(gp.Strategy(tp=4), 2)
    with pytest.raises(ValueError, match="seed inside model_fn"):
        assert_parity(lambda: torch.nn.Linear(2, 2), make_batches, [gp.Strategy()])
    with pytest.raises(ValueError, match="steps=3 needs at least 3"):
        assert_parity(build_model, lambda: make_batches()[:2], [gp.Strategy()])
    with pytest.raises(ValueError, match=r"batch_fn\(\) returned a different batch 0 on a second call"):
        assert_parity(build_model, lambda: [(torch.randint(0, 256, (8, 32)),) * 2 for _ in range(3)])
    plan = gp.Plan(mesh={"dp": 8})
    with pytest.raises(ValueError, match=r"a Plan for 8 ranks \(plan-dp8-[0-9a-f]{8}\) is in strategies"):
        assert_parity(build_model, make_batches, [gp.Strategy(), plan])
    with pytest.raises(ValueError, match=r"needs 4 GPUs, this machine has 0"):
        assert_parity(build_model, make_batches, backend="nccl")
    with pytest.raises(ValueError, match=r"'gloo' \(CPU ranks\) or 'nccl'"):
        assert_parity(build_model, make_batches, backend="mpi")


def _golden_case(bucket_cap_bytes: int) -> str:
    from graphpass.capture import capture
    from graphpass.plan_builder import plan_from_strategy

    batch = make_batches()[0]
    plan = plan_from_strategy(capture(build_model(), tuple(t[:4] for t in batch)).gm, gp.Strategy(dp=2), ["test"])
    return program_text(build_model(), batch, dataclasses.replace(plan, bucket_cap_bytes=bucket_cap_bytes), 2)


def test_a_changed_bucket_size_changes_the_golden_text_and_the_diff_names_the_pass(tmp_path, monkeypatch):
    monkeypatch.delenv("GRAPHPASS_UPDATE_GOLDEN", raising=False)
    one, many = _golden_case(2**30), _golden_case(40_000)
    with pytest.raises(GoldenMismatch, match="is missing; write it with pytest --graphpass-update-golden"):
        assert_golden(tmp_path / "gpt.txt", one)
    (tmp_path / "gpt.txt").write_text(one)
    assert_golden(tmp_path / "gpt.txt", one)
    with pytest.raises(GoldenMismatch, match=r"added \(line \d+\): \[insert_collectives\] all_reduce_grads"):
        assert_golden(tmp_path / "gpt.txt", many)
    assert one != many
    changes = explain_diff(one, many)
    assert any(c.startswith("dropped") and "plan.bucket_cap_bytes = 1073741824" in c for c in changes)
    assert any(c.startswith("added") and "[insert_collectives] all_reduce_grads over dp" in c for c in changes)


GOLDEN_TEST = '''
import dataclasses, pathlib
import torch
import graphpass as gp
from graphpass.capture import capture
from graphpass.plan_builder import plan_from_strategy
from graphpass.testing import assert_golden, program_text

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.layers(x), y)

def test_program():
    batch = (torch.randn(8, 64), torch.randn(8, 64))
    plan = plan_from_strategy(capture(MLP(), tuple(t[:4] for t in batch)).gm, gp.Strategy(dp=2), ["t"])
    plan = dataclasses.replace(plan, bucket_cap_bytes={cap})
    assert_golden(pathlib.Path(__file__).parent / "golden" / "mlp.txt", program_text(MLP(), batch, plan, 2))
'''


def test_the_update_flag_rewrites_a_golden_file_that_no_longer_matches(pytester, monkeypatch):
    monkeypatch.delenv("GRAPHPASS_UPDATE_GOLDEN", raising=False)
    pytester.makepyfile(test_user=GOLDEN_TEST.format(cap=2**30))
    pytester.runpytest_inprocess("--graphpass-update-golden").assert_outcomes(passed=1)
    golden = pytester.path / "golden" / "mlp.txt"
    before = golden.read_text()
    assert "plan.bucket_cap_bytes = 1073741824" in before

    pytester.makepyfile(test_user=GOLDEN_TEST.format(cap=20_000))
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*differs from*golden*mlp.txt*--graphpass-update-golden*",
                                 "*added (line *): [[]insert_collectives] all_reduce_grads over dp*"])
    assert golden.read_text() == before
    pytester.runpytest_inprocess("--graphpass-update-golden").assert_outcomes(passed=1)
    after = golden.read_text()
    assert after != before and "plan.bucket_cap_bytes = 20000" in after
    assert after.count("all_reduce_grads over dp") > before.count("all_reduce_grads over dp")
