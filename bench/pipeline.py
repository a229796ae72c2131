"""Pipeline stages: bubble, step time against torch.distributed.pipelining driven by hand, and
per-stage peak memory measured against the planner's prediction, in one launch.

What is measured: on ``--world-size`` gloo ranks (default 2; one pipeline stage per rank), the
example GPT (``examples/gpt.py``, its LM head untied from the token embedding, because a pipeline
driven by hand cannot tie weights across stages: torchtitan does not support it either) is
trained with plain SGD two ways side by side, for every microbatch count ``m`` in ``--microbatches``
(default 1, 2, 4, 8) under GPipe, zero-bubble (torch's ZB1P) and 1F1B (where ``m >= p``):

* **graphpass**: ``gp.compile(model, strategy=gp.Strategy(pp=p, microbatches=m, schedule=...))``
  and ``dmodel.train_step(idx, targets)``: graphpass cuts its captured graph into ``p`` stages
  evenly by layers and runs them with the engine's schedule;
* **by hand**: the same split written as modules (embeddings and the first layers; the middle
  layers; the last layers, final norm and LM head), each a ``PipelineStage`` run by the same
  engine schedule with a cross-entropy ``loss_fn`` and ``scale_grads=True`` (what a user of
  ``torch.distributed.pipelining`` writes).

One step is the schedule's ``step`` (every microbatch's forward and backward) + ``SGD.step()`` +
``zero_grad()``, timed on every rank; the step's time is its slowest rank's (each round starts
at a barrier; a rank that is done early, as the first stage under zero-bubble, waits for the
others at the next step anyway). The two sides alternate in rounds (who goes first alternates
too).

Columns:

* ``ideal bubble`` ``(p - 1) / (m + p - 1)``: the share of a step a stage idles when all stages
  take the same time ``t`` per microbatch and nothing else costs time (GPipe and 1F1B alike);
  for zero-bubble a third of that idle time (``graphpass.cost.memory.zero_bubble_fraction``: the
  forward's third of forward + input gradient + weight gradient).
* ``bubble``: measured as ``1 - m * t / T``, with ``T`` the median step time of graphpass and
  ``t`` the slowest stage's forward + backward of one microbatch timed alone on its rank (the
  hand module, same math; no communication). It includes what the ideal leaves out: the
  send/receive of activations and their gradients over gloo, the optimizer step, unequal stages
  (the last stage also runs the LM head and the loss).
* ``gp / hand``: graphpass step time / hand-driven step time (median of paired rounds; target
  <= 1.0: graphpass adds the step's loss broadcast to every rank).
* ``peak rN`` and ``pred rN``: the peak bytes of live tensors during one step on rank N
  (:class:`graphpass.runtime.memory.MemoryProbe`, parameters, their gradients and the optimizer
  state as its baseline) and the planner's prediction for that stage
  (``gp.plan(..., strategy=Strategy(...)).report.predicted_stage_peaks_bytes``, SGD without momentum:
  no optimizer state), and their error.
* ``max |dloss|``: the largest difference between the two sides' losses (the same model, the
  same batches: fp32 rounding only).

    python bench/pipeline.py                    # 2 stages, m = 1, 2, 4, 8 (a few minutes here)
    python bench/pipeline.py --world-size 4 --n-layer 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

import graphpass as gp
from graphpass.cost.memory import pipeline_bubble_fraction, zero_bubble_fraction
from graphpass.runtime.memory import MemoryProbe
from graphpass.runtime.pipeline import SCHEDULES

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT  # noqa: E402  (examples/ is not a package)
from gpt_args import add_gpt_args, gpt_batches, gpt_config  # noqa: E402
from alternating import alternate  # noqa: E402

MiB = 2**20


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks = pipeline stages (default 2)")
    add_gpt_args(p, vocab_size=4096, n_embd=256)
    p.add_argument("--batch", type=int, default=16, help="global batch (split into microbatches)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "zero_bubble"],
                   choices=["gpipe", "1f1b", "zero_bubble"], help="schedules to run (default all three)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each side first")
    p.add_argument("--rounds", type=int, default=12, help="rounds per side (they alternate)")
    p.add_argument("--steps-per-round", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per rank (default: cpu_count // world_size, at least 1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.n_layer < args.world_size:
        p.error(f"--n-layer {args.n_layer} must be at least --world-size {args.world_size} (one stage per rank)")
    for m in args.microbatches:
        if args.batch % m:
            p.error(f"--batch {args.batch} must be a multiple of every --microbatches value ({m})")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.world_size)
    return args


def _model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)
    model = GPT(gpt_config(args))
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())  # untied (see the docstring)
    return model


class _HandStage(nn.Module):
    """Layers ``[lo, hi)`` of the GPT, with the embeddings on the first stage and the final norm
    and LM head (logits) on the last: the split graphpass makes."""

    def __init__(self, model: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.h = nn.ModuleList(model.h[lo:hi])
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def _layer_range(n_layer: int, stages: int, s: int) -> tuple[int, int]:
    base, extra = divmod(n_layer, stages)  # earlier stages take the remainder, as graphpass does
    lo = s * base + min(s, extra)
    return lo, lo + base + (1 if s < extra else 0)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _stage_time(module: _HandStage, x: torch.Tensor, targets: torch.Tensor, repeats: int = 5) -> float:
    """Median forward + backward of one microbatch through ``module`` alone (no communication)."""
    times = []
    for _ in range(repeats + 1):
        inp = x.detach().requires_grad_(x.is_floating_point())
        t0 = time.perf_counter()
        out = module(inp)
        if module.last:
            _loss(out, targets).backward()
        else:
            out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - t0)
        module.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def _run_rank(args: argparse.Namespace, schedule: str, m: int) -> dict:
    torch.set_num_threads(args.threads)
    rank, p = dist.get_rank(), dist.get_world_size()
    steps = args.warmup + args.rounds * args.steps_per_round
    data = gpt_batches(args, steps)

    gp_model = _model(args)
    dmodel = gp.compile(gp_model, gp.Cluster.local(), example_inputs=data[0],
                        strategy=gp.Strategy(pp=p, microbatches=m, schedule=schedule))
    gp_opt = torch.optim.SGD(dmodel.parameters(), lr=args.lr)

    hand_model = _model(args)
    lo, hi = _layer_range(args.n_layer, p, rank)
    module = _HandStage(hand_model, lo, hi, rank == 0, rank == p - 1)
    rows = args.batch // m
    width = args.block_size
    example = (torch.zeros(rows, width, dtype=torch.long) if rank == 0
               else torch.zeros(rows, width, args.n_embd, requires_grad=True))  # its gradient is sent back
    stage = PipelineStage(module, rank, p, torch.device("cpu"), input_args=(example,),
                          output_args=(torch.zeros(rows, width, args.vocab_size) if rank == p - 1
                                       else torch.zeros(rows, width, args.n_embd, requires_grad=True),))
    engine_cls = SCHEDULES[schedule]
    engine = engine_cls([stage] if issubclass(engine_cls, PipelineScheduleMulti) else stage, n_microbatches=m,
                        loss_fn=_loss, scale_grads=True)
    hand_opt = torch.optim.SGD(module.parameters(), lr=args.lr)

    def gp_step(idx, targets):
        loss = dmodel.train_step(idx, targets)
        gp_opt.step()
        gp_opt.zero_grad()
        return loss

    def hand_step(idx, targets):
        losses: list[torch.Tensor] = []
        if rank == 0:
            engine.step(idx, return_outputs=False)
        elif rank == p - 1:
            engine.step(target=targets, losses=losses, return_outputs=False)
        else:
            engine.step(return_outputs=False)
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        hand_opt.step()
        hand_opt.zero_grad()
        return loss

    times, losses = alternate({"graphpass": gp_step, "hand": hand_step}, data, args.warmup, args.rounds,
                              args.steps_per_round)

    # One more graphpass step under the memory probe: parameters and their gradients are the
    # baseline (SGD without momentum keeps no state).
    params = list(dmodel.parameters())
    with MemoryProbe([*params, *(q.grad for q in params)]) as probe:
        gp_step(*data[0])
    # The slowest stage's compute of one microbatch, timed alone on its rank.
    x = data[0][0].narrow(0, 0, rows) if rank == 0 else torch.randn(rows, width, args.n_embd)
    own = _stage_time(module, x, data[0][1].narrow(0, 0, rows))

    hand_losses = torch.stack(losses["hand"])
    dist.broadcast(hand_losses, p - 1)  # the last stage has them
    gp_losses = torch.stack(losses["graphpass"])
    gathered: list = [None] * p
    dist.all_gather_object(gathered, {"peak": probe.peak_bytes, "own": own, "times": times})
    return {
        # A step of the job ends when its slowest rank ends (every round starts at a barrier):
        # under zero-bubble that is the last stage, whose deferred weight gradients run after
        # the first stage is done.
        "times": {side: [max(g["times"][side][i] for g in gathered) for i in range(len(times[side]))]
                  for side in times},
        "max_loss_diff": (gp_losses - hand_losses).abs().max().item(),
        "peaks": [g["peak"] for g in gathered],
        "stage_s": [g["own"] for g in gathered],
    }


def _predicted(args: argparse.Namespace, schedule: str, m: int) -> tuple[int, ...]:
    """The planner's per-stage peaks for this strategy on this machine's ranks."""
    model = _model(args)
    batch = gpt_batches(args, 1)[0]
    plan = gp.plan(model, gp.Cluster.local(args.world_size), example_inputs=batch, optimizer_states=0,
                   strategy=gp.Strategy(pp=args.world_size, microbatches=m, schedule=schedule))
    return plan.report.predicted_stage_peaks_bytes


def main(argv=None) -> None:
    args = _parse_args(argv)
    t0 = time.perf_counter()
    p = args.world_size
    c = gpt_config(args)
    print(f"GPT (untied LM head) vocab={c.vocab_size} block={c.block_size} layers={c.n_layer} embd={c.n_embd}; "
          f"global batch {args.batch}; {p} gloo ranks = {p} stages, {args.threads} thread(s) each; "
          f"{args.rounds} alternating rounds x {args.steps_per_round} step(s) per side after {args.warmup} warm-up")
    print()
    header = (f"{'schedule':9s} {'m':>2s} {'gp ms':>8s} {'hand ms':>8s} {'gp/hand':>7s} {'ideal bubble':>12s} "
              f"{'bubble':>7s} " + " ".join(f"{f'peak r{r}':>8s} {f'pred r{r}':>8s} {'err':>6s}" for r in range(p))
              + f" {'max |dloss|':>11s}")
    print(header)
    ideal = {"gpipe": pipeline_bubble_fraction, "1f1b": pipeline_bubble_fraction, "zero_bubble": zero_bubble_fraction}
    for m in args.microbatches:
        for schedule in args.schedules:
            if schedule == "1f1b" and m < p:
                continue
            result = gp.launch(_run_rank, p, args=(args, schedule, m), timeout_s=900)[0]
            predicted = _predicted(args, schedule, m)
            gp_t, hand_t = result["times"]["graphpass"], result["times"]["hand"]
            k = args.steps_per_round
            paired = [statistics.median(gp_t[i:i + k]) / statistics.median(hand_t[i:i + k])
                      for i in range(0, len(gp_t), k)]
            step = statistics.median(gp_t)
            bubble = 1 - m * max(result["stage_s"]) / step
            cells = " ".join(
                f"{peak / MiB:8.1f} {pred / MiB:8.1f} {(pred - peak) / peak:+6.1%}"
                for peak, pred in zip(result["peaks"], predicted))
            print(f"{schedule:9s} {m:2d} {step * 1e3:8.1f} {statistics.median(hand_t) * 1e3:8.1f} "
                  f"{statistics.median(paired):7.3f} {ideal[schedule](p, m):12.3f} {bubble:7.3f} {cells} "
                  f"{result['max_loss_diff']:11.2e}", flush=True)
    print()
    print("gp/hand: median of per-round ratios of step time (target <= 1.0); bubble = 1 - m t / T with t the "
          "slowest stage's forward + backward of one microbatch alone; peaks and predictions in MiB")
    print(f"(wall time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
