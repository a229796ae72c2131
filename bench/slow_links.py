"""Training across a slow link, EMULATED: 2 sites x 2 gloo ranks behind a 1 Gbit/s (and 10 Gbit/s)
link of 20 ms, in one run: torch DDP, graphpass dp, hierarchical dp, PowerSGD, int8 and DiLoCo.

What is measured: 4 ranks of this machine as ``gp.Cluster.local().split(2, gp.Link(rate, "20
ms"))``. The link is emulated (``runtime/link_emulator.py``): every collective whose group spans
the two sites completes no sooner than the cost model's flat time for it on that link, so every
step time below is an emulation of such a link on this CPU, not a measurement of one. Each row
trains ``examples/gpt.py``'s GPT (``--n-layer`` x ``--n-embd``) on the same ``--steps`` global
batches of a learnable sequence (an affine recurrence of token ids: exact training drives its
loss far down) from the same weights:

* ``torch DDP``: the model under ``DistributedDataParallel`` with a comm hook that all-reduces
  each bucket through the same emulated link (DDP's reducer is C++: the hook is how its buckets
  reach the emulator), each rank on its share of the batch;
* ``gp dp``: ``Strategy(dp=4)``, buckets all-reduced over all four ranks (flat, across the link);
* ``gp hierarchical``: ``Strategy(dp=4, zero=2, dp_shard=2)``: gradients reduce-scattered inside
  each site, the half shards all-reduced across the link (HSDP);
* ``gp PowerSGD r=4`` / ``gp int8``: ``Strategy(dp=4, grad_compression=...)``, error feedback;
* ``gp int8/site``: ``Strategy(dp=4, zero=2, dp_shard=2, grad_compression=GradCompression("int8"))``:
  HSDP's reduce-scatter exact inside each site, only the hop across the link in int8;
* ``gp DiLoCo H=8``: ``Strategy(dp=4, diloco=gp.DiLoCo(8))``, AdamW inside as every row (its
  ``train_step`` reports its worker's loss: no collective in the step; the loss column is rank 0's);
* ``gp DiLoCo/site H=8``: ``Strategy(dp=4, dp_shard=2, zero=1, diloco=gp.DiLoCo(8))``: each site one
  worker, ZeRO-1 inside it every step, only the outer step across the link;
* ``planned exact`` / ``planned inexact``: the planner's own choice on the same emulated cluster,
  ``gp.plan(model, cluster, batch)`` and ``gp.plan(..., allow_inexact_sync=True)``, trained as
  planned (the plan made once, in the parent; its mesh or sync named under the table).

Columns: the mean step time (after ``--warmup`` steps; a mean, not a median, so that DiLoCo's
outer step counts: a DiLoCo row runs past its first outer step, ``H + warmup + 1`` steps where
that is more than ``--steps``), its ratio to DDP's; the bytes a rank hands
to collectives that cross the link per step (the emulator's count; DDP's buckets alike); the
mean loss of the 5 steps up to ``--steps`` (the same tokens for every row; exact rows agree to rounding,
the inexact ones drift); and the planner's predicted step time for that strategy on the same
cluster (``Planner.price``; the cluster's sites are this machine's profile if one was written,
``graphpass profile --world-size 4``, else default figures), with its ratio to the measured one.

    python bench/slow_links.py                  # about 8 minutes here
    python bench/slow_links.py --rates "1 Gbit/s" --steps 20
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import graphpass as gp  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

ROWS = ("torch DDP", "gp dp", "gp hierarchical", "gp PowerSGD r=4", "gp int8", "gp int8/site", "gp DiLoCo H=8",
        "gp DiLoCo/site H=8", "planned exact", "planned inexact")
PLANNED = {"planned exact": False, "planned inexact": True}  # the row: gp.plan's allow_inexact_sync
STRATEGIES = {
    "gp dp": {},
    "gp hierarchical": {"zero": 2, "dp_shard": 2},
    "gp PowerSGD r=4": {"grad_compression": gp.GradCompression("powersgd", rank=4)},
    "gp int8": {"grad_compression": gp.GradCompression("int8")},
    "gp int8/site": {"grad_compression": gp.GradCompression("int8"), "zero": 2, "dp_shard": 2},
    "gp DiLoCo H=8": {"diloco": gp.DiLoCo(8)},
    "gp DiLoCo/site H=8": {"diloco": gp.DiLoCo(8), "zero": 1, "dp_shard": 2},
}


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", nargs="+", default=["1 Gbit/s", "10 Gbit/s"])
    p.add_argument("--latency", default="20 ms")
    p.add_argument("--steps", type=int, default=40)  # past step 32: the planner's DiLoCo every 32 syncs once
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def _config(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, block_size=args.block_size, n_layer=args.n_layer, n_head=4,
                     n_embd=args.n_embd)


def _batches(args, steps: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps or args.steps):
        seq = torch.empty(args.batch, args.block_size + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
        for i in range(args.block_size):
            seq[:, i + 1] = (5 * seq[:, i] + 3) % args.vocab
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def _cluster(rate: str, latency: str) -> gp.Cluster:
    return gp.Cluster.local().split(2, gp.Link(rate, latency))


def _emulated_ddp(model: nn.Module, emulator) -> nn.Module:
    """DDP whose buckets are all-reduced through ``emulator`` (a comm hook: DDP's reducer is C++)."""
    ddp = nn.parallel.DistributedDataParallel(model)

    def hook(state, bucket):
        buffer = bucket.buffer()
        size = buffer.numel() * buffer.element_size()
        due = emulator.charge(emulator.emulated_s("all_reduce", size, None), size, time.perf_counter())
        future = dist.all_reduce(buffer.div_(dist.get_world_size()), async_op=True).get_future()

        def done(fut):
            emulator.sleep_until(due)
            return fut.value()[0]
        return future.then(done)
    ddp.register_comm_hook(None, hook)
    return ddp


def _run_rank(args, row: str, rate: str, plan_json: str | None = None) -> dict:
    torch.set_num_threads(args.threads)
    from graphpass.runtime.link_emulator import LinkEmulator
    from graphpass.cost.collectives import collective_time

    cluster = _cluster(rate, args.latency)
    torch.manual_seed(0)
    model = GPT(_config(args))
    strategy = gp.Plan.from_json(plan_json) if plan_json else None
    diloco = strategy.diloco if strategy is not None else STRATEGIES.get(row, {}).get("diloco")
    # a DiLoCo row runs past its first outer step, so that its mean step pays for one
    data = _batches(args, max(args.steps, diloco.inner_steps + args.warmup + 1) if diloco else args.steps)
    world, rank = dist.get_world_size(), dist.get_rank()
    if row == "torch DDP":
        emulator = LinkEmulator(cluster, lambda kind, size, ranks: collective_time(kind, size, ranks, cluster,
                                                                                algorithm="ring"))
        ddp = _emulated_ddp(model, emulator)
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
        share = args.batch // world

        def step(batch):
            loss = ddp(*(t[rank * share:(rank + 1) * share] for t in batch))
            loss.backward()
            opt.step()
            opt.zero_grad()
            reported = loss.detach().clone()
            with emulator.active():  # the global mean, as train_step reports it, across the link too
                dist.all_reduce(reported)
            return float(reported) / world
    else:
        strategy = strategy or gp.Strategy(dp=world, **STRATEGIES[row])
        dmodel = gp.compile(model, cluster, example_inputs=data[0], strategy=strategy)
        emulator = dmodel.link_emulator
        opt = torch.optim.AdamW(dmodel.parameters(), lr=3e-3)

        def step(batch):
            loss = float(dmodel.train_step(*batch))
            opt.step()  # DiLoCo's outer step runs in this step's post-hook, through the emulator
            opt.zero_grad()
            return loss
    times, losses = [], []
    for i, batch in enumerate(data):
        if i == args.warmup:
            emulator.crossed_bytes = 0
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step(batch))
        times.append(time.perf_counter() - t0)
    return {"times": times[args.warmup:], "losses": losses,
            "crossed": emulator.crossed_bytes / (len(data) - args.warmup)}


def _planner(args, rate: str):
    import graphpass.planner

    torch.manual_seed(0)
    data = _batches(args)
    cluster = gp.Cluster.local(4).split(2, gp.Link(rate, args.latency))
    return graphpass.planner.Planner(GPT(_config(args)), cluster, data[0])


def _predicted(args, row: str, rate: str) -> float:
    """The planner's step time for the row's strategy on the same (emulated) cluster."""
    return _planner(args, rate).price(gp.Strategy(dp=4, **STRATEGIES.get(row, {}))).report.predicted_step_time_s


def _planned(args, rate: str, inexact: bool) -> gp.Plan:
    """The planner's own choice on the same (emulated) cluster."""
    return _planner(args, rate).auto(allow_inexact_sync=inexact)


def _choice(plan: gp.Plan) -> str:
    sync = plan.diloco or plan.grad_compression
    return " x ".join(f"{axis} {size}" for axis, size in plan.mesh.items() if size > 1) + (f", {sync}" if sync else "")


def main(argv=None) -> None:
    args = _parse_args(argv)
    t0 = time.perf_counter()
    params = sum(p.numel() for p in GPT(_config(args)).parameters())
    print(f"EMULATED link (runtime/link_emulator.py), 2 sites x 2 gloo ranks on this CPU; GPT {args.n_layer} x "
          f"{args.n_embd} ({params / 1e6:.2f}M parameters), global batch {args.batch} x {args.block_size}, "
          f"{args.steps} steps (mean after {args.warmup}), AdamW 3e-3, {args.threads} thread(s) a rank")
    for rate in args.rates:
        print(f"\nlink {rate}, {args.latency} (emulated)")
        print(f"  {'strategy':<18} {'mean step ms':>12} {'/ DDP':>7} {'link MiB/step':>14} {'loss (last 5)':>14} "
              f"{'predicted ms':>13} {'pred / meas':>12}")
        reference, chosen = None, []
        for row in ROWS:
            plan = _planned(args, rate, PLANNED[row]) if row in PLANNED else None
            if plan is not None:
                chosen.append(f"  {row}: {_choice(plan)}")
            results = gp.launch(_run_rank, 4, args=(args, row, rate, plan.to_json() if plan else None), timeout_s=1800)
            steps = [max(r["times"][i] for r in results) for i in range(len(results[0]["times"]))]
            step = statistics.mean(steps)  # the mean: DiLoCo's outer step comes every 8th step
            reference = reference or step
            loss = statistics.mean(results[0]["losses"][args.steps - 5:args.steps])  # after the same tokens
            predicted = plan.report.predicted_step_time_s if plan is not None else _predicted(args, row, rate)
            print(f"  {row:<18} {step * 1e3:12.1f} {step / reference:7.3f} {results[0]['crossed'] / 2**20:14.3f} "
                  f"{loss:14.4f} {predicted * 1e3:13.1f} {predicted / step:12.2f}")
        print("\n".join(["  the planner's choices:", *chosen]))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
