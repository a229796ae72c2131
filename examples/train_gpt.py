"""Train the example GPT with graphpass on local gloo ranks, next to a single-process run.

    python examples/train_gpt.py                  # 4 ranks, 10 steps, strategy="auto" (data parallel)
    python examples/train_gpt.py --world-size 2 --steps 20 --dump-dir /tmp/gp
    python examples/train_gpt.py --tp 2 --zero 3 --sequence-parallel   # dp 2 x tp 2, ZeRO-3 inside dp

Every rank runs the same SPMD function: build the model from the same seed, compile it, and
train on the *global* batch (graphpass gives each rank its share). The parent process first
trains the same model alone, then prints both loss curves side by side, the plan, and where the
per-pass graph dumps went.

Under torchrun (``graphpass run -n 2 examples/train_gpt.py``) every worker runs this script:
``gp.launch`` joins torchrun's ranks instead of spawning, rank 0 alone trains the single-process
reference (once, after the ranks have trained) and prints the report; the other ranks print nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import graphpass as gp  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)


def make_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic next-token data: a noisy repeating pattern the model can learn."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        start = torch.randint(0, CONFIG.vocab_size, (batch, 1), generator=g)
        seq = (start + torch.arange(CONFIG.block_size + 1)) % CONFIG.vocab_size
        noise = torch.randint(0, CONFIG.vocab_size, seq.shape, generator=g)
        seq = torch.where(torch.rand(seq.shape, generator=g) < 0.1, noise, seq)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def train_single_process(steps: int, batch: int) -> list[float]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = make_optimizer(model.parameters())
    losses = []
    for idx, targets in make_batches(steps, batch):
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_rank(steps: int, batch: int, dump_dir: str | None, strategy: dict | None = None) -> dict:
    """The SPMD training function every rank runs."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    data = make_batches(steps, batch)
    chosen = "auto" if strategy is None else gp.Strategy(**strategy)
    dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=data[0], strategy=chosen, dump_dir=dump_dir)
    opt = make_optimizer(dmodel.parameters())
    losses, times = [], []
    for idx, targets in data:
        start = time.perf_counter()
        loss = dmodel.train_step(idx, targets)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"losses": losses, "times": times, "plan": dmodel.plan.explain(), "history": dmodel.history}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 4)),
                        help="ranks (default 4; under torchrun, its WORLD_SIZE)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--dump-dir", default=os.environ.get("GRAPHPASS_DUMP_DIR", "dumps/train_gpt"))
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (dp = world size / tp)")
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage inside dp")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="gradient accumulation: microbatches per step, gradients synchronised once")
    args = parser.parse_args()
    strategy = None  # "auto"
    if args.tp != 1 or args.zero or args.sequence_parallel or args.recompute or args.microbatches != 1:
        if args.world_size % args.tp:
            parser.error(f"--tp {args.tp} must divide --world-size {args.world_size}")
        strategy = dict(dp=args.world_size // args.tp, tp=args.tp, zero=args.zero,
                        sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                        microbatches=args.microbatches)

    # Under torchrun this script runs once per rank: rank 0 alone reports (and trains the reference).
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ["RANK"]) if under_torchrun else 0
    if rank == 0:
        n_params = sum(p.numel() for p in GPT(CONFIG).parameters())
        print(f"GPT {n_params / 1e6:.2f}M parameters, global batch {args.batch} x {CONFIG.block_size} tokens")
    # Without torchrun the reference trains here, before the ranks start; under torchrun rank 0
    # trains it after them, so the other ranks do not wait for it in the rendezvous.
    reference = None if under_torchrun else train_single_process(args.steps, args.batch)
    results = gp.launch(train_rank, args.world_size, args=(args.steps, args.batch, args.dump_dir, strategy))
    if rank != 0:
        return
    if reference is None:
        reference = train_single_process(args.steps, args.batch)
    rank0 = results[0]
    print(f"\nplan ({args.world_size} gloo ranks):\n{rank0['plan']}\n")
    print("passes:")
    for i, record in enumerate(rank0["history"], start=1):
        print("  " + record.header(i))
    print(f"\n{'step':>4}  {'graphpass':>10}  {'1 process':>10}  {'rel diff':>9}  {'ms/step':>8}")
    worst = 0.0
    for step, (ours, ref) in enumerate(zip(rank0["losses"], reference)):
        rel = abs(ours - ref) / abs(ref)
        worst = max(worst, rel)
        print(f"{step:>4}  {ours:>10.6f}  {ref:>10.6f}  {rel:>9.2e}  {rank0['times'][step] * 1e3:>8.1f}")
    agree = all(r["losses"] == rank0["losses"] for r in results)
    print(f"\nmax relative loss difference vs one process: {worst:.2e} (all ranks agree: {agree})")
    print(f"per-pass graph dumps: {os.path.abspath(args.dump_dir)}/rank*/  (plan.txt, summary.txt)")
    if worst > 1e-5 or not agree:
        sys.exit("loss does not match the single-process run")


if __name__ == "__main__":
    main()
