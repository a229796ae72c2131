"""A mean loss over padded targets trains as one process when the batch is split
(graphpass.passes.global_loss_mean): Hugging Face labels padded with -100 unevenly across the
ranks' shares and the microbatches, under data parallelism, accumulation, ZeRO-3, pipelines and
vocabulary-parallel tensor parallelism, on 2 and 4 gloo ranks; a mean masked by hand
(``(loss * mask).sum() / mask.sum()``, clamped or not) likewise; and the losses it cannot make
exact are refused.

Before the pass, each share's mean weighted its tokens by the share's own count: the loss of
step 1 differed from one process in the fourth digit (5.5426 against 5.5420 on hf_llama).
Tolerances: as tests/test_dp.py (rtol 1e-5 / atol 1e-6: the pieces' sums are added in another
order than one process adds the tokens, fp32 rounding; SGD with momentum over 3 steps keeps it
there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpass as gp
import zoo
from graphpass.pass_manager import PassError

RTOL, ATOL = 1e-5, 1e-6
CLUSTER2 = gp.Cluster.preset("h100-80g", nodes=1, gpus_per_node=2)


def _batches(name: str, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """Keyword batches whose labels are padded unevenly: the first half of the rows loses the
    second half of its labels, one row loses them all (so every share and microbatch counts a
    different number of targets)."""
    out = []
    for ids, _ in zoo.batches(name, steps):
        labels = ids.clone()
        labels[: len(ids) // 2, zoo.SEQ // 2:] = -100
        labels[1] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _reference(name: str):
    model = zoo.build(name).model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for batch in _batches(name):
        loss = model(**batch).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        evaluated = model(**_batches(name)[0]).loss.item()  # after training, as _train evaluates
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, evaluated


def _train(name: str, strategies):
    out = []
    for strategy in strategies:
        model = zoo.build(name).model
        batches = _batches(name)
        dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=batches[0], strategy=strategy)
        opt = torch.optim.SGD(dmodel.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for batch in batches:
            losses.append(dmodel.train_step(**batch).item())
            opt.step()
            opt.zero_grad()
        # the evaluation loss divides by the same count
        out.append((losses, dmodel.full_state_dict(), dmodel(**batches[0]).item()))
    return out


STRATEGIES = {
    2: [gp.Strategy(dp=2), gp.Strategy(dp=2, microbatches=2, zero=3), gp.Strategy(pp=2, microbatches=2),
        gp.Strategy(tp=2, microbatches=2)],
    4: [gp.Strategy(dp=2, tp=2), gp.Strategy(dp=4, zero=1)],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_padded_labels_train_as_one_process_however_the_batch_is_split(rank_pool, world_size):
    name = "hf_llama"
    ref_losses, ref_state, ref_eval = _reference(name)
    strategies = STRATEGIES[world_size]
    for rank, runs in enumerate(rank_pool(world_size).run(_train, name, strategies, timeout_s=500)):
        for strategy, (losses, state, evaluated) in zip(strategies, runs):
            where = f"{name} {strategy} rank {rank}/{world_size}"
            zoo.assert_matches_reference(where, losses, state, ref_losses, ref_state, rtol=RTOL, atol=ATOL)
            assert evaluated == pytest.approx(ref_eval, rel=RTOL), where


class _HandMasked(nn.Module):
    """Per-token losses masked by the batch's attention mask and averaged by hand, the
    denominator clamped or not."""

    def __init__(self, clamp: bool):
        super().__init__()
        self.wte = nn.Embedding(zoo.VOCAB, 32)
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, zoo.VOCAB)
        self.clamp = clamp

    def forward(self, idx, targets, mask):
        logits = self.head(torch.relu(self.fc(self.wte(idx))))
        per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        m = mask.flatten().float()
        return (per_token * m).sum() / (m.sum().clamp(min=1) if self.clamp else m.sum())


def _hand_masked_batches(steps: int = 3):
    out = []
    for ids, targets in zoo.batches("gpt", steps):
        mask = torch.ones_like(ids)
        mask[: len(ids) // 2, zoo.SEQ // 3:] = 0
        mask[2] = 0
        out.append((ids, targets, mask))
    return out


def _train_hand_masked(strategies):
    out = []
    for clamp, strategy in strategies:
        torch.manual_seed(0)
        out.append(_train_positional(_HandMasked(clamp), strategy))
    return out


def _train_positional(model, strategy):
    batches = _hand_masked_batches()
    dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=batches[0], strategy=strategy)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for batch in batches:
        losses.append(dmodel.train_step(*batch).item())
        opt.step()
        opt.zero_grad()
    return losses, dmodel.full_state_dict()


@pytest.mark.timeout(600)
def test_a_mean_masked_by_hand_trains_as_one_process(rank_pool):
    strategies = [(False, gp.Strategy(dp=2)), (True, gp.Strategy(dp=2, microbatches=2, zero=3)),
                  (True, gp.Strategy(tp=2, microbatches=2))]
    runs = rank_pool(2).run(_train_hand_masked, strategies, timeout_s=300)
    for clamp in (False, True):
        torch.manual_seed(0)
        model = _HandMasked(clamp)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_losses = []
        for batch in _hand_masked_batches():
            loss = model(*batch)
            ref_losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        ref_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for rank, results in enumerate(runs):
            for (was_clamped, strategy), (losses, state) in zip(strategies, results):
                if was_clamped == clamp:
                    zoo.assert_matches_reference(f"clamp={clamp} {strategy} rank {rank}", losses, state, ref_losses,
                                                 ref_state, rtol=RTOL, atol=ATOL)


def test_the_pass_leaves_an_unsplit_batch_and_class_probabilities_alone():
    from graphpass.capture import capture
    from graphpass.passes.global_loss_mean import COUNT_PREFIX, global_loss_mean
    from graphpass.plan_builder import plan_from_strategy
    from graphpass.pass_manager import PassContext, run_passes

    batch = zoo.batches("gpt", 1, 4)[0]
    for strategy, counted in ((gp.Strategy(), 0), (gp.Strategy(dp=2), 1)):
        gm = capture(zoo.build("gpt"), batch).gm
        plan = plan_from_strategy(gm, strategy, [])
        gm, _ = run_passes(gm, plan, PassContext(0, strategy.dp, batch), (global_loss_mean,))
        buffers = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith(COUNT_PREFIX)]
        assert len(buffers) == counted, strategy
    # the count program counts one microbatch's targets that are not ignored
    count = buffers[0].meta["gp.loss_count"]
    idx, targets = batch
    targets = targets.clone()
    targets[0, :5] = -100
    assert int(count.program(idx, targets)) == targets.numel() - 5

    class Soft(nn.Module):  # class probabilities as targets: every piece counts its rows alike
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x, p):
            return F.cross_entropy(self.fc(x), p)

    inputs = (torch.randn(4, 8), torch.softmax(torch.randn(4, 4), -1))
    gm = capture(Soft(), inputs).gm
    plan = plan_from_strategy(gm, gp.Strategy(dp=2), [])
    gm, _ = run_passes(gm, plan, PassContext(0, 2, inputs), (global_loss_mean,))
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith(COUNT_PREFIX)]


class _Weighted(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.how = how
        self.register_buffer("class_weight", torch.tensor([1.0, 2.0, 1.0, 0.5]))

    def forward(self, x, y):
        if self.how == "weighted":
            return F.cross_entropy(self.fc(x), y, weight=self.class_weight)
        if self.how == "squared":
            return F.cross_entropy(self.fc(x), y) ** 2
        return F.cross_entropy(self.fc(x), (y + self.class_weight.long()[0]) % 4)  # targets from a buffer


@pytest.mark.parametrize("how, message", [
    ("weighted", r"'cross_entropy_loss' is a class-weighted mean loss.*split into 2 pieces \(dp=2, microbatches=1\)"),
    ("squared", r"the mean loss 'cross_entropy_loss' reaches the output through 'pow.*not linear in it"),
    ("from_buffer", r"the targets '.*' of the mean loss 'cross_entropy_loss' are computed from 'class_weight'"),
])
def test_mean_losses_that_cannot_be_exact_with_the_batch_split_are_refused(how, message):
    inputs = (torch.randn(8, 8), torch.randint(0, 4, (8,)))
    with pytest.raises(PassError, match=message):
        gp.verify(_Weighted(how), CLUSTER2, example_inputs=inputs, strategy=gp.Strategy(dp=2))
    gp.verify(_Weighted(how), gp.Cluster.preset("h100-80g", nodes=1, gpus_per_node=1), example_inputs=inputs,
              strategy=gp.Strategy())  # one piece: nothing to make exact
