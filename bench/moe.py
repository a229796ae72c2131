"""Mixture-of-Experts: step time with the experts replicated (data parallel) or sharded over
``ep``, under balanced and skewed routing; the slowest rank's expert time over the mean rank's;
and hierarchical against flat all-to-all on 2 nodes x 2, in one run.

What is measured, on ``--world-size`` gloo ranks (default 4): a 2-layer decoder whose MLPs are
``graphpass.nn.MoE`` layers (``--experts`` experts, top-2, dropless), with routing made to follow
Zipf's law over the experts (``ZipfGate``: a bias of ``-skew * log(e + 1)`` on expert ``e``'s
logit plus Gumbel noise hashed from the token, so a token's first choice is expert ``e`` with
probability ``(e + 1) ** -skew / H``); the hottest experts sit together on the first ranks
(contiguous placement), the case dynamic placement exists for. Each row trains with SGD for ``--rounds`` steps after a warm-up:

* ``torch DDP``: the model eagerly under ``DistributedDataParallel`` (what a user would write):
  the reference of the ratio column;
* ``gp dp``: ``Strategy(dp=n)``, experts replicated, each rank routing its own tokens;
* ``gp ep=k``: ``Strategy(dp=n, ep=k)``, experts sharded over groups of ``k`` ranks;
* ``+ placement``: the same with ``gp.ExpertPlacement(dmodel, opt, every=--every)`` deciding
  every ``--every`` steps (its own cost model decides whether to move; ``layers moved`` counts
  the layer moves it made, most in the warm-up).

Columns: median step time (a step's time is its slowest rank's; each step starts at a barrier),
its ratio to torch DDP's in the same run, ``slow/mean expert s``: on each rank the time the
grouped expert products took in a profiled step (``torch.profiler``: the forward and backward
``graphpass::grouped_mm`` ops; median of 3), the slowest rank's over the mean rank's, and
``slow/mean rows``: the same for the rows those products multiplied (exact, where the times
carry the noise of 4 ranks sharing 2 cores). Under data parallelism every rank multiplies its own
``2 x tokens`` rows, so the rows ratio is 1 whatever the skew (torch DDP's eager model calls the
same op); under ``ep`` a rank multiplies the rows routed to its experts.

Hierarchical vs flat all-to-all is priced by the cost model (``graphpass.cost.collectives``), not
measured: the ranks here are processes of one host on one loopback interface, and emulating a
slower link between two "nodes" (network namespaces with ``tc``) needs privileges and addresses
this sandbox does not have. The cluster is 2 nodes x 2 ranks, the intra-node link the measured
loopback figures (``graphpass profile``'s, else graphpass's CPU defaults), the inter-node link
``--inter-slowdown`` times slower in bandwidth and latency; the messages are one dispatch of the
model above on one rank, 16 times less and 16 times more.

    python bench/moe.py                   # about two minutes on 2 cores
    python bench/moe.py --skews 0 1.5 --experts 8
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

import graphpass as gp
from graphpass.cluster import Cluster, LinkSpec
from graphpass.cost.collectives import collective_time
from graphpass.nn.gates import TopKGate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from moe_gpt import MoEGPT, MoEGPTConfig  # noqa: E402  (examples/ is not a package)


class ZipfGate(TopKGate):
    """Top-2 routing whose first choice follows Zipf's law over the experts: logit ``e`` is
    ``-skew * log(e + 1)`` plus Gumbel noise drawn from the token's hidden state (a fixed hash:
    the same token routes alike every step), so expert ``e`` is a token's first choice with
    probability ``(e + 1) ** -skew / H`` (the Gumbel-max trick). The router's own weights are
    kept (they train) but scaled down to leave the routing to the bias and the noise."""

    def __init__(self, d_model: int, num_experts: int, skew: float):
        super().__init__(d_model, num_experts, k=2)
        with torch.no_grad():
            self.router.weight.mul_(1e-3)
        self.register_buffer("bias", -skew * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float32)))
        self.register_buffer("hash", torch.randn(d_model, num_experts, generator=torch.Generator().manual_seed(7)))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.frac(torch.sin(x.detach().float() @ self.hash) * 43758.5453).abs().clamp(1e-6, 1 - 1e-6)
        return super().logits(x) + self.bias - torch.log(-torch.log(u))


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--d-hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--skews", type=float, nargs="+", default=[0.0, 1.2])
    p.add_argument("--eps", type=int, nargs="+", default=None, help="ep degrees (default 2 and world size)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--every", type=int, default=2, help="steps between ExpertPlacement's decisions")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--inter-slowdown", type=float, default=8.0,
                   help="the inter-node link's bandwidth is the intra-node one's over this, its latency this times")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.eps = args.eps or sorted({2, args.world_size})
    args.threads = max(1, (os.cpu_count() or 1) // args.world_size)
    return args


def _model(args, skew: float) -> MoEGPT:
    torch.manual_seed(args.seed)
    config = MoEGPTConfig(vocab_size=1024, block_size=args.seq, n_layer=2, n_head=4, n_embd=args.n_embd,
                          num_experts=args.experts, d_hidden=args.d_hidden)
    model = MoEGPT(config)
    for block in model.h:
        block.moe.gate = ZipfGate(args.n_embd, args.experts, skew)
    return model


def _batches(args, n: int):
    g = torch.Generator().manual_seed(args.seed + 1)
    return [(torch.randint(0, 1024, (args.batch, args.seq), generator=g),
             torch.randint(0, 1024, (args.batch, args.seq), generator=g)) for _ in range(n)]


def _expert_work(step) -> tuple[float, int]:
    """(seconds, rows) of the grouped expert products in one call of ``step`` on this rank: the
    forward and backward ops' CPU time, and the rows the forward products multiplied."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    seconds = sum(e.self_cpu_time_total for e in prof.key_averages() if "grouped_mm" in e.key) / 1e6
    rows = sum(e.input_shapes[0][0] for e in prof.events()
               if e.name == "graphpass::grouped_mm" and e.input_shapes and e.input_shapes[0])
    return seconds, rows


def _run_rank(args, skew: float, kind: str, ep: int) -> dict:
    torch.set_num_threads(args.threads)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model(args, skew)
    data = _batches(args, args.warmup + args.rounds + 1)
    if kind == "ddp":
        local = args.batch // world
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def step(batch):
            idx, targets = (t[rank * local:(rank + 1) * local] for t in batch)
            loss = ddp(idx, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
    else:
        dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=data[0],
                            strategy=gp.Strategy(dp=world, ep=ep))
        opt = torch.optim.SGD(dmodel.parameters(), lr=0.01)
        placement = gp.ExpertPlacement(dmodel, opt, every=args.every) if kind == "place" else None

        def step(batch):
            dmodel.train_step(*batch)
            opt.step()
            opt.zero_grad()
            if placement is not None:
                placement.step()
    for batch in data[:args.warmup]:
        step(batch)
    times = []
    for batch in data[args.warmup:args.warmup + args.rounds]:
        dist.barrier()
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
    seconds, rows = zip(*(_expert_work(lambda: step(data[-1])) for _ in range(3)))
    moved = sum(m.moved for m in placement.history) if kind == "place" else 0
    return {"times": times, "experts": statistics.median(seconds), "rows": rows[0], "moves": moved}


def _row(args, skew: float, kind: str, ep: int) -> dict:
    results = gp.launch(_run_rank, args.world_size, args=(args, skew, kind, ep), timeout_s=900)
    steps = [max(r["times"][i] for r in results) for i in range(args.rounds)]  # the slowest rank's
    experts = [r["experts"] for r in results]
    rows = [r["rows"] for r in results]
    return {"step": statistics.median(steps), "slow_mean": max(experts) / statistics.mean(experts),
            "rows": max(rows) / statistics.mean(rows), "moves": results[0]["moves"]}


def _all_to_all_rows(args) -> list[str]:
    local = Cluster.local(args.world_size)
    intra = local.intra_node
    inter = LinkSpec(intra.bandwidth_gbps / args.inter_slowdown, intra.latency_s * args.inter_slowdown,
                     "slower inter-node")
    two_nodes = Cluster(local.device, 2, args.world_size // 2, intra, inter, local.backend, "2 nodes (cost model)")
    rows = args.batch // args.world_size * args.seq * 2 * args.n_embd * 4  # top-2 rows of fp32 on one rank
    ranks = list(range(args.world_size))
    out = [f"all-to-all of one dispatch ({rows / 2**20:.2f} MiB per rank) on {args.world_size} ranks as 2 nodes x "
           f"{args.world_size // 2}: cost model, intra {intra.bandwidth_gbps:g} GB/s {intra.latency_s * 1e6:.0f} us, "
           f"inter {inter.bandwidth_gbps:g} GB/s {inter.latency_s * 1e6:.0f} us"]
    for size in (rows / 16, rows, rows * 16):
        flat = collective_time("all_to_all", size, ranks, two_nodes, algorithm="ring")
        hier = collective_time("all_to_all", size, ranks, two_nodes, algorithm="hierarchical")
        out.append(f"  {size / 2**20:8.3f} MiB  flat {flat * 1e3:8.3f} ms  hierarchical {hier * 1e3:8.3f} ms  "
                   f"hierarchical / flat {hier / flat:.3f}")
    return out


def main(argv=None) -> None:
    args = _parse_args(argv)
    t0 = time.perf_counter()
    print(f"MoE decoder: 2 layers, {args.experts} experts (top-2, dropless), d {args.n_embd}, expert hidden "
          f"{args.d_hidden}, {args.batch} x {args.seq} tokens per step; {args.world_size} gloo ranks, "
          f"{args.threads} thread(s) each; median of {args.rounds} steps after {args.warmup} warm-up")
    kinds = [("torch DDP", "ddp", 1), ("gp dp", "gp", 1)] + [
        row for e in args.eps for row in ((f"gp ep={e}", "gp", e), ("  + placement", "place", e))]
    for skew in args.skews:
        share = [(e + 1) ** -skew for e in range(args.experts)]
        hottest = max(share) / sum(share)
        print(f"\nrouting skew {skew:g} (Zipf): the hottest expert is the first choice of {hottest:.1%} of the "
              f"tokens ({1 / args.experts:.1%} balanced)")
        print(f"  {'strategy':<12} {'step ms':>9} {'/ DDP':>7} {'slow/mean expert s':>19} {'slow/mean rows':>15} "
              f"{'layers moved':>13}")
        reference = None
        for label, kind, ep in kinds:
            r = _row(args, skew, kind, ep)
            reference = reference or r["step"]
            print(f"  {label:<12} {r['step'] * 1e3:9.1f} {r['step'] / reference:7.3f} {r['slow_mean']:19.2f} "
                  f"{r['rows']:15.2f} {r['moves'] if kind == 'place' else '':>13}")
    print()
    print("\n".join(_all_to_all_rows(args)))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
