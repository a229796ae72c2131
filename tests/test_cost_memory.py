"""The closed-form memory and bubble formulas of ``graphpass.cost.memory`` against the papers.

Numbers are hand-computed from the papers' formulas and, where the paper prints one, checked to the
paper's own rounding: ZeRO's 7.5B example (Rajbhandari et al. 2020, Figure 1), Megatron's GPT-3
175B activation figures (Korthikanti et al. 2022, section 4), and the pipeline bubble
(Narayanan et al. 2021, section 2.2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from graphpass.cost.memory import (
    ModelState,
    gathered_weight_bytes,
    in_flight_microbatches,
    interleaved_bubble_fraction,
    megatron_activation_bytes,
    model_state_bytes,
    pipeline_bubble_fraction,
    zero_bubble_fraction,
)

GB = 1e9

# --- ZeRO -------------------------------------------------------------------------------------

PSI = 7.5e9
N = 64


@pytest.mark.parametrize(
    "stage, paper_gb",
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_model_state_matches_zero_papers_7_5b_example(stage, paper_gb):
    total_gb = model_state_bytes(PSI, stage, N).total_bytes / GB
    assert round(total_gb, 1) == paper_gb


def test_model_state_splits_into_params_grads_and_optimizer_per_stage():
    # (2 + 2 + K)Ψ with K = 12, each term divided by N once its stage partitions it.
    assert model_state_bytes(PSI, 0, N) == ModelState(2 * PSI, 2 * PSI, 12 * PSI)
    assert model_state_bytes(PSI, 1, N) == ModelState(2 * PSI, 2 * PSI, 12 * PSI / N)
    assert model_state_bytes(PSI, 2, N) == ModelState(2 * PSI, 2 * PSI / N, 12 * PSI / N)
    assert model_state_bytes(PSI, 3, N) == ModelState(2 * PSI / N, 2 * PSI / N, 12 * PSI / N)
    assert model_state_bytes(PSI, 1, N).total_bytes == 4 * PSI + 12 * PSI / N
    assert model_state_bytes(PSI, 2, N).total_bytes == 2 * PSI + 14 * PSI / N
    assert model_state_bytes(PSI, 3, N).total_bytes == 16 * PSI / N


def test_model_state_in_fp32_counts_four_four_and_eight_bytes():
    fp32 = dict(param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    psi, n = 1_000_000, 8
    assert model_state_bytes(psi, 0, n, **fp32).total_bytes == 16 * psi
    assert model_state_bytes(psi, 1, n, **fp32).total_bytes == 8 * psi + 8 * psi / n
    assert model_state_bytes(psi, 2, n, **fp32).total_bytes == 4 * psi + 12 * psi / n
    assert model_state_bytes(psi, 3, n, **fp32).total_bytes == 16 * psi / n


def test_model_state_with_one_rank_is_the_same_at_every_stage():
    totals = {model_state_bytes(1000, stage, 1).total_bytes for stage in range(4)}
    assert totals == {16_000}


@pytest.mark.parametrize(
    "kwargs",
    [dict(zero_stage=4, dp=2), dict(zero_stage=1, dp=0), dict(zero_stage=1, dp=2.0)],
)
def test_model_state_rejects_bad_stage_or_dp(kwargs):
    with pytest.raises(ValueError):
        model_state_bytes(10, **kwargs)


# --- Megatron activations ---------------------------------------------------------------------

# GPT-3 175B as in Korthikanti et al. 2022: s = 2048, b = 1, h = 12288, a = 96, t = 8.
S, B, H, A, T = 2048, 1, 12288, 96, 8
SBH = S * B * H


def test_gpt3_attention_term_is_80_as_the_paper_says():
    # Section 4.1: "for GPT-3 ... 5as/h = 80", so the attention core outweighs the other 34.
    core = megatron_activation_bytes(S, B, H, A) - megatron_activation_bytes(S, B, H, A, recompute="selective")
    assert core == 80 * SBH
    assert megatron_activation_bytes(S, B, H, A) == SBH * 114


def test_megatron_activation_without_parallelism_is_34_plus_5as_over_h():
    s, b, h, a = 512, 4, 1024, 16
    assert megatron_activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)


def test_megatron_activation_with_tensor_parallel_splits_24_and_the_attention_term():
    expected = SBH * (10 + 24 / T + 5 * A * S / (H * T))
    assert megatron_activation_bytes(S, B, H, A, tp=T) == expected
    assert expected == 23 * SBH  # 10 + 3 + 10 for GPT-3 at t = 8


def test_megatron_activation_with_sequence_parallel_divides_everything_by_t():
    got = megatron_activation_bytes(S, B, H, A, tp=T, sequence_parallel=True)
    assert got == SBH / T * (34 + 5 * A * S / H)
    assert got == megatron_activation_bytes(S, B, H, A) / T


def test_selective_recompute_drops_the_attention_term():
    assert megatron_activation_bytes(S, B, H, A, tp=T, sequence_parallel=True, recompute="selective") == 34 * SBH / T
    assert megatron_activation_bytes(S, B, H, A, tp=T, recompute="selective") == SBH * (10 + 24 / T)
    assert megatron_activation_bytes(S, B, H, A, recompute="selective") == 34 * SBH


def test_selective_recompute_saves_70_percent_for_gpt3():
    # Section 4.3: selective recomputation removes 80 of 114, about 70% of GPT-3's activations.
    none = megatron_activation_bytes(S, B, H, A)
    selective = megatron_activation_bytes(S, B, H, A, recompute="selective")
    assert round(1 - selective / none, 2) == 0.70


def test_sequence_parallel_and_selective_recompute_cut_tp_memory_by_over_5x():
    # The paper's headline: SP + selective recompute reduce activation memory ~5x vs. TP alone.
    tp_only = megatron_activation_bytes(S, B, H, A, tp=T)
    both = megatron_activation_bytes(S, B, H, A, tp=T, sequence_parallel=True, recompute="selective")
    assert tp_only / both == pytest.approx(23 / 4.25)
    assert tp_only / both > 5


def test_full_recompute_keeps_only_the_layer_input():
    assert megatron_activation_bytes(S, B, H, A, recompute="full") == 2 * SBH
    assert megatron_activation_bytes(S, B, H, A, tp=T, recompute="full") == 2 * SBH
    assert megatron_activation_bytes(S, B, H, A, tp=T, sequence_parallel=True, recompute="full") == 2 * SBH / T


def test_megatron_variants_are_ordered_by_memory():
    def mem(**kw):
        return megatron_activation_bytes(S, B, H, A, **kw)

    assert (
        mem()
        > mem(tp=T)
        > mem(tp=T, sequence_parallel=True)
        > mem(tp=T, sequence_parallel=True, recompute="selective")
        > mem(tp=T, sequence_parallel=True, recompute="full")
    )


def test_sequence_parallel_without_tensor_parallel_changes_nothing():
    assert megatron_activation_bytes(S, B, H, A, sequence_parallel=True) == megatron_activation_bytes(S, B, H, A)


def test_bytes_per_element_scales_tensors_but_not_dropout_masks():
    # 32 of the 34 and 4 of the 5 are 16-bit tensors; the rest are 1-byte masks.
    s, b, h, a = 256, 2, 512, 8
    sbh = s * b * h
    assert megatron_activation_bytes(s, b, h, a, bytes_per_element=4) == sbh * (66 + 9 * a * s / h)
    assert megatron_activation_bytes(s, b, h, a, dropout=False) == sbh * (32 + 4 * a * s / h)
    assert megatron_activation_bytes(s, b, h, a, recompute="full", bytes_per_element=4) == 4 * sbh


def test_activation_scales_linearly_in_batch():
    assert megatron_activation_bytes(S, 4, H, A, tp=T) == 4 * megatron_activation_bytes(S, 1, H, A, tp=T)


@pytest.mark.parametrize(
    "kwargs",
    [dict(recompute="some"), dict(tp=0), dict(bytes_per_element=0)],
)
def test_megatron_activation_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        megatron_activation_bytes(S, B, H, A, **kwargs)


# --- Pipeline -----------------------------------------------------------------------------------


def test_pipeline_bubble_for_four_stages_and_eight_microbatches_is_3_over_11():
    assert pipeline_bubble_fraction(4, 8) == pytest.approx(3 / 11)


def test_pipeline_bubble_vanishes_with_one_stage_and_shrinks_with_microbatches():
    assert pipeline_bubble_fraction(1, 8) == 0
    assert pipeline_bubble_fraction(8, 64) < pipeline_bubble_fraction(8, 16) < pipeline_bubble_fraction(8, 8)


def test_interleaved_bubble_divides_the_bubble_by_chunks():
    p, m, v = 4, 8, 2
    f = interleaved_bubble_fraction(p, m, v)
    assert f == pytest.approx(3 / 19)
    # Narayanan et al.'s bubble-to-ideal ratio (p - 1)/(v m) is f / (1 - f).
    assert f / (1 - f) == pytest.approx((p - 1) / (v * m))
    assert interleaved_bubble_fraction(p, m, 1) == pipeline_bubble_fraction(p, m)


def test_zero_bubble_leaves_the_forwards_third_of_the_bubble():
    # Qi et al. 2024 (ZB-H1), F = B = W: (p - 1) T_F idle against 1F1B's (p - 1)(T_F + T_B + T_W).
    assert zero_bubble_fraction(4, 8) == pytest.approx(1 / 9)
    assert zero_bubble_fraction(4, 8) < interleaved_bubble_fraction(4, 8, 2) < pipeline_bubble_fraction(4, 8)
    assert zero_bubble_fraction(4, 8, 2) == pytest.approx(1 / 17)
    assert zero_bubble_fraction(1, 8) == 0


def test_in_flight_microbatches_for_gpipe_is_all_of_them():
    assert [in_flight_microbatches(4, 8, i, "gpipe") for i in range(4)] == [8, 8, 8, 8]


def test_in_flight_microbatches_for_1f1b_falls_from_p_to_one():
    assert [in_flight_microbatches(4, 8, i) for i in range(4)] == [4, 3, 2, 1]
    # Fewer microbatches than stages: never more than m.
    assert [in_flight_microbatches(4, 2, i, "1f1b") for i in range(4)] == [2, 2, 2, 1]


@pytest.mark.parametrize(
    "args",
    [(4, 8, 4, "1f1b"), (4, 8, -1, "1f1b"), (4, 8, 0, "zb"), (0, 8, 0, "1f1b")],
)
def test_in_flight_microbatches_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        in_flight_microbatches(*args)


# --- Gathered weights -------------------------------------------------------------------------


def test_gathered_weights_take_the_largest_group_split_and_prefetched():
    layers = [100, 400, 200]
    assert gathered_weight_bytes(layers, prefetch=0) == 400
    assert gathered_weight_bytes(layers) == 800  # default: one group prefetched
    assert gathered_weight_bytes(layers, split=4, prefetch=0) == 100
    assert gathered_weight_bytes(layers, split=4, prefetch=2) == 300
    assert gathered_weight_bytes(400, split=2, prefetch=1) == 400
    assert gathered_weight_bytes([], prefetch=0) == 0


@pytest.mark.parametrize("kwargs", [dict(split=0), dict(prefetch=-1)])
def test_gathered_weights_rejects_bad_split_or_prefetch(kwargs):
    with pytest.raises(ValueError):
        gathered_weight_bytes([1], **kwargs)


def test_cost_memory_imports_no_torch():
    # ``import graphpass`` itself loads torch, so check the module's own imports, not sys.modules.
    import ast

    import graphpass.cost.memory as memory

    tree = ast.parse(Path(memory.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.split(".")[0] == "torch"}
