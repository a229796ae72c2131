"""Every pipeline schedule on every cut of the zoo models that pipeline matches one process.

A cut is a choice of stage boundaries among the model's layer boundaries
(``graphpass.stages.layer_starts``: the first op of each repeated layer; the planner and
``stage_starts`` cut only there, every stage taking at least one layer). Two tests:

* one process: the split backward of zero-bubble (``runtime.pipeline.split_backward_input``
  then ``split_backward_weight``) gives every stage graph the input and weight gradients a whole
  ``torch.autograd.grad`` gives it. A stage graph is fixed by its first and last layer (what it
  takes and returns depends on nothing else), so every layer range of every model covers every
  stage of every cut, at any stage count. torch's own split backward fails this on T5 (a shared
  embedding whose decoder lookup reaches the stage outputs without meeting a received
  activation gets no gradient; the position bias's group, read at every layer, is walked
  through nodes other groups' walks freed) and on the torchtitan-style MoE (a stage output
  detached in place that an op saved for its weight gradient).
* two ranks: GPipe, 1F1B and zero-bubble on every 2-stage cut; interleaved 1F1B and zero-bubble
  with 2 stages per rank on 4-stage cuts: every 4-stage cut where a model has at most
  ``MAX_CUTS`` of them, else cuts that put a boundary at every layer boundary. Loss of every
  step, every gradient after the first backward and the state after the last SGD-with-momentum
  step against one process on the whole batch (for a batch-norm model, over the same
  microbatches: :data:`PER_MICROBATCH`).

Tolerances. One process: the split walks run the same kernels on the same values as the whole
backward, but a weight read at several depths sums its parts in another order; ~1e-7 relative,
checked at rtol 1e-5 / atol 1e-6 (a missing or doubled part is off by its own size). Ranks: as
in tests/test_pipeline.py: microbatches change only the order of fp32 additions (each
microbatch's mean scaled by 1/k, a tied weight's stage gradients summed by an all-reduce), ~1e-7
relative; rtol 1e-5 / atol 1e-6 catch any real error (a gradient scaled twice is off by k, a
missing one by all of it).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist

import graphpass as gp
import zoo
from graphpass import meta
from graphpass.capture import capture
from graphpass.passes.partition_stages import cut_stages
from graphpass.stages import layer_starts
from graphpass.testing.parity import Trace, compare, full_grads, train_reference

RTOL, ATOL = 1e-5, 1e-6
BATCH, STEPS, MICROBATCHES = 4, 2, 2
MAX_CUTS = 4

#: The zoo models with repeated layers (the CNN without, "convnet", cannot be cut), by kind:
#: decoders (tied: gpt, fused_gpt, hf_gpt2), an encoder and nn.Transformer's encoder-decoder,
#: Hugging Face causal LMs and T5, a regressor, a ResNet, Mixture-of-Experts models.
MODELS = ("gpt", "gpt_deep", "gpt_3heads", "fused_gpt", "encoder", "transformer", "mha_weights", "mlp", "resnet",
          "hf_gpt2", "hf_llama", "hf_llama_deep", "hf_llama_mqa", "hf_neox", "hf_phi3", "hf_t5", "hf_mixtral",
          "hf_qwen2_moe", "tt_moe", "moe_topk", "moe_switch_score", "moe_expert_choice", "moe_hash")

#: Models whose forward reads the batch beyond its rows (batch norm's statistics): a pipeline
#: normalises each microbatch and counts it in ``num_batches_tracked``, so their one process
#: accumulates over the same microbatches (as DDP without SyncBatchNorm compares).
PER_MICROBATCH = {"resnet"}

#: (schedule, stages per rank) on 2 ranks.
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2))


def _captured(name: str):
    """The graph of ``name`` at one microbatch, as compile captures it (so a rank's compiles reuse
    it), and that microbatch."""
    inputs = zoo.batches(name, 1, BATCH // MICROBATCHES)[0]
    with gp.reusing_captures(zoo.CAPTURES):
        return capture(zoo.build(name), inputs).gm, inputs


def cuts(gm, num_stages: int) -> list[tuple[str, ...]]:
    """The ``Plan.stages`` of the cuts into ``num_stages`` stages the test runs (see the module
    docstring): all, or where there are more than :data:`MAX_CUTS`, a few that together put a
    boundary at every layer boundary."""
    boundaries = [first for _, first in layer_starts(gm)[1:]]
    every = [("*", *chosen) for chosen in itertools.combinations(boundaries, num_stages - 1)]
    if len(every) <= MAX_CUTS:
        return every
    chosen, missing = [], list(boundaries)
    while missing:  # the cut with the most boundaries not yet used, the earliest first
        best = max(every, key=lambda c: (len(set(c) & set(missing)), -every.index(c)))
        chosen.append(best)
        missing = [b for b in missing if b not in best]
    return chosen


def _cases(gm) -> list[tuple[tuple[str, ...], str, int]]:
    return [(starts, schedule, v) for schedule, v in SCHEDULES for starts in cuts(gm, 2 * v)]


def _reference(name: str) -> Trace:
    """One process: every step on the whole batch (over its microbatches for
    :data:`PER_MICROBATCH`, each microbatch's mean loss scaled by 1/k), SGD with momentum."""
    k = MICROBATCHES if name in PER_MICROBATCH else 1
    data = zoo.batches(name, STEPS, BATCH)
    if k == 1:
        return train_reference(lambda: zoo.build(name), data, "sgd-momentum", 0.05)
    model = zoo.build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], {}
    for step, batch in enumerate(data):
        loss = sum(model(*chunk) / k for chunk in zip(*(t.chunk(k) for t in batch)))
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return Trace(losses, grads, {n: t.detach().clone() for n, t in model.state_dict().items()})


# ----------------------------------------------------------------------- one process


def _run_stage(stage, values, names):
    inputs = [v.detach().requires_grad_(bool(n.meta.get(meta.REQUIRES_GRAD)) and v.is_floating_point())
              for v, n in zip(values, names)]
    out = stage(*inputs)
    return inputs, out if isinstance(out, tuple) else (out,)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", MODELS)
def test_split_backward_gives_every_stage_the_whole_backwards_gradients(name):
    from graphpass.runtime.pipeline import split_backward_input, split_backward_weight

    gm, batch = _captured(name)
    firsts = [first for _, first in layer_starts(gm)]
    torch.manual_seed(0)
    for a, b in itertools.combinations(range(len(firsts) + 1), 2):
        if a == 0:
            continue  # the first stage runs whole backwards (it receives no activation)
        last = b == len(firsts)
        starts = ("*", firsts[a]) if last else ("*", firsts[a], firsts[b])
        stages = cut_stages(gm, starts)
        with torch.no_grad():
            values = stages[0](*batch)
        stage = stages[1]
        names = [n for n in stage.graph.nodes if n.op == "placeholder"]
        weights = [p for p in stage.parameters() if p.requires_grad]
        where = f"{name} layers {a}..{b - 1}{' (last)' if last else ''}"

        inputs, outputs = _run_stage(stage, values, names)
        outputs = outputs[:1] if last else outputs
        live = [i for i, o in enumerate(outputs) if o.requires_grad]
        output_grads = None if last else [torch.randn_like(o) if o.requires_grad else None for o in outputs]
        wanted = [i for i, x in enumerate(inputs) if x.requires_grad]
        expected = torch.autograd.grad([outputs[i] for i in live], [inputs[i] for i in wanted] + weights,
                                       None if last else [output_grads[i] for i in live], allow_unused=True)

        inputs, outputs = _run_stage(stage, values, names)
        for w in weights:
            w.grad = None
        dinputs, state = split_backward_input(outputs[:1] if last else outputs, output_grads, inputs, weights)
        split_backward_weight(state)
        got = [dinputs[i] for i in wanted] + [w.grad for w in weights]
        labels = [f"input {names[i].name}" for i in wanted] + [n for n, p in stage.named_parameters() if p.requires_grad]
        for label, g, e in zip(labels, got, expected):
            if e is None:
                assert g is None or not g.any(), f"{where}: {label} gets a gradient the whole backward does not give"
                continue
            assert g is not None, f"{where}: {label} gets no gradient"
            torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where}: {label}: {m}")
        for w in weights:
            w.grad = None


# ---------------------------------------------------------------------------- 2 ranks


def _train_cuts(name: str, cases) -> list:
    """On each rank: compile ``name`` for every (cut, schedule, stages per rank) and train it;
    rank 0 returns each case's :class:`Trace` (others their losses)."""
    from graphpass.plan_builder import plan_from_strategy

    data = zoo.batches(name, STEPS, BATCH)
    gm, _ = _captured(name)
    out = []
    for starts, schedule, v in cases:
        strategy = gp.Strategy(pp=2, microbatches=MICROBATCHES, schedule=schedule, virtual_stages=v)
        plan = dataclasses.replace(plan_from_strategy(gm, strategy, ["test"]), stages=starts)
        dmodel = zoo.compile(zoo.build(name), data[0], plan)
        opt = torch.optim.SGD(dmodel.parameters(), lr=0.05, momentum=0.9)
        losses, grads = [], {}
        for step, batch in enumerate(data):
            losses.append(dmodel.train_step(*batch).item())
            if step == 0:
                grads = full_grads(dmodel)
            opt.step()
            opt.zero_grad()
        state = dmodel.full_state_dict()
        out.append(Trace(losses, grads, state) if dist.get_rank() == 0 else losses)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", MODELS)
def test_every_schedule_on_every_cut_matches_one_process(rank_pool, name):
    gm, _ = _captured(name)
    cases = _cases(gm)
    reference = _reference(name)
    results = rank_pool(2).run(_train_cuts, name, cases, timeout_s=540)
    failed = []
    for (starts, schedule, v), trace, other in zip(cases, results[0], results[1]):
        worst = compare(dataclasses.replace(trace, rank_losses=[trace.losses, other]), reference, RTOL, ATOL)
        if worst is not None and worst.excess > 1:
            failed.append(f"{schedule} x{v} cut {starts}: {worst}")
    assert not failed, f"{name}: {len(failed)} of {len(cases)} cases differ from one process:\n" + "\n".join(failed)
