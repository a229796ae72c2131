"""Step-time overhead of graphpass data parallel against torch DDP, measured in one launch.

What is measured: on ``--world-size`` gloo ranks (default 2) of this machine, the same GPT
(``examples/gpt.py``, same seed, so the same initial weights) is trained two ways side by side:

* **graphpass DP**: ``gp.compile(model, strategy=gp.Strategy(dp=N))``, then
  ``dmodel.train_step(idx, targets)`` (forward + backward with bucketed, overlapped gradient
  all-reduces, plus the global-loss all-reduce it returns);
* **torch DDP**: ``DistributedDataParallel(model)`` on this rank's slice of the same global batch,
  ``loss = ddp(idx, targets); loss.backward()``.

One *step* is forward + backward + ``SGD.step()`` + ``zero_grad()``, timed on every rank with
``time.perf_counter`` (rank 0's times are reported; ranks are coupled by the all-reduces, so they
agree to within a collective's latency). After a warm-up of both, the two run in alternating
rounds of ``--steps-per-round`` steps (who goes first alternates too), each round started by a
barrier, so machine noise (other processes, frequency changes) hits both sides equally.

Both sides see the same sequence of global batches and take the same SGD steps, so their losses
must agree at every step up to fp32 rounding of the reduction order (~1e-6); the max abs
difference is printed as a correctness check. DDP's per-rank losses are averaged once, after
timing, so its timed step has no extra collective; graphpass's step includes its loss all-reduce
because ``train_step`` returns the global loss.

How to read it: the table gives the median, 10th and 90th percentile step time of each side; the
last line is the ratio of medians, ``graphpass DP / torch DDP step time``: 1.00 means no
overhead, the target is <= 1.05. Each rank uses one intra-op thread (``--threads``), since the
ranks share the machine's cores; compute dominates a step at the default size, so the ratio is
mostly sensitive to per-step fixed costs (graph interpretation, buffer copies, collectives that
do not overlap with backward).

``--model llama`` trains a Llama-style decoder instead (``examples/configs.py``'s
``LlamaLike``, Hugging Face ``LlamaForCausalLM``: RMSNorm, rotary, SwiGLU; ~3.7M parameters at
the default vocabulary 1024, hidden 256, 4 layers), ``--optimizer adamw`` steps AdamW.

    python bench/overhead.py                      # 2 ranks, default size (< 3 min here)
    python bench/overhead.py --world-size 4 --rounds 12
    python bench/overhead.py --model llama --optimizer adamw --batch 16 --block-size 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import graphpass as gp
from graphpass.runtime.grad_sync import all_reduce_grads

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT  # noqa: E402  (examples/ is not a package)
from gpt_args import add_gpt_args, gpt_batches, gpt_config, llama_config  # noqa: E402
from alternating import alternate  # noqa: E402
from configs import LlamaLike  # noqa: E402


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="number of gloo ranks (default 2)")
    add_gpt_args(p, vocab_size=4096, n_embd=256)
    p.add_argument("--batch", type=int, default=8, help="global batch (split over the ranks)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each side first")
    # Short rounds: this machine's load comes and goes within seconds (other jobs share its two
    # cores), and 1-2 step rounds spread it over both sides far more evenly than 5-step rounds.
    p.add_argument("--rounds", type=int, default=24, help="rounds per side (they alternate)")
    p.add_argument("--steps-per-round", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per rank (default: cpu_count // world_size, at least 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    args = p.parse_args(argv)
    if args.model == "llama" and "--vocab-size" not in (argv or sys.argv):
        args.vocab_size = 1024
    if args.batch % args.world_size:
        p.error(f"--batch {args.batch} must be a multiple of --world-size {args.world_size}")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.world_size)
    return args


def _model(args: argparse.Namespace, config) -> torch.nn.Module:
    return LlamaLike(llama_config(args)) if args.model == "llama" else GPT(config)


def _run_rank(args: argparse.Namespace) -> dict | None:
    # Explicit, though the launcher sets the same: ranks share the cores, and oversubscribing
    # them makes both sides slow and noisy.
    torch.set_num_threads(args.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = gpt_config(args)
    total_steps = args.warmup + args.rounds * args.steps_per_round
    data = gpt_batches(args, total_steps)
    chunk = args.batch // world

    # Two models with identical initial weights (graphpass broadcasts rank 0's, DDP too).
    torch.manual_seed(args.seed)
    gp_model = _model(args, config)
    torch.manual_seed(args.seed)
    ddp_model = _model(args, config)

    dmodel = gp.compile(gp_model, gp.Cluster.local(), example_inputs=data[0],
                        strategy=gp.Strategy(dp=world))
    optimizer = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD
    gp_opt = optimizer(dmodel.parameters(), lr=args.lr)
    ddp = DistributedDataParallel(ddp_model)
    ddp_opt = optimizer(ddp.parameters(), lr=args.lr)

    def gp_step(idx, targets):
        loss = dmodel.train_step(idx, targets)
        gp_opt.step()
        gp_opt.zero_grad()
        return loss

    def ddp_step(idx, targets):
        # The same slice of the global batch that graphpass gives this rank.
        loss = ddp(idx.narrow(0, rank * chunk, chunk), targets.narrow(0, rank * chunk, chunk))
        loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
        return loss.detach()

    times, losses = alternate({"graphpass DP": gp_step, "torch DDP": ddp_step}, data, args.warmup, args.rounds,
                              args.steps_per_round)
    gp_losses = torch.stack(losses["graphpass DP"])
    ddp_losses = torch.stack(losses["torch DDP"])
    dist.all_reduce(ddp_losses)  # per-rank means -> global mean (equal shards)
    ddp_losses /= world
    if rank != 0:
        return None
    return {
        "params": sum(p.numel() for p in dmodel.parameters()),
        "buckets": len(dmodel.graph_module.graph.find_nodes(op="call_function", target=all_reduce_grads)),
        "times": times,
        "max_loss_diff": (gp_losses - ddp_losses).abs().max().item(),
        "first_loss": gp_losses[0].item(),
        "last_loss": gp_losses[-1].item(),
    }


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> None:
    args = _parse_args(argv)
    t0 = time.perf_counter()
    result = gp.launch(_run_rank, args.world_size, args=(args,), timeout_s=600)[0]
    c = gpt_config(args)
    model = ("Llama-style (LlamaLike)" if args.model == "llama" else "GPT") + f" ({args.optimizer})"
    print(f"{model} vocab={c.vocab_size} block={c.block_size} layers={c.n_layer} "
          f"embd={c.n_embd}: {result['params'] / 1e6:.2f}M params, {result['buckets']} graphpass "
          f"gradient bucket(s); global batch {args.batch} on {args.world_size} gloo ranks, "
          f"{args.threads} thread(s) each")
    print(f"{args.rounds} alternating rounds x {args.steps_per_round} steps per side, "
          f"after {args.warmup} warm-up steps each (step = fwd + bwd + optimizer step + zero_grad)")
    print()
    print(f"{'':14s} {'median ms':>10s} {'p10 ms':>8s} {'p90 ms':>8s} {'steps':>6s}")
    medians = {}
    for name, times in result["times"].items():
        medians[name] = statistics.median(times)
        print(f"{name:14s} {medians[name] * 1e3:10.1f} {_quantile(times, 0.1) * 1e3:8.1f} "
              f"{_quantile(times, 0.9) * 1e3:8.1f} {len(times):6d}")
    print()
    print(f"max |loss graphpass - loss DDP| over {len(result['times']['torch DDP']) + args.warmup} "
          f"steps: {result['max_loss_diff']:.2e} (loss {result['first_loss']:.4f} at the first step, "
          f"{result['last_loss']:.4f} at the last)")
    # Paired view: each round of one side sits next to a round of the other, so the median of
    # per-round ratios cancels slow drifts in machine load that the ratio of medians does not.
    k = args.steps_per_round
    gp_t, ddp_t = result["times"]["graphpass DP"], result["times"]["torch DDP"]
    paired = [statistics.median(gp_t[i:i + k]) / statistics.median(ddp_t[i:i + k])
              for i in range(0, len(gp_t), k)]
    print(f"median of per-round ratios: {statistics.median(paired):.3f} "
          f"(p10 {_quantile(paired, 0.1):.3f}, p90 {_quantile(paired, 0.9):.3f})")
    ratio = medians["graphpass DP"] / medians["torch DDP"]
    print(f"graphpass DP / torch DDP step time: {ratio:.3f} (target <= 1.05)")
    print(f"(wall time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
